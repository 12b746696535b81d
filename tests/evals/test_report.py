"""HTML report: one inline SVG per chart, escaped text, robust to missing and non-finite values."""

from __future__ import annotations

import json
import math
import re
from html import escape, unescape
from html.parser import HTMLParser
from pathlib import Path

import pytest

from evals.gates import Criterion, decide
from evals.report import (
    CHAR_PX,
    LABEL_CHARS,
    bar_chart,
    episode_anchor,
    inspect_command,
    label_lines,
    line_chart,
    write_report,
    write_run_report,
)
from evals.run import EvalRecord, EvalRun, slice_summary, write_episodes, write_records
from trajectories import Episode, Outcome, RewardBreakdown
from trajectories.testing import episode, session

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


def hand_episode(structure: str, i: int, reward: float, text: str = "42",
                 outcome: Outcome | None = None) -> Episode:
    eid = f"{structure}-{i}#0@{i}"
    ep = episode([session("s0", episode_id=eid, text=text)], reward=reward, episode_id=eid,
                 task_id=f"{structure}-{i}", split="holdout",
                 task_meta={"skills": [structure], "structure": structure})
    if outcome is None:
        return ep
    return ep.evolve(reward=RewardBreakdown.from_components({"accuracy": reward},
                                                            {"accuracy": 1.0}, outcome, "hand@1"))


def test_worst_slices_link_to_their_escaped_transcripts(tmp_path):
    evil = "<script>alert(1)</script>"
    episodes = [hand_episode("add", i, 1.0) for i in range(3)]  # the best slice: not linked
    episodes += [hand_episode("mul", 0, 0.0, text=f"I think {evil} & 7"),
                 hand_episode("mul", 1, 0.5)]
    episodes += [hand_episode("div", i, 0.75) for i in range(2)]
    episodes += [hand_episode("sub", 0, 0.5),
                 hand_episode("sub", 1, 0.0, outcome=Outcome.sandbox_error)]
    run = EvalRun([EvalRecord.from_episode(e, "p") for e in episodes], episodes)
    rows = [row for by in ((), "structure") for row in slice_summary(run.records, by, n_boot=50)]
    store = tmp_path / "eval dir" / "episodes.jsonl"
    html = write_report(tmp_path / "report.html", title="eval", slices=rows, evaluation=run,
                        episodes_path=store).read_text()

    worst = html[html.index("<h2>Worst slices</h2>"):html.index("<h2>Transcripts</h2>")]
    # lowest reward/mean first: mul 0.25, sub 0.5 (its infrastructure fault not scored), div 0.75
    assert [m.split(":")[0] for m in re.findall(r"<h3>([^<]*)</h3>", worst)] == [
        "structure=mul", "structure=sub", "structure=div"]
    assert "infrastructure fault: not scored" in worst and "structure=add" not in worst
    for e in episodes:
        anchor = episode_anchor(e.episode_id)
        linked = e.task_meta["structure"] != "add"
        assert (f'href="#{anchor}"' in worst) == linked, e.episode_id
        assert html.count(f'id="{anchor}"') == linked, e.episode_id  # one transcript each
        assert (escape(inspect_command(store, e.episode_id)) in html) == linked
    assert "&#x27;" in escape(inspect_command(store, episodes[3].episode_id))  # shell-quoted
    # the worst episode's transcript: its task, outcome and every turn, escaped
    worst_ep = html[html.index(f'id="{episode_anchor("mul-0#0@0")}"'):]
    worst_ep = worst_ep[:worst_ep.index("</section>")]
    assert "task mul-0" in worst_ep and "outcome <b>wrong</b>" in worst_ep
    assert "<b>user</b>" in worst_ep and "<pre>task</pre>" in worst_ep
    assert f"I think {escape(evil)} &amp; 7" in worst_ep
    assert "<script" not in html
    checker = _Checker()
    checker.feed(html)
    assert "script" not in checker.tags and checker.tags.count("section") == 6
    fault = html[html.index(f'id="{episode_anchor("sub-1#0@1")}"'):]
    assert "outcome <b>sandbox_error</b>" in fault[:fault.index("</section>")]


def test_episode_anchors_are_distinct_and_fragment_safe():
    ids = ["a#1", "a.23.1", "a-23-1", "a_1", "é", "a 1", "a.20.1", 'x"><script>']
    anchors = [episode_anchor(i) for i in ids]
    assert len(set(anchors)) == len(ids)
    assert all(re.fullmatch(r"ep-[A-Za-z0-9_.-]+", a) for a in anchors)


def test_run_report_shows_the_trained_policys_worst_transcripts(tmp_path):
    episodes = [hand_episode("add", 0, 1.0), hand_episode("mul", 0, 0.0, text="nine?")]
    records = [EvalRecord.from_episode(e, tag) for tag in ("before", "after") for e in episodes]
    write_records(records[:2], tmp_path / "evals" / "before.jsonl")
    write_records(records[2:], tmp_path / "evals" / "after.jsonl")
    write_episodes(episodes, tmp_path / "evals" / "episodes" / "after.jsonl")
    html = write_run_report(tmp_path).read_text()
    assert f'id="{episode_anchor("mul-0#0@0")}"' in html and "nine?" in html
    assert "policy_name=after · structure=mul" in html
    assert "policy_name=before · structure=" not in html[html.index("<h2>Worst slices"):]


# --- axes, labels, run details, session curves --------------------------------------------------


def tick_labels(svg: str) -> tuple[list[str], list[str]]:
    """(y-axis labels, x-axis labels) of a ``line_chart``: end-anchored and middle-anchored
    texts, the axis name ``step`` left out."""
    y = re.findall(r'text-anchor="end">([^<]*)</text>', svg)
    x = re.findall(r'text-anchor="middle">([^<]*)</text>', svg)
    return y, [t for t in x if t != "step"]


def test_a_narrow_range_gets_distinct_tick_labels():
    # entropy barely moving (the tiny model): 6.4466 .. 6.4469 read "6.45" on every tick before
    svg = line_chart("entropy", {"e": [(1, 6.44657, None, None), (2, 6.44671, None, None),
                                       (3, 6.44689, None, None)]})
    y, _ = tick_labels(svg)
    assert len(y) >= 3 and len(set(y)) == len(y), y
    assert all(float(a) < float(b) for a, b in zip(y, y[1:], strict=False)), y  # full values
    assert {"6.4466", "6.4468"} <= set(y), y
    # values near 1e-9 (kl/approx of an unchanged policy): short labels, still distinct
    y, _ = tick_labels(line_chart("kl", {"k": [(1, -1.2e-9, None, None), (2, 2.3e-9, None, None)]}))
    assert y == ["-1e-09", "0", "1e-09", "2e-09"], y


def test_step_ticks_are_whole_numbers():
    for steps in ([1, 2], [1, 2, 3], [0, 5, 10, 15, 20], [3]):
        svg = line_chart("reward", {"r": [(s, 0.1 * s, None, None) for s in steps]})
        _, x = tick_labels(svg)
        assert x and all(re.fullmatch(r"-?\d+", t) for t in x), (steps, x)
        assert len(set(x)) == len(x), x
    _, x = tick_labels(line_chart("t", {"r": [(0.25, 1, None, None), (0.5, 2, None, None)]}))
    assert "0.30" in x or "0.3" in x  # fractional x values keep their fractions


def test_bar_labels_are_never_clipped():
    long = ("structure=recall>combine>transform>recall>combine · entity_group=people-and-places"
            " · composition=composed")
    svg = bar_chart("reward", [("all", 0.5, 0.4, 0.6, 10), (long, 0.25, 0.1, 0.4, 4)])
    shown = []
    for x, spans in re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end">(.*?)</text>', svg):
        lines = [unescape(t) for t in re.findall(r"<tspan[^>]*>([^<]*)</tspan>", spans)]
        assert all(float(x) - CHAR_PX * len(line) >= 0 for line in lines), (x, lines)
        assert all(len(line) <= LABEL_CHARS for line in lines)
        shown.append(lines)
    assert shown == [["all"], ["structure=recall>combine>transform>recall>combine",
                               "entity_group=people-and-places · composition=composed"]]
    assert label_lines("a · b") == ["a · b"]
    assert label_lines("x" * 70 + " · y") == ["x" * 56, "x" * 14 + " · y"]  # a word cut


def write_run(tmp: Path, per_episode: float = 1.0) -> Path:
    (tmp / "contract.yaml").write_text(
        "name: r\nenv: {id: agent_rl/Relay-v0, split: train}\n"
        "model: {id: smollm2-135m, dtype: float32, adapter: lora, lora_rank: 16}\n"
        "credit: {assigner: usage_weighted, params: {unused_value: 0.0}, "
        "session_weighting: per_episode}\noptim: {max_steps: 4}\n")
    (tmp / "contract.sha256").write_text("ab" * 32 + "\n")
    with (tmp / "metrics.jsonl").open("w") as f:
        for step in range(1, 4):
            f.write(json.dumps({**step_metrics(step), "step/seconds": 20.5,
                                "sessions/per_episode": per_episode,
                                "sessions/compressions_per_episode": per_episode - 1,
                                "sessions/summary_tokens": 20.0 + step,
                                "sessions/summary_used_frac": 0.25 * step,
                                "sessions/branches": 0}) + "\n")
    (tmp / "result.json").write_text(json.dumps({
        "before": {"reward_mean": 0.371}, "after": {"reward_mean": 0.565},
        "comparison": {"reward_diff": 0.194, "lo": 0.121, "hi": 0.272, "n": 96}}))
    return tmp


def details_table(html: str) -> dict[str, str]:
    table = html[html.index('<table class="details">'):]
    table = table[:table.index("</table>")]
    return {unescape(k): unescape(v)
            for k, v in re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", table)}


def test_run_report_shows_the_runs_details(tmp_path):
    html = write_run_report(write_run(tmp_path)).read_text()
    assert html.index("<h2>Run</h2>") < html.index("<h2>Training curves</h2>")
    details = details_table(html)
    assert details["model"] == "smollm2-135m (float32, LoRA rank 16)"
    assert details["environment"] == "agent_rl/Relay-v0 (trained on split train)"
    assert details["assigner"] == 'usage_weighted {"unused_value": 0.0}, session weighting per_episode'
    assert details["steps"] == "3 of optim.max_steps 4"
    assert details["duration"].startswith("1m 02s in 3 training steps")  # 3 x 20.5 s
    assert details["contract sha256"] == "ab" * 6
    assert details["held-out result"] == "0.371 -> 0.565, paired +0.194 [0.121, 0.272] (n=96)"
    assert details["code"].startswith("agent-rl ")
    assert "git " in details["code"] or not (Path(__file__).parents[2] / ".git").exists()


def test_run_report_of_a_bare_folder_has_no_invented_details(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step_metrics(1)) + "\n")
    (tmp_path / "contract.yaml").write_text("[not, a, mapping")  # unreadable: left out
    details = details_table(write_run_report(tmp_path).read_text())
    assert set(details) == {"steps", "code"} and details["steps"] == "1 of optim.max_steps ?"


def test_multi_session_runs_get_note_curves(tmp_path):
    (tmp_path / "multi").mkdir()
    (tmp_path / "single").mkdir()
    html = write_run_report(write_run(tmp_path / "multi", per_episode=2.0)).read_text()
    notes = html[html.index("<h2>Sessions and notes</h2>"):html.index("<h2>Held-out evaluation</h2>")]
    titles = re.findall(r"<svg[^>]*><title>([^<]*)</title>", notes)
    assert titles == ["sessions per episode", "notes per episode (compressions)",
                      "tokens per note", "share of notes the final answer used",
                      "branches per step"]
    assert "Sessions and notes" not in write_run_report(write_run(tmp_path / "single")).read_text()


def test_held_out_table_shows_the_notes_when_episodes_wrote_them(tmp_path):
    evals = [{**e, "compressions_per_episode": 1.0, "summary_tokens": 28.5,
              "summary_used_frac": 0.75} for e in EVALS]
    html = write_report(tmp_path / "r.html", title="t", evals=evals).read_text()
    assert "<th>summary_tokens</th>" in html and "<td>28.5</td>" in html
    html = write_report(tmp_path / "s.html", title="t", evals=EVALS).read_text()
    assert "summary_tokens" not in html
