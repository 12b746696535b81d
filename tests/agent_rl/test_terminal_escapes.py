"""Agent- and task-controlled text reaches a terminal escaped: ``agent-rl inspect`` transcripts,
eval tables, progress lines, check reports, warnings and error messages never pass an escape
sequence, a C1 control or a bidi override through, and never read agent text as rich markup."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from trajectories import RolloutStore
from trajectories.testing import episode, session

SCRIPT = Path(sys.executable).with_name("agent-rl")

# What a hostile reply carries, and how each piece must be shown.
HOSTILE = {
    "\x1b]52;c;cm0gLXJmIH4=\x07": "\\x1b]52;c;cm0gLXJmIH4=\\x07",  # OSC 52: write the clipboard
    "\x1b[2J\x1b[H": "\\x1b[2J\\x1b[H",  # clear the screen
    "\x1b[1;32mPASSED\x1b[0m all 12 tests": "\\x1b[1;32mPASSED\\x1b[0m all 12 tests",  # fake verdict
    "\x9b2K": "\\x9b2K",  # C1 CSI: erase the line
    "\u202eexe.txt": "\\u202eexe.txt",  # right-to-left override
    "[bold red]x[/]": "[bold red]x[/]",  # rich markup, shown as written
}
RAW = ("\x1b", "\x07", "\x9b", "\u202e")
REPLY = "first line\n" + " ".join(HOSTILE) + "\nlast line"


def agent_rl(*args: str) -> subprocess.CompletedProcess:
    exe = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("agent-rl") or "agent-rl"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(exe + list(args), capture_output=True, text=True, env=env, timeout=120)


def assert_escaped(out: str) -> None:
    for raw in RAW:
        assert raw not in out, repr(raw)


@pytest.fixture
def hostile_store(tmp_path) -> Path:
    path = tmp_path / "episodes.jsonl"
    eid = "ep\x1b[2J-1"
    RolloutStore(path).append([episode(
        [session("r", episode_id=eid, text=REPLY),
         session("c1", "r", "compression", episode_id=eid, text="done")],
        episode_id=eid, task_id="task\u202e-1")])
    return path


def test_inspect_transcript_escapes_agent_text(hostile_store):
    result = agent_rl("inspect", str(hostile_store), "--transcript")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert_escaped(out)
    assert "\n".join(["first line", " ".join(HOSTILE.values()), "last line"]) in out  # newlines kept
    assert "episode ep\\x1b[2J-1" in out and "task task\\u202e-1" in out


def test_inspect_in_process_escapes_agent_text(hostile_store, capsys, monkeypatch):
    from agent_rl.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(hostile_store), "--episode", "ep\x1b[2J-1"]) == 0
    out = capsys.readouterr().out
    assert_escaped(out)
    for shown in HOSTILE.values():
        assert shown in out


def test_cli_error_message_quoting_episode_ids_is_escaped(hostile_store):
    result = agent_rl("inspect", str(hostile_store), "--episode", "task\u202e-1")  # a task id
    assert result.returncode == 2
    assert_escaped(result.stderr)
    assert "its episodes: ep\\x1b[2J-1" in result.stderr


def test_warnings_printed_by_a_command_are_escaped():
    code = ("import warnings\nfrom agent_rl.cli.common import escaped_warnings\n"
            "with escaped_warnings():\n    warnings.warn('task \\x1b[2J\\u202e done')\n"
            "warnings.warn('after \\x1b[2J')\n")
    result = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "UserWarning: task \\x1b[2J\\u202e done" in result.stderr
    assert "UserWarning: after \x1b[2J" in result.stderr  # only while the command runs


def test_escaped_warnings_leave_recorders_the_raw_warning():
    from agent_rl.cli.common import escaped_warnings

    with warnings.catch_warnings(record=True) as caught, escaped_warnings():
        warnings.simplefilter("always")
        warnings.warn("raw \x1b", stacklevel=1)
        shown = warnings.formatwarning(caught[0].message, UserWarning, "f.py", 3)
    assert str(caught[0].message) == "raw \x1b" and "UserWarning: raw \\x1b" in shown


def test_eval_slice_table_escapes_task_metadata():
    from agent_rl.cli.evaluate import slice_table

    row = {"structure": "chain\x1b[31m", "entity_group": "[bold]g\u202e", "n": 3,
           "reward/mean": 0.5, "reward/lo": 0.1, "reward/hi": 0.9, "success/rate": 0.5,
           "success/lo": 0.1, "success/hi": 0.9}
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(
        slice_table([row], "policy on agent_rl/X-v0\x07 holdout"))
    text = out.getvalue()
    assert_escaped(text)
    assert "structure=chain\\x1b[31m entity_group=[bold]g\\u202e" in text
    assert "agent_rl/X-v0\\x07 holdout" in text


def test_progress_line_is_escaped_and_not_markup(capsys):
    from agent_rl.training.metrics import progress_bar

    with progress_bar(True, 1, 0, status=lambda m: m["said"]) as advance:
        advance({"said": "[red]task\x1b[2J\u202e"})
    out = capsys.readouterr().out
    assert_escaped(out)
    assert "[red]task\\x1b[2J\\u202e" in out


def test_envs_check_report_is_escaped(monkeypatch, capsys):
    import envs.checks
    from agent_rl.cli import main

    report = envs.checks.CheckReport("agent_rl/Arithmetic-v0", [envs.checks.CheckResult(
        "rollout", False, "task t-1 replied '\x1b[32mPASSED\x1b[0m\u202e'")])
    monkeypatch.setattr(envs.checks, "check_env_id", lambda env_id, episodes: report)
    assert main(["envs", "check", "agent_rl/Arithmetic-v0"]) == 1
    out = capsys.readouterr().out
    assert_escaped(out)
    assert "[FAIL] rollout: task t-1 replied '\\x1b[32mPASSED\\x1b[0m\\u202e'" in out


def test_echo_escapes_the_cli_plain_lines(capsys):
    from agent_rl.cli.common import echo

    echo("dropped {'task\x1b[2J': 1}\nbundle: runs/x")
    assert capsys.readouterr().out == "dropped {'task\\x1b[2J': 1}\nbundle: runs/x\n"
