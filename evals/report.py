"""A self-contained HTML report of a run: curves, per-slice bars with intervals, tables, decision,
and the transcripts of the worst slices' episodes.

One file, no scripts, no network: the plots are inline SVG drawn by two small helpers here,
``line_chart`` (curves over steps, optional error bars) and ``bar_chart`` (horizontal bars with
interval whiskers and ``n`` labels). Every piece of text is HTML-escaped. Missing, ``None``,
NaN and infinite values are skipped (a line is broken where they are); a chart with no finite
value says so.

Inputs are what the trainer and evaluation write: ``metrics`` (``metrics.jsonl``, one dict per
step with namespaced keys), ``evals`` (``eval.jsonl``: ``step``, ``tag``, ``reward_mean``,
``reward_lo``, ``reward_hi``, ...), ``slices`` (rows of ``evals.run.slice_summary``, possibly
for several policies), ``decision`` (an ``evals.gates.Decision`` or its dict) and
``evaluation`` (an ``evals.run.EvalRun``: the records and the episodes behind the slices).

With ``evaluation``, the ``WORST_SLICES`` slices of lowest ``reward/mean`` (the overall row is
not a slice) list their lowest-reward episodes (infrastructure faults marked), each linked to
its transcript further down the page (anchor ``episode_anchor(episode_id)``: every turn of
every session, escaped, long texts cut at ``TURN_CHARS``) and given as the
``agent-rl inspect EPISODES --episode ID`` command that shows it whole (``episodes_path``:
where the episodes were written).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from evals.gates import Decision
from evals.run import EvalRecord, EvalRun, slice_members
from trajectories import Episode

# (title, metrics key) of the training curves, in page order.
CURVES = [("reward/mean", "reward/mean"), ("holdout/reward", "holdout/reward"),
          ("loss/policy", "loss/policy"), ("KL of each update", "kl/update"),
          ("KL to the reference", "kl/ref"), ("kl/approx (before the update)", "kl/approx"),
          ("response/length_mean", "response/length_mean"), ("entropy", "policy/entropy")]
# (title, metrics key) of the session and note curves, shown for runs whose episodes had more
# than one session (a compression writes a note that the next session starts from).
SESSION_CURVES = [("sessions per episode", "sessions/per_episode"),
                  ("notes per episode (compressions)", "sessions/compressions_per_episode"),
                  ("tokens per note", "sessions/summary_tokens"),
                  ("share of notes the final answer used", "sessions/summary_used_frac"),
                  ("branches per step", "sessions/branches"),
                  ("share of sub-agents the final answer used", "sessions/branch_used_frac")]
# eval.jsonl's session columns (the held-out episodes' notes and sub-agents), shown when any
# is non-zero
EVAL_NOTES = ("compressions_per_episode", "summary_tokens", "summary_used_frac",
              "branches_per_episode", "branched_frac", "branch_used_frac")
# slice_summary columns that are numbers, not slice keys.
SLICE_NUMBERS = ("n", "n_tasks", "n_infra_faults", "reward/mean", "reward/lo", "reward/hi",
                 "success/k", "success/rate", "success/lo", "success/hi")
WORST_SLICES = 3  # slices linked to their transcripts, lowest reward/mean first
WORST_EPISODES = 4  # episodes listed (and transcribed) per linked slice, lowest reward first
TURN_CHARS = 4000  # a turn's text is cut after this many characters (the store keeps it whole)
TICK_CHARS = 8  # a tick label longer than this in fixed notation is written as 1.5e-09
CHAR_PX = 6.6  # width of a character of the charts' 11px font, generously (labels are sized by it)
LABEL_CHARS = 56  # a bar label wraps after this many characters
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
STATUS_COLORS = {"pass": "#2ca02c", "fail": "#d62728", "inconclusive": "#ff7f0e"}


def _num(value: Any) -> float | None:
    """A finite float, or None for anything else (None, NaN, inf, strings, lists)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt(value: Any) -> str:
    x = _num(value)
    return "–" if x is None else f"{x:.4g}"


def _ticks(lo: float, hi: float, n: int = 6, integer: bool = False) -> list[tuple[float, str]]:
    """About ``n`` round ticks (1, 2 or 5 times a power of ten apart) inside [lo, hi], each
    with its label: as many decimals as the spacing needs, so neighbours never read alike
    (6.4502, 6.4504, ... not 6.45 on every tick), and no offset to add; a label longer than
    ``TICK_CHARS`` in fixed notation in scientific notation with as many digits. ``integer``:
    whole numbers only (steps), at least 1 apart."""
    raw = (hi - lo) / (n - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if integer:
        step = max(round(step), 1)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    first = math.ceil(lo / step - 1e-9) * step
    values = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    labels = [f"{round(v, decimals) + 0.0:.{decimals}f}" for v in values]  # + 0.0: no "-0"
    if max(map(len, labels), default=0) > TICK_CHARS:  # 0.000000001: as 1e-09, digits kept
        top = max(abs(v) for v in values) or step
        digits = max(0, math.floor(math.log10(top)) - math.floor(math.log10(step) + 1e-9))
        labels = [f"{v:.{digits}e}" if abs(v) > step / 2 else "0" for v in values]
    return list(zip(values, labels, strict=True))


def _span(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
            f'<title>{escape(title)}</title>'
            f'<text x="{width / 2}" y="16" text-anchor="middle" class="t">{escape(title)}</text>'
            + "".join(body) + "</svg>")


def line_chart(title: str, series: Mapping[str, Sequence[tuple[Any, Any, Any, Any]]],
               width: int = 460, height: int = 240) -> str:
    """Curves as SVG: ``series`` maps a name to points ``(x, y, lo, hi)`` (lo/hi may be None:
    no error bar). Non-finite points are skipped and break the line."""
    left, right, top, bottom = 64, 12, 26, 36
    pts = {name: [(_num(x), _num(y), _num(lo), _num(hi)) for x, y, lo, hi in points]
           for name, points in series.items()}
    finite = [(x, y, lo, hi) for p in pts.values() for x, y, lo, hi in p
              if x is not None and y is not None]
    if not finite:
        return _svg(width, 60, title, [f'<text x="{width / 2}" y="44" text-anchor="middle">'
                                       "no finite values</text>"])
    x0, x1 = _span([p[0] for p in finite])
    y0, y1 = _span([v for p in finite for v in p[1:] if v is not None])
    sx = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    sy = lambda y: height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    body = [f'<rect x="{left}" y="{top}" width="{width - left - right}" '
            f'height="{height - top - bottom}" class="frame"/>']
    for y, label in _ticks(y0, y1):
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                    f'class="grid"/><text x="{left - 4}" y="{sy(y) + 4:.1f}" '
                    f'text-anchor="end">{label}</text>')
    whole = all(p[0] == int(p[0]) for p in finite)  # steps: integer ticks
    for x, label in _ticks(x0, x1, integer=whole):
        body.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" '
                    f'text-anchor="middle">{label}</text>')
    body.append(f'<text x="{(left + width - right) / 2}" y="{height - 4}" '
                f'text-anchor="middle">step</text>')
    for i, (name, points) in enumerate(pts.items()):
        color = COLORS[i % len(COLORS)]
        segments, current = [], []
        for x, y, lo, hi in points:
            if x is None or y is None:
                segments.append(current)
                current = []
                continue
            current.append(f"{sx(x):.1f},{sy(y):.1f}")
            if lo is not None and hi is not None:
                body.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{sy(lo):.1f}" '
                            f'y2="{sy(hi):.1f}" stroke="{color}" class="bar"/>')
        segments.append(current)
        for seg in segments:
            if len(seg) > 1:
                body.append(f'<polyline points="{" ".join(seg)}" stroke="{color}" class="line"/>')
            for point in seg:
                cx, cy = point.split(",")
                body.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
        if len(pts) > 1:
            body.append(f'<text x="{left + 8}" y="{top + 14 + 14 * i}" fill="{color}">'
                        f'{escape(name)}</text>')
    return _svg(width, height, title, body)


def label_lines(label: str, chars: int = LABEL_CHARS) -> list[str]:
    """A bar label in lines of at most ``chars`` characters, broken between its ``" · "``
    parts (``structure=a · entity_group=b``), then at spaces, a longer word cut."""
    import textwrap

    lines: list[str] = []
    for part in label.split(" · "):
        pieces = textwrap.wrap(part, chars, break_on_hyphens=False) or [""]
        if lines and len(lines[-1]) + 3 + len(pieces[0]) <= chars:
            lines[-1] += " · " + pieces.pop(0)
        lines += pieces
    return lines


def bar_chart(title: str, rows: Sequence[tuple[str, Any, Any, Any, Any]],
              colors: Sequence[str] | None = None, plot_width: int = 290) -> str:
    """Horizontal bars as SVG, one per ``(label, value, lo, hi, n)`` row, with an interval
    whisker from lo to hi and an ``n=`` label; a row without a finite value shows ``n/a``.
    Labels are never clipped: long ones wrap (``label_lines``), the label column is as wide
    as its longest line (``CHAR_PX`` a character) and a row as tall as its label."""
    labels = [label_lines(str(label)) for label, *_ in rows]
    longest = max((len(line) for lines in labels for line in lines), default=0)
    label_w, right, top, line_h = max(60, math.ceil(longest * CHAR_PX) + 12), 110, 26, 13
    width = label_w + plot_width + right
    heights = [22 + line_h * (len(lines) - 1) for lines in labels]
    height = top + sum(heights or [22]) + 24
    vals = [v for _, *nums, _ in rows for v in map(_num, nums) if v is not None]
    if not vals:
        return _svg(width, 60, title, [f'<text x="{width / 2}" y="44" text-anchor="middle">'
                                       "no finite values</text>"])
    x0, x1 = _span([0.0, *vals])
    x0 = min(x0, 0.0)
    sx = lambda x: label_w + (x - x0) / (x1 - x0) * (width - label_w - right)  # noqa: E731
    body = [f'<line x1="{sx(0):.1f}" x2="{sx(0):.1f}" y1="{top}" y2="{height - 24}" class="axis"/>']
    for x, tick in _ticks(x0, x1):
        body.append(f'<text x="{sx(x):.1f}" y="{height - 8}" text-anchor="middle">{tick}</text>')
    y = top
    for i, ((_, value, lo, hi, n), lines, row_h) in enumerate(zip(rows, labels, heights, strict=True)):
        color = (colors or COLORS)[i % len(colors or COLORS)]
        v, lo, hi = _num(value), _num(lo), _num(hi)
        body.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">' + "".join(
            f'<tspan x="{label_w - 6}" dy="{0 if k == 0 else line_h}">{escape(line)}</tspan>'
            for k, line in enumerate(lines)) + "</text>")
        y += row_h - 22  # the bar sits beside the label's last line
        if v is not None:
            a, b = sorted((sx(0), sx(v)))
            body.append(f'<rect x="{a:.1f}" y="{y + 4}" width="{max(b - a, 1):.1f}" '
                        f'height="14" fill="{color}" opacity="0.75"/>')
        if lo is not None and hi is not None:
            body.append(f'<line x1="{sx(lo):.1f}" x2="{sx(hi):.1f}" y1="{y + 11}" y2="{y + 11}" '
                        f'class="whisker"/>' + "".join(
                            f'<line x1="{sx(e):.1f}" x2="{sx(e):.1f}" y1="{y + 6}" '
                            f'y2="{y + 16}" class="whisker"/>' for e in (lo, hi)))
        note = f"{_fmt(v) if v is not None else 'n/a'}  n={_fmt(n)}"
        body.append(f'<text x="{width - right + 4}" y="{y + 15}">{note}</text>')
        y += 22
    return _svg(width, height, title, body)


def _cell(value: Any) -> str:
    """A table cell: numbers to 4 significant digits, missing or non-finite as a dash."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return _fmt(value)
    return escape(str(value))


def _table(columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _slice_label(row: Mapping[str, Any]) -> str:
    keys = [k for k in row if k not in SLICE_NUMBERS]
    return " · ".join(f"{k}={row[k]}" for k in keys) or "all"


def multi_session(metrics: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any step's episodes had more than one session (``sessions/per_episode``)."""
    return any((_num(m.get("sessions/per_episode")) or 0) > 1 for m in metrics)


def _metrics_section(metrics: Sequence[Mapping[str, Any]], curves=CURVES) -> str:
    if not metrics:
        return "<p>No training metrics.</p>"
    charts, summary = [], []
    for title, key in curves:
        if all(m.get(key) is None for m in metrics):  # never logged, or not measured (None)
            continue
        # steps without the key (holdout/reward is logged on eval steps only) are left out;
        # a logged None or NaN breaks the line
        points = [(m.get("step", i), m.get(key), None, None)
                  for i, m in enumerate(metrics) if key in m]
        charts.append(line_chart(title, {key: points}))
        finite = [v for _, v, _, _ in points if _num(v) is not None]
        summary.append({"metric": key, "first": finite[0] if finite else None,
                        "last": finite[-1] if finite else None,
                        "min": min(finite) if finite else None,
                        "max": max(finite) if finite else None, "points": len(finite)})
    if not charts:
        return "<p>No plotted metrics in the training log.</p>"
    return ('<div class="charts">' + "".join(charts) + "</div>"
            + _table(["metric", "first", "last", "min", "max", "points"], summary))


def _evals_section(evals: Sequence[Mapping[str, Any]]) -> str:
    if not evals:
        return "<p>No held-out evaluations.</p>"
    points = [(e.get("step"), e.get("reward_mean"), e.get("reward_lo"), e.get("reward_hi"))
              for e in evals]
    chart = line_chart("held-out reward (95% interval)", {"holdout": points})
    columns = ["step", "tag", "reward_mean", "reward_lo", "reward_hi", "success", "success_lo",
               "success_hi", "n"]
    if any(_num(e.get(k)) for e in evals for k in EVAL_NOTES):  # the held-out episodes' notes
        columns += EVAL_NOTES
    return f'<div class="charts">{chart}</div>' + _table(columns, evals)


def _slices_section(slices: Sequence[Mapping[str, Any]]) -> str:
    if not slices:
        return "<p>No slices.</p>"
    labels = [_slice_label(r) for r in slices]
    policies = list(dict.fromkeys(str(r.get("policy_name", "")) for r in slices))
    colors = [COLORS[policies.index(str(r.get("policy_name", ""))) % len(COLORS)] for r in slices]
    reward = bar_chart("reward/mean per slice (95% interval)", [
        (label, r.get("reward/mean"), r.get("reward/lo"), r.get("reward/hi"), r.get("n"))
        for label, r in zip(labels, slices, strict=True)], colors)
    success = bar_chart("success/rate per slice (95% Wilson interval)", [
        (label, r.get("success/rate"), r.get("success/lo"), r.get("success/hi"), r.get("n"))
        for label, r in zip(labels, slices, strict=True)], colors)
    keys = list(dict.fromkeys(k for r in slices for k in r if k not in SLICE_NUMBERS))
    return (f'<div class="charts">{reward}{success}</div>'
            + _table([*keys, *SLICE_NUMBERS], slices))


def episode_anchor(episode_id: str) -> str:
    """The HTML id of an episode's transcript: ``ep-`` then the id, every character but an ASCII
    letter, digit, ``_`` or ``-`` written ``.<hex code>.`` (so two ids never share an anchor)."""
    return "ep-" + "".join(c if c.isascii() and (c.isalnum() or c in "_-") else f".{ord(c):x}."
                           for c in episode_id)


def inspect_command(episodes_path: str | Path, episode_id: str | None = None) -> str:
    """The shell command that shows a stored episode (all of them without ``episode_id``)."""
    command = f"agent-rl inspect {shlex.quote(str(episodes_path))}"
    return command if episode_id is None else f"{command} --episode {shlex.quote(episode_id)}"


def worst_slices(slices: Sequence[Mapping[str, Any]], records: Sequence[EvalRecord],
                 n: int = WORST_SLICES) -> list[tuple[Mapping[str, Any], list[EvalRecord]]]:
    """The ``n`` slice rows of lowest ``reward/mean`` (ties by label) with members among
    ``records``, each with its members, scored ones by rising reward, then infrastructure
    faults. The overall row (no slice keys) and rows with no scored episode are left out."""
    ranked = []
    for row in slices:
        keys = {k: row[k] for k in row if k not in SLICE_NUMBERS}
        mean = _num(row.get("reward/mean"))
        members = slice_members(records, keys) if keys and mean is not None else []
        if members:
            members.sort(key=lambda r: (r.infra_fault, r.reward))
            ranked.append((mean, _slice_label(row), row, members))
    ranked.sort(key=lambda t: t[:2])
    return [(row, members) for _, _, row, members in ranked[:n]]


def _clip(text: str, limit: int = TURN_CHARS) -> str:
    if not text.strip():  # an empty or whitespace-only text would show as nothing
        return f"(empty: {text[:200]!r}{' …' if len(text) > 200 else ''})"
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters: agent-rl inspect shows them)"


def transcript_html(episode: Episode, episodes_path: str | Path | None = None) -> str:
    """One episode as an HTML section (id ``episode_anchor``): its task, outcome and reward,
    then every turn of every session in the order they were made, all text escaped."""
    reward = episode.reward
    fault = (' <span class="fault">infrastructure fault: not scored</span>'
             if reward.is_infrastructure_fault else "")
    components = ", ".join(f"{escape(k)} {_fmt(v)}" for k, v in reward.components.items())
    parts = [f'<section class="transcript" id="{episode_anchor(episode.episode_id)}">'
             f"<h3>task {escape(episode.task_id)} · episode {escape(episode.episode_id)}</h3>"
             f"<p>{escape(episode.env_id)} v{escape(str(episode.env_version))} · split "
             f"{escape(episode.split)} · outcome <b>{escape(reward.outcome.value)}</b>{fault} · "
             f"reward {_fmt(reward.total)} ({components}) · {escape(reward.verifier)}</p>"]
    if episodes_path is not None:
        parts.append(f"<p><code>{escape(inspect_command(episodes_path, episode.episode_id))}"
                     "</code></p>")
    final = episode.final_session.session_id
    for session in episode.sessions:
        tag = " · final" if session.session_id == final else ""
        parts.append(f'<div class="session"><h4>session {escape(session.session_id)} · '
                     f"{escape(session.origin)}{tag}</h4>")
        boundary = session.boundary
        if boundary is not None and boundary.summary is not None:
            parts.append(f"<p>summary carried over:</p><pre>{escape(_clip(boundary.summary))}</pre>")
        if boundary is not None and boundary.kind == "branch":
            returned = "(not returned)" if boundary.returned is None else boundary.returned
            parts.append(f"<p>returned to the parent:</p><pre>{escape(_clip(returned))}</pre>")
        for turn in session.turns:
            about = [turn.name or "", f"finish {turn.finish_reason}" if turn.finish_reason else "",
                     f"{len(turn.token_ids)} tokens" if turn.token_ids is not None else ""]
            label = " · ".join(a for a in about if a)
            calls = (f"<pre>{escape(_clip(json.dumps(turn.tool_calls, ensure_ascii=False)))}</pre>"
                     if turn.tool_calls else "")
            parts.append(f'<div class="turn {escape(turn.role)}"><b>{escape(turn.role)}</b> '
                         f"{escape(label)}<pre>{escape(_clip(turn.content))}</pre>{calls}</div>")
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _worst_sections(slices: Sequence[Mapping[str, Any]], evaluation: EvalRun,
                    episodes_path: str | Path | None) -> list[tuple[str, str]]:
    """("Worst slices", their episodes linked to transcripts), ("Transcripts", ...)."""
    episodes = {e.episode_id: e for e in evaluation.episodes}
    worst = worst_slices(slices, evaluation.records)
    if not worst:
        return [("Worst slices", "<p>No scored slices.</p>")]
    intro = (f"<p>The {len(worst)} slices of lowest reward/mean and their lowest-reward "
             "episodes, linked to their transcripts below.")
    if episodes_path is not None:
        intro += f" Every episode: <code>{escape(inspect_command(episodes_path))}</code>"
    parts, shown = [intro + "</p>"], {}
    columns = "".join(f"<th>{c}</th>" for c in ("task", "episode", "outcome", "reward", "inspect"))
    for row, members in worst:
        parts.append(f"<h3>{escape(_slice_label(row))}: reward/mean {_fmt(row.get('reward/mean'))}"
                     f" (n={_fmt(row.get('n'))}, infrastructure faults "
                     f"{_fmt(row.get('n_infra_faults'))})</h3><table><tr>{columns}</tr>")
        for record in members[:WORST_EPISODES]:
            episode = episodes.get(record.episode_id)
            eid = escape(record.episode_id)
            link = f'<a href="#{episode_anchor(record.episode_id)}">{eid}</a>' if episode else eid
            outcome = record.outcome.value + (" (infrastructure fault: not scored)"
                                              if record.infra_fault else "")
            command = ("" if episodes_path is None or episode is None
                       else inspect_command(episodes_path, record.episode_id))
            parts.append(f"<tr><td>{escape(record.task_id)}</td><td>{link}</td>"
                         f"<td>{escape(outcome)}</td><td>{_fmt(record.reward)}</td>"
                         f"<td><code>{escape(command)}</code></td></tr>")
            if episode is not None:
                shown[record.episode_id] = episode
        parts.append("</table>")
        if len(members) > WORST_EPISODES:
            parts.append(f"<p>… and {len(members) - WORST_EPISODES} more episodes in this slice.</p>")
    transcripts = "".join(transcript_html(e, episodes_path) for e in shown.values())
    return [("Worst slices", "".join(parts)),
            ("Transcripts", transcripts or "<p>No transcripts stored for these episodes.</p>")]


def _details_section(details: Mapping[str, str]) -> str:
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in details.items())
    return f'<table class="details">{rows}</table>'


def _decision_section(decision: Decision | Mapping[str, Any]) -> str:
    d = decision.model_dump() if isinstance(decision, Decision) else dict(decision)
    status = str(d.get("status", "?"))
    color = STATUS_COLORS.get(status, "#555")
    reasons = "".join(f"<li>{escape(str(r))}</li>" for r in d.get("reasons", []))
    blocking = d.get("blocking") or []
    block = (f"<p>Blocked by critical criteria: {escape(', '.join(map(str, blocking)))}</p>"
             if blocking else "")
    return (f'<p class="status" style="background:{color}">{escape(status.upper())}</p>'
            f"{block}<ul>{reasons}</ul>")


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg{font-size:11px;background:#fff;border:1px solid #eee}
svg .t{font-size:13px;font-weight:600}
.frame{fill:none;stroke:#999}.grid{stroke:#eee}.axis{stroke:#999}
.line{fill:none;stroke-width:1.8}.bar{stroke-width:1.2}.whisker{stroke:#222;stroke-width:1.2}
table{border-collapse:collapse;margin:12px 0;font-size:12px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4}
.status{display:inline-block;color:#fff;padding:4px 12px;font-weight:700;border-radius:4px}
td code{font-size:11px;white-space:nowrap}
.details th,.details td{text-align:left}
.transcript{border:1px solid #ddd;margin:12px 0;padding:4px 12px}.fault{color:#d62728}
.session{margin:8px 0 8px 12px}.turn{margin:6px 0}
.turn pre,.session pre{white-space:pre-wrap;background:#f7f7f7;padding:6px;margin:2px 0}
.turn.assistant pre{background:#eef4fb}.turn.tool pre{background:#f3f0e8}
"""


def write_report(
    path: str | Path,
    *,
    title: str,
    metrics: Sequence[Mapping[str, Any]] | None = None,
    evals: Sequence[Mapping[str, Any]] | None = None,
    slices: Sequence[Mapping[str, Any]] | None = None,
    decision: Decision | Mapping[str, Any] | None = None,
    evaluation: EvalRun | None = None,
    episodes_path: str | Path | None = None,
    details: Mapping[str, str] | None = None,
) -> Path:
    """Write the HTML report to ``path`` (parents created); returns the path. ``evaluation``
    (the records and episodes behind ``slices``) adds the worst slices' transcripts;
    ``episodes_path`` (where its episodes are stored) the commands that show them; ``details``
    (name -> text: ``run_details``) a table at the top. Metrics of multi-session episodes
    (``multi_session``) add the session and note curves (``SESSION_CURVES``)."""
    metrics = metrics or []
    sections = [("Training curves", _metrics_section(metrics))]
    if multi_session(metrics):
        sections.append(("Sessions and notes", _metrics_section(metrics, SESSION_CURVES)))
    sections += [("Held-out evaluation", _evals_section(evals or [])),
                 ("Slices", _slices_section(slices or []))]
    if evaluation is not None and slices:
        sections += _worst_sections(slices, evaluation, episodes_path)
    if decision is not None:
        sections.insert(0, ("Decision", _decision_section(decision)))
    if details:
        sections.insert(0, ("Run", _details_section(details)))
    html = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1>"
            + "".join(f"<h2>{escape(h)}</h2>{s}" for h, s in sections)
            + "</body></html>\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_run_report(run_dir: str | Path, path: str | Path | None = None, *,
                     slices: Sequence[Mapping[str, Any]] | None = None,
                     decision: Decision | Mapping[str, Any] | None = None) -> Path:
    """The report of a run directory (``metrics.jsonl``, ``eval.jsonl``; either may be missing),
    written to ``run_dir/report.html`` unless ``path`` says otherwise. Without ``slices``, the
    held-out records of the policy before and after training (``evals/before.jsonl``,
    ``evals/after.jsonl``), when present, give per-structure bars for both. The trained
    policy's episodes (``evals/episodes/after.jsonl``), when stored, give the worst slices'
    transcripts."""
    run_dir = Path(run_dir)
    if slices is None:
        slices = _before_after_slices(run_dir / "evals")
    episodes_path = run_dir / "evals" / "episodes" / "after.jsonl"
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    return write_report(path or run_dir / "report.html", title=f"agent-rl run {run_dir.name}",
                        metrics=metrics, evals=_read_jsonl(run_dir / "eval.jsonl"), slices=slices,
                        decision=decision,
                        evaluation=_stored_evaluation(run_dir / "evals" / "after.jsonl",
                                                      episodes_path),
                        episodes_path=episodes_path, details=run_details(run_dir, metrics))


def run_details(run_dir: Path, metrics: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """What a run was, from its folder: model, environment, assigner (from ``contract.yaml``),
    steps and the time they took (``metrics.jsonl``: the sum of ``step/seconds``; held-out
    evaluations and loading are not in it), the contract hash, the result (``result.json``)
    or the guard that stopped it (``guard.json``), and the code that wrote the report
    (``code_version``). A file that is missing or unreadable leaves its lines out."""
    import yaml

    try:
        contract = yaml.safe_load((run_dir / "contract.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        contract = {}
    contract = contract if isinstance(contract, dict) else {}

    def section(name: str) -> dict[str, Any]:
        value = contract.get(name)
        return value if isinstance(value, dict) else {}

    model, env, credit, optim = (section(k) for k in ("model", "env", "credit", "optim"))
    out: dict[str, str] = {}
    if model.get("id") is not None:
        adapter = (f", LoRA rank {model.get('lora_rank')}" if model.get("adapter") == "lora"
                   else "")
        out["model"] = f"{model['id']} ({model.get('dtype', '?')}{adapter})"
    if env.get("id") is not None:
        out["environment"] = f"{env['id']} (trained on split {env.get('split', 'train')})"
    if credit.get("assigner") is not None:
        params = credit.get("params") or {}
        shown = f" {json.dumps(params, sort_keys=True)}" if params else ""
        out["assigner"] = (f"{credit['assigner']}{shown}, session weighting "
                           f"{credit.get('session_weighting', '?')}")
    steps = [m["step"] for m in metrics if isinstance(m.get("step"), int)]
    if steps or optim.get("max_steps") is not None:
        out["steps"] = f"{max(steps, default=0)} of optim.max_steps {optim.get('max_steps', '?')}"
    seconds = [v for m in metrics if (v := _num(m.get("step/seconds"))) is not None]
    if seconds:
        out["duration"] = (f"{_duration(sum(seconds))} in {len(seconds)} training steps "
                           "(held-out evaluations and loading not included)")
    if (run_dir / "contract.sha256").is_file():
        out["contract sha256"] = (run_dir / "contract.sha256").read_text().strip()[:12]
    result = _read_json(run_dir / "result.json")
    comparison = result.get("comparison") if isinstance(result.get("comparison"), dict) else {}
    if {"reward_diff", "lo", "hi", "n"} <= comparison.keys():
        before, after = result.get("before") or {}, result.get("after") or {}
        out["held-out result"] = (
            f"{before.get('reward_mean', math.nan):.3f} -> {after.get('reward_mean', math.nan):.3f}, paired "
            f"{comparison['reward_diff']:+.3f} [{comparison['lo']:.3f}, {comparison['hi']:.3f}] "
            f"(n={comparison['n']})")
    guard = _read_json(run_dir / "guard.json")
    if guard.get("rule"):
        out["stopped by guard"] = f"{guard['rule']} ({guard.get('action', '?')}): {guard.get('message', '')}"
    out["code"] = code_version()
    return out


def code_version() -> str:
    """The agent-rl version and, where this code is a git checkout, its commit (``+ local
    changes`` when the work tree differs from it), as the report is written."""
    import importlib.metadata
    import subprocess

    try:
        version = f"agent-rl {importlib.metadata.version('agent-rl')}"
    except importlib.metadata.PackageNotFoundError:
        version = "agent-rl (not installed)"
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(here), *args], capture_output=True,
                                  text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return version
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{version}, git {commit}{' + local changes' if dirty else ''} (when this report was written)"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _stored_evaluation(records_path: Path, episodes_path: Path) -> EvalRun | None:
    """Records and episodes written by one evaluation; None when either file is missing or
    unreadable (the report is written without transcripts)."""
    from evals.run import read_records
    from trajectories import RolloutStore

    if not (records_path.is_file() and episodes_path.is_file()):
        return None
    try:
        return EvalRun(read_records(records_path), list(RolloutStore(episodes_path).read()))
    except ValueError:  # a bad record line, or a StoreError
        return None


def _before_after_slices(folder: Path) -> list[dict[str, Any]] | None:
    from evals.run import read_records, slice_summary

    records = [r for tag in ("before", "after") if (folder / f"{tag}.jsonl").is_file()
               for r in read_records(folder / f"{tag}.jsonl")]
    if not records:
        return None
    return [row for by in (("policy_name",), ("policy_name", "structure"))
            for row in slice_summary(records, by, n_boot=2000)]
