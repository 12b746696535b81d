"""The run directory: what a training run writes and reads back.

``contract.yaml`` + ``contract.sha256``, ``contract.pins.json`` (the content hashes of the
files the contract reads: ``input_pins``) and ``base_model.json`` (the content hashes of the
base model's files: pinned before the first rollout), ``metrics.jsonl`` (one namespaced
record per step, mirrored to TensorBoard when it is installed), ``eval.jsonl`` (held-out
summaries) and ``evals/<tag>.jsonl`` (one record per held-out episode), ``rollouts.jsonl``
(every episode), ``curriculum.jsonl`` (one record per difficulty-filter round, keyed by the
first step it trains), ``checkpoints/``, ``guard.json``, ``result.json``; ``run.lock`` while a
process runs there (``runlock``: one process per run directory). ``agent-rl sft`` writes its
resume bundles to ``resume/`` and its final bundle to ``checkpoints/``.

What a user owns is never overwritten or dropped: ``check_run_dir`` refuses, writing
nothing, a folder that is no run of this contract and base model, or whose logs lost what
its checkpoint committed; only then are the pins written (``pin_run_dir``) and the logs cut
back to the checkpoint (``rewind_logs``: later lines move to ``<file>.rewound``).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from agent_rl import checkpoint
from agent_rl.config import ExperimentContract, SFTContract, read_contract
from agent_rl.guards import limit_clauses
from agent_rl.models import fingerprint_changes
from agent_rl.rollout import (
    LIMITS,
    EmptyStep,
    RolloutBatch,
    empty_reason,
    shown_hint,
    too_long_prompts,
    zero_contrast_step,
)
from envs.core import TaskSpec
from evals.run import EvalRecord, slice_summary
from evals.stats import paired_bootstrap
from trajectories.display import escape_terminal

LOG_FILES = ("rollouts.jsonl", "metrics.jsonl", "eval.jsonl", "curriculum.jsonl")
RUN_FILES = (*LOG_FILES, "checkpoints")
BASE_MODEL_FILE = "base_model.json"
PINS_FILE = "contract.pins.json"  # the content hashes of the files the contract reads
PIN_FILES = ("contract.yaml", "contract.sha256", PINS_FILE, BASE_MODEL_FILE)
LOCK_FILE = "run.lock"  # runlock.py: held while a process runs in the folder


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (getrusage: kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_metrics(step: int, batch: RolloutBatch, update: dict[str, float], rollout_s: float,
                 train_s: float, counters: Counter, lag: dict[str, float],
                 wait_s: float = 0.0, hint_share: float | None = None) -> dict[str, Any]:
    """One step's record. ``rollout_s``: generating the batch (on whatever thread did);
    ``wait_s``: how long the trainer waited for it (all of ``rollout_s`` when synchronous);
    ``hint_share``: the share the contract's ``hints`` scheduled for this step (logged, when
    given, as ``hint/scheduled_share``, beside ``hint/share``: the share the episodes' hint
    provenance says was shown). ``reward/hinted_mean`` and ``reward/unhinted_mean`` split
    ``reward/mean`` by whether the episode showed a hint (None when no episode is on that side);
    ``hint/used_frac`` is the share that did. ``train/empty_step`` is 1 on a step that trained
    on no token, ``train/empty_reason`` says why (``rollout.empty_reason``)."""
    episodes = batch.episodes
    hinted = [e.reward.total for e in episodes if shown_hint(e)]
    unhinted = [e.reward.total for e in episodes if not shown_hint(e)]
    groups = batch.advantage_stats  # over every valid episode, dropped groups included
    compressed = [s for e in episodes for s in e.compressed_sessions()]
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
        "sessions/per_episode": float(np.mean([len(e.sessions) for e in episodes])),
        "sessions/compressions": sum(s.origin == "compression" for e in episodes for s in e.sessions),
        "sessions/compressions_per_episode": len(compressed) / max(len(episodes), 1),
        "sessions/branches": sum(s.origin == "branch" for e in episodes for s in e.sessions),
        "sessions/summary_tokens": (float(np.mean([len(s.last_reply.token_ids or []) for s in compressed]))
                                    if compressed else 0.0),
        "sessions/summary_used_frac": (sum(bool(s.used_by_final) for s in compressed) / len(compressed)
                                       if compressed else 0.0),
        "reward/hinted_mean": float(np.mean(hinted)) if hinted else None,
        "reward/unhinted_mean": float(np.mean(unhinted)) if unhinted else None,
        "hint/used_frac": len(hinted) / max(len(episodes), 1),
        **({"hint/share": len(hinted) / max(len(episodes), 1), "hint/scheduled_share": hint_share}
           if hint_share is not None else {}),
        "rollout/tokens_generated": report["tokens_generated"],
        "rollout/tokens_discarded": report["tokens_discarded"],
        "rollout/tokens_per_s": report["tokens_generated"] / max(rollout_s, 1e-9),
        "rollout/seconds": rollout_s,
        "rollout/policy_lag": lag["max"],
        "rollout/policy_lag_mean": lag["mean"],
        "rollout/data_wait_s": wait_s,
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


# what a step that trained on no token says, by its cause (``rollout.EmptyStep``), where no limit
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


def held_out_tasks(splits: dict[str, Any], names: list[str], n: int) -> dict[str, list[TaskSpec]]:
    """The first ``n`` tasks (``eval.n``) of each held-out split in ``names``. A split holding
    fewer is evaluated whole, and a warning says so (as does every evaluation's summary:
    ``summarize_eval``'s ``n_requested`` and ``n_evaluated``)."""
    out = {name: list(splits[name])[:n] for name in names}
    short = [f"{name!r} holds {len(tasks)}" for name, tasks in out.items() if 0 < len(tasks) < n]
    if short:
        warnings.warn(f"eval.n is {n}, but held-out split {', '.join(short)} tasks: those are "
                      "evaluated (n_requested and n_evaluated in eval.jsonl)", stacklevel=2)
    return out


def summarize_eval(records: list[EvalRecord], requested: int | None = None) -> dict[str, Any]:
    """Held-out summary from ``evals.run.slice_summary`` (overall and, with several splits,
    per split), with what crossed compression boundaries and the per-task rewards a paired
    comparison needs (infrastructure faults are counted, never scored). ``requested``: the
    tasks asked for per split (``eval.n``), recorded as ``n_requested`` beside
    ``n_evaluated`` (``{split: tasks evaluated}``), which may be fewer."""

    def summary(group: list[EvalRecord]) -> dict[str, Any]:
        (row,) = slice_summary(group, by=(), n_boot=2000)
        scored = [r for r in group if not r.infra_fault]
        compressions = sum(r.compressions for r in scored)
        return {"reward_mean": row["reward/mean"], "reward_lo": row["reward/lo"],
                "reward_hi": row["reward/hi"], "success": row["success/rate"],
                "success_lo": row["success/lo"], "success_hi": row["success/hi"], "n": row["n"],
                "infra_faults": row["n_infra_faults"],
                "compressions_per_episode": compressions / max(len(scored), 1),
                "summary_tokens": sum(r.summary_tokens for r in scored) / max(compressions, 1),
                "summary_used_frac": sum(r.summaries_used for r in scored) / max(compressions, 1),
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


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Paired bootstrap of after - before over the tasks both scored (same tasks, same
    sampling seeds), overall and per split."""

    def paired(b: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
        old = dict(zip(b["keys"], b["rewards"], strict=True))
        pairs = [(reward, old[key]) for key, reward in zip(a["keys"], a["rewards"], strict=True)
                 if key in old]
        diff, lo, hi = paired_bootstrap([p[0] for p in pairs], [p[1] for p in pairs], n_boot=5000)
        return {"reward_diff": diff, "lo": lo, "hi": hi, "n": len(pairs)}

    out = paired(before, after)
    if "splits" in after:
        out["splits"] = {name: paired(before["splits"][name], summary)
                         for name, summary in after["splits"].items()}
    return out


class RunDirError(ValueError):
    """The run directory cannot take the run asked for; nothing in it was changed."""


def check_run_dir(run_dir: Path, contract: ExperimentContract | SFTContract, contract_hash: str,
                  base_model: dict[str, Any], resume: bool,
                  checkpoints: Path | None = None) -> Path | None:
    """Check, writing nothing, that ``run_dir`` can take this run; return the checkpoint to
    resume from (None: start at step 0), the newest complete bundle of ``checkpoints``
    (``run_dir/checkpoints`` by default). Refused: a non-empty folder that is no agent-rl run
    (no ``contract.sha256``, readable ``contract.yaml`` or checkpoint), a run of another
    contract, a run without ``resume``; with ``resume``: a folder with nothing to resume, a
    changed base model (``base_model``: ``{role: models.model_fingerprint}``, pinned in
    ``base_model.json``) and logs that lost records the checkpoint committed (``split_log``).
    The lock file (``runlock``) is no content."""
    checkpoints = run_dir / "checkpoints" if checkpoints is None else checkpoints
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if not entries:
        if resume:
            raise nothing_to_resume(run_dir)
        return None
    pinned = pinned_contract_hash(run_dir)
    latest = checkpoint.latest_complete(checkpoints) if resume or pinned is None else None
    meta = json.loads((latest / checkpoint.META_FILE).read_text()) if latest else {}
    pinned = pinned or meta.get("contract_hash")
    if pinned is None:
        raise RunDirError(f"{run_dir} is not an agent-rl run directory (no contract.sha256, "
                          f"readable contract.yaml or checkpoint) and holds {entries[:5]}: "
                          "choose a new or an empty run_dir")
    if pinned != contract_hash:
        try:
            old = read_contract(run_dir / "contract.yaml")
        except ValueError:  # the old contract.yaml is missing or no longer validates
            old = None
        changed = ([] if old is None else contract.changes_from(old)
                   if type(old) is type(contract) else [f"a run of another kind ({type(old).__name__})"])
        if (run_dir / PINS_FILE).is_file():  # files whose content changed under the same name
            changed += contract.pin_changes(json.loads((run_dir / PINS_FILE).read_text()))
        raise RunDirError(f"{run_dir} belongs to another contract ({pinned[:12]} != "
                          f"{contract_hash[:12]}; changed: {'; '.join(changed) or '?'}); "
                          "use a new run_dir or restore the old config")
    if not resume:
        if any((run_dir / name).exists() for name in RUN_FILES):
            raise RunDirError(f"{run_dir} already holds a run; pass --resume to continue it "
                              "or choose a new run_dir")
        return None
    pin = run_dir / BASE_MODEL_FILE
    pinned_model = json.loads(pin.read_text()) if pin.exists() else meta.get("base_model", {})
    changes = [f"{role} {now['id']}: {change}" for role, now in base_model.items()
               for change in fingerprint_changes(pinned_model.get(role, now), now)]
    if changes:
        raise RunDirError(f"cannot resume {run_dir}: its base model changed since the run "
                          f"started ({'; '.join(changes)}); restore those files or start a "
                          "new run_dir")
    for name in LOG_FILES:  # raises when a record the checkpoint committed is lost
        split_log(run_dir / name, meta.get("step", -1), meta.get("store_cursor", 0))
    return latest


def nothing_to_resume(run_dir: Path) -> RunDirError:
    """--resume of a folder that is empty or does not exist."""
    return RunDirError(f"--resume: {run_dir} {'is empty' if run_dir.is_dir() else 'does not exist'}"
                       ", so there is no run to resume; start it without --resume")


def pinned_contract_hash(run_dir: Path) -> str | None:
    """The contract hash a run directory was pinned to: ``contract.sha256``, else the hash of
    a ``contract.yaml`` that still validates, else None."""
    if (run_dir / "contract.sha256").is_file():
        return (run_dir / "contract.sha256").read_text().strip()
    try:
        return read_contract(run_dir / "contract.yaml").contract_hash()
    except ValueError:
        return None


def pin_run_dir(run_dir: Path, contract: ExperimentContract | SFTContract, contract_hash: str,
                base_model: dict[str, Any]) -> None:
    """Write what the run is pinned to, once ``check_run_dir`` and the checkpoint accepted it:
    ``contract.yaml``, ``contract.sha256``, ``contract.pins.json`` and ``base_model.json``
    (``PIN_FILES``). From here
    on the folder is this run's: a run killed before its first checkpoint resumes from step 0."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_file(run_dir / "contract.yaml", contract.to_yaml())
    write_file(run_dir / "contract.sha256", contract_hash + "\n")
    write_file(run_dir / PINS_FILE, json.dumps(contract.input_pins(), indent=2, sort_keys=True)
               + "\n")
    write_file(run_dir / BASE_MODEL_FILE, json.dumps(base_model, indent=2, sort_keys=True) + "\n")


def unpin_run_dir(run_dir: Path) -> None:
    """Take back ``pin_run_dir``'s files: a run that failed before writing anything else
    (an empty curriculum band) leaves the folder as it found it."""
    for name in PIN_FILES:
        (run_dir / name).unlink(missing_ok=True)


def split_log(path: Path, step: int, store_cursor: int) -> tuple[list[bytes], list[bytes], bytes]:
    """A log of the run cut at the checkpoint of ``step``: (lines kept, lines after it, torn
    last line). Kept: the first ``store_cursor`` records of ``rollouts.jsonl``, the records of
    steps <= ``step`` of ``metrics.jsonl`` and ``eval.jsonl``. Raises RunDirError naming the
    file and the line, record or step when a line before the last is no JSON record (with a
    step, but in the rollouts) or when a record the checkpoint committed is missing: a rollout
    record, or the metrics of a step <= ``step``. A crash cannot do that (both are fsynced
    before the checkpoint is written): the file was damaged, and nothing is cut."""
    if not path.exists():
        return [], [], b""
    *lines, torn = path.read_bytes().split(b"\n")  # torn: b"" when the file ends cleanly
    records = [_log_record(path, number, line) for number, line in enumerate(lines, start=1)]
    lost = ""
    if path.name == "rollouts.jsonl":
        kept, cut = lines[:store_cursor], lines[store_cursor:]
        if len(lines) < store_cursor:
            lost = (f"record {store_cursor}" if len(lines) + 1 == store_cursor
                    else f"records {len(lines) + 1}..{store_cursor}")
    else:
        steps = [_log_step(path, number, record) for number, record in enumerate(records, start=1)]
        kept = [line for line, s in zip(lines, steps, strict=True) if s <= step]
        cut = [line for line, s in zip(lines, steps, strict=True) if s > step]
        missing = sorted(set(range(1, step + 1)) - set(steps)) if path.name == "metrics.jsonl" else []
        if missing:
            lost = f"the metrics of step {', '.join(map(str, missing))}"
    if lost:
        torn_note = f"; its last line is torn ({len(torn)} bytes without a newline)" if torn else ""
        raise RunDirError(f"{path}: {lost}, which the checkpoint of step {step} committed, "
                          f"cannot be found{torn_note}. Restore {path.name}, or move that "
                          "checkpoint (and any later) out of checkpoints/ to resume from an "
                          "earlier one")
    return kept, cut, torn


def _log_record(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        record = None
    if not isinstance(record, dict):
        raise RunDirError(f"{path}: line {number} is not a JSON record (the file is corrupt "
                          f"before its last line): restore {path.name}")
    return record


def _log_step(path: Path, number: int, record: dict[str, Any]) -> int:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise RunDirError(f"{path}: line {number} has no step: not a record agent-rl wrote")
    return step


def rewind_logs(run_dir: Path, step: int, store_cursor: int) -> None:
    """Cut the run's logs back to a checkpoint (``split_log``): later records and a torn last
    line (work of a killed run after its last checkpoint, which the resumed run redoes) move
    to ``<file>.rewound``, a torn line with a warning naming it. So every step is logged
    once, and nothing is lost."""
    for name in LOG_FILES:
        path = run_dir / name
        kept, cut, torn = split_log(path, step, store_cursor)
        if torn:
            started = re.match(rb'\{"step": (\d+)', torn)
            warnings.warn(f"{path}: its last line ({f'of step {int(started[1])}, ' if started else ''}"
                          f"{len(torn)} bytes) was cut short by an interrupted write; moved to "
                          f"{name}.rewound", stacklevel=2)
        if cut or torn:
            with open(path.with_name(name + ".rewound"), "ab") as fh:
                fh.write(b"".join(line + b"\n" for line in [*cut, torn] if line))
            write_file(path, b"".join(line + b"\n" for line in kept))


def write_file(path: Path, content: str | bytes) -> None:
    """Write ``content`` atomically (temp file, fsync, rename); a file that already holds it is
    left alone. The one way the run directory's files are replaced."""
    data = content.encode() if isinstance(content, str) else content
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def logged_eval(run_dir: Path, tag: str, step: int) -> dict[str, Any] | None:
    """The summary ``eval.jsonl`` holds for ``tag`` at ``step`` (the last one), else None."""
    path = run_dir / "eval.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    found = [r for r in records if r.get("tag") == tag and r.get("step") == step]
    return {k: v for k, v in found[-1].items() if k not in ("step", "tag")} if found else None


def json_safe(obj: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"), for strict JSON (checkpoint meta)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(value) for value in obj]
    return obj


class TensorBoardLog:
    """Mirrors metrics to TensorBoard when it is installed. The event file is opened at the
    first record, so a run that logs no step (a finished run resumed) writes none."""

    def __init__(self, path: Path):
        self.path, self.writer = path, None

    def log(self, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return
            self.writer = SummaryWriter(str(self.path))
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.writer.add_scalar(key, value, metrics["step"])
        self.writer.flush()

    def close(self) -> None:
        """Stop the writer's background thread (a run's end)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def log_json(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line, fsynced: a logged step survives a crash as its checkpoint does."""
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def train_status(m: dict[str, Any]) -> str:
    return (f"reward {m['reward/mean']:.3f}  loss {m['loss/policy']:+.4f}  "
            f"kept {m['train/sequences']} seqs")


class progress_bar:
    """A rich progress bar over steps showing ``status(latest metrics)`` (the training
    reward and loss by default), or nothing when not ``enabled``. The status line is shown
    as text, never markup, its control characters escaped: a caller's status may quote what
    a step saw (a task id, a reply)."""

    def __init__(self, enabled: bool, total: int, completed: int, label: str = "train",
                 status=train_status):
        self.enabled, self.total, self.completed = enabled, total, completed
        self.label, self.status = label, status

    def __enter__(self):
        if not self.enabled:
            return lambda metrics: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[status]}", markup=False))
        self.progress.start()
        task = self.progress.add_task(self.label, total=self.total, completed=self.completed,
                                      status="")

        def advance(m: dict[str, Any]) -> None:
            self.progress.update(task, advance=1, status=escape_terminal(self.status(m)))

        return advance

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()
