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
    assert "agent-rl inspect: error: no rollout store at" in result.stderr
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
