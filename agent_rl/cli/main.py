"""The ``agent-rl`` command line.

Each subcommand is one small function ``run(args) -> exit code`` registered with
``@command(name, help, arguments)``, where ``arguments(parser)`` adds its flags. Keep heavy
imports (torch, transformers) inside the command function so ``agent-rl inspect`` stays fast.

Commands: ``train CONFIG``, ``report RUN_DIR``, ``eval``, ``canary``, ``envs list|new|check``,
``inspect EPISODES``. A policy is named ``base`` (the base model), ``PATH`` (a checkpoint bundle
or a run directory) or ``openai:URL``; ``load_policy`` is the one place that turns it into one.

What is printed may quote agent or task text (replies, ids, dataset rows, check and error
messages): plain lines go through ``echo``, rich cells through ``terminal_text``, warnings
through ``escaped_warnings``, all of them ``trajectories.display.escape_terminal``, so no
escape sequence, C1 control or bidi override reaches the terminal and no such text is markup.

Exit codes: 0 success; 1 a check failed (``inspect --verify`` found bad records, ``envs check``
failed, ``canary`` rolled back or stopped); 2 a usage error, a broken contract (the message names
the key), a missing file, model or bundle, an unreadable record, a run directory that another
process holds or that cannot be written, or a full disk (the message names the last complete
checkpoint); 3 ``train`` stopped by a guard; 4 ``train`` trained on no token because of a limit
the contract sets (guard ``nothing_trained``: every first prompt over
``rollout.max_prompt_tokens``, or every reply truncated under ``rollout.truncation: mask``; the
message names the key); 130 ``train`` or ``sft`` interrupted (Ctrl-C or SIGTERM; ``--resume``
continues from the last complete checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CLIError(Exception):
    """A user-facing failure: printed as ``agent-rl <command>: error: <message>``, exit 2."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``run(args) -> int`` as the subcommand ``name``."""

    def decorator(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"agent-rl command {name!r} is already registered")
        COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return decorator


# --- shared helpers: policies from `base | PATH | openai:URL`, bundles, tables ----------------

DEFAULT_MODEL = "smollm2-135m"
SPLIT_NAMES = "train, holdout, holdout_structure, holdout_entity, holdout_length, holdout_iid"
POLICY_HELP = ("base (the --model weights), PATH (a checkpoint bundle folder, or a run dir: its "
               "newest complete bundle) or openai:URL (an OpenAI-compatible server, evaluation "
               "only; --model names the served model, $OPENAI_API_KEY is sent when set)")


@dataclass
class LoadedPolicy:
    """A policy with what evaluation records about it."""

    policy: Any
    name: str
    bundle: Path | None = None
    bundle_hash: str | None = None
    contract: Any = None  # the ExperimentContract of the run the bundle came from, if found


def load_model_or_fail(model_id: str, dtype: str = "float32"):
    """``agent_rl.models.load_model``; a missing or unreadable model file is a ``CLIError``."""
    from agent_rl.models import load_model

    try:
        return load_model(model_id, dtype=dtype)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        raise CLIError(f"cannot load model {model_id!r}: {exc}") from exc


def resolve_bundle(path: str | Path) -> Path:
    """``checkpoint.resolve_bundle``; no bundle there is a ``CLIError``."""
    from agent_rl import checkpoint

    try:
        return checkpoint.resolve_bundle(path)
    except checkpoint.BundleError as exc:
        raise CLIError(str(exc)) from None


def contract_of(bundle: Path):
    """The contract of the run a bundle belongs to (``RUN_DIR/checkpoints/step-N``): an
    ``ExperimentContract``, or an ``SFTContract`` for a warm start's bundle; or None."""
    from agent_rl.config import ContractError, read_contract

    for folder in (bundle.parent.parent, bundle.parent, bundle):
        if (folder / "contract.yaml").is_file():
            try:
                return read_contract(folder / "contract.yaml")
            except ContractError as exc:
                raise CLIError(f"the run's contract is unreadable: {exc}") from exc
    return None


def response_limit(contract) -> int:
    """Tokens per reply of the run a bundle came from: an RL run's rollout limit, a warm
    start's limits.max_response_tokens, 128 without a contract."""
    if contract is None:
        return 128
    section = getattr(contract, "rollout", None) or contract.limits
    return section.max_response_tokens


def lora_rank(bundle: Path, names: list[str]) -> int:
    """The LoRA rank of a bundle without a contract: rows of its first ``lora_A`` weight."""
    from safetensors import safe_open

    from agent_rl.checkpoint import MODEL_FILE

    name = next(n for n in names if "lora_A" in n)
    with safe_open(bundle / MODEL_FILE, framework="pt") as f:
        return int(f.get_slice(name).get_shape()[0])


def load_bundle_policy(path: str | Path, model_id: str | None, device: str) -> LoadedPolicy:
    """A bundle loaded onto its base model. LoRA bundles (parameter names with ``lora_``) get
    the adapter first, with the rank and alpha of the run's contract (rank read off the
    tensors, alpha the contract default, when the contract is gone)."""
    from agent_rl import checkpoint
    from agent_rl.config import ModelSection
    from agent_rl.policy import HFPolicy
    from agent_rl.train import add_lora

    bundle = resolve_bundle(path)
    contract = contract_of(bundle)
    model_id = model_id or (contract.model.id if contract else DEFAULT_MODEL)
    model, tokenizer = load_model_or_fail(model_id, contract.model.dtype if contract else "float32")
    if contract is not None and contract.model.init is not None:  # the run's starting weights
        from agent_rl.models import model_fingerprint

        try:
            checkpoint.load_init(contract.model.init, model, model_fingerprint(model_id))
        except checkpoint.BundleError as exc:
            raise CLIError(f"the run's model.init: {exc}") from exc
    names = json.loads((bundle / checkpoint.META_FILE).read_text()).get("parameter_names", [])
    if any("lora_" in n for n in names):
        section = contract.model if contract else ModelSection()
        rank = section.lora_rank if contract else lora_rank(bundle, names)
        model = add_lora(model, rank, section.lora_alpha)
    try:
        checkpoint.load_bundle(bundle, model, restore_rng=False)
    except checkpoint.BundleError as exc:
        text = str(exc) if len(str(exc)) <= 600 else str(exc)[:600] + " ..."
        if "does not fit the model" in text:
            text += f" (is {model_id!r} the model this bundle was trained from? pass --model)"
        raise CLIError(text) from exc
    digest = checkpoint.bundle_hash(bundle)
    return LoadedPolicy(HFPolicy(model.eval(), tokenizer, device=device),
                        f"{bundle.parent.parent.name}/{bundle.name}", bundle, digest, contract)


def load_policy(spec: str, model_id: str | None, device: str,
                timeout: float = 60) -> LoadedPolicy:
    """``base`` | ``PATH`` | ``openai:URL`` -> a policy (see ``POLICY_HELP``); ``timeout``: the
    wall-clock seconds one request to an ``openai:URL`` server may take, retries included."""
    if spec.startswith("openai:"):
        from agent_rl.policy import OpenAIPolicy

        try:
            policy = OpenAIPolicy(spec.removeprefix("openai:"), model=model_id or "default",
                                  api_key=os.environ.get("OPENAI_API_KEY"), timeout=timeout)
        except ValueError as exc:  # a bad URL, --timeout or $OPENAI_API_KEY
            raise CLIError(f"--policy openai:...: {exc}") from None
        return LoadedPolicy(policy, spec)
    if spec == "base":
        from agent_rl.policy import HFPolicy

        model_id = model_id or DEFAULT_MODEL
        model, tokenizer = load_model_or_fail(model_id)
        return LoadedPolicy(HFPolicy(model, tokenizer, device=device), f"base:{model_id}")
    return load_bundle_policy(spec, model_id, device)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def interval(lo: Any, hi: Any) -> str:
    return "–" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"


def number(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def console():
    from rich.console import Console

    return Console()


def echo(text: str, file=None) -> None:
    """``print`` for the CLI's plain lines: they may quote agent or task text (ids, replies,
    dataset rows, check and error messages), so control characters are escaped
    (``trajectories.display.escape_terminal``)."""
    from trajectories.display import escape_terminal

    print(escape_terminal(text), file=file)


@contextmanager
def escaped_warnings():
    """While a command runs, a printed warning has its message escaped like every other line:
    it may quote agent or task text (a task id, a path, a record). Only the printing changes
    (``warnings.formatwarning``); filters and recorders see the warning as it was raised."""
    from trajectories.display import escape_terminal

    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        return original(escape_terminal(str(message)), category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = original


# --- train --------------------------------------------------------------------------------


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="experiment contract (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a contract key by its dotted path, e.g. optim.max_steps=4")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run_dir from its newest complete checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@contextlib.contextmanager
def plain_warnings(command: str):
    """Warnings print as ``agent-rl COMMAND: warning: MESSAGE``, without the source line
    Python adds (a run's warnings are for its user, not about this code), escaped as every
    other line (they may quote agent or task text)."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        echo(f"agent-rl {command}: warning: {message}", file=file or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


class _StopSignal:
    """While active, SIGTERM raises KeyboardInterrupt, so a run stops the way Ctrl-C stops it
    (a checkpoint being written is discarded whole; finished bundles stay)."""

    def __enter__(self):
        def stop(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self.previous = signal.signal(signal.SIGTERM, stop)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def before_after_table(result):
    """Held-out reward of the starting and the trained policy and the paired difference,
    overall and (when several splits were evaluated) per split, with what crossed
    compression boundaries (notes per episode, note tokens, share of notes used)."""
    from rich.table import Table

    from trajectories.display import terminal_text

    table = Table(title="held-out reward before/after (greedy, hint-free)")
    for column in ("split", "policy", "reward mean", "95% interval", "n", "success",
                   "95% Wilson", "notes/ep", "note tok", "notes used"):
        table.add_column(column, justify="left" if column in ("split", "policy") else "right")
    before, after, comparison = result.before or {}, result.after or {}, result.comparison or {}
    def pick(summary: dict, name: str) -> dict | None:
        return summary if name == "all" else (summary.get("splits") or {}).get(name)

    def notes(summary: dict) -> list[str]:  # single-session episodes wrote no notes
        if not summary.get("compressions_per_episode"):
            return ["–"] * 3
        return [number(summary[k]) for k in ("compressions_per_episode", "summary_tokens",
                                             "summary_used_frac")]

    for name in ["all", *(before.get("splits") or after.get("splits") or {})]:
        for tag, summary in (("before", pick(before, name)), ("after", pick(after, name))):
            if summary:
                table.add_row(terminal_text(name), tag, number(summary["reward_mean"]),
                              interval(summary["reward_lo"], summary["reward_hi"]),
                              str(summary["n"]), number(summary["success"]),
                              interval(summary["success_lo"], summary["success_hi"]),
                              *notes(summary))
        c = pick(comparison, name) if comparison else None
        if c:
            table.add_row(terminal_text(name), "paired diff", f"{c['reward_diff']:+.3f}",
                          interval(c["lo"], c["hi"]), str(c["n"]), "", "", "", "", "")
    return table


@command("train", "run GRPO training from an experiment contract", _train_arguments)
def train(args: argparse.Namespace) -> int:
    from agent_rl.config import ContractError, ExperimentContract

    try:  # a broken contract fails before torch is imported
        contract = ExperimentContract.from_yaml(args.config, args.overrides)
        run_dir = contract.check_run_dir()
    except ContractError as exc:
        raise CLIError(str(exc)) from exc
    with holding(run_dir, args.resume):  # before the model loads: a busy or unwritable run_dir fails at once
        return train_held(args, contract, run_dir)


def holding(run_dir: Path, resume: bool) -> contextlib.AbstractContextManager:
    """``runlock.hold_if_main(run_dir, resume)``, entered: the run directory is this process's until
    the returned context exits; one held by another process or that cannot be written is a
    ``CLIError`` naming it (exit 2)."""
    from agent_rl.runlock import hold_if_main
    from agent_rl.runlog import RunDirError

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(hold_if_main(run_dir, resume))
    except RunDirError as exc:
        raise CLIError(str(exc)) from None
    return stack


def no_space(exc: OSError, run_dir: Path, checkpoints: Path) -> CLIError | None:
    """A full disk while writing a file of the run (a log line; a checkpoint's is a
    ``checkpoint.DiskFullError`` already) as a ``CLIError`` naming the file and the newest
    complete bundle in ``checkpoints``; None for any other error."""
    from agent_rl import checkpoint

    if not checkpoint.is_disk_full(exc):
        return None
    return CLIError(str(checkpoint.no_space(exc.filename or run_dir, checkpoints, exc)))


def train_held(args: argparse.Namespace, contract, run_dir: Path) -> int:
    """``agent-rl train`` once its run directory is held."""
    import gymnasium

    from agent_rl import checkpoint
    from agent_rl import train as trainer
    from evals.report import write_run_report

    # Deprecation notices from the model libraries say nothing about this run.
    for module in ("transformers", "peft", "torch"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    load_model_or_fail(contract.model.id, contract.model.dtype)  # fail fast, before the run dir
    out = console()
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun / deepspeed: rank 0 reports
    try:
        with _StopSignal(), plain_warnings("train"):
            result = trainer.run(contract, resume=args.resume, progress=not args.no_progress)
    except KeyboardInterrupt:
        if not main_rank:
            return 130
        latest = checkpoint.latest_complete(run_dir / "checkpoints")
        where = f"from {latest}" if latest else "from the start (no complete checkpoint yet)"
        echo(f"agent-rl train: interrupted; `agent-rl train {args.config} --resume` (same "
             f"--set options) continues {where}", file=sys.stderr)
        if (run_dir / "contract.sha256").is_file():  # the run got as far as pinning its folder
            write_run_report(run_dir)
        return 130
    except OSError as exc:  # a full disk while writing a log line
        if (error := no_space(exc, run_dir, run_dir / "checkpoints")) is None:
            raise
        raise error from exc
    except (ValueError, ImportError, checkpoint.BundleError, gymnasium.error.Error) as exc:
        raise CLIError(str(exc)) from exc  # a bad env id, run dir, resume point or missing extra
    if not main_rank:
        return stopped_code(result.stopped)
    report = write_run_report(run_dir)
    if result.before or result.after:
        out.print(before_after_table(result))
    echo(f"report: {report}\nrun dir: {run_dir}")
    if result.stopped is not None:
        trip = result.stopped
        echo(f"agent-rl train: stopped by guard {trip.rule} ({trip.action}) at step "
             f"{result.steps}: {trip.message}", file=sys.stderr)
    return stopped_code(result.stopped)


def stopped_code(trip) -> int:
    """``train``'s exit code for a run that ended (``RunResult.stopped``): 0 finished, 4 the
    guard ``nothing_trained`` (nothing was trained), 3 any other guard."""
    from agent_rl.guards import NothingTrained

    return 0 if trip is None else 4 if isinstance(trip, NothingTrained) else 3


# --- sft ----------------------------------------------------------------------------------


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="SFT contract (YAML: env, eval, model, "
                        "data, optim, limits, run_dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a contract key by its dotted path, e.g. optim.epochs=1")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run_dir from its newest resume bundle")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("sft", "supervised warm start on episodes (solver or a rollout store); writes a bundle "
         "`train` starts from with model.init", _sft_arguments)
def sft(args: argparse.Namespace) -> int:
    from agent_rl.config import ContractError, SFTContract

    try:  # a broken contract fails before torch is imported
        contract = SFTContract.from_yaml(args.config, args.overrides)
        run_dir = contract.check_run_dir()
    except ContractError as exc:
        raise CLIError(str(exc)) from exc
    with holding(run_dir, args.resume):  # before the model loads: a busy or unwritable run_dir fails at once
        return sft_held(args, contract, run_dir)


def sft_held(args: argparse.Namespace, contract, run_dir: Path) -> int:
    """``agent-rl sft`` once its run directory is held."""
    import gymnasium

    from agent_rl import checkpoint
    from agent_rl import sft as warm_start

    for module in ("transformers", "peft", "torch"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    load_model_or_fail(contract.model.id, contract.model.dtype)
    try:
        with _StopSignal(), plain_warnings("sft"):
            result = warm_start.run(contract, resume=args.resume, progress=not args.no_progress)
    except KeyboardInterrupt:
        latest = checkpoint.latest_complete(run_dir / warm_start.RESUME_DIR)
        where = f"from {latest}" if latest else "from the start (no resume bundle yet)"
        print(f"agent-rl sft: interrupted; `agent-rl sft {args.config} --resume` (same --set "
              f"options) continues {where}", file=sys.stderr)
        return 130
    except OSError as exc:  # a full disk while writing a log line
        if (error := no_space(exc, run_dir, run_dir / warm_start.RESUME_DIR)) is None:
            raise
        raise error from exc
    except (ValueError, ImportError, checkpoint.BundleError, gymnasium.error.Error) as exc:
        raise CLIError(str(exc)) from exc
    data = result.data
    echo(f"trained on {data['sessions']} sessions of {data['episodes_kept']} episodes "
         f"({data['episodes_read']} read, dropped {data['dropped'] or 'none'}, sessions "
         f"skipped {data.get('skipped_sessions') or 'none'}), "
         f"{result.steps} steps, loss {result.losses[0] if result.losses else float('nan'):.4f}"
         f" -> {result.losses[-1] if result.losses else float('nan'):.4f}")
    console().print(before_after_table(result))
    echo(f"bundle: {result.bundle} (sha256 {result.bundle_hash[:12]})\n"  # whole, to be copied
         f"start RL from it: agent-rl train CONFIG --set model.init={result.bundle}")
    return 0


# --- report -------------------------------------------------------------------------------


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")


@command("report", "write RUN_DIR/report.html (reward, holdout, KL and length curves)",
         _report_arguments)
def report(args: argparse.Namespace) -> int:
    from evals.report import write_run_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CLIError(f"no run directory at {run_dir}")
    if not any((run_dir / name).exists() for name in ("metrics.jsonl", "eval.jsonl")):
        raise CLIError(f"{run_dir} is not a run directory: no metrics.jsonl or eval.jsonl")
    echo(str(write_run_report(run_dir)))
    return 0


# --- eval ---------------------------------------------------------------------------------


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default=None, metavar="ID",
                        help="environment id (default: the env of the run PATH came from)")
    parser.add_argument("--split", default="holdout", metavar="NAME",
                        help=f"task split: {SPLIT_NAMES} (default: holdout)")
    parser.add_argument("--policy", default="base", metavar="SPEC", help=POLICY_HELP)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="an experiment contract whose env section (id, kwargs, task pool, "
                             "iid_fraction) defines the tasks (default: the run's, when --policy "
                             "is a run; e.g. evaluate the base model on a run's held-out tasks)")
    parser.add_argument("--model", default=None, metavar="ID",
                        help="smollm2-135m | tiny | a local HF folder (default: the run's model, "
                             f"else {DEFAULT_MODEL}); for openai:URL the served model's name")
    parser.add_argument("--n", type=int, default=64, help="tasks evaluated (default: 64)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling and episode seed")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where records.jsonl, episodes.jsonl and report.html go, replacing "
                             "those of an earlier eval there (default: runs/eval-ENV-SPLIT)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="M",
                        help="per reply (default: the run's max_response_tokens, else 128)")
    parser.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                        help="openai:URL only: wall-clock limit on one request, retries "
                             "included (default: 60)")
    parser.add_argument("--hinted", action="store_true",
                        help="show the tasks' hints (evaluation is hint-free without it; every "
                             "record says whether a hint was shown)")


def eval_tasks(env_id: str, split: str, n: int, contract) -> tuple[list, dict]:
    """The first ``n`` tasks of a default split and the env kwargs; the pool is the run's
    (``env.pool_size``, ``env.pool_seed``) when the contract trained on this env, so its
    held-out tasks are exactly the ones the trainer held out."""
    import gymnasium

    from agent_rl.config import EnvSection

    section = contract.env if contract and contract.env.id == env_id else EnvSection(id=env_id)
    try:
        import envs

        env = envs.make(env_id, **section.kwargs)
        tasks = list(section.splits(env, require=[split])[split])[:n]
    except (gymnasium.error.Error, ValueError) as exc:  # a bad id or holdout, an empty split
        raise CLIError(str(exc)) from exc
    except KeyError as exc:
        raise CLIError(f"unknown split {split!r}; splits: {SPLIT_NAMES}") from exc
    if not tasks:
        raise CLIError(f"split {split!r} of {env_id} is empty (pool of {section.pool_size})")
    return tasks, section.kwargs


def slice_rows(records) -> list[dict[str, Any]]:
    """Overall, then per structure, entity group and composition (atomic / composed)."""
    from evals.run import slice_summary

    return [row for by in ((), "structure", "entity_group", "composition")
            for row in slice_summary(records, by, n_boot=2000)]


def slice_table(rows: list[dict[str, Any]], title: str):
    from rich.table import Table

    from evals.report import SLICE_NUMBERS
    from trajectories.display import terminal_text

    table = Table(title=terminal_text(title))
    for column in ("slice", "n", "reward mean", "95% interval", "success", "95% Wilson"):
        table.add_column(column, justify="left" if column == "slice" else "right", overflow="fold")
    for row in rows:
        label = " ".join(f"{k}={row[k]}" for k in row if k not in SLICE_NUMBERS) or "all"
        table.add_row(terminal_text(label), str(row["n"]), number(row["reward/mean"]),
                      interval(row["reward/lo"], row["reward/hi"]), number(row["success/rate"]),
                      interval(row["success/lo"], row["success/hi"]))
    return table


@command("eval", "evaluate a policy on a task split, per slice, with intervals", _eval_arguments)
def eval_(args: argparse.Namespace) -> int:
    from envs.runner import Sampling
    from evals.report import inspect_command, write_report
    from evals.run import run_eval, write_episodes, write_records

    if args.n < 1:
        raise CLIError(f"--n must be >= 1, got {args.n}")
    loaded = load_policy(args.policy, args.model, default_device(), timeout=args.timeout)
    contract = loaded.contract
    if args.config is not None:
        from agent_rl.config import ContractError, ExperimentContract

        try:
            contract = ExperimentContract.from_yaml(args.config)
        except ContractError as exc:
            raise CLIError(str(exc)) from exc
    env_id = args.env or (contract.env.id if contract else None)
    if env_id is None:
        raise CLIError("pass --env ID (e.g. agent_rl/Arithmetic-v0)")
    tasks, env_kwargs = eval_tasks(env_id, args.split, args.n, contract)
    max_new = args.max_new_tokens or response_limit(contract)
    sampling = Sampling(temperature=args.temperature, top_p=1.0, max_new_tokens=max_new,
                        seed=args.seed)
    run = run_eval(loaded.policy, env_id, tasks, sampling, seed=args.seed,
                   env_kwargs=env_kwargs, policy_name=loaded.name,
                   bundle_hash=loaded.bundle_hash, split=args.split, hinted=args.hinted)
    out = Path(args.out or f"runs/eval-{env_id.rsplit('/', 1)[-1]}-{args.split}")
    records = write_records(run.records, out / "records.jsonl")
    episodes = write_episodes(run.episodes, out / "episodes.jsonl")  # one per record, in order
    rows = slice_rows(run.records)
    title = f"{loaded.name} on {env_id} {args.split} (n={len(run.records)})"
    report = write_report(out / "report.html", title=title, slices=rows, evaluation=run,
                          episodes_path=episodes)
    console().print(slice_table(rows, title))
    faults = sum(r.infra_fault for r in run.records)
    echo(f"records: {records}\nepisodes: {episodes} ({len(run.episodes)} episodes, {faults} "
         f"infrastructure faults)\nreport: {report} (the worst slices' transcripts)\n"
         f"one episode: {inspect_command(episodes)} --episode ID")
    return 0


# --- canary -------------------------------------------------------------------------------


def _canary_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--candidate", required=True, metavar="BUNDLE",
                        help="bundle (or run dir) to release")
    parser.add_argument("--baseline", required=True, metavar="BUNDLE",
                        help="bundle (or run dir) now serving")
    parser.add_argument("--env", default=None, metavar="ID",
                        help="environment id (default: the candidate run's env)")
    parser.add_argument("--n", type=int, default=32,
                        help="offline and shadow tasks; the canary serves about as many")
    parser.add_argument("--canary-fraction", type=float, default=0.25,
                        help="share of live traffic the candidate serves (default: 0.25)")
    parser.add_argument("--model", default=None, metavar="ID",
                        help="base model of both bundles (default: from their runs)")
    parser.add_argument("--seed", type=int, default=1234, help="episode seeds and traffic split")


def bundle_candidate(loaded: LoadedPolicy):
    """A canary ``Candidate`` of a loaded bundle; before promotion its whole bundle is verified
    again (every file against the manifest, the COMPLETE marker present)."""
    from functools import partial

    from agent_rl.checkpoint import verify_bundle
    from evals.canary import Candidate

    return Candidate(loaded.name, loaded.bundle_hash, loaded.policy,
                     current_hash=partial(verify_bundle, loaded.bundle))


@command("canary", "release a bundle: offline gate -> shadow -> canary -> promote, or roll back",
         _canary_arguments)
def canary(args: argparse.Namespace) -> int:
    from agent_rl.config import AcceptanceSection
    from evals import canary as release

    if args.n < 1:
        raise CLIError(f"--n must be >= 1, got {args.n}")
    try:  # before any bundle is loaded
        count = args.n + release.live_task_count(args.n, args.canary_fraction)
    except ValueError as exc:
        raise CLIError(f"--canary-fraction: {exc}") from exc
    device = default_device()
    cand, base = (load_bundle_policy(p, args.model, device) for p in (args.candidate, args.baseline))
    if cand.bundle_hash == base.bundle_hash:
        raise CLIError(f"candidate and baseline are the same bundle ({cand.bundle_hash[:12]})")
    contract = cand.contract or base.contract
    env_id = args.env or (contract.env.id if contract else None)
    if env_id is None:
        raise CLIError("pass --env ID: neither bundle comes from a run with a contract")
    tasks, env_kwargs = eval_tasks(env_id, "holdout", count, contract)
    try:
        plan = release.release_plan(
            env_id, tasks, args.n, args.canary_fraction,
            contract.acceptance if contract else AcceptanceSection(), response_limit(contract),
            args.seed, base.bundle_hash, env_kwargs)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    result = release.run(bundle_candidate(cand), bundle_candidate(base), plan)
    from trajectories.display import terminal_text

    out = console()
    for stage in result.stages:
        out.print(f"[bold]{stage.stage}[/bold]: {stage.status.upper()}")
        for reason in stage.reasons:  # they quote task ids and slice names
            out.print(terminal_text(f"  {reason}"))
    echo(f"result: {result.status} at {result.stage}; serving {result.serving[:12]}")
    if result.rollback is not None:
        echo(f"rollback: live store restored to {result.rollback.store_hash[:12]}")
    return 0 if result.status == "promoted" else 1


# --- envs ---------------------------------------------------------------------------------


def _envs_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="envs_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="registered environment ids").set_defaults(_envs=envs_list)
    new = sub.add_parser("new", help="scaffold an installable environment package")
    new.add_argument("name", metavar="NAME", help="lowercase identifier, e.g. letter_count")
    new.add_argument("--dest", default=".", metavar="DIR", help="parent folder (default: .)")
    new.set_defaults(_envs=envs_new)
    check = sub.add_parser("check", help="run the contract checks on an environment id")
    check.add_argument("id", metavar="ID", help="registered environment id")
    check.add_argument("--episodes", type=int, default=20, help="episodes per check")
    check.set_defaults(_envs=envs_check)


@command("envs", "list, scaffold or check environments", _envs_arguments)
def envs_(args: argparse.Namespace) -> int:
    return args._envs(args)


def describe_env(env_id: str) -> tuple[str, str]:
    """(version, first docstring line) of an env's class (its module's, when it has none)."""
    import envs

    env = envs.make(env_id)
    try:
        cls = type(env.unwrapped)
        doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""
        return f"v{getattr(cls, 'version', '?')}", (doc.strip().splitlines() or [""])[0]
    finally:
        env.close()


def envs_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    import envs
    from trajectories.display import terminal_text

    table = Table(title="registered environments")
    for column in ("id", "version", "description"):
        table.add_column(column)
    for env_id in envs.list_envs():  # ids and docstrings come from installed plugins
        table.add_row(*map(terminal_text, (env_id, *describe_env(env_id))))
    console().print(table)
    return 0


def envs_new(args: argparse.Namespace) -> int:
    from envs.scaffold import new_env_package, next_steps, package_names

    try:
        root = new_env_package(args.name, args.dest)
    except (ValueError, FileExistsError) as exc:
        raise CLIError(str(exc)) from exc
    echo(f"{root}: the environment {package_names(args.name)['env_id']} (edit its env.py)\n"
         f"next, from this folder (the last trains it: 2 steps of the tiny model, evaluated "
         f"before and after on its unseen tasks, into runs/{args.name}/):")
    for step in next_steps(args.name, root):
        echo(f"  {step}")
    return 0


def envs_check(args: argparse.Namespace) -> int:
    import envs
    from envs.checks import check_env_id

    if args.id not in envs.list_envs():
        try:
            envs.make(args.id)  # raises with suggestions and the fix
        except Exception as exc:  # noqa: BLE001 - shown to the user as is
            raise CLIError(str(exc)) from exc
    report = check_env_id(args.id, episodes=args.episodes)
    echo(str(report))  # its messages quote the env's tasks, replies and exceptions
    return 0 if report.passed else 1


# --- inspect ------------------------------------------------------------------------------


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="rollout store (.jsonl or .jsonl.zst)")
    parser.add_argument("--assigner", default="broadcast",
                        help="credit assigner drawn on each session (default: broadcast)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="inspect only the first N episodes")
    parser.add_argument("--verify", action="store_true",
                        help="recompute every content hash first; exit 1 if any record is bad")
    parser.add_argument("--episode", action="append", default=[], metavar="ID",
                        help="only the episode with this id (repeatable), with its transcript")
    parser.add_argument("--transcript", action="store_true",
                        help="print every turn of every episode shown, not only its tree")


ROLE_STYLE = {"system": "dim", "user": "bold blue", "assistant": "bold green", "tool": "yellow"}


def print_transcript(console, episode) -> None:
    """Every turn of every session, in the order they were made. Episode text is printed as
    it is, its control characters escaped: never read as markup, never re-wrapped, newlines
    and tabs kept."""
    from trajectories.display import terminal_text

    def show(text: str, style: str = "") -> None:
        console.print(terminal_text(text, style), soft_wrap=True)

    for session in episode.sessions:
        show(f"── session {session.session_id} ({session.origin})", "bold")
        boundary = session.boundary
        if boundary is not None and boundary.summary is not None:
            show("summary carried over:", "magenta")
            show(boundary.summary)
        if boundary is not None and boundary.kind == "branch":
            show("returned to the parent:", "yellow")
            show("(not returned)" if boundary.returned is None else boundary.returned)
        for turn in session.turns:
            about = [turn.name or "", f"finish {turn.finish_reason}" if turn.finish_reason else "",
                     f"{len(turn.token_ids)} tokens" if turn.token_ids is not None else ""]
            show(" · ".join([f"[{turn.role}]", *filter(None, about)]), ROLE_STYLE[turn.role])
            if turn.content.strip():
                show(turn.content)
            else:  # an empty or whitespace-only reply would print as nothing
                more = " …" if len(turn.content) > 200 else ""
                show(f"(empty: {turn.content[:200]!r}{more})", "dim")
            if turn.tool_calls:
                show(json.dumps(turn.tool_calls, ensure_ascii=False))


@command("inspect", "draw the session trees and credit of stored episodes, or their transcripts",
         _inspect_arguments)
def inspect(args: argparse.Namespace) -> int:
    from itertools import islice

    from rich.console import Console

    from trajectories import ASSIGNERS, RolloutStore, assign
    from trajectories.display import episode_tree, summary_table, terminal_text

    path = Path(args.path)
    if not path.is_file():
        raise CLIError(f"no rollout store at {path}")
    if args.assigner not in ASSIGNERS:
        raise CLIError(f"unknown assigner {args.assigner!r}; registered: {sorted(ASSIGNERS)}")
    if args.limit is not None and args.limit < 0:
        raise CLIError(f"--limit must be >= 0, got {args.limit}")
    console = Console()
    store = RolloutStore(path)
    if args.verify:
        report = store.verify()
        console.print(terminal_text(str(report)))  # it names episode ids
        if not report.ok:
            return 1

    wanted, found, tasks = set(args.episode), set(), {}

    def selected():  # every episode, or the --episode ones (reading stops once all are found)
        for episode in store.read():
            tasks.setdefault(episode.task_id, []).append(episode.episode_id)
            if not wanted or episode.episode_id in wanted:
                found.add(episode.episode_id)
                yield episode
                if wanted and found == wanted:
                    return

    def drawn():  # streams: each tree is printed as its episode is read
        for episode in islice(selected(), args.limit):
            console.print(episode_tree(episode, assign(episode, args.assigner)))
            if wanted or args.transcript:
                print_transcript(console, episode)
            yield episode

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = summary_table(drawn(), args.assigner)
        except ValueError as exc:  # StoreError (a bad record) or an assigner refusing an episode
            raise CLIError(str(exc)) from exc
        finally:
            for warning in caught:
                Console(stderr=True).print(terminal_text(f"warning: {warning.message}",
                                                         "yellow"))
    missing = sorted(wanted - found) if args.limit is None else []
    if missing:
        as_tasks = [f"{m!r} is a task id; its episodes: {', '.join(tasks[m])}"
                    for m in missing if m in tasks]
        raise CLIError(f"no episode {', '.join(map(repr, missing))} in {path} "
                       f"({sum(map(len, tasks.values()))} episodes)"
                       + ("; " + "; ".join(as_tasks) if as_tasks else ""))
    console.print(table)
    return 0


# --- entry point --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-rl",
        description="Multi-session agentic RL: environments, GRPO training, evaluation.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from agent_rl.openai_policy import OpenAIPolicyError

    try:
        with escaped_warnings():
            code = args._run(args)
    except (CLIError, OpenAIPolicyError) as exc:  # a remote endpoint's failure is redacted
        echo(f"agent-rl {args.command}: error: {exc}", file=sys.stderr)  # it may quote agent text
        code = 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "torch" in sys.modules:  # (else no group)
        from agent_rl.distributed import end_launched_rank

        end_launched_rank(code)  # one of several ranks: no interpreter teardown (its docstring)
    return code


if __name__ == "__main__":
    sys.exit(main())
