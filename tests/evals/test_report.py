"""HTML report: one inline SVG per chart, escaped text, robust to missing and non-finite values."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser

import pytest

from evals.gates import Criterion, decide
from evals.report import bar_chart, line_chart, write_report, write_run_report
from evals.run import EvalRecord, slice_summary
from trajectories import Outcome

CURVE_KEYS = ["reward/mean", "holdout/reward", "loss/policy", "kl/approx",
              "response/length_mean", "policy/entropy"]


def step_metrics(step: int) -> dict:
    m = {"step": step, "loss/policy": 0.1 / step, "reward/mean": 0.1 * step,
         "kl/approx": 0.01 * step, "response/length_mean": 10.0 + step,
         "policy/entropy": 1.0 / step, "batch/task_ids": ["a", "b"]}
    if step % 2 == 0:
        m["holdout/reward"] = 0.05 * step
    return m


EVALS = [{"step": 0, "tag": "before", "reward_mean": 0.2, "reward_lo": 0.1, "reward_hi": 0.3,
          "success": 0.2, "n": 16, "rewards": [0.0] * 16},
         {"step": 4, "tag": "after", "reward_mean": 0.5, "reward_lo": 0.4, "reward_hi": 0.6,
          "success": 0.5, "n": 16, "rewards": [1.0] * 16}]


def records(policy: str, structure: str, rewards: list[float]) -> list[EvalRecord]:
    return [EvalRecord(task_id=f"{structure}-{i}", episode_id=f"{policy}-{structure}-{i}",
                       env_id="test/Env-v0", policy_name=policy, reward=r,
                       outcome=Outcome.correct if r >= 1 else Outcome.wrong, success=r >= 1,
                       structure=structure, atomic=True)
            for i, r in enumerate(rewards)]


def count_svgs(html: str) -> int:
    return len(re.findall(r"<svg\b", html))


class _Checker(HTMLParser):
    """Collects start tags, to prove no injected element got through."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def test_full_report_has_an_svg_per_chart(tmp_path):
    evil = "<script>alert(1)</script>"
    rows = slice_summary(records("before", "add", [0.0, 1.0] * 6)
                         + records("after", "add", [1.0] * 12)
                         + records("after", evil, [1.0, 0.0, 1.0]),
                         by=("policy_name", "structure"), n_boot=200)
    candidate = records("after", "add", [1.0] * 12)
    decision = decide(candidate, [Criterion(name=f"min {evil}", kind="min", threshold=0.5)],
                      n_boot=200)
    path = write_report(tmp_path / "out" / "report.html", title=f"run {evil}",
                        metrics=[step_metrics(s) for s in range(1, 6)], evals=EVALS,
                        slices=rows, decision=decision)
    html = path.read_text(encoding="utf-8")

    # 6 training curves + held-out reward + 2 slice bar charts
    assert count_svgs(html) == len(CURVE_KEYS) + 1 + 2
    assert html.count("</svg>") == count_svgs(html)
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    checker = _Checker()
    checker.feed(html)
    assert "script" not in checker.tags
    assert "PASS" in html and "n=12" in html
    assert "http://" not in html and "https://" not in html  # self-contained
    for key in CURVE_KEYS:
        assert f">{key}<" in html or key == "policy/entropy"
    assert ">entropy<" in html


def test_empty_and_missing_inputs(tmp_path):
    html = write_report(tmp_path / "empty.html", title="empty").read_text()
    assert count_svgs(html) == 0
    assert "No training metrics" in html and "No held-out evaluations" in html
    assert "No slices" in html

    # a log with only some keys: only those curves are drawn
    html = write_report(tmp_path / "partial.html", title="partial",
                        metrics=[{"step": 1, "reward/mean": 0.5}, {"step": 2}]).read_text()
    assert count_svgs(html) == 1


def test_nan_and_none_values(tmp_path):
    metrics = [{"step": 1, "reward/mean": 0.1, "loss/policy": None, "kl/approx": math.nan},
               {"step": 2, "reward/mean": math.nan, "loss/policy": None, "kl/approx": math.inf},
               {"step": 3, "reward/mean": 0.3, "loss/policy": None, "kl/approx": None},
               {"step": 4, "reward/mean": None, "loss/policy": None}]
    evals = [{"step": 0, "tag": "before", "reward_mean": None, "reward_lo": None,
              "reward_hi": None, "n": 0},
             {"step": 4, "tag": "after", "reward_mean": 0.4, "reward_lo": math.nan,
              "reward_hi": 0.5, "n": 4}]
    slices = [{"structure": "a", "n": 0, "n_tasks": 0, "n_infra_faults": 2,
               "reward/mean": None, "reward/lo": None, "reward/hi": None,
               "success/k": None, "success/rate": None, "success/lo": None, "success/hi": None}]
    html = write_report(tmp_path / "nan.html", title="nan", metrics=metrics, evals=evals,
                        slices=slices, decision={"status": "inconclusive",
                                                 "reasons": ["n=0 < min_n"]}).read_text()
    # loss/policy is None on every step (not measured): no chart; kl/approx (NaN, inf) and the
    # slice bars have no finite value: a chart that says so
    assert count_svgs(html) == 2 + 1 + 2
    assert "<h3>loss/policy</h3>" not in html and "loss/policy</text>" not in html
    assert not re.search(r'="[^"]*(nan|inf)', html, re.IGNORECASE)  # no NaN coordinates
    assert html.count("no finite values") == 1 + 2
    assert "INCONCLUSIVE" in html


def test_chart_helpers_break_lines_at_gaps():
    svg = line_chart("r", {"r": [(1, 0.1, None, None), (2, 0.2, None, None),
                                 (3, None, None, None), (4, 0.4, None, None),
                                 (5, 0.5, 0.4, 0.6)]})
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 4
    bars = bar_chart("b", [("x", 0.5, 0.4, 0.6, 10), ("y", None, None, None, 0)])
    assert bars.count("<rect") == 1 and "n=10" in bars and "n/a" in bars


@pytest.mark.parametrize("with_eval", [True, False])
def test_run_report_reads_run_dir(tmp_path, with_eval):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(1, 4):
            f.write(json.dumps(step_metrics(step)) + "\n")
    if with_eval:
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVALS))
    path = write_run_report(tmp_path)
    assert path == tmp_path / "report.html"
    assert count_svgs(path.read_text()) == len(CURVE_KEYS) + int(with_eval)
