"""`agent-rl inspect` run as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trajectories import RolloutStore
from trajectories.testing import episode, session

SCRIPT = Path(sys.executable).with_name("agent-rl")


def agent_rl(*args: str) -> subprocess.CompletedProcess:
    exe = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("agent-rl") or "agent-rl"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(exe + list(args), capture_output=True, text=True, env=env, timeout=120)


def multi_session_episode():
    # r -> c1 (compression) -> {b1 (branch, unused), c2 (compression, final)}
    return episode(
        [
            session("r"),
            session("c1", "r", "compression"),
            session("b1", "c1", "branch", used_by_final=False),
            session("c2", "c1", "compression"),
        ],
        reward=1.0,
    )


@pytest.fixture(params=["rollouts.jsonl", "rollouts.jsonl.zst"])
def store_path(tmp_path, request) -> Path:
    path = tmp_path / request.param
    single = episode([session("solo", episode_id="ep-1")], episode_id="ep-1", reward=0.0)
    RolloutStore(path).append([multi_session_episode(), single])
    return path


def test_console_script_is_installed():
    assert SCRIPT.exists() or shutil.which("agent-rl"), "run: pip install -e . --no-deps"


def test_inspect_draws_sessions_origins_and_credit(store_path):
    result = agent_rl("inspect", str(store_path), "--assigner", "discounted")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "episode ep-0" in out and "episode ep-1" in out
    # discounted, gamma 0.9, final c2: r 2 edges -> 0.81, c1 1 -> 0.9, b1 2 -> 0.81, c2 0 -> 1
    for line_start, origin, credit in [
        ("r root", "root", "credit 0.81"),
        ("c1 compression", "compression", "credit 0.9"),
        ("b1 branch", "branch", "credit 0.81"),
        ("c2 compression [final]", "compression", "credit 1"),
        ("solo root [final]", "root", "credit 0"),
    ]:
        [line] = [ln for ln in out.splitlines() if line_start in ln]
        assert origin in line and line.rstrip().endswith(credit), line
    assert 'summary "summary of c1"' in out
    assert 'parent_turn=1 returned "done"' in out
    assert "used_by_final=False" in out
    assert "credit: discounted (session)" in out
    # summary table
    assert "2 episodes · credit: discounted" in out
    rows = {" ".join(ln.strip("│┃ ").split("│")[0].split()): ln for ln in out.splitlines()}
    assert "5" in rows["sessions"] and "2" in rows["compressions"] and "1" in rows["branches"]
    assert "correct: 1, wrong: 1" in out


def test_inspect_default_assigner_and_limit(store_path):
    result = agent_rl("inspect", str(store_path), "--limit", "1")
    assert result.returncode == 0, result.stderr
    assert "episode ep-0" in result.stdout and "episode ep-1" not in result.stdout
    assert "credit: broadcast (episode)" in result.stdout
    assert result.stdout.count("credit 1") == 4  # broadcast: every session gets reward 1


def test_inspect_verify_ok(store_path):
    result = agent_rl("inspect", str(store_path), "--verify")
    assert result.returncode == 0, result.stderr
    assert f"{store_path}: 2 records, 0 bad" in result.stdout
    assert "episode ep-0" in result.stdout


def test_inspect_verify_reports_bad_record_and_exits_1(tmp_path):
    path = tmp_path / "r.jsonl"
    RolloutStore(path).append([multi_session_episode()])
    data = path.read_bytes()
    path.write_bytes(data.replace(b"summary of c1", b"summary of c9"))  # hash no longer matches
    result = agent_rl("inspect", str(path), "--verify")
    assert result.returncode == 1
    assert "1 records, 1 bad" in result.stdout
    assert "record 1: content_hash mismatch for episode ep-0" in result.stdout


def test_inspect_missing_file_exits_2(tmp_path):
    result = agent_rl("inspect", str(tmp_path / "absent.jsonl"))
    assert result.returncode == 2
    assert "agent-rl inspect: error: no rollout store or run directory at" in result.stderr
    assert "absent.jsonl" in result.stderr
    assert "Traceback" not in result.stderr


def test_inspect_corrupt_record_exits_2_naming_it(tmp_path):
    path = tmp_path / "r.jsonl"
    RolloutStore(path).append([multi_session_episode(), multi_session_episode()])
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"[" + lines[1][1:]  # record 2 now opens a list: not JSON
    path.write_bytes(b"\n".join(lines))
    result = agent_rl("inspect", str(path))
    assert result.returncode == 2
    assert "record 2 is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr


def test_inspect_torn_tail_warns_and_shows_complete_records(tmp_path):
    path = tmp_path / "r.jsonl"
    RolloutStore(path).append([multi_session_episode()])
    with open(path, "ab") as fh:
        fh.write(b'{"episode_id": "half-writ')
    result = agent_rl("inspect", str(path))
    assert result.returncode == 0, result.stderr
    assert "torn tail of 25 bytes" in result.stderr
    assert "1 episodes" in result.stdout


def test_inspect_unknown_assigner_exits_2(store_path):
    result = agent_rl("inspect", str(store_path), "--assigner", "nope")
    assert result.returncode == 2
    assert "unknown assigner 'nope'" in result.stderr and "broadcast" in result.stderr


def test_cli_lists_inspect_and_requires_a_command():
    result = agent_rl("--help")
    assert result.returncode == 0 and "inspect" in result.stdout
    assert agent_rl().returncode == 2


def test_main_in_process(store_path, capsys, monkeypatch):
    from agent_rl.cli import COMMANDS, main

    monkeypatch.setenv("COLUMNS", "200")
    assert "inspect" in COMMANDS
    assert main(["inspect", str(store_path), "--assigner", "terminal_only"]) == 0
    out = capsys.readouterr().out
    assert "credit: terminal_only (session)" in out


def test_episode_text_is_not_read_as_markup(tmp_path):
    path = tmp_path / "r.jsonl"
    eid = "ep-[red]x[/red]"
    ep = episode([session("[bold]r", episode_id=eid),
                  session("c1", "[bold]r", "compression", episode_id=eid)], episode_id=eid)
    RolloutStore(path).append([ep])
    result = agent_rl("inspect", str(path))
    assert result.returncode == 0, result.stderr
    assert "episode ep-[red]x[/red]" in result.stdout
    assert "[bold]r root" in result.stdout and 'summary "summary of [bold]r"' in result.stdout


# --- a run directory: its own assigner, advantages, worked examples -------------------------------


def worked_example_session(episode_id: str, reply: str):
    """A root session that opened with a system message, a worked example (a user turn and an
    assistant turn the env wrote into the prompt) and the task; then the policy's reply."""
    from trajectories.models import Session, Turn
    from trajectories.testing import assistant

    turns = [Turn(role="system", content="Answer with a number."),
             Turn(role="user", content="What is 1 + 1?"), Turn(role="assistant", content="2"),
             Turn(role="user", content="What is 2 + 3?"), assistant(reply)]
    return Session(session_id=f"{episode_id}/s0", episode_id=episode_id, origin="root",
                   turns=turns, used_by_final=True, metrics={"opening_turns": 4})


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory as the trainer leaves it: contract.yaml (credit: terminal_only) and
    rollouts.jsonl with one group of two kept episodes (rewards 1 and 0) and a dropped one."""
    from agent_rl.run.contract import ExperimentContract

    run = tmp_path / "run"
    run.mkdir()
    contract = ExperimentContract.from_dict({"credit": {"assigner": "terminal_only"}})
    (run / "contract.yaml").write_text(contract.to_yaml())
    kept = {"kept": True, "reason": "kept"}
    two = episode([session("r", episode_id="ep-a"), session("c", "r", "compression", "ep-a")],
                  episode_id="ep-a", reward=1.0, group_id="g1", filter=kept)
    one = episode([worked_example_session("ep-b", "4")], episode_id="ep-b", reward=0.0,
                  group_id="g1", filter=kept)
    dropped = episode([session("x", episode_id="ep-c")], episode_id="ep-c", reward=0.0,
                      group_id="g2", filter={"kept": False, "reason": "zero_contrast"})
    RolloutStore(run / "rollouts.jsonl").append([two, one, dropped])
    return run


def test_inspect_a_run_dir_draws_credit_and_advantage_under_its_assigner(run_dir):
    result = agent_rl("inspect", str(run_dir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "credit: terminal_only, the run's credit.assigner" in out
    # group g1: rewards 1 and 0, mean 0.5, population std 0.5. terminal_only: ep-a's root r
    # gets credit 0 -> (0 - 0.5) / 0.5 = -1; its final c gets 1 -> +1; ep-b's one session 0 -> -1
    lines = out.splitlines()
    for start, credit, advantage in [("r root", "credit 0", "advantage -1"),
                                     ("c compression [final]", "credit 1", "advantage +1"),
                                     ("ep-b/s0 root [final]", "credit 0", "advantage -1")]:
        [line] = [ln for ln in lines if start in ln]
        assert line.rstrip().endswith(f"{credit} · {advantage}"), line
    # the dropped episode trained nothing: credit, no advantage
    [line] = [ln for ln in lines if "x root" in ln]
    assert line.rstrip().endswith("credit 0"), line
    assert "1 episodes" not in out and "3 episodes · credit: terminal_only" in out


def test_inspect_assigner_flag_overrides_the_runs(run_dir):
    result = agent_rl("inspect", str(run_dir), "--assigner", "broadcast", "--limit", "1")
    assert result.returncode == 0, result.stderr
    assert "credit: broadcast, --assigner" in result.stdout
    [line] = [ln for ln in result.stdout.splitlines() if "r root" in ln]
    assert line.rstrip().endswith("credit 1 · advantage +1"), line


def test_inspect_marks_worked_example_turns_as_prompt_only(run_dir):
    result = agent_rl("inspect", str(run_dir), "--episode", "ep-b")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    headers = [ln for ln in lines if ln.startswith("[")]
    assert headers == ["[system] · in the prompt", "[user] · in the prompt",
                       "[assistant] · worked example, in the prompt: not generated by the policy",
                       "[user] · in the prompt", "[assistant] · finish stop · 2 tokens"]


def test_inspect_a_run_dir_without_rollouts_reads_its_last_evaluation(run_dir):
    (run_dir / "rollouts.jsonl").write_text("")
    episodes = run_dir / "evals" / "episodes"
    episodes.mkdir(parents=True)
    RolloutStore(episodes / "after.jsonl").append(
        [episode([session("e", episode_id="ev-1")], episode_id="ev-1")])
    result = agent_rl("inspect", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert f"episodes: {episodes / 'after.jsonl'}" in result.stdout
    assert "episode ev-1" in result.stdout


def test_inspect_a_folder_that_is_no_run_or_a_run_without_episodes_exits_2(tmp_path, run_dir):
    result = agent_rl("inspect", str(tmp_path / "run" / ".."))
    assert result.returncode == 2 and "is not a run directory (no contract.yaml)" in result.stderr
    (run_dir / "rollouts.jsonl").unlink()
    result = agent_rl("inspect", str(run_dir))
    assert result.returncode == 2 and "recorded no episode yet" in result.stderr
    assert "agent-rl eval --policy" in result.stderr
