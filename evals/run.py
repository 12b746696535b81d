"""Evaluation runs: one record per episode; aggregation (per slice, with intervals) by the caller.

``run_eval`` drives ``envs.runner.run_episodes`` (the same runner RL rollouts use) over a list
of tasks and returns an ``EvalRun``: the episodes themselves and, for every one of them, an
``EvalRecord`` (``evaluate`` returns the records only): reward and its components, outcome,
the split it was drawn from, the task's slice fields (skills, structure, entity group, length,
difficulty, atomic or composed), whether a hint was shown, cost (generated tokens, sessions,
compressions, branches, latency from reset to the terminal step, policy time included) and
what crossed compression boundaries (summary tokens, summaries whose session reached the
answer). ``write_records`` / ``read_records`` store the records as JSONL; ``write_episodes``
stores the episodes as a ``RolloutStore`` (``agent-rl inspect PATH --episode ID`` shows one),
so what the agent did on each evaluated task can be read back, infrastructure faults
included. Both replace the file they are given, whole: a file never mixes two evaluations.

Evaluation is hint-free: hints stay hidden whatever the env kwargs say (``hints=True`` is a
training option). ``hinted=True`` is the explicit, separately named exception, and every
record says whether a hint was shown.

``slice_summary(records, by)`` aggregates records per slice:

- ``reward/mean`` with a percentile bootstrap interval ``reward/lo``, ``reward/hi``
  (``evals.stats.cluster_bootstrap``), resampling whole tasks: the samples of one task are one
  cluster and never count as independent draws (with one sample per task this is the plain
  bootstrap);
- ``success/rate`` (outcome ``correct``) with a Wilson interval ``success/lo``, ``success/hi``
  over the ``n`` scored episodes;
- ``n``, ``n_tasks``, and ``n_infra_faults``: episodes that ended on an infrastructure fault
  (``sandbox_error``) are counted but never scored as wrong, so they are left out of ``n`` and
  of both means.

``by`` is a record field or property (``structure``, ``entity_group``, ``length``,
``difficulty``, ``composition`` = ``atomic`` | ``composed`` | ``unknown``, ...), a tuple of them
(``("entity_group", "composition")``) or ``()`` for one overall row.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
from pydantic import BaseModel, ConfigDict, Field

from envs.core import TaskSpec
from envs.registry import make
from envs.runner import Policy, Sampling, run_episodes
from evals.stats import cluster_bootstrap, wilson
from trajectories import Episode, Outcome, RolloutStore


class EvalRecord(BaseModel):
    """One evaluated episode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    episode_id: str
    env_id: str
    sample_id: int = 0
    seed: int | None = None
    split: str = Field("", description="the split the task was drawn from (holdout_iid, ...)")
    policy_name: str = "policy"
    bundle_hash: str | None = Field(None, description="content hash of the evaluated bundle")
    reward: float = Field(description="RewardBreakdown.total")
    components: dict[str, float] = Field(default_factory=dict)
    outcome: Outcome
    success: bool = Field(description="outcome == correct")
    infra_fault: bool = Field(False, description="outcome is an infrastructure fault (not scored)")
    skills: list[str] = Field(default_factory=list)
    structure: str = ""
    entity_group: str = ""
    length: int = 1
    difficulty: int = 0
    atomic: bool = Field(description="exactly one skill")
    hint_shown: bool = False
    generated_tokens: int = 0
    sessions: int = 1
    compressions: int = 0
    branches: int = 0
    summary_tokens: int = Field(0, description="generated tokens of the summaries written")
    summaries_used: int = Field(0, description="compressed sessions whose output reached the answer")
    branches_used: int = Field(0, description="sub-agent sessions whose output reached the answer")
    latency_s: float = Field(0.0, description="reset to terminal step, policy time included")

    @property
    def composition(self) -> str:
        """``atomic`` (one skill), ``composed`` (several) or ``unknown`` (no skills recorded)."""
        if not self.skills:
            return "unknown"
        return "atomic" if self.atomic else "composed"

    @classmethod
    def from_episode(cls, episode: Episode, policy_name: str = "policy",
                     bundle_hash: str | None = None, latency_s: float = 0.0) -> EvalRecord:
        meta = episode.task_meta
        skills = list(meta.get("skills", []))
        origins = [s.origin for s in episode.sessions]
        compressed = episode.compressed_sessions()
        return cls(
            task_id=episode.task_id, episode_id=episode.episode_id, env_id=episode.env_id,
            sample_id=episode.sample_id, seed=episode.seed, split=episode.split,
            policy_name=policy_name,
            bundle_hash=bundle_hash, reward=episode.reward.total,
            components=dict(episode.reward.components), outcome=episode.reward.outcome,
            success=episode.reward.outcome == Outcome.correct,
            infra_fault=episode.reward.is_infrastructure_fault,
            skills=skills, structure=meta.get("structure", ""),
            entity_group=meta.get("entity_group", ""), length=meta.get("length", 1),
            difficulty=meta.get("difficulty", 0), atomic=len(skills) == 1,
            hint_shown=bool(episode.hint and episode.hint.get("shown")),
            generated_tokens=sum(s.generated_tokens for s in episode.sessions),
            sessions=len(episode.sessions), compressions=origins.count("compression"),
            branches=origins.count("branch"),
            summary_tokens=sum(len(s.last_reply.token_ids or []) for s in compressed),
            summaries_used=sum(bool(s.used_by_final) for s in compressed),
            branches_used=sum(bool(s.used_by_final) for s in episode.sessions
                              if s.origin == "branch"),
            latency_s=latency_s)


class _Timed(gymnasium.Wrapper):
    """Records each episode's wall time from reset to its terminal step."""

    def __init__(self, env: gymnasium.Env, latencies: dict[str, float]):
        super().__init__(env)
        self._latencies = latencies
        self._t0 = 0.0

    def reset(self, **kwargs: Any):
        self._t0 = time.perf_counter()
        return self.env.reset(**kwargs)

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            self._latencies[info["episode"].episode_id] = time.perf_counter() - self._t0
        return obs, reward, terminated, truncated, info


@dataclass(frozen=True)
class EvalRun:
    """What one evaluation produced: ``episodes[i]`` is the episode ``records[i]`` describes
    (one record per episode, infrastructure faults included, in task order)."""

    records: list[EvalRecord]
    episodes: list[Episode]


def run_eval(
    policy: Policy,
    env_id: str,
    tasks: Sequence[TaskSpec],
    sampling: Sampling | None = None,
    seed: int = 0,
    samples_per_task: int = 1,
    env_kwargs: dict[str, Any] | None = None,
    policy_name: str = "policy",
    bundle_hash: str | None = None,
    num_envs: int = 16,
    split: str | None = None,
    hinted: bool = False,
    on_round: Callable[[int, int], None] | None = None,
) -> EvalRun:
    """Run every task ``samples_per_task`` times; the episodes and one ``EvalRecord`` per
    episode, in task order.

    ``env_kwargs`` build the environments; hints are hidden whatever they say unless
    ``hinted=True``. ``split`` names where the tasks come from (recorded on every episode and
    record). Episodes are seeded as ``run_episodes`` seeds them; ``on_round(done, total)``
    reports progress in episodes as it does there.
    """
    jobs = len(tasks) * samples_per_task
    if jobs == 0:
        return EvalRun([], [])
    latencies: dict[str, float] = {}
    pool = [_Timed(make(env_id, **(env_kwargs or {})), latencies)
            for _ in range(min(num_envs, jobs))]
    try:
        episodes = run_episodes(pool, tasks, policy, sampling or Sampling(),
                                samples_per_task=samples_per_task, seed=seed, split=split,
                                hints=hinted, on_round=on_round)
    finally:
        for env in pool:
            env.close()
    records = [EvalRecord.from_episode(ep, policy_name, bundle_hash,
                                       latencies.get(ep.episode_id, 0.0)) for ep in episodes]
    return EvalRun(records, episodes)


def write_records(records: Iterable[EvalRecord], path: str | Path) -> Path:
    """Write records as JSONL (one record a line, sorted keys); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.model_dump(mode="json"), sort_keys=True,
                               ensure_ascii=False, allow_nan=False) + "\n")
    return path


def write_episodes(episodes: Iterable[Episode], path: str | Path) -> Path:
    """Write episodes as a fresh ``RolloutStore`` at ``path`` (``.jsonl``, or ``.jsonl.zst``
    compressed), replacing any file there whole and atomically (written beside it, then
    renamed), as ``write_records`` replaces its file; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # left by a write that was killed
    RolloutStore(tmp, compress=path.suffix == ".zst").append(episodes)
    tmp.touch()  # an evaluation of no tasks: an empty store
    os.replace(tmp, path)
    return path


def read_records(path: str | Path) -> list[EvalRecord]:
    """Read a JSONL file written by ``write_records``; a bad line is reported by its number."""
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(EvalRecord.model_validate_json(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not an EvalRecord: {exc}") from exc
    return records


def _key_value(record: EvalRecord, name: str) -> Any:
    if not hasattr(record, name):
        raise ValueError(f"cannot slice by {name!r}: EvalRecord has no such field or property")
    value = getattr(record, name)
    return tuple(value) if isinstance(value, list) else value


def slice_members(records: Iterable[EvalRecord], keys: Mapping[str, Any]) -> list[EvalRecord]:
    """The records of one ``slice_summary`` row: those whose ``keys`` (the row's slice fields,
    e.g. ``{"structure": "add>mul"}``; ``{}``: every record) have the row's values."""
    return [r for r in records
            if all(_key_value(r, k) == (tuple(v) if isinstance(v, list) else v)
                   for k, v in keys.items())]


def slice_summary(
    records: Sequence[EvalRecord],
    by: str | Sequence[str] = "structure",
    n_boot: int = 10000,
    seed: int = 0,
    conf: float = 0.95,
    cluster_by: str | None = "task_id",
) -> list[dict[str, Any]]:
    """One row per slice (sorted by slice value): the slice keys, ``n``, ``n_tasks``,
    ``n_infra_faults``, ``reward/mean|lo|hi`` and ``success/k|rate|lo|hi``.

    ``cluster_by=None`` treats every episode as an independent draw (plain bootstrap). Records
    of several policies or bundles must be told apart by ``by`` (e.g. ``("policy_name",
    "structure")``); mixing them silently would average two policies.
    """
    keys = (by,) if isinstance(by, str) else tuple(by)
    policies = {(r.policy_name, r.bundle_hash) for r in records}
    if len(policies) > 1 and not {"policy_name", "bundle_hash"} & set(keys):
        raise ValueError(f"records mix policies/bundles {sorted(policies, key=str)}; add "
                         "'policy_name' or 'bundle_hash' to `by`")
    groups: dict[tuple, list[EvalRecord]] = {}
    for record in records:
        groups.setdefault(tuple(_key_value(record, k) for k in keys), []).append(record)
    rows = []
    for value in sorted(groups, key=lambda v: tuple(map(str, v))):
        group = groups[value]
        scored = [r for r in group if not r.infra_fault]
        row: dict[str, Any] = dict(zip(keys, value, strict=True))
        row.update({"n": len(scored), "n_tasks": len({r.task_id for r in scored}),
                    "n_infra_faults": len(group) - len(scored)})
        if scored:
            rewards = [r.reward for r in scored]
            clusters = [getattr(r, cluster_by) for r in scored] if cluster_by else range(len(scored))
            mean, lo, hi = cluster_bootstrap(rewards, list(clusters), n_boot, seed, conf=conf)
            k = sum(r.success for r in scored)
            s_lo, s_hi = wilson(k, len(scored), conf)
            row.update({"reward/mean": mean, "reward/lo": lo, "reward/hi": hi,
                        "success/k": k, "success/rate": k / len(scored),
                        "success/lo": s_lo, "success/hi": s_hi})
        else:
            row.update(dict.fromkeys(("reward/mean", "reward/lo", "reward/hi", "success/k",
                                      "success/rate", "success/lo", "success/hi")))
        rows.append(row)
    return rows
