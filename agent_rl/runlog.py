"""The run directory: what a training run writes and reads back.

``contract.yaml`` + ``contract.sha256`` (pinned before the first rollout), ``metrics.jsonl``
(one namespaced record per step, mirrored to TensorBoard when it is installed),
``eval.jsonl`` (held-out summaries) and ``evals/<tag>.jsonl`` (one record per held-out
episode), ``rollouts.jsonl`` (every episode), ``checkpoints/``, ``guard.json``, ``result.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from agent_rl.config import ExperimentContract
from agent_rl.rollout import RolloutBatch
from evals.run import EvalRecord, slice_summary
from evals.stats import paired_bootstrap

RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl", "checkpoints")


def step_metrics(step: int, batch: RolloutBatch, update: dict[str, float], rollout_s: float,
                 train_s: float, counters: Counter, lag: dict[str, float]) -> dict[str, Any]:
    episodes = batch.episodes
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
        "hint/used_frac": sum(e.hint is not None for e in episodes) / max(len(episodes), 1),
        "rollout/tokens_generated": report["tokens_generated"],
        "rollout/tokens_discarded": report["tokens_discarded"],
        "rollout/tokens_per_s": report["tokens_generated"] / max(rollout_s, 1e-9),
        "rollout/seconds": rollout_s,
        "rollout/policy_lag": lag["max"],
        "rollout/policy_lag_mean": lag["mean"],
        "rollout/data_wait_s": 0.0,
        "train/tokens": update.get("tokens", 0),
        "train/tokens_per_s": update.get("tokens", 0) / max(train_s, 1e-9),
        "train/seconds": train_s,
        "train/sequences": len(batch.sequences),
        "total/tokens_generated": counters["tokens_generated"],
        "total/episodes": counters["episodes"],
        "batch/task_ids": sorted({e.task_id for e in episodes}),
        "rollout/acceptance": report["acceptance"],
    }


def summarize_eval(records: list[EvalRecord]) -> dict[str, Any]:
    """Held-out summary from ``evals.run.slice_summary`` (overall and, with several splits,
    per split), with what crossed compression boundaries and the per-task rewards a paired
    comparison needs (infrastructure faults are counted, never scored)."""

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


def prepare_run_dir(run_dir: Path, contract: ExperimentContract, contract_hash: str,
                    resume: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    hash_file = run_dir / "contract.sha256"
    if hash_file.exists():
        old = hash_file.read_text().strip()
        if old != contract_hash:
            try:
                changed = contract.changes_from(
                    ExperimentContract.from_yaml(run_dir / "contract.yaml"))
            except ValueError:  # the old contract.yaml is missing or no longer validates
                changed = []
            raise ValueError(f"{run_dir} belongs to another contract ({old[:12]} != "
                             f"{contract_hash[:12]}; changed: {'; '.join(changed) or '?'}); "
                             "use a new run_dir or restore the old config")
        if not resume and any((run_dir / name).exists() for name in RUN_FILES):
            raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it "
                             "or choose a new run_dir")
    (run_dir / "contract.yaml").write_text(contract.to_yaml())
    hash_file.write_text(contract_hash + "\n")


def rewind_logs(run_dir: Path, step: int, store_cursor: int) -> None:
    """Cut the run's logs back to a checkpoint: the first ``store_cursor`` rollout records and
    the metrics/eval records of steps <= ``step`` stay; later records and a torn last line
    (work of a killed run after its last checkpoint, which the resumed run redoes) move to
    ``<file>.rewound``. So every step is logged once, and nothing is lost."""
    for name in ("rollouts.jsonl", "metrics.jsonl", "eval.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        *lines, torn = path.read_bytes().split(b"\n")  # torn: b"" when the file ends cleanly
        if name == "rollouts.jsonl":
            kept, cut = lines[:store_cursor], lines[store_cursor:]
        else:
            late = [json.loads(line)["step"] > step for line in lines]
            kept = [line for line, x in zip(lines, late, strict=True) if not x]
            cut = [line for line, x in zip(lines, late, strict=True) if x]
        if cut or torn:
            with open(path.with_name(name + ".rewound"), "ab") as fh:
                fh.write(b"".join(line + b"\n" for line in [*cut, torn] if line))
            tmp = path.with_name(name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, path)


def json_safe(obj: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"), for strict JSON (checkpoint meta)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(value) for value in obj]
    return obj


def tensorboard_writer(path: Path):
    """A TensorBoard SummaryWriter when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


def log_tensorboard(writer, metrics: dict[str, Any]) -> None:
    if writer is None:
        return
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            writer.add_scalar(key, value, metrics["step"])
    writer.flush()


def log_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")


class progress_bar:
    """A rich progress bar over steps showing the latest reward and loss (or nothing)."""

    def __init__(self, enabled: bool, total: int, completed: int):
        self.enabled, self.total, self.completed = enabled, total, completed

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

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[status]}"))
        self.progress.start()
        task = self.progress.add_task("train", total=self.total, completed=self.completed, status="")

        def advance(m: dict[str, Any]) -> None:
            self.progress.update(task, advance=1, status=(
                f"reward {m['reward/mean']:.3f}  loss {m['loss/policy']:+.4f}  "
                f"kept {m['train/sequences']} seqs"))

        return advance

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()
