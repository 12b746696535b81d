"""Printed results read at 80 columns and in a redirected log: the before/after summary of
``train`` and ``sft``, the eval slice table, the canary verdict and the progress line keep every
digit (no column cut to ``…``), no line is wider than 80 columns, and a log gets no control
codes. A terminal wide enough for a table still gets the table."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from agent_rl.cli.canary import verdict_lines
from agent_rl.cli.common import print_lines, show, wrap_line
from agent_rl.cli.evaluate import slice_lines, slice_table
from agent_rl.cli.train import before_after_lines, before_after_table
from agent_rl.training.metrics import TrainStatus, clock, progress_bar, train_status


def summary(mean, lo, hi, n, success, s_lo, s_hi, notes=0.0, tokens=0.0, used=0.0):
    return {"reward_mean": mean, "reward_lo": lo, "reward_hi": hi, "n": n, "success": success,
            "success_lo": s_lo, "success_hi": s_hi, "compressions_per_episode": notes,
            "summary_tokens": tokens, "summary_used_frac": used}


def demo_result():
    """The shape of the demo's result (two held-out splits, one note per episode)."""
    before = summary(0.371, 0.309, 0.435, 96, 0.219, 0.148, 0.311, 1.0, 28.1, 0.4)
    before["splits"] = {"holdout_iid": summary(0.395, 0.311, 0.482, 48, 0.25, 0.149, 0.388),
                        "holdout": summary(0.347, 0.266, 0.431, 48, 0.188, 0.102, 0.32, 2.0, 25.5, 0.25)}
    after = summary(0.565, 0.5, 0.63, 96, 0.396, 0.303, 0.497, 1.0, 30.2, 0.76)
    after["splits"] = {"holdout_iid": summary(0.673, 0.581, 0.761, 48, 0.5, 0.365, 0.635),
                       "holdout": summary(0.484, 0.402, 0.567, 48, 0.292, 0.183, 0.432, 2.0, 27.0, 0.5)}
    comparison = {"reward_diff": 0.194, "lo": 0.121, "hi": 0.272, "n": 96, "splits": {
        "holdout_iid": {"reward_diff": 0.278, "lo": 0.172, "hi": 0.391, "n": 48},
        "holdout": {"reward_diff": 0.137, "lo": 0.031, "hi": 0.248, "n": 48}}}
    return SimpleNamespace(before=before, after=after, comparison=comparison)


def printed(table, lines, width: int, terminal: bool) -> str:
    out = io.StringIO()
    show(Console(file=out, width=width, force_terminal=terminal, color_system=None), table, lines)
    return out.getvalue()


def assert_readable(text: str, width: int = 80) -> None:
    assert "…" not in text and "\x1b" not in text and "\r" not in text
    assert max(len(line) for line in text.splitlines()) <= width, text


KEY_LINES = ["held-out all: 0.371 -> 0.565, paired +0.194 [0.121, 0.272] (n=96)",
             "held-out holdout_iid: 0.395 -> 0.673, paired +0.278 [0.172, 0.391] (n=48)",
             "held-out holdout: 0.347 -> 0.484, paired +0.137 [0.031, 0.248] (n=48)"]


def test_before_after_at_80_columns_keeps_every_digit():
    result = demo_result()
    text = printed(before_after_table(result), before_after_lines(result), 80, terminal=True)
    assert_readable(text)
    for line in KEY_LINES:
        assert line in text
    assert "  reward: before 0.371 [0.309, 0.435] n=96, after 0.565 [0.500, 0.630] n=96" in text
    assert "  success: before 0.219 [0.148, 0.311], after 0.396 [0.303, 0.497] (Wilson)" in text
    assert "  notes: 1.00 -> 1.00 per episode, 28.1 -> 30.2 tokens each, 40% -> 76% used" in text
    # held-out_iid episodes wrote no notes: no notes line for that split
    iid = text.split("held-out holdout_iid:")[1].split("held-out holdout:")[0]
    assert "notes" not in iid


def test_before_after_shows_the_sub_agents_where_episodes_spawned_them():
    before = summary(0.145, 0.084, 0.213, 64, 0.094, 0.044, 0.19)
    after = summary(0.25, 0.17, 0.33, 64, 0.2, 0.12, 0.31)
    before |= {"branches_per_episode": 0.6875, "branched_frac": 0.6875, "branch_used_frac": 0.5}
    after |= {"branches_per_episode": 1.0, "branched_frac": 0.9375, "branch_used_frac": 0.75}
    result = SimpleNamespace(before=before, after=after, comparison={
        "reward_diff": 0.105, "lo": 0.01, "hi": 0.2, "n": 64})
    text = printed(before_after_table(result), before_after_lines(result), 80, terminal=False)
    assert_readable(text)
    # per episode; the share of episodes that spawned one; the share whose answer was used
    assert "  sub-agents: 0.69 -> 1.00 per episode, 69% -> 94% spawned, 50% -> 75% used\n" in text
    assert "notes" not in text  # no compressions, no notes line


def test_before_after_names_a_sampled_evaluation_by_its_temperature():
    result = demo_result()
    assert printed(before_after_table(result), before_after_lines(result), 80,
                   terminal=False).startswith("held-out reward before -> after (greedy, ")
    result.before["temperature"] = 0.7
    for terminal, width in ((False, 80), (True, 160)):  # the lines and the table
        text = printed(before_after_table(result), before_after_lines(result), width, terminal)
        assert "(T=0.7, hint-free" in text and "greedy" not in text


def test_before_after_in_a_redirected_log_is_plain_even_when_the_console_is_wide():
    result = demo_result()
    text = printed(before_after_table(result), before_after_lines(result), 200, terminal=False)
    assert_readable(text)
    assert all(line in text for line in KEY_LINES)
    assert "┃" not in text and "paired diff" not in text  # not the table


def test_a_terminal_wide_enough_gets_the_table():
    result = demo_result()
    text = printed(before_after_table(result), before_after_lines(result), 160, terminal=True)
    assert "paired diff" in text and "[0.121, 0.272]" in text and "…" not in text
    assert "held-out all:" not in text


def test_a_stopped_run_shows_the_starting_policy_only():
    result = SimpleNamespace(before=summary(0.25, 0.1, 0.4, 8, 0.125, 0.02, 0.47), after=None,
                             comparison=None)
    text = printed(before_after_table(result), before_after_lines(result), 80, terminal=False)
    assert "held-out all: before 0.250 (n=8)\n" in text
    assert "  reward: before 0.250 [0.100, 0.400] n=8\n" in text
    assert "after" not in text.split("\n", 1)[1] and "notes" not in text


def test_the_plain_lines_escape_control_characters():
    result = demo_result()
    result.before["splits"] = {"x\x1b[2J": result.before["splits"]["holdout"]}
    result.after["splits"] = {"x\x1b[2J": result.after["splits"]["holdout"]}
    text = printed(before_after_table(result), before_after_lines(result), 80, terminal=False)
    assert "\x1b" not in text and "held-out x\\x1b[2J: before 0.347" in text


def test_wrap_line_keeps_intervals_whole_and_indents_continuations():
    line = "  reward: before 0.371 [0.309, 0.435] n=96, after 0.565 [0.500, 0.630] n=96"
    assert wrap_line(line, 40) == ["  reward: before 0.371 [0.309, 0.435]",
                                   "      n=96, after 0.565 [0.500, 0.630]", "      n=96"]
    assert wrap_line("short", 80) == ["short"]
    assert wrap_line("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]  # one word wider than a line


def test_eval_slices_at_80_columns_keep_every_digit():
    rows = [{"n": 32, "reward/mean": 0.4375, "reward/lo": 0.28125, "reward/hi": 0.59375,
             "success/rate": 0.40625, "success/lo": 0.25543, "success/hi": 0.57622},
            {"structure": "search>get>transform>update", "entity_group": "warehouse-inventory",
             "n": 7, "reward/mean": 0.142857, "reward/lo": 0.0, "reward/hi": 0.428571,
             "success/rate": 0.142857, "success/lo": 0.02571, "success/hi": 0.51313}]
    title = "base:smollm2-135m on agent_rl/Records-v0 holdout_structure (n=32)"
    for terminal in (True, False):
        text = printed(slice_table(rows, title), slice_lines(rows, title), 80, terminal)
        assert_readable(text)
        assert "structure=search>get>transform>update entity_group=warehouse-inventory (n=7)" in text
        assert "  reward 0.143 [0.000, 0.429], success 0.143 [0.026, 0.513]" in text
        assert "all (n=32)\n  reward 0.438 [0.281, 0.594], success 0.406 [0.255, 0.576]" in text
        assert "95% Wilson" in text


def test_canary_verdict_wraps_its_reasons_without_cutting_a_number():
    reason = ("PASS no reward regression (slice all): reward/mean change (cand-base) 0.0625 "
              "[-0.03125, 0.15625] n=10 (10 tasks) needs >= -0.05")
    result = SimpleNamespace(
        stages=[SimpleNamespace(stage="offline", status="pass", reasons=[reason]),
                SimpleNamespace(stage="shadow", status="fail", reasons=["task t\x1b[31m-1 wrote"])],
        status="rolled_back", stage="shadow", serving="69d4ec1a0ab9" + "0" * 52,
        rollback=SimpleNamespace(store_hash="daa4b4fee593" + "1" * 52))
    out = io.StringIO()
    print_lines(Console(file=out, width=200, color_system=None), verdict_lines(result))
    text = out.getvalue()
    assert_readable(text)
    assert text.startswith("offline: PASS\n  PASS no reward regression")
    assert "[-0.03125, 0.15625]" in text and "needs >= -0.05" in text
    assert "  task t\\x1b[31m-1 wrote" in text
    assert text.endswith("result: rolled_back at shadow; serving 69d4ec1a0ab9\n"
                         "rollback: live store restored to daa4b4fee593\n")


# --- the progress line ------------------------------------------------------------------------


def test_train_status_shows_reward_held_out_and_speed():
    m = {"step": 7, "reward/mean": 0.34375, "rollout/tokens_per_s": 412.4}
    assert train_status(m) == "reward 0.344  412 tok/s"
    assert train_status(m, (0, 0.371)) == "reward 0.344  held-out 0.371 (before)  412 tok/s"
    status = TrainStatus({"reward_mean": 0.371})
    assert status(m) == "reward 0.344  held-out 0.371 (before)  412 tok/s"
    assert status({**m, "step": 10, "holdout/reward": 0.4125}).endswith(
        "held-out 0.412 (step 10)  412 tok/s")
    assert "held-out 0.412 (step 10)" in status({**m, "step": 11})  # the last one stays
    assert TrainStatus(None)(m) == "reward 0.344  412 tok/s"


def test_clock():
    assert [clock(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]


def metrics(step: int) -> dict:
    return {"step": step, "reward/mean": 0.25, "rollout/tokens_per_s": 90.0}


def test_progress_in_a_log_is_plain_periodic_lines(capsys):
    with progress_bar(True, 45, 0, status=TrainStatus({"reward_mean": 0.5})) as advance:
        for step in range(1, 46):
            advance(metrics(step))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert_readable(out)
    # the first and last step and every ceil(45 / 20) = 3 steps between
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [1, *range(3, 46, 3)]
    assert lines[0].startswith("train step 1/45  reward 0.250  held-out 0.500 (before)  "
                               "90 tok/s  ETA ")
    assert lines[-1].endswith("ETA 0:00")


def test_evaluation_progress_counts_the_episodes_each_round_finished(capsys):
    from agent_rl.training.metrics import episode_progress

    # 40 episodes: a line at the first round, every ceil(40 / 20) = 2 episodes crossed, the last
    with episode_progress(True, 40, "eval before holdout") as on_round:
        for done in (5, 5, 6, 17, 40):  # a round may finish none, one or many episodes
            on_round(done, 40)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == [
        "eval before holdout episode 5/40", "eval before holdout episode 6/40",
        "eval before holdout episode 17/40", "eval before holdout episode 40/40"]
    assert lines[-1].endswith("  ETA 0:00") and "   " not in lines[0]  # no empty status


def test_evaluation_progress_off_prints_nothing(capsys):
    from agent_rl.training.metrics import episode_progress

    with episode_progress(False, 4, "eval") as on_round:
        on_round(4, 4)
    assert capsys.readouterr().out == ""


def test_a_resumed_run_counts_from_its_checkpoint(capsys):
    with progress_bar(True, 10, 8, status=lambda m: f"loss {m['step']}") as advance:
        advance(metrics(9))
        advance(metrics(10))
    assert capsys.readouterr().out.splitlines() == ["train step 9/10  loss 9  ETA 0:00",
                                                    "train step 10/10  loss 10  ETA 0:00"]


def test_progress_on_an_80_column_terminal_fits_its_line(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "80")
    with progress_bar(True, 180, 0, status=TrainStatus({"reward_mean": 0.5})) as advance:
        for step in range(1, 11):
            advance({**metrics(step), "holdout/reward": 0.625} if step == 10 else metrics(step))
    out = capsys.readouterr().out
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.split("\r")[-1]).strip()  # the final redraw
    assert last == "train  10/180 reward 0.250  held-out 0.625 (step 10)  90 tok/s  ETA 0:00"
    assert len(last) <= 80 and "…" not in out


def test_library_progress_bars_stay_out_of_a_log(monkeypatch):
    """transformers' weight-loading bars are carriage-return redraws: off when stderr is not
    a terminal (a log), left on where one is."""
    from transformers.utils import logging as transformers_logging

    from agent_rl.cli.common import ignore_library_deprecations

    try:
        transformers_logging.enable_progress_bar()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        ignore_library_deprecations()
        assert transformers_logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
        ignore_library_deprecations()
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


def test_the_gguf_conversion_bar_follows_transformers_switch():
    """The GGUF conversion draws its own tqdm bar: off in a log as the others are."""
    import io

    from transformers import modeling_gguf_pytorch_utils as conversion
    from transformers.utils import logging as transformers_logging

    from agent_rl.policies.models import gguf_bar_follows_transformers

    def drawn() -> str:
        out = io.StringIO()
        with gguf_bar_follows_transformers():
            for _ in conversion.tqdm(range(3), desc="Converting", file=out):
                pass
        return out.getvalue()

    try:
        transformers_logging.disable_progress_bar()
        assert drawn() == ""
        transformers_logging.enable_progress_bar()
        assert "Converting" in drawn()
    finally:
        transformers_logging.enable_progress_bar()


def test_no_task_scored_on_both_sides_is_no_paired_difference_not_a_crash():
    """A held-out evaluation whose every episode was an infrastructure fault scores no task:
    compare warns and gives no difference (an Agent-v0 agent that always fails made the
    bootstrap raise on an empty sample); a split without pairs is left out."""
    from agent_rl.training.metrics import compare

    before = {"keys": ["a", "b"], "rewards": [0.0, 1.0],
              "splits": {"x": {"keys": ["a"], "rewards": [0.0]},
                         "y": {"keys": ["b"], "rewards": [1.0]}}}
    nothing = {"keys": [], "rewards": [], "splits": {"x": {"keys": [], "rewards": []}}}
    with pytest.warns(UserWarning, match="held-out all: no task was scored both"):
        assert compare(before, nothing) is None
    half = {"keys": ["a"], "rewards": [1.0],
            "splits": {"x": {"keys": ["a"], "rewards": [1.0]}, "y": {"keys": [], "rewards": []}}}
    with pytest.warns(UserWarning, match="held-out y: no task"):
        out = compare(before, half)
    assert out["reward_diff"] == 1.0 and out["n"] == 1 and list(out["splits"]) == ["x"]


@pytest.mark.parametrize("quiet", [False, True])
def test_deepspeeds_accelerator_notice_stays_out_of_a_cpu_run(quiet):
    """transformers imports DeepSpeed where it is installed, and DeepSpeed's detection warns
    "Setting accelerator to CPU. If you have GPU ..." into every command's output on a machine
    without one; the CLI tells it the CPU first."""
    import subprocess

    pytest.importorskip("deepspeed")
    code = ("from agent_rl.cli.common import ignore_library_deprecations\n"
            f"{'ignore_library_deprecations()' if quiet else ''}\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "print(get_accelerator().device_name())\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "cpu"  # the notice goes to stdout
    assert ("Setting accelerator to CPU" in result.stderr + result.stdout) is not quiet
