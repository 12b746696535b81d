"""Difficulty filter (Kimi k1.5's best-of-k pass rate): train on the tasks the rollout policy
solves sometimes, not always or never.

``curriculum: {filter: pass_rate, k, min, max, every, pool}`` in the contract; the trainer calls
``estimation_pool`` -> ``estimate_pass_rates`` -> ``select`` once per round and draws every
step's tasks from the kept ones only (``Selection.tasks``).

1. Rounds. Round 0 runs before step 1. With ``every = N > 0`` round r runs before step
   ``r * N + 1``, with the weights after step ``r * N``; ``every = 0``: round 0 only.
2. Pool (the cost cap). Round r estimates at most ``pool`` train tasks: the first ``pool`` of
   the permutation ``numpy.random.default_rng([optim.seed, r])`` of the train split (all of it
   when the split is no larger). Only kept pool tasks are trained on; a task outside the pool is
   not drawn until a later round's pool holds it (with ``every > 0`` each round draws anew).
3. Estimate. Every pool task is sampled k times by the rollout policy at the rollout's sampling
   settings (temperature, top_p, response and prompt limits) through ``envs.runner.run_episodes``
   in batches of the rollout's size (tasks_per_step x group_size), in envs built from
   ``env.kwargs`` (an annealed ``hints`` schedule is not applied: the estimate shows no hint),
   on a random stream of its own: ``Sampling.seed = stream_seed(optim.seed, CURRICULUM_STREAM,
   r)``, run seed = the job index (several ranks estimate contiguous shards of the pool, seeded
   as a whole, and gather the estimates). A sample *passes*
   when its outcome is ``Outcome.correct`` (the verifier's own verdict: the "correct" of the
   length reward); partial credit never passes. Infrastructure faults (``sandbox_error``) are no
   samples: they neither pass nor fail. ``pass_rate = passes / valid samples``; a task without
   a valid sample has no rate and is dropped.
4. Band. A task is kept iff ``min <= pass_rate <= max``: both edges inclusive (``min: 0.0``
   keeps never-solved tasks, ``max: 1.0`` always-solved ones). Round 0 keeping nothing is a
   ``CurriculumError`` raised before the run directory is written, saying what to change; a later round keeping
   nothing keeps the previous round's tasks (recorded as ``kept_previous``).
5. Cost. Every token the estimate generates is rollout budget: the trainer adds it to the run's
   token counter (``total/tokens_generated``) and logs it as ``curriculum/tokens_generated`` on
   the step the round precedes (0 on other steps), with ``curriculum/kept|dropped|round``.
6. Record. One line per round in the run directory's ``curriculum.jsonl`` (``Selection.record``):
   the band, every estimated task's passes, samples and rate, and a per-difficulty
   (``TaskMeta.difficulty``) count of estimated, kept, too hard (< min), too easy (> max).
7. Resume. The round in force travels in the checkpoint (``Selection.state``, estimates
   included) and is reloaded (``Selection.from_state``), never re-estimated: its weights are
   gone by then. A round starting after the checkpoint is estimated as the killed run did (same
   weights, same seeds), and its record, cut from ``curriculum.jsonl`` by the rewind, written
   again.

Where this departs from Kimi k1.5: Kimi rates difficulty once, offline, with the SFT model (10
samples at a high temperature) and then samples by difficulty and prioritises failures; here
the rate comes from the rollout policy at its own sampling settings, the band is a hard filter,
and ``every > 0`` re-rates with the current policy.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from envs.core import TaskSpec
from envs.runner import Policy, Sampling, run_episodes, stream_seed
from trajectories import Outcome

CURRICULUM_STREAM = 0x6375_7272  # "curr": the key of the estimate's random stream (step 3)


class CurriculumError(ValueError):
    """The difficulty band keeps no task; the message says which setting to change."""


def round_of(step: int, every: int) -> int:
    """The round whose band step ``step`` trains on (step 1 of the module docstring)."""
    return (step - 1) // every if every else 0


def due(selection: Selection | None, step: int, every: int) -> bool:
    """Whether step ``step`` needs a new round: none yet, or the one held has ended."""
    return selection is None or selection.round != round_of(step, every)


def round_start(round_: int, every: int) -> int:
    """The first step trained on round ``round_``'s band."""
    return round_ * every + 1


def round_sampling(sampling: Sampling, seed: int, round_: int) -> Sampling:
    """The rollout's sampling settings on the estimate's own random stream (step 3)."""
    return replace(sampling, seed=stream_seed(seed, CURRICULUM_STREAM, round_), streams=None)


def estimation_pool(tasks: Sequence[TaskSpec], size: int, seed: int, round_: int) -> list[TaskSpec]:
    """At most ``size`` of ``tasks``, the first of a permutation seeded by (seed, round) (step 2)."""
    order = np.random.default_rng([seed, round_]).permutation(len(tasks))
    return [tasks[int(i)] for i in order[:size]]


@dataclass(frozen=True)
class TaskEstimate:
    """One task's k samples: how many passed (``Outcome.correct``) out of the valid ones."""

    task_id: str
    difficulty: Any  # TaskMeta.difficulty
    passes: int
    samples: int  # valid samples: infrastructure faults left out
    faults: int = 0
    tokens: int = 0  # every generated token of its samples

    @property
    def pass_rate(self) -> float | None:
        return self.passes / self.samples if self.samples else None


def estimate_pass_rates(policy: Policy, env_id: str, tasks: Sequence[TaskSpec], *, k: int,
                        sampling: Sampling, seed: int = 0,
                        env_kwargs: dict[str, Any] | None = None, num_envs: int = 16,
                        group_prefix: str = "curriculum/") -> list[TaskEstimate]:
    """Step 3: ``k`` samples of every task (job i*k + j resets with ``seed + i*k + j``, so a
    shard passes ``seed`` = its first global job index), one estimate per task, in order."""
    episodes = run_episodes(env_id, tasks, policy, sampling=sampling, samples_per_task=k,
                            num_envs=num_envs, seed=seed, env_kwargs=env_kwargs,
                            group_prefix=group_prefix)
    by_task: dict[str, list] = defaultdict(list)
    for e in episodes:
        by_task[e.task_id].append(e)
    out = []
    for task in tasks:
        mine = by_task[task.task_id]
        valid = [e for e in mine if not e.reward.is_infrastructure_fault]
        out.append(TaskEstimate(
            task.task_id, task.meta.difficulty,
            passes=sum(e.reward.outcome == Outcome.correct for e in valid), samples=len(valid),
            faults=len(mine) - len(valid),
            tokens=sum(s.generated_tokens for e in mine for s in e.sessions)))
    return out


def in_band(rate: float | None, lo: float, hi: float) -> bool:
    """Step 4: ``lo <= rate <= hi``, edges included; no rate is never in the band."""
    return rate is not None and lo <= rate <= hi


@dataclass(frozen=True)
class Selection:
    """One round's result: the band, its estimates and the task ids the sampler draws from."""

    round: int
    step: int  # the first step trained on it
    band: tuple[float, float]
    estimates: list[TaskEstimate]
    kept: list[str]  # what the sampler draws: the in-band ids, or the previous round's
    kept_previous: bool = False
    k: int = 0
    by_difficulty: dict[str, dict[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lo, hi = self.band
        table: dict[str, Counter] = defaultdict(Counter)
        for e in self.estimates:
            rate, row = e.pass_rate, table[str(e.difficulty)]
            row["estimated"] += 1
            row["kept"] += in_band(rate, lo, hi)
            row["too_hard"] += rate is not None and rate < lo
            row["too_easy"] += rate is not None and rate > hi
            row["no_rate"] += rate is None
        object.__setattr__(self, "by_difficulty", {
            d: {**{key: 0 for key in ("estimated", "kept", "too_hard", "too_easy", "no_rate")},
                **row, "dropped": row["estimated"] - row["kept"]}
            for d, row in sorted(table.items())})

    @property
    def dropped(self) -> list[str]:
        return [e.task_id for e in self.estimates if not in_band(e.pass_rate, *self.band)]

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.estimates)

    def tasks(self, train_tasks: Sequence[TaskSpec]) -> list[TaskSpec]:
        """The kept train tasks, in their split order (the TaskSampler's list)."""
        kept = set(self.kept)
        return [t for t in train_tasks if t.task_id in kept]

    def metrics(self, step: int) -> dict[str, Any]:
        """The ``curriculum/*`` metrics of step ``step`` (step 5)."""
        return {"curriculum/round": self.round, "curriculum/kept": len(self.kept),
                "curriculum/dropped": len(self.dropped),
                "curriculum/tokens_generated": self.tokens if step == self.step else 0}

    def record(self) -> dict[str, Any]:
        """Its ``curriculum.jsonl`` line (step 6)."""
        lo, hi = self.band
        return {"step": self.step, "round": self.round, "k": self.k, "min": lo, "max": hi,
                "estimated": len(self.estimates), "kept": len(self.kept),
                "dropped": len(self.dropped), "kept_previous": self.kept_previous,
                "tokens_generated": self.tokens, "by_difficulty": self.by_difficulty,
                "tasks": [{**asdict(e), "pass_rate": e.pass_rate,
                           "kept": in_band(e.pass_rate, lo, hi)} for e in self.estimates],
                "kept_task_ids": list(self.kept)}

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of it (step 7): plain JSON."""
        return {"round": self.round, "step": self.step, "band": list(self.band), "k": self.k,
                "estimates": [asdict(e) for e in self.estimates], "kept": list(self.kept),
                "kept_previous": self.kept_previous}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Selection:
        return cls(state["round"], state["step"], tuple(state["band"]),
                   [TaskEstimate(**e) for e in state["estimates"]], list(state["kept"]),
                   state["kept_previous"], state["k"])


def select(estimates: Sequence[TaskEstimate], lo: float, hi: float, *, round_: int, step: int,
           k: int, previous: Sequence[str] | None = None) -> Selection:
    """Step 4: keep the estimates in ``[lo, hi]``. None kept: the ``previous`` round's ids when
    given, else a ``CurriculumError`` saying what to change."""
    kept = [e.task_id for e in estimates if in_band(e.pass_rate, lo, hi)]
    if kept or previous is None:
        if not kept:
            raise CurriculumError(empty_band_message(estimates, lo, hi, k))
        return Selection(round_, step, (lo, hi), list(estimates), kept, False, k)
    return Selection(round_, step, (lo, hi), list(estimates), list(previous), True, k)


def empty_band_message(estimates: Sequence[TaskEstimate], lo: float, hi: float, k: int) -> str:
    rates = Counter(e.pass_rate for e in estimates)
    shown = ", ".join(f"{'none' if r is None else f'{r:g}'} on {n}" for r, n in
                      sorted(rates.items(), key=lambda item: -1.0 if item[0] is None else item[0]))
    below = all(e.pass_rate is not None and e.pass_rate < lo for e in estimates)
    above = all(e.pass_rate is not None and e.pass_rate > hi for e in estimates)
    hint = ("lower curriculum.min (0.0 keeps tasks the policy never solves)" if below else
            "raise curriculum.max (1.0 keeps tasks the policy always solves)" if above else
            "widen curriculum.min / curriculum.max")
    return (f"curriculum: none of the {len(estimates)} estimated tasks has a pass rate in "
            f"[{lo:g}, {hi:g}] with k={k} samples each (pass rates: {shown or 'no task'}); "
            f"{hint}, raise curriculum.k or curriculum.pool, or set curriculum.filter: none")
