"""envs.scaffold: a generated environment package installs, registers through the
``agent_rl.envs`` entry point, passes the contract checks and its own tests."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from envs.scaffold import new_env_package, next_steps, package_names

_SCRIPT = Path(sys.executable).with_name("agent-rl")
AGENT_RL = [str(_SCRIPT) if _SCRIPT.exists() else shutil.which("agent-rl") or "agent-rl"]


def _run(args: list[str], cwd, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _as_here(step: str) -> list[str]:
    """A printed command with `agent-rl` and `python` as this venv's."""
    program, *args = shlex.split(step)
    return {"agent-rl": AGENT_RL, "python": [sys.executable]}[program] + args


@pytest.mark.slow
def test_scaffolded_package_installs_registers_passes_and_trains(tmp_path):
    """What `agent-rl envs new` prints, run as printed from the folder it ran in: install, the
    contract checks, the package's tests, then a 2-step training run of its train.yaml."""
    name = f"scaffold_{uuid.uuid4().hex[:6]}"  # unique: other test runs share the venv
    names = package_names(name)
    done = _run([*AGENT_RL, "envs", "new", name], tmp_path)
    root = tmp_path / names["dist"]
    steps = next_steps(name, names["dist"])
    assert [line.strip() for line in done.stdout.splitlines()[-4:]] == steps
    assert steps[0] == f"pip install -e ./{names['dist']}"
    assert steps[-1] == f"agent-rl train ./{names['dist']}/train.yaml"
    env_py = (root / names["pkg"] / "env.py").read_text()
    for section in ("Description", "Tools", "Observation", "Reward", "Episode end",
                    "Version history"):
        assert f"\n{section}\n" in env_py
    assert f'{name} = "{names["pkg"]}:register_envs"' in (root / "pyproject.toml").read_text()
    readme = (root / "README.md").read_text()
    assert "agent-rl train train.yaml" in readme and f"agent-rl envs check {names['env_id']}" in readme

    # offline here: the printed `pip install -e DIR` without build isolation or dependencies
    assert shlex.split(steps[0])[:3] == ["pip", "install", "-e"]
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", *shlex.split(steps[0])[2:]],
         tmp_path)
    try:
        script = textwrap.dedent(f"""
            import sys
            import envs

            ids = envs.list_envs()
            assert {names["env_id"]!r} in ids, ids
            assert {names["pkg"] + ".env"!r} not in sys.modules  # registered lazily
        """)
        # cwd=tmp_path: the package is importable only through the install
        _run([sys.executable, "-c", script], tmp_path)
        check, tests, train = (_as_here(step) for step in steps[1:])
        assert "PASS" in _run(check, tmp_path).stdout
        assert "2 passed" in _run([*tests, "-q", "-p", "no:cacheprovider"], tmp_path).stdout
        done = _run([*train, "--no-progress"], tmp_path, timeout=600)
        run_dir = tmp_path / "runs" / name
        assert f"run dir: runs/{name}" in done.stdout
        # its train.yaml asks for holdout_iid itself: no fallback notice
        assert "holdout_iid" not in done.stderr and "HoldoutFallback" not in done.stderr
        tags = [json.loads(line)["tag"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
        assert tags == ["before", "after"]
        for tag in tags:
            records = [json.loads(line) for line in
                       (run_dir / "evals" / f"{tag}.jsonl").read_text().splitlines()]
            assert len(records) == 4 and {r["split"] for r in records} == {"holdout_iid"}
        steps_logged = [json.loads(line)["step"] for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps_logged[-1] == 2
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", names["dist"]], capture_output=True,
                       timeout=60)


def test_refuses_to_overwrite(tmp_path):
    root = new_env_package("letters", tmp_path)
    with pytest.raises(FileExistsError, match="already exists"):
        new_env_package("letters", tmp_path)
    assert (root / "tests" / "test_env.py").exists()


@pytest.mark.parametrize("bad", ["", "Letters", "1abc", "my-env", "my env", "class", "a" * 41])
def test_rejects_bad_names(tmp_path, bad):
    with pytest.raises(ValueError, match="lowercase identifier"):
        new_env_package(bad, tmp_path)
    assert not any(tmp_path.iterdir())


def test_names():
    assert package_names("letter_count") == {
        "name": "letter_count", "Name": "LetterCount", "pkg": "agent_rl_env_letter_count",
        "dist": "agent-rl-env-letter-count", "env_id": "letter_count/LetterCount-v0"}


def test_next_steps_name_the_folder_as_pip_reads_it(tmp_path):
    assert next_steps("inventory", "agent-rl-env-inventory") == [
        "pip install -e ./agent-rl-env-inventory",
        "agent-rl envs check inventory/Inventory-v0",
        "python -m pytest ./agent-rl-env-inventory/tests",
        "agent-rl train ./agent-rl-env-inventory/train.yaml"]
    assert next_steps("inventory", tmp_path / "my dir")[0] == f"pip install -e '{tmp_path}/my dir'"


def test_train_yaml_is_a_valid_contract(tmp_path):
    """Without installing the package: every key but the (unregistered) id is checked on a
    built-in env; the slow test above trains it for real."""
    import yaml

    from agent_rl.run.contract import ExperimentContract

    root = new_env_package("letters", tmp_path)
    data = yaml.safe_load((root / "train.yaml").read_text())
    assert data["env"]["id"] == "letters/Letters-v0"
    contract = ExperimentContract.from_dict(data, ["env.id=agent_rl/Arithmetic-v0"])
    assert contract.eval.splits == ["holdout_iid"] and contract.env.iid_fraction == 0.25
    assert contract.model.id == "tiny" and contract.optim.max_steps == 2
    assert contract.resolved_run_dir.as_posix() == "runs/letters"
