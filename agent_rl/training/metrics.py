"""What a training step and a held-out evaluation report: one namespaced record per step
(``step_metrics``, and what scaling out needs to watch: ``scale_metrics``), the warnings of a step that trained less than it seems to
(``note_untrained``), held-out summaries and their paired comparison (``summarize_eval``,
``compare``) and the progress bar. The files they are written to: ``agent_rl.run.rundir``."""

from __future__ import annotations

import resource
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from typing import Any

import numpy as np

from agent_rl.run.distributed import Backend
from agent_rl.run.flops import Peak, mfu
from agent_rl.run.guards import LIMITS, EmptyStep, limit_clauses
from agent_rl.training.rollout import (
    RolloutBatch,
    TrainSequence,
    empty_reason,
    shown_hint,
    too_long_prompts,
    zero_contrast_step,
)
from envs.core import TaskSpec
from evals.run import EvalRecord, slice_summary
from evals.splits import Splits
from evals.stats import paired_bootstrap
from trajectories.display import escape_terminal


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (getrusage: kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024



def step_metrics(step: int, batch: RolloutBatch, update: dict[str, float], rollout_s: float,
                 train_s: float, counters: Counter, lag: dict[str, float],
                 hint_share: float | None = None) -> dict[str, Any]:
    """One step's record. ``rollout_s``: generating the batch (on whatever thread did);
    ``hint_share``: the share the contract's ``hints`` scheduled for this step (logged, when
    given, as ``hint/scheduled_share``, beside ``hint/share``: the share the episodes' hint
    provenance says was shown). ``reward/hinted_mean`` and ``reward/unhinted_mean`` split
    ``reward/mean`` by whether the episode showed a hint (None when no episode is on that side);
    ``hint/used_frac`` is the share that did. ``train/empty_step`` is 1 on a step that trained
    on no token, ``train/empty_reason`` says why (``rollout.empty_reason``)."""
    episodes = batch.episodes
    groups = batch.advantage_stats  # over every valid episode, dropped groups included
    rewards = [e.reward.total for e in episodes]
    responses = [t for e in episodes for s in e.sessions for t in s.turns if t.token_ids]
    outcomes = Counter(e.reward.outcome.value for e in episodes)
    components = Counter()
    for e in episodes:
        for name, value in e.reward.components.items():
            components[name] += value / len(episodes)
    report = batch.report
    empty = empty_reason(report, update.get("tokens", 0), update.get("rollout/dropped_stale", 0))
    return {
        "step": step,
        "loss/policy": update.get("loss/policy", 0.0),
        "reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "reward/std": float(np.std(rewards)) if rewards else 0.0,
        **{f"reward/{k}": v for k, v in components.items()},
        **{f"outcome/{k}": v / len(episodes) for k, v in outcomes.items()},
        "reward/infra_error_rate": report["infrastructure_faults"] / max(len(episodes), 1),
        **{f"faults/agent_{reason}": n for reason, n in sorted(report["agent_faults"].items())},
        "groups/total": report["groups"],
        "groups/dropped": report["groups_dropped"],
        "groups/all_correct": groups.get("all_correct", 0),
        "groups/all_wrong": groups.get("all_wrong", 0),
        "groups/zero_contrast_other": groups.get("zero_contrast_other", 0),
        "policy/entropy": update.get("entropy"),
        "kl/approx": update.get("kl/approx"),
        "kl/ref": update.get("kl/ref"),
        "kl/update": update.get("kl/update"),
        "ratio/min": update.get("ratio/min"),
        "ratio/mean": update.get("ratio/mean"),
        "ratio/max": update.get("ratio/max"),
        "clip/low_frac": update.get("clip/low_frac"),
        "clip/high_frac": update.get("clip/high_frac"),
        "optim/grad_norm": update.get("optim/grad_norm", 0.0),
        "optim/nonfinite": update.get("optim/nonfinite", 0.0),
        "optim/skipped": update.get("optim/skipped", 0.0),
        "response/length_mean": float(np.mean([len(t.token_ids) for t in responses])) if responses else 0.0,
        "response/truncated_frac": (sum(t.finish_reason == "length" for t in responses)
                                    / max(len(responses), 1)),
        **session_and_hint_metrics(episodes, hint_share),
        "rollout/tokens_generated": report["tokens_generated"],
        "rollout/tokens_discarded": report["tokens_discarded"],
        "rollout/tokens_per_s": report["tokens_generated"] / max(rollout_s, 1e-9),
        "rollout/seconds": rollout_s,
        "rollout/policy_lag": lag["max"],
        "rollout/policy_lag_mean": lag["mean"],
        **{k: v for k, v in update.items() if k.startswith("rollout/")},
        "rollout/prompt_too_long": report["prompt_too_long"],
        "rollout/prompt_too_long_tokens": report["prompt_too_long_tokens"],
        "rollout/overlong_masked": report["overlong_masked"],
        "train/tokens": update.get("tokens", 0),
        "train/empty_step": int(empty is not None),
        "train/empty_reason": None if empty is None else empty.value,
        # decoder-layer work recomputed in backward (rows over optim.micro_batch_tokens)
        "train/recomputed_frac": update.get("train/recomputed_frac", 0.0),
        "train/tokens_per_s": update.get("tokens", 0) / max(train_s, 1e-9),
        "train/seconds": train_s,
        # of which the micro-batches' forward and backward passes, the optimizer step and
        # update_kl's forward (kl/update)
        **{f"train/{k}_seconds": update.get(f"train/{k}_seconds") for k in ("forward_backward", "optimizer", "kl")},
        "train/sequences": len(batch.sequences),
        "total/tokens_generated": counters["tokens_generated"],
        "total/episodes": counters["episodes"],
        "memory/peak_rss_mb": peak_rss_mb(),
        "batch/task_ids": sorted({e.task_id for e in episodes}),
        "rollout/acceptance": report["acceptance"],
    }



def scale_metrics(backend: Backend, *, flops: float, peak: Peak | None, step_s: float,
                  train_s: float, wait_s: float, collective_s: float, queue_age_s: float,
                  trained: list[TrainSequence]) -> dict[str, Any]:
    """What a step says about scaling out (docs/training.md, "Scale metrics"), on every rank:
    its model FLOPs (``flops``: ``agent_rl.run.flops``' formula over the trained tokens) and MFU over
    the whole step (``step_s``) and over the update alone (``train_s``) against ``peak`` (None:
    not reported); ``wait_s``, the trainer's wait for its batch; ``queue_age_s``, how long that
    batch had waited for the trainer (``pipeline.py``); ``collective_s``, this rank's seconds
    inside the backend's collectives during the step; the straggler time, the slowest rank's
    own work (its step less its collective seconds, waiting for others being no work) minus the
    fastest's: one small gather, so collective; and the sessions in the loss (``batch_ids``)."""
    busy = backend.all_gather_object(step_s - collective_s)  # [world_size] seconds
    return {
        "perf/flops": flops,
        "perf/mfu": mfu(flops, step_s, peak),
        "perf/mfu_update": mfu(flops, train_s, peak),
        "rollout/queue_age_s": queue_age_s,
        "time/data_wait_s": wait_s,
        "time/collective_s": collective_s,
        "time/straggler_s": max(busy) - min(busy),
        "batch/ids": batch_ids(trained),
    }


def batch_ids(trained: list[TrainSequence]) -> dict[str, list[str]]:
    """``batch/ids``: the sessions the step trained on, ``{episode_id: [session_id, ...]}``
    (both sorted): the episodes are the ``rollouts.jsonl`` records of those ids."""
    ids: dict[str, list[str]] = {}
    for q in trained:
        ids.setdefault(q.episode_id, []).append(q.session_id)
    return {episode: sorted(sessions) for episode, sessions in sorted(ids.items())}


def session_and_hint_metrics(episodes: list, hint_share: float | None) -> dict[str, Any]:
    """``step_metrics``' sessions (compressions, branches, notes and their use) and hints
    (the reward split by whether a hint was shown, the share shown and scheduled)."""
    hinted = [e.reward.total for e in episodes if shown_hint(e)]
    unhinted = [e.reward.total for e in episodes if not shown_hint(e)]
    compressed = [s for e in episodes for s in e.compressed_sessions()]
    branches = [s for e in episodes for s in e.sessions if s.origin == "branch"]
    return {
        "sessions/per_episode": float(np.mean([len(e.sessions) for e in episodes])),
        "sessions/compressions": sum(s.origin == "compression" for e in episodes for s in e.sessions),
        "sessions/compressions_per_episode": len(compressed) / max(len(episodes), 1),
        "sessions/branches": len(branches),
        "sessions/branch_used_frac": (sum(bool(s.used_by_final) for s in branches) / len(branches)
                                      if branches else 0.0),
        "sessions/summary_tokens": (float(np.mean([len(s.last_reply.token_ids or []) for s in compressed]))
                                    if compressed else 0.0),
        "sessions/summary_used_frac": (sum(bool(s.used_by_final) for s in compressed) / len(compressed)
                                       if compressed else 0.0),
        "reward/hinted_mean": float(np.mean(hinted)) if hinted else None,
        "reward/unhinted_mean": float(np.mean(unhinted)) if unhinted else None,
        "hint/used_frac": len(hinted) / max(len(episodes), 1),
        **({"hint/share": len(hinted) / max(len(episodes), 1), "hint/scheduled_share": hint_share}
           if hint_share is not None else {}),
    }


# what a step that trained on no token says, by its cause (``guards.EmptyStep``), where no limit
# is the cause (those: ``guards.limit_clauses``); a zero-contrast step is warned once, apart
EMPTY_STEP_CAUSES = {
    EmptyStep.zero_contrast: "no group had both reward contrast and a token to train (dynamic "
                             "sampling dropped those without contrast)",
    EmptyStep.stale: "every session was sampled more than rollout.max_policy_lag updates ago",
    EmptyStep.infrastructure_faults: "its episodes were infrastructure faults (masked, never "
                                     "trained: see reward/infra_error_rate)",
    EmptyStep.nothing_generated: "no episode generated a token",
}



SHOWN_PROMPTS = 5  # the too-long prompts a warning names



def note_untrained(metrics: dict[str, Any], batch: RolloutBatch, counters: Counter,
                   max_prompt_tokens: int, max_response_tokens: int, warn: bool = True
                   ) -> dict[str, int]:
    """What a step trained less on than it seems to, counted in ``counters`` (kept in the
    checkpoint, so a resumed run counts on) and warned when ``warn``: the first prompts over
    ``rollout.max_prompt_tokens`` the run meets (their task ids, lengths and the limit: once);
    a step that trained on no token (its cause and the key that decides it: every time), but
    a zero-contrast one: a step whose groups all had zero reward contrast (no policy gradient;
    normal on hard tasks, so counted and warned once). Returns the totals for the record."""
    step, report = metrics["step"], batch.report
    empty = None if metrics["train/empty_reason"] is None else EmptyStep(metrics["train/empty_reason"])
    if report["prompt_too_long"] and not counters["prompt_too_long"] and warn:
        named = dict(too_long_prompts(batch.episodes))  # one per task
        shown = ", ".join(f"task {task} ({'?' if n is None else n} tokens)"
                          for task, n in list(named.items())[:SHOWN_PROMPTS])
        more = f" and {len(named) - SHOWN_PROMPTS} more tasks" if len(named) > SHOWN_PROMPTS else ""
        warnings.warn(f"step {step}: {report['prompt_too_long']} of {report['episodes']} "
                      f"episodes generated nothing, their first prompt longer than "
                      f"rollout.max_prompt_tokens ({max_prompt_tokens}): {shown}{more}; raise "
                      "rollout.max_prompt_tokens (counted in rollout/prompt_too_long, warned "
                      "once)", RuntimeWarning, stacklevel=2)
    counters["prompt_too_long"] += report["prompt_too_long"]
    counters["empty_steps"] += metrics["train/empty_step"]
    zero = zero_contrast_step(batch.advantage_stats) and empty not in LIMITS
    counters["zero_contrast_steps"] += zero
    if warn and empty is not None and not zero:
        cause = ("; ".join(limit_clauses(metrics, max_prompt_tokens, max_response_tokens))
                 if empty in LIMITS else EMPTY_STEP_CAUSES[empty])
        warnings.warn(f"step {step} trained on no token: {cause}", RuntimeWarning, stacklevel=2)
    if warn and zero and counters["zero_contrast_steps"] == 1:
        g = batch.advantage_stats
        warnings.warn(f"step {step}: every group had one reward for all its samples "
                      f"({g['all_wrong']} all wrong, {g['all_correct']} all correct, "
                      f"{g['zero_contrast_other']} other), so no policy gradient"
                      f"{' and no token trained (dynamic sampling)' if empty else ''}; normal on "
                      "hard tasks, counted in total/zero_contrast_steps (warned once)",
                      RuntimeWarning, stacklevel=2)
    return {"total/empty_steps": counters["empty_steps"],
            "total/zero_contrast_steps": counters["zero_contrast_steps"],
            "total/prompt_too_long": counters["prompt_too_long"]}



def held_out_tasks(splits: Splits, names: list[str], n: int) -> dict[str, list[TaskSpec]]:
    """The first ``n`` tasks (``eval.n``) of each held-out split in ``names``, keyed by the
    split evaluated (``Splits.evaluated``: ``holdout_iid`` for ``holdout`` in a pool with
    nothing compositional to hold out). A split holding fewer is evaluated whole, and a warning
    says so (as does every evaluation's summary: ``summarize_eval``'s ``n_requested`` and
    ``n_evaluated``)."""
    out = {name: list(splits[name])[:n] for name in splits.evaluated(names)}
    short = [f"{name!r} holds {len(tasks)}" for name, tasks in out.items() if 0 < len(tasks) < n]
    if short:
        warnings.warn(f"eval.n is {n}, but held-out split {', '.join(short)} tasks: those are "
                      "evaluated (n_requested and n_evaluated in eval.jsonl)", stacklevel=2)
    return out



def summarize_eval(records: list[EvalRecord], requested: int | None = None) -> dict[str, Any]:
    """Held-out summary from ``evals.run.slice_summary`` (overall and, with several splits,
    per split), with what crossed compression boundaries, the sub-agents (branches per
    episode, the share of episodes that branched, the share of branches whose output reached
    the answer) and the per-task rewards a paired
    comparison needs (infrastructure faults are counted, never scored). ``requested``: the
    tasks asked for per split (``eval.n``), recorded as ``n_requested`` beside
    ``n_evaluated`` (``{split: tasks evaluated}``), which may be fewer."""

    def summary(group: list[EvalRecord]) -> dict[str, Any]:
        (row,) = slice_summary(group, by=(), n_boot=2000)
        scored = [r for r in group if not r.infra_fault]
        compressions = sum(r.compressions for r in scored)
        branches = sum(r.branches for r in scored)
        return {"reward_mean": row["reward/mean"], "reward_lo": row["reward/lo"],
                "reward_hi": row["reward/hi"], "success": row["success/rate"],
                "success_lo": row["success/lo"], "success_hi": row["success/hi"], "n": row["n"],
                "infra_faults": row["n_infra_faults"],
                "compressions_per_episode": compressions / max(len(scored), 1),
                "summary_tokens": sum(r.summary_tokens for r in scored) / max(compressions, 1),
                "summary_used_frac": sum(r.summaries_used for r in scored) / max(compressions, 1),
                "branches_per_episode": branches / max(len(scored), 1),
                "branched_frac": sum(r.branches > 0 for r in scored) / max(len(scored), 1),
                "branch_used_frac": sum(r.branches_used for r in scored) / max(branches, 1),
                "rewards": [r.reward for r in scored], "task_ids": [r.task_id for r in scored],
                "keys": [f"{r.split}:{r.task_id}:{r.sample_id}" for r in scored]}

    out = summary(records)
    names = list(dict.fromkeys(r.split for r in records))
    if requested is not None:
        out |= {"n_requested": requested,
                "n_evaluated": {name: sum(r.split == name for r in records) for name in names}}
    if len(names) > 1:
        out["splits"] = {name: summary([r for r in records if r.split == name]) for name in names}
    return out



def held_out_task(key: str) -> tuple[str, str]:
    """``(split, task_id)`` of a summary's key ``SPLIT:TASK_ID:SAMPLE_ID`` (``summarize_eval``)."""
    split, rest = key.split(":", 1)
    return split, rest.rsplit(":", 1)[0]


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Paired bootstrap of after - before over the tasks both scored (same tasks, same
    sampling seeds), overall and per split. None when no task was scored by both (every
    held-out episode of one side an infrastructure fault: nothing to pair), and a split with
    no such task is left out, each with a warning."""

    def paired(b: dict[str, Any], a: dict[str, Any], where: str) -> dict[str, Any] | None:
        old = dict(zip(b["keys"], b["rewards"], strict=True))
        pairs = [(reward, old[key]) for key, reward in zip(a["keys"], a["rewards"], strict=True)
                 if key in old]
        if not pairs:
            warnings.warn(f"held-out {where}: no task was scored both before and after (their "
                          "episodes were infrastructure faults): no paired difference",
                          stacklevel=3)
            return None
        diff, lo, hi = paired_bootstrap([p[0] for p in pairs], [p[1] for p in pairs], n_boot=5000)
        return {"reward_diff": diff, "lo": lo, "hi": hi, "n": len(pairs)}

    out = paired(before, after, "all")
    if out is not None and "splits" in after:
        splits = {name: paired(before["splits"][name], summary, name)
                  for name, summary in after["splits"].items()}
        out["splits"] = {name: c for name, c in splits.items() if c is not None}
    return out


def train_status(m: dict[str, Any], held_out: tuple[int, float] | None = None) -> str:
    """A training step's status: its reward, the latest held-out reward ``held_out`` (``(step,
    reward)``, step 0 the starting policy's) and the generation speed (``rollout/tokens_per_s``)."""
    held = ("" if held_out is None else
            f"  held-out {held_out[1]:.3f} ({'before' if held_out[0] == 0 else f'step {held_out[0]}'})")
    return (f"reward {m['reward/mean']:.3f}{held}  "
            f"{m.get('rollout/tokens_per_s') or 0.0:.0f} tok/s")


class TrainStatus:
    """``train_status`` of each step for ``progress_bar``, with the last held-out reward: the
    starting policy's (``before``, an evaluation summary, or None) until an evaluation in the
    loop logs ``holdout/reward``."""

    def __init__(self, before: dict[str, Any] | None):
        self.held_out = None if before is None else (0, before["reward_mean"])

    def __call__(self, m: dict[str, Any]) -> str:
        if m.get("holdout/reward") is not None:
            self.held_out = (m["step"], m["holdout/reward"])
        return train_status(m, self.held_out)


def clock(seconds: float) -> str:
    """``seconds`` as ``M:SS`` or ``H:MM:SS``."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


PLAIN_LINES = 20  # a log gets about this many progress lines per run (and the first and last)
WIDE = 100  # a terminal at least this wide shows the bar beside the status


class progress_bar:
    """Progress over steps: ``status(latest metrics)`` (``train_status`` by default) after the
    step count and, from the steps taken so far, the time left (``ETA``); nothing when not
    ``enabled``. On a terminal one line redrawn in place (with a bar where it is at least
    ``WIDE`` columns); otherwise (a log, a pipe: ``plain`` None decides by stdout) plain lines
    ``LABEL UNIT N/TOTAL  STATUS  ETA M:SS`` on the first and last step and every
    ``total / PLAIN_LINES`` steps between, no control codes. ``advance(metrics, n)`` counts
    ``n`` units done at once (an evaluation round finishes several episodes). The status is shown as text, never markup, its control characters
    escaped: a caller's status may quote what a step saw (a task id, a reply)."""

    def __init__(self, enabled: bool, total: int, completed: int, label: str = "train",
                 status=train_status, plain: bool | None = None, unit: str = "step"):
        self.enabled, self.total, self.completed = enabled, total, completed
        self.label, self.status, self.plain, self.unit = label, status, plain, unit

    def __enter__(self):
        if not self.enabled:
            return lambda metrics, n=1: None
        from rich.console import Console

        terminal = Console()
        plain = not terminal.is_terminal if self.plain is None else self.plain
        start, first, done = time.perf_counter(), self.completed, self.completed
        every = max(1, -(-(self.total - first) // PLAIN_LINES))
        if not plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            bar = [BarColumn(bar_width=20)] if terminal.width >= WIDE else []  # room for the status
            self.progress = Progress(TextColumn(f"[bold]{self.label}"), *bar, MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}", markup=False))
            self.progress.start()
            task = self.progress.add_task(self.label, total=self.total, completed=self.completed,
                                          status="")

        def advance(m: dict[str, Any], n: int = 1) -> None:
            nonlocal done
            if n < 1:
                return
            done += n
            elapsed = time.perf_counter() - start
            eta = clock(elapsed / (done - first) * max(self.total - done, 0))
            status = escape_terminal(self.status(m))
            if not plain:
                self.progress.update(task, advance=n, status=f"{status}  ETA {eta}")
            elif done - n == first or done == self.total or (done - first) // every > (
                    done - n - first) // every:
                parts = (f"{self.label} {self.unit} {done}/{self.total}", status, f"ETA {eta}")
                print("  ".join(part for part in parts if part), flush=True)

        self.plain_mode = plain
        return advance

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.plain_mode:
            self.progress.stop()


@contextmanager
def episode_progress(enabled: bool, total: int, label: str):
    """``on_round(done, total)`` for ``evals.run.run_eval``: ``progress_bar`` over its
    ``total`` episodes, advanced by those each policy round finished."""
    with progress_bar(enabled, total, 0, label=label, status=lambda m: "",
                      unit="episode") as advance:
        shown = 0

        def on_round(done: int, _total: int) -> None:
            nonlocal shown
            advance({}, done - shown)
            shown = done

        yield on_round
