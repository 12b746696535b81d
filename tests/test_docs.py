"""The documentation's commands name what exists and run; every contract key is documented.

(a) Every command in a fenced ``bash`` block of README.md and docs/*.md that runs ``agent-rl``,
``make``, ``python`` (on a repository file, ``-m agent_rl.cli`` or ``-m pytest``), ``bash`` on a
script, or ``torchrun``/``deepspeed`` on ``agent_rl.cli`` is checked: the subcommand and its
flags parse, a contract file exists and validates with its ``--set`` overrides (each naming a
contract key), a script exists and takes the flags given, a ``make`` target exists, and a run
directory, bundle or rollout store a command reads was written by a command earlier on the
same page. Other programs (``pip``, shell builtins) are not checked.

Every checked command is also run (``test_every_command_not_marked_long_runs``, slow) unless
its comment starts with ``long`` (``make demo   # long: ...``): in page order, README.md first,
in one scratch folder, each distinct command once, with the ``VAR=value`` words before it
set. The scaffold's printed steps (``agent-rl
envs new`` and the four lines it prints) are run by tests/envs/test_scaffold.py instead.

(b) Every dotted key of the contract models (``ExperimentContract``, ``SFTContract``) appears
in docs/contract.md as ``key`` in backticks.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from agent_rl.cli import build_parser, main
from agent_rl.run.contract import ContractError, ExperimentContract, SFTContract
from envs.scaffold import next_steps, package_names

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
ASSIGNMENTS = re.compile(r"^(?:\w+=(?:\$\([^)]*\)|\S*)\s+)+")  # LD_PRELOAD=$(...) agent-rl ...
AGENT_RL = {"agent-rl", ".venv/bin/agent-rl", ".venv-vllm/bin/agent-rl"}
PYTHON = {"python", "python3", ".venv/bin/python", ".venv-vllm/bin/python"}
FREE_FORM = ("env.kwargs.", "credit.params.")  # dict-valued keys: their own keys are the env's
SCAFFOLD = ["agent-rl envs new inventory --dest .", *next_steps("inventory", "agent-rl-env-inventory")]
SCAFFOLD_TEST = "tests/envs/test_scaffold.py::test_scaffolded_package_installs_registers_passes_and_trains"


@dataclass(frozen=True)
class Command:
    page: str
    text: str  # the command as written, continuation lines joined, comment dropped
    argv: tuple[str, ...]  # without leading VAR=value assignments
    comment: str

    @property
    def long(self) -> bool:
        return re.match(r"long\b", self.comment) is not None

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def logical_lines(block: str) -> list[str]:
    lines, pending = [], ""
    for raw in block.splitlines():
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            lines.append(pending.strip())
        pending = ""
    return lines


def parse_command(page: str, line: str) -> Command:
    code, _, comment = line.partition(" #")
    code = code.strip()
    return Command(page, code, tuple(shlex.split(ASSIGNMENTS.sub("", code))), comment.strip())


def assignments(command: Command) -> dict[str, str]:
    """The ``VAR=value`` words before a command (``WANDB_MODE=offline agent-rl train ...``)."""
    prefix = ASSIGNMENTS.match(command.text)
    return dict(word.split("=", 1) for word in shlex.split(prefix[0])) if prefix else {}


def page_commands(path: Path) -> list[Command]:
    name = str(path.relative_to(ROOT))
    return [parse_command(name, line) for block in BLOCK.findall(path.read_text())
            for line in logical_lines(block)]


ALL = [command for page in PAGES for command in page_commands(page)]


# --- what a command is --------------------------------------------------------------------------


def cli_args(argv: tuple[str, ...]) -> list[str] | None:
    """The ``agent-rl`` arguments of a command that runs the CLI, else None."""
    program, *args = argv
    if program in AGENT_RL:
        return args
    for i, arg in enumerate(args):
        if arg in ("-m", "--module") and i + 1 < len(args) and args[i + 1] == "agent_rl.cli":
            return args[i + 2:]
    return None


def kind(command: Command) -> str:
    program, *args = command.argv
    if cli_args(command.argv) is not None:
        return "cli"
    if program == "make":
        return "make"
    if program == "bash" and args and args[0].endswith(".sh"):
        return "script"
    if program in PYTHON and args:
        if args[0].endswith(".py"):
            return "script"
        if args[:2] == ["-m", "pytest"]:
            return "pytest"
    return "other"


def norm(path: str) -> str:
    return os.path.normpath(path)


def option(args: list[str], name: str) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


def overrides(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]


def contract_keys() -> set[str]:
    """Every dotted key of both contract models, sections included."""
    def walk(model: type[BaseModel], prefix: str) -> set[str]:
        keys = set()
        for name, field in model.model_fields.items():
            keys.add(prefix + name)
            for member in (getattr(field.annotation, "__args__", None) or (field.annotation,)):
                if isinstance(member, type) and issubclass(member, BaseModel):
                    keys |= walk(member, f"{prefix}{name}.")
        return keys

    return walk(ExperimentContract, "") | walk(SFTContract, "")


def produced(command: Command) -> list[str]:
    """Paths a command writes that later commands on its page may read."""
    args = cli_args(command.argv)
    if args is None:
        return []
    if args[0] in ("train", "sft"):
        run_dir = next((o.split("=", 1)[1] for o in overrides(args) if o.startswith("run_dir=")), None)
        if run_dir is None and (ROOT / args[1]).is_file():
            contract = (SFTContract if args[0] == "sft" else ExperimentContract).from_yaml(ROOT / args[1])
            run_dir = str(contract.resolved_run_dir)
        return [norm(run_dir)] if run_dir else []
    if args[0] == "eval" and option(args, "--out"):
        return [norm(option(args, "--out"))]
    if args[:2] == ["envs", "new"]:
        names = package_names(args[2])
        return [norm(os.path.join(option(args, "--dest") or ".", names["dist"])), names["env_id"]]
    return []


def written_before(command: Command) -> set[str]:
    page = [c for c in ALL if c.page == command.page]
    before = page[:page.index(command)] if command in page else []
    return {p for c in before for p in produced(c)}


def check_read(path: str, command: Command, what: str) -> None:
    """``path`` (something ``command`` reads) is written by a command earlier on its page."""
    path = norm(path)
    earlier = written_before(command)
    assert path in earlier or any(path.startswith(p + os.sep) for p in earlier), (
        f"{command}\n  {what} {path!r} is written by no command before it on {command.page}")


# --- the static checks ----------------------------------------------------------------------------


def check_cli(command: Command) -> None:
    args = cli_args(command.argv)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{command}\n  does not parse: {stderr.getvalue().strip()}")
    known, sub = contract_keys(), args[0]
    for item in overrides(args):
        key = item.split("=", 1)[0]
        assert key in known or key.startswith(FREE_FORM), (
            f"{command}\n  --set {key}: not a contract key (docs/contract.md lists them)")
    import envs

    registered = set(envs.list_envs()) | {p for c in ALL if c.page == command.page for p in produced(c)}
    if sub in ("train", "sft"):
        config = args[1]
        if (ROOT / config).is_file():
            model = SFTContract if sub == "sft" else ExperimentContract
            try:
                model.from_yaml(ROOT / config, overrides(args))
            except ContractError as exc:
                pytest.fail(f"{command}\n  the contract does not validate: {exc}")
        else:
            check_read(config, command, "the contract")
    if sub == "eval":
        if option(args, "--config"):
            try:
                ExperimentContract.from_yaml(ROOT / option(args, "--config"))
            except ContractError as exc:
                pytest.fail(f"{command}\n  the contract does not validate: {exc}")
        policy = option(args, "--policy") or "base"
        if policy != "base" and not policy.startswith("openai:"):
            check_read(policy, command, "the policy")
    if sub in ("eval", "canary") and option(args, "--env"):
        assert option(args, "--env") in registered, f"{command}\n  no environment {option(args, '--env')!r}"
    if sub == "canary":
        check_read(option(args, "--candidate"), command, "the candidate")
        check_read(option(args, "--baseline"), command, "the baseline")
    if sub == "report":
        check_read(args[1], command, "the run directory")
    if sub == "inspect":
        check_read(args[1], command, "the rollout store")
    if sub == "export":
        check_read(args[1], command, "the run or bundle")
    if args[:2] == ["envs", "check"]:
        assert args[2] in registered, f"{command}\n  no environment {args[2]!r}"


def check_script(command: Command) -> None:
    program, script, *args = command.argv
    path = ROOT / script
    assert path.is_file(), f"{command}\n  no file {script}"
    source = path.read_text()
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            assert f'"{flag}"' in source, f"{command}\n  {script} takes no option {flag}"


def check_make(command: Command) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in (a for a in command.argv[1:] if not a.startswith("-") and "=" not in a):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), (
            f"{command}\n  the Makefile has no target {target!r}")


def check_pytest(command: Command) -> None:
    for arg in command.argv[3:]:
        if arg.startswith("-") or not ("/" in arg or arg.endswith(".py")):
            continue  # options and their values (-k training, -m vllm)
        path = arg.split("::")[0]
        if not (ROOT / path).exists():
            check_read(path, command, "the tests")


CHECKS = {"cli": check_cli, "script": check_script, "make": check_make, "pytest": check_pytest}
CHECKED = [c for c in ALL if kind(c) in CHECKS]


def test_the_pages_have_commands():
    assert len(CHECKED) > 40, [str(c) for c in CHECKED]
    assert {c.page for c in CHECKED} >= {"README.md", "docs/training.md", "docs/evaluation.md"}


@pytest.mark.parametrize("command", CHECKED, ids=str)
def test_the_command_names_what_exists(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    CHECKS[kind(command)](command)


def test_the_scaffold_steps_are_those_envs_new_prints():
    """A page that shows ``agent-rl envs new inventory`` shows the four steps it prints next
    (tests/envs/test_scaffold.py runs them as printed)."""
    pages = {c.page for c in ALL if c.text == SCAFFOLD[0]}
    assert "README.md" in pages
    for page in pages:
        texts = [c.text for c in ALL if c.page == page]
        start = texts.index(SCAFFOLD[0])
        assert texts[start:start + len(SCAFFOLD)] == SCAFFOLD, page


def test_the_checks_catch_what_does_not_exist(monkeypatch):
    """The checks fail where they should: an unknown key, a missing file, a run never written."""
    monkeypatch.chdir(ROOT)
    bad = [parse_command("x.md", "agent-rl train examples/tiny.yaml --set optim.max_stepz=2"),
           parse_command("x.md", "agent-rl train examples/nope.yaml --set run_dir=runs/x"),
           parse_command("x.md", "python examples/nope.py"),
           parse_command("x.md", "make nope"),
           parse_command("x.md", "agent-rl report runs/never"),
           parse_command("x.md", "agent-rl export runs/never exported/never"),
           parse_command("x.md", "agent-rl trian examples/tiny.yaml"),
           parse_command("x.md", "agent-rl eval --policy base --nn 4"),
           parse_command("x.md", "python benchmarks/vs_trl.py --no-such-flag")]
    for command in bad:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            CHECKS[kind(command)](command)


# --- running them ---------------------------------------------------------------------------------


def to_run() -> list[Command]:
    seen, out = set(), []
    for command in CHECKED:
        if command.long or command.text in SCAFFOLD or command.text in seen:
            continue
        seen.add(command.text)
        out.append(command)
    return out


@pytest.mark.slow
def test_every_command_not_marked_long_runs(tmp_path, monkeypatch):
    """In page order, in one scratch folder that sees the repository's examples/ and
    benchmarks/: the CLI in this process, scripts as subprocesses. Each exits 0."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "120", "NO_COLOR": "1"}
    commands = to_run()
    assert len(commands) >= 10, [str(c) for c in commands]
    for command in commands:
        args = cli_args(command.argv)
        if args is not None:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), monkeypatch.context() as variables:
                for name, value in assignments(command).items():
                    variables.setenv(name, value)
                code = main([*args, "--no-progress"] if args[0] in ("train", "sft") else args)
            assert code == 0, f"{command}\n  exit {code}\n{out.getvalue()[-3000:]}"
        else:
            program, *rest = command.argv
            argv = [sys.executable, *rest] if program in PYTHON else list(command.argv)
            done = subprocess.run(argv, cwd=tmp_path, env=env | assignments(command),
                                  capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, (f"{command}\n  exit {done.returncode}\n"
                                          f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


# --- (b) every contract key is documented ----------------------------------------------------------


def test_every_contract_key_is_in_contract_md():
    text = (ROOT / "docs" / "contract.md").read_text()
    missing = sorted(k for k in contract_keys() if f"`{k}`" not in text)
    assert not missing, f"docs/contract.md does not document: {missing}"


def documented_default(cell: str):
    """A default as contract.md's table writes it: `1e-5`, `null`, `[]`, (required), ..."""
    cell = cell.strip()
    if cell == "(required)":
        return PydanticUndefined
    value = yaml.safe_load(cell.strip("`"))
    return float(value) if re.fullmatch(r"-?[\d.]+e-?\d+", str(value)) else value


def model_defaults(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    out = {}
    for name, field in model.model_fields.items():
        section = next((m for m in (getattr(field.annotation, "__args__", None) or (field.annotation,))
                        if isinstance(m, type) and issubclass(m, BaseModel)), None)
        if section is not None:
            out |= model_defaults(section, f"{prefix}{name}.")
        else:
            out[prefix + name] = field.default_factory() if field.default_factory else field.default
    return out


def test_the_documented_defaults_are_the_models():
    """Each key's row in docs/contract.md gives the pydantic model's default (the training
    contract's table above the SFT section, the SFT contract's below it)."""
    train, sft = (ROOT / "docs" / "contract.md").read_text().split("## SFT contract")
    wrong = []
    for page, model in ((train, ExperimentContract), (sft, SFTContract)):
        rows = dict(re.findall(r"^\| `([\w.]+)` \| ([^|]+) \|", page, re.MULTILINE))
        for key, default in model_defaults(model).items():
            if key in rows and documented_default(rows[key]) != default:
                wrong.append(f"{model.__name__} {key}: documented {rows[key].strip()}, default {default!r}")
    assert not wrong, wrong


# --- no commit hashes in user docs --------------------------------------------------------------

HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def without_output_blocks(text: str) -> str:
    """The page less its fenced blocks without a language (printed output)."""
    kept, fence = [], None  # fence: the open block's language, None outside a block
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence != "":
            kept.append(line)
    return "\n".join(kept)


def test_no_commit_hashes_outside_printed_output():
    """History belongs to git: a 7-40 digit hex word is allowed only inside a block of printed
    output (store and bundle hashes a command prints)."""
    found = [(str(page.relative_to(ROOT)), word) for page in PAGES
             for word in HASH.findall(without_output_blocks(page.read_text()))]
    assert not found, found


# --- links between the pages ----------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)#\s]+\.md)?(?:#([^)\s]+))?\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_page_and_section_exists():
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            path = (page.parent / target).resolve() if target else page
            assert path.is_file(), f"{page.name}: link to a missing page {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)
                assert anchor in {slug(h) for h in headings}, (
                    f"{page.name}: no section #{anchor} in {path.name}")
