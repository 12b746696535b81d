"""Canary release: offline gate -> shadow -> canary fraction -> promote, with automatic rollback.

``run(candidate, baseline, plan)`` walks a candidate bundle through four stages and stops at the
first gate that does not pass (``evals.gates.decide``: a ``fail`` *or* an ``inconclusive``
decision stops it; inconclusive is never a pass):

1. ``offline``: candidate and baseline are evaluated (``evals.run.run_eval``) on the plan's
   held-out tasks; ``decide(candidate, criteria, baseline)``. Not a pass: ``stopped`` (nothing
   was served, nothing to roll back).
2. ``shadow``: both policies run the shadow tasks, each against its own deep copy of the live
   store (write tools act on the copy). The live store's hash (sha256 of its canonical JSON)
   is recorded before and after and must be identical; ``decide`` on the shadow records
   (paired by task). Not a pass, or the live store changed: ``rolled_back``. What it compared
   is reported (``ShadowComparison``): each arm's tool calls and tasks with store writes, and
   the tasks whose tool effects differ between the arms.
3. ``canary``: the live traffic is served in order; a seeded ``canary_fraction`` of it goes to
   the candidate with restricted permissions (``allowed_tools`` narrowed to
   ``canary_allowed_tools``, ``write_scopes`` = the task's declared scope, never "any"), the
   rest to the baseline. Both write to the live store and append to its conversation log.
   ``decide(candidate share, canary_criteria, baseline share)``. Not a pass: ``rolled_back``
   (the live store and conversation log are restored to the snapshot taken before the canary,
   ``serving`` stays the baseline).
4. ``promote``: ``candidate.current_hash()`` (the whole artifact re-read and verified now)
   must equal ``candidate.bundle_hash`` (what was evaluated); a mismatch ("artifact changed
   after evaluation") or an artifact that no longer verifies (a corrupt file, a missing
   ``COMPLETE`` marker: the error names the file) is refused and rolled back. Otherwise
   ``serving`` becomes the candidate's hash.

A crash during shadow or canary (a policy raising) counts as a failed gate: rolled back, the
exception in the reasons; so does an artifact that cannot be re-read at promotion. A crash
during the offline gate propagates (nothing was served, nothing to undo).

Live state. ``LiveSystem`` is production state that persists across episodes: a record store
in the env's own state type (Records-v0: ``{collection: {id: {field: value}}}``), a
conversation log (one entry per served episode: who served it, its sessions' messages, its
tool effects), ``serving`` (the bundle hash in production), ``canary`` (the bundle hash on the
canary share, while one runs) and ``history`` (promotions and rollbacks). ``snapshot()`` /
``restore()`` copy all of it deeply; ``rollback_drill(live, snapshot)`` restores a snapshot and
verifies that the restored store and log hash to the snapshot's.

How an env acts on the live store. Records-v0 builds each episode's store from ``task.data``
(``new_state`` returns a deep copy) and has no hook for an injected store; envs/records is not
changed for this. Instead ``LiveStore`` wraps the env: on ``reset`` it rebases the task onto
the store (``task.data`` := a copy of the store as it is now, so the env's verifier scores the
episode's own diff, and ``Episode.tool_effects`` is that diff) and then points the env's
``state`` at the shared store object, so the tools read and write it. This fits any
``ToolEnv`` whose state is a dict store copied from ``task.data`` (Records-v0,
LongRecords-v0). Episodes on one store run one at a time (one env per arm), so a per-episode
diff holds only that episode's writes. Tasks that each carry their own store (Records-v0's
pool: every task its own records) use ``store_per_task``: ``live.store`` is
``{task_id: store}`` and each episode acts on its task's entry.

Bundles are addressed by content hash. ``evals`` does not import ``agent_rl``: the caller hands
the hash and a way to re-read and verify it, e.g.
``Candidate(name, verify_bundle(path), policy, current_hash=partial(verify_bundle, path))``
with ``agent_rl.run.checkpoint.verify_bundle`` (every file against the manifest, the marker
present; returns the hash). ``bundle_hash`` alone would read only ``MANIFEST.json``.

Traffic split. The canary arms serve different tasks, so a ``no_regression`` criterion (paired
by task and sample) would find no pairs and be inconclusive on every run; ``canary_criteria``
must use ``min`` / ``max`` rules (absolute bounds set at the baseline's known level).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Literal

import gymnasium
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from envs.core import TaskSpec
from envs.registry import make
from envs.runner import Policy, Sampling, run_episodes
from evals.gates import Criterion, Decision, decide
from evals.run import EvalRecord, run_eval
from trajectories import Episode
from trajectories.hashing import canonical_hash

Stage = Literal["offline", "shadow", "canary", "promote"]
ARTIFACT_CHANGED = "artifact changed after evaluation"


# ---------------------------------------------------------------------------------------------
# Bundles and live state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A servable bundle: ``run`` reads only these four attributes (any object having them works).

    ``current_hash`` re-reads and verifies the whole artifact now and returns its content hash,
    raising (naming the bad file) when it does not verify (e.g. ``partial(
    agent_rl.run.checkpoint.verify_bundle, path)``), so weights swapped or corrupted after
    evaluation are caught.
    """

    name: str
    bundle_hash: str
    policy: Policy
    current_hash: Callable[[], str]


class LiveEvent(BaseModel):
    """One promotion or rollback."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["promote", "rollback"]
    serving_before: str
    serving_after: str
    reason: str
    store_hash: str = Field(description="the live store's hash right after the event")


class LiveSnapshot(BaseModel):
    """A deep copy of the live state, with the hashes a restore is checked against."""

    model_config = ConfigDict(frozen=True)

    store: dict[str, Any]
    conversations: list[dict[str, Any]]
    serving: str
    store_hash: str
    conversations_hash: str


class LiveSystem(BaseModel):
    """Production state that persists across episodes (mutable; ``store`` is the live store)."""

    model_config = ConfigDict(extra="forbid")

    store: dict[str, Any] = Field(default_factory=dict, description="the env's state type")
    conversations: list[dict[str, Any]] = Field(default_factory=list,
                                                description="one entry per served episode")
    serving: str = Field(description="bundle hash in production")
    canary: str | None = Field(None, description="bundle hash on the canary share, while it runs")
    history: list[LiveEvent] = Field(default_factory=list, description="promotions, rollbacks")

    @field_validator("store", "conversations", mode="before")
    @classmethod
    def _own(cls, value: Any) -> Any:
        return copy.deepcopy(value)  # the live system owns its state; callers keep theirs

    def store_hash(self) -> str:
        return canonical_hash(self.store)

    def conversations_hash(self) -> str:
        return canonical_hash(self.conversations)

    def snapshot(self) -> LiveSnapshot:
        return LiveSnapshot(store=copy.deepcopy(self.store),
                            conversations=copy.deepcopy(self.conversations),
                            serving=self.serving, store_hash=self.store_hash(),
                            conversations_hash=self.conversations_hash())

    def restore(self, snapshot: LiveSnapshot) -> None:
        """Put the snapshot back, in place (holders of ``store`` see the restored records)."""
        self.store.clear()
        self.store.update(copy.deepcopy(snapshot.store))
        self.conversations[:] = copy.deepcopy(snapshot.conversations)
        self.serving, self.canary = snapshot.serving, None


class RollbackError(RuntimeError):
    """A restore did not reproduce the snapshot: live state is not what it was."""


class DrillReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    serving: str
    store_hash: str
    conversations_hash: str
    store_hash_before: str = Field(description="live store hash before the restore")


def rollback_drill(live: LiveSystem, to_snapshot: LiveSnapshot, reason: str = "drill") -> DrillReport:
    """Restore ``to_snapshot`` (its bundle, conversation log and tool effects), verify the restored
    hashes equal the snapshot's, and record the rollback in ``live.history``.

    Raises ``RollbackError`` when the restored store or log does not hash to the snapshot's.
    """
    before, serving_before = live.store_hash(), live.serving
    live.restore(to_snapshot)
    store, log = live.store_hash(), live.conversations_hash()
    if store != to_snapshot.store_hash or log != to_snapshot.conversations_hash:
        raise RollbackError(f"restore did not reproduce the snapshot: store {store} (want "
                            f"{to_snapshot.store_hash}), log {log} (want "
                            f"{to_snapshot.conversations_hash})")
    live.history.append(LiveEvent(kind="rollback", serving_before=serving_before,
                                  serving_after=live.serving, reason=reason, store_hash=store))
    return DrillReport(serving=live.serving, store_hash=store, conversations_hash=log,
                       store_hash_before=before)


class LiveStore(gymnasium.Wrapper):
    """Points a store env (state = a dict copied from ``task.data``) at a shared ``store``
    (with ``per_task``: at ``store[task_id]``).

    On reset the task is rebased onto the store as it is now, so scoring and ``tool_effects``
    see this episode's diff; the tools then act on ``store`` itself. Finished episodes are
    appended to ``log`` (when given) as conversation entries served by ``served_by``.
    """

    def __init__(self, env: gymnasium.Env, store: dict[str, Any], served_by: str,
                 log: list[dict[str, Any]] | None = None, stage: str = "",
                 latencies: dict[str, float] | None = None, per_task: bool = False):
        super().__init__(env)
        self.store, self.served_by, self.log, self.stage = store, served_by, log, stage
        self.latencies = latencies if latencies is not None else {}
        self.per_task, self._t0 = per_task, 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = dict(options or {})
        task = options["task"]
        task = task if isinstance(task, TaskSpec) else TaskSpec.model_validate(task)
        state = self.store[task.task_id] if self.per_task else self.store
        options["task"] = task.model_copy(update={"data": copy.deepcopy(state)})
        self._t0 = time.perf_counter()
        obs, info = self.env.reset(seed=seed, options=options)
        self.env.unwrapped.state = state
        return obs, info

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            episode: Episode = info["episode"]
            self.latencies[episode.episode_id] = time.perf_counter() - self._t0
            if self.log is not None:
                self.log.append({
                    "episode_id": episode.episode_id, "task_id": episode.task_id,
                    "served_by": self.served_by, "stage": self.stage,
                    "sessions": {s.session_id: s.messages() for s in episode.sessions},
                    "tool_calls": sum(t.role == "tool" for s in episode.sessions
                                      for t in s.turns),
                    "tool_effects": episode.tool_effects})
        return obs, reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------
# The plan and the result
# ---------------------------------------------------------------------------------------------


class CanaryPlan(BaseModel):
    """What a release runs: tasks and criteria per stage, the traffic split, the live system."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    env_id: str = Field(description="the live env (shadow and canary); its state is a dict store")
    offline_env_id: str | None = Field(None, description="env of the offline gate; None: env_id")
    offline_tasks: list[TaskSpec] = Field(description="held-out tasks of the offline gate")
    criteria: list[Criterion] = Field(description="offline gate (and shadow, unless overridden)")
    samples_per_task: int = Field(1, ge=1, description="offline samples per task")
    shadow_tasks: list[TaskSpec] = Field(description="mirrored traffic run against store copies")
    shadow_criteria: list[Criterion] | None = Field(None, description="None: `criteria`")
    live_tasks: list[TaskSpec] = Field(description="live traffic, served in order")
    canary_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="share of live traffic "
                                   "served by the candidate (at least one task)")
    canary_criteria: list[Criterion] = Field(description="min/max rules on the candidate's share")
    canary_allowed_tools: list[str] | None = Field(
        None, description="tools the candidate may call on live traffic; None: the task's own")
    canary_writes: Literal["task_scope", "none"] = Field(
        "task_scope", description="task_scope: only the ids the task declares (a task with no "
                                  "declared scope gets none); none: no writes at all")
    store_per_task: bool = Field(False, description="live.store is {task_id: store} and each "
                                 "episode acts on its task's entry (tasks that carry their own "
                                 "stores, as Records-v0); False: one store shared by all tasks")
    sampling: Sampling = Field(default_factory=Sampling)
    seed: int = Field(0, description="episode seeds and the traffic split")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="for every env made")
    n_boot: int = Field(10000, ge=1, description="bootstrap draws per criterion")
    conf: float = Field(0.95, gt=0.0, lt=1.0, description="interval coverage")
    live: LiveSystem

    @model_validator(mode="after")
    def _check(self) -> CanaryPlan:
        paired = [c.name for c in self.canary_criteria if c.kind == "no_regression"]
        if paired:
            raise ValueError(f"canary criteria {paired} are no_regression, but the canary arms "
                             "serve different tasks, so they would never pair (always "
                             "inconclusive); use min/max bounds at the baseline's level")
        if not self.canary_criteria:
            raise ValueError("canary_criteria is empty: a gate with no criteria passes anything")
        missing = [t.task_id for t in self.shadow_tasks + self.live_tasks
                   if self.store_per_task and t.task_id not in self.live.store]
        if missing:
            raise ValueError(f"store_per_task: live.store has no store for tasks {missing[:5]}")
        return self


class ShadowComparison(BaseModel):
    """What the shadow stage compared, task by task, each arm on its own copy of the live store."""

    model_config = ConfigDict(frozen=True)

    tasks: int
    tool_calls: dict[str, int] = Field(description="arm (candidate | baseline) -> tool calls")
    writing_tasks: dict[str, int] = Field(description="arm -> tasks with store writes")
    differing: list[str] = Field(description="task ids whose tool effects differ between arms")

    def summary(self) -> str:
        arms = "; ".join(f"{arm} {self.tool_calls[arm]} tool calls, writes on "
                         f"{self.writing_tasks[arm]} tasks" for arm in self.tool_calls)
        listed = f" ({', '.join(self.differing[:5])}{', ...' if len(self.differing) > 5 else ''})"
        return (f"compared {self.tasks} tasks on store copies: {arms}; tool effects differ "
                f"on {len(self.differing)}{listed if self.differing else ''}")


class StageReport(BaseModel):
    """One stage: the gate's decision (or the promote check), reasons, records, state hashes."""

    model_config = ConfigDict(frozen=True)

    stage: Stage
    status: Literal["pass", "fail", "inconclusive"]
    reasons: list[str]
    decision: Decision | None = None
    candidate_records: list[EvalRecord] = Field(default_factory=list)
    baseline_records: list[EvalRecord] = Field(default_factory=list)
    hashes: dict[str, str] = Field(default_factory=dict, description="live/shadow store hashes")
    compared: ShadowComparison | None = Field(None, description="shadow: what was compared")


class CanaryResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    status: Literal["promoted", "rolled_back", "stopped"]
    stage: Stage = Field(description="the last stage reached")
    stages: list[StageReport]
    serving: str = Field(description="bundle hash served at the end")
    store_hash: str = Field(description="live store hash at the end")
    rollback: DrillReport | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{s.stage}: {r}" for s in self.stages for r in s.reasons]


# ---------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------


def _serve(who: Candidate, tasks: Sequence[TaskSpec], env: LiveStore, sampling: Sampling,
           seed: int) -> list[EvalRecord]:
    """Run ``tasks`` one after another on ``env`` (a shared store), hint-free; one record per
    episode."""
    episodes = run_episodes([env], tasks, who.policy, sampling, seed=seed, hints=False)
    return [EvalRecord.from_episode(ep, who.name, who.bundle_hash,
                                    env.latencies.get(ep.episode_id, 0.0)) for ep in episodes]


def _restricted(task: TaskSpec, plan: CanaryPlan) -> TaskSpec:
    tools = task.allowed_tools
    if plan.canary_allowed_tools is not None:
        allowed = set(plan.canary_allowed_tools)
        tools = [t for t in (tools if tools is not None else plan.canary_allowed_tools)
                 if t in allowed]
    scopes = [] if plan.canary_writes == "none" else list(task.write_scopes or [])
    return task.model_copy(update={"allowed_tools": tools, "write_scopes": scopes})


def canary_split(n: int, fraction: float, seed: int) -> list[bool]:
    """Which of ``n`` traffic tasks the candidate serves: round(fraction * n) (at least 1), seeded."""
    k = min(n, max(1, round(fraction * n)))
    chosen = set(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())
    return [i in chosen for i in range(n)]


def _offline(candidate: Candidate, baseline: Candidate, plan: CanaryPlan) -> StageReport:
    env_id = plan.offline_env_id or plan.env_id
    cand, base = (run_eval(who.policy, env_id, plan.offline_tasks, plan.sampling, plan.seed,
                           plan.samples_per_task, plan.env_kwargs, who.name,
                           who.bundle_hash).records
                  for who in (candidate, baseline))
    decision = decide(cand, plan.criteria, base, plan.n_boot, plan.seed, plan.conf)
    return StageReport(stage="offline", status=decision.status, reasons=decision.reasons,
                       decision=decision, candidate_records=cand, baseline_records=base)


def _shadow(candidate: Candidate, baseline: Candidate, plan: CanaryPlan) -> StageReport:
    live = plan.live
    live_before, log_before = live.store_hash(), live.conversations_hash()
    copies = {who.bundle_hash: copy.deepcopy(live.store) for who in (candidate, baseline)}
    records, logs = [], []
    for who in (candidate, baseline):
        logs.append([])
        env = LiveStore(make(plan.env_id, **plan.env_kwargs), copies[who.bundle_hash],
                        who.bundle_hash, logs[-1], stage="shadow", per_task=plan.store_per_task)
        try:
            records.append(_serve(who, plan.shadow_tasks, env, plan.sampling, plan.seed))
        finally:
            env.close()
    cand, base = records
    effects = [{e["task_id"]: e["tool_effects"] for e in log} for log in logs]
    compared = ShadowComparison(
        tasks=len(plan.shadow_tasks),
        tool_calls={arm: sum(e["tool_calls"] for e in log)
                    for arm, log in zip(("candidate", "baseline"), logs, strict=True)},
        writing_tasks={arm: sum(map(bool, eff.values()))
                       for arm, eff in zip(("candidate", "baseline"), effects, strict=True)},
        differing=[t.task_id for t in plan.shadow_tasks
                   if effects[0].get(t.task_id) != effects[1].get(t.task_id)])
    hashes = {"live_before": live_before, "live_after": live.store_hash(),
              "shadow_after": canonical_hash(copies[candidate.bundle_hash]),
              "baseline_shadow_after": canonical_hash(copies[baseline.bundle_hash])}
    decision = decide(cand, plan.shadow_criteria or plan.criteria, base, plan.n_boot,
                      plan.seed, plan.conf)
    status, reasons = decision.status, list(decision.reasons)
    untouched = hashes["live_after"] == live_before and live.conversations_hash() == log_before
    if not untouched:
        status = "fail"
        reasons.insert(0, f"FAIL shadow wrote to the live system: store {live_before} -> "
                          f"{hashes['live_after']}")
    else:
        reasons.append(f"live store unchanged by shadow ({live_before[:12]}); candidate's "
                       f"shadow copy {hashes['shadow_after'][:12]}")
    reasons.append(compared.summary())
    return StageReport(stage="shadow", status=status, reasons=reasons, decision=decision,
                       candidate_records=cand, baseline_records=base, hashes=hashes,
                       compared=compared)


def _canary(candidate: Candidate, baseline: Candidate, plan: CanaryPlan) -> StageReport:
    live = plan.live
    live_before = live.store_hash()
    live.canary = candidate.bundle_hash
    to_candidate = canary_split(len(plan.live_tasks), plan.canary_fraction, plan.seed)
    pool = {who.bundle_hash: LiveStore(make(plan.env_id, **plan.env_kwargs), live.store,
                                       who.bundle_hash, live.conversations, stage="canary",
                                       per_task=plan.store_per_task)
            for who in (candidate, baseline)}
    records: dict[str, list[EvalRecord]] = {candidate.bundle_hash: [], baseline.bundle_hash: []}
    try:  # serve in traffic order, one run of consecutive same-arm tasks at a time
        for arm, run_ in groupby(range(len(plan.live_tasks)), key=to_candidate.__getitem__):
            positions = list(run_)
            who = candidate if arm else baseline
            tasks = [_restricted(plan.live_tasks[i], plan) if arm else plan.live_tasks[i]
                     for i in positions]
            records[who.bundle_hash] += _serve(who, tasks, pool[who.bundle_hash],
                                               plan.sampling, plan.seed + positions[0])
    finally:
        for env in pool.values():
            env.close()
    cand, base = records[candidate.bundle_hash], records[baseline.bundle_hash]
    decision = decide(cand, plan.canary_criteria, base, plan.n_boot, plan.seed, plan.conf)
    reasons = [*decision.reasons, f"candidate served {len(cand)} of {len(plan.live_tasks)} "
               f"live tasks, baseline {len(base)}"]
    return StageReport(stage="canary", status=decision.status, reasons=reasons,
                       decision=decision, candidate_records=cand, baseline_records=base,
                       hashes={"live_before": live_before, "live_after": live.store_hash()})


def _promote(candidate: Candidate, plan: CanaryPlan) -> StageReport:
    live = plan.live
    try:
        current = candidate.current_hash()
    except Exception as exc:  # e.g. agent_rl.run.checkpoint.BundleError, naming the file
        return StageReport(stage="promote", status="fail", reasons=[
            f"FAIL the artifact does not verify now: {exc}; refused"])
    if current != candidate.bundle_hash:
        return StageReport(stage="promote", status="fail", reasons=[
            f"{ARTIFACT_CHANGED}: evaluated {candidate.bundle_hash}, the artifact now hashes "
            f"to {current}; refused"])
    before = live.serving
    live.serving, live.canary = candidate.bundle_hash, None
    live.history.append(LiveEvent(kind="promote", serving_before=before,
                                  serving_after=live.serving, reason=f"promoted {candidate.name}",
                                  store_hash=live.store_hash()))
    return StageReport(stage="promote", status="pass",
                       reasons=[f"promoted {candidate.name} ({candidate.bundle_hash}) over {before}"])


def _crashed(stage: Stage, exc: Exception) -> StageReport:
    return StageReport(stage=stage, status="fail",
                       reasons=[f"FAIL {stage} crashed: {type(exc).__name__}: {exc}"])


def run(candidate: Candidate, baseline: Candidate, plan: CanaryPlan) -> CanaryResult:
    """Offline gate -> shadow -> canary -> promote; see the module docstring."""
    live = plan.live
    if live.serving != baseline.bundle_hash:
        raise ValueError(f"the baseline must be what is served: live.serving is {live.serving}, "
                         f"baseline.bundle_hash is {baseline.bundle_hash}")
    if candidate.bundle_hash == baseline.bundle_hash:
        raise ValueError(f"candidate and baseline are the same bundle ({baseline.bundle_hash})")
    stages: list[StageReport] = []

    def end(status: str, snapshot: LiveSnapshot | None = None) -> CanaryResult:
        drill = None
        if snapshot is not None:
            last = stages[-1]
            why = next((r for r in last.reasons if not r.startswith("PASS")), "")
            drill = rollback_drill(live, snapshot, reason=f"{last.stage} {last.status}: {why}")
        return CanaryResult(status=status, stage=stages[-1].stage, stages=stages,
                            serving=live.serving, store_hash=live.store_hash(), rollback=drill)

    current = candidate.current_hash()
    if current != candidate.bundle_hash:
        stages.append(StageReport(stage="offline", status="fail", reasons=[
            f"the artifact hashes to {current}, not the candidate's bundle_hash "
            f"{candidate.bundle_hash}; not evaluated"]))
        return end("stopped")
    stages.append(_offline(candidate, baseline, plan))
    if stages[-1].status != "pass":
        return end("stopped")

    before_shadow = live.snapshot()
    try:
        stages.append(_shadow(candidate, baseline, plan))
    except Exception as exc:  # a crash is a failed gate: roll back, report it
        stages.append(_crashed("shadow", exc))
    if stages[-1].status != "pass":
        return end("rolled_back", before_shadow)

    before_canary = live.snapshot()
    try:
        stages.append(_canary(candidate, baseline, plan))
    except Exception as exc:
        stages.append(_crashed("canary", exc))
    if stages[-1].status != "pass":
        return end("rolled_back", before_canary)

    stages.append(_promote(candidate, plan))
    if stages[-1].status != "pass":
        return end("rolled_back", before_canary)
    return end("promoted")


# ---------------------------------------------------------------------------------------------
# A release from held-out tasks (what `agent-rl canary` runs)
# ---------------------------------------------------------------------------------------------

MARGIN = 0.05
"""Allowed drop of held-out reward against the baseline, offline and in shadow."""


def live_task_count(n: int, fraction: float) -> int:
    """Live tasks enough that the candidate's share of them (``fraction``) is about ``n``."""
    if not 0 < fraction < 1:
        raise ValueError(f"canary fraction must be in (0, 1), got {fraction}")
    return math.ceil(n / fraction)


def release_criteria(acceptance) -> tuple[list[Criterion], list[Criterion]]:
    """(offline/shadow criteria, canary criteria) from a contract's ``acceptance`` section (an
    ``agent_rl.run.contract.AcceptanceSection``): no held-out reward regression beyond ``MARGIN``,
    plus the acceptance bounds; the canary arms serve different tasks, so it keeps only the
    min/max bounds."""
    from evals.gates import criteria_from_acceptance

    bounds = criteria_from_acceptance(acceptance.holdout_min, acceptance.max_error_rate)
    gate = [Criterion(name="no reward regression", metric="reward/mean", kind="no_regression",
                      margin=MARGIN), *bounds,
            *criteria_from_acceptance(critical_slices=acceptance.critical_slices, margin=MARGIN)]
    return gate, bounds


def release_plan(env_id: str, tasks: Sequence[TaskSpec], n: int, fraction: float,
                 acceptance, max_new_tokens: int, seed: int, live_serving: str,
                 env_kwargs: dict[str, Any] | None = None) -> CanaryPlan:
    """A plan from held-out ``tasks``: the first ``n`` for the offline gate, mirrored again in
    shadow against copies of the live store; live: the rest (``live_task_count(n,
    fraction)`` of them make the candidate's share about ``n``). Tasks that carry their own
    stores (Records-v0) each act on their own entry of the live store (``store_per_task``).
    Greedy, ``max_new_tokens`` a reply."""
    live_task_count(n, fraction)  # the fraction, checked
    shadow, live = list(tasks[:n]), list(tasks[n:])
    if not live:
        raise ValueError(f"{len(tasks)} held-out tasks of {env_id}: too few for {n} offline and "
                         "shadow tasks and a live stage; lower n (or raise env.pool_size)")
    per_task = len({canonical_hash(t.data) for t in tasks}) > 1
    store = {t.task_id: t.data for t in tasks} if per_task else live[0].data
    gate, bounds = release_criteria(acceptance)
    return CanaryPlan(env_id=env_id, offline_tasks=shadow, criteria=gate, shadow_tasks=shadow,
                      live_tasks=live, canary_fraction=fraction, canary_criteria=bounds,
                      store_per_task=per_task,
                      sampling=Sampling(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed),
                      seed=seed, env_kwargs=env_kwargs or {},
                      live=LiveSystem(store=store, serving=live_serving))
