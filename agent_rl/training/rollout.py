"""From a policy and tasks to training sequences: rollout -> filter -> credit -> advantages -> render.

0. Hints (optional, the contract's ``hints``): annealed task hints, shown on a decaying share of
   the training episodes. Steps count from 1; with t = min(s - 1, over_steps) / over_steps the
   share of step s is (``hint_share``)::

       constant: start
       linear:   (1 - t) * start + t * end       (start at step 1, end from step over_steps + 1)
       step:     start for s <= over_steps, end after

   e.g. linear 1.0 -> 0.0 over 10: steps 1, 2, 6, 10, 11, 50 -> 1.0, 0.9, 0.5, 0.1, 0.0, 0.0.
   Of the step's J jobs (task i, sample j -> job i * G + j, the step's tasks in sampler order,
   before any sharding) exactly n = floor(share * J + 1/2) show their task's hint (half rounds
   up): the first n of ``numpy.random.default_rng([seed, s, HINT_STREAM]).permutation(J)``
   (``hinted_jobs``), so a step's hinted jobs are a pure function of (seed, step, J) and a
   resumed run shows what the killed one would have. A job whose task has no hint is unhinted
   (``Episode.hint`` None) and counted so. Every shown hint keeps the task's ``text`` and
   ``provenance`` and gets ``shown: True`` (the env) and ``schedule: {schedule, step, share}``
   (here). A group may mix hinted and unhinted episodes; they share the group baseline.
   Held-out evaluation never shows hints (``evals.run``).
1. Collect: ``envs.runner.run_episodes`` with G samples per task (a group shares
   ``group_id``); every episode, kept or not, carries its ``filter`` decision (the trainer
   appends them all to the RolloutStore when it takes the batch).
2. Overlong responses (any assistant turn cut with ``finish_reason == "length"``) follow
   ``truncation``: ``mask`` keeps the episode in its group's baseline but gives its sequences
   loss weight 0 (DAPO's overlong filtering); ``penalize`` replaces its reward by
   ``truncation_penalty`` (component ``overlong``); ``keep`` leaves it alone.
3. Infrastructure faults (outcome ``sandbox_error``) are never scored as wrong: they leave the
   group and the loss, and are counted.
4. Length reward (Kimi k1.5's length penalty, optional: ``length_weight`` w > 0,
   ``reward_shaping.length`` in the contract). Within a group's valid episodes, with len_i the
   episode's generated tokens (every policy-sampled token of *all* its sessions: root,
   compression continuations, branches, summaries included; prompts and tool results are not)
   and min_len / max_len their extremes::

       lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)      (0 for all when max = min)
       length_i = lambda_i if outcome_i is correct else min(0, lambda_i)

   "Correct" is ``Outcome.correct``; every other outcome (wrong, format_error, truncated, ...)
   is not. ``length`` becomes a component of the episode's RewardBreakdown with weight w, so
   ``total = task total + w * length_i``; the task total is kept in
   ``reward.audit["length_shaping"]["unshaped_total"]`` (``task_total``) with len_i, lambda_i and
   the group's extremes. That is the paper's rule exactly; it departs in two ways: Kimi warms
   the penalty up (no penalty for the first phase of training, then a constant one) where this
   is constant from step 1, and Kimi's baseline is the group mean without a std division, so
   with ``advantage.std`` other than ``none`` the length term is rescaled with the group's
   spread. Only training rollouts are shaped; held-out evaluation never is.
5. Dynamic sampling (DAPO) drops groups whose valid *task* rewards (``task_total``, before the
   length reward) are all equal: no contrast, no policy gradient. Length contrast alone never
   keeps a group: the std division would blow a 0.1-weighted length spread up to unit-scale
   advantages, training saturated groups only to be short and all-wrong groups to give up early
   (a wrong answer is only ever pushed down, never up). Each drop is recorded with its reason
   (``all_correct``, ``all_wrong``, ``zero_contrast``, ``too_few_valid``); acceptance rates are
   kept per env, skill and difficulty. The budget report counts *all* generated tokens, kept and
   discarded.
6. Credit: ``trajectories.assign`` gives each session its credit; ``session_weights`` gives
   each session a loss weight (``per_episode``: an episode's sessions share weight 1).
7. Advantages (``session_advantages``): the group baseline is over *episodes*. For episode e
   of group g (the G episodes sampled for one task) and its session s::

       A(e, s) = (credit(e, s) - mean_g R) / (std_g R + eps)      (std="none": no division)

   with R the episode rewards (``reward.total``, the length reward included) of the group's
   kept episodes, never the sessions, so an episode cut into more sessions does not pull the
   mean or the spread; a group whose rewards are all equal gives 0 everywhere. Under
   ``broadcast`` this is exactly plain GRPO per episode whatever the session count; under
   ``terminal_only`` the non-final sessions of a rewarded episode are pushed down. A turn-level
   credit (``turn_discount``: one value per assistant turn) is measured against the same
   episode baseline, turn by turn.
8. Render: each session becomes one sequence (``render.render_session``) with its own loss
   mask and old log-probs, carrying its advantage and weight; under a turn-level credit the
   advantage is one per trained token, each token taking its turn's (``token_advantages``).

The group statistics (``all_correct``, ``all_wrong``, ...) are counted over every valid
episode's task reward before dynamic sampling drops anything, so they mean the same with it on
or off, and with the length reward on or off.

A step that trains on no token says why (``empty_reason``). Two causes are the contract's, not
the data's: every episode's first prompt over the prompt limit (nothing generated; the episode
records the prompt's length in ``reward.audit["prompt_tokens"]``: ``prompt_too_long``), or
every episode overlong under ``mask`` (``masked_overlong``); the budget report counts both, and
``guards`` stops a run whose first steps they all block. Groups dropped for having no reward
contrast are the data's (normal on hard tasks).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agent_rl.policies.render import Rendered, render_session
from agent_rl.run.guards import EmptyStep
from agent_rl.training.grpo import GroupBaseline, group_baseline
from envs.core import TaskSpec
from envs.runner import Policy, Sampling, run_episodes
from trajectories import Episode, Outcome, RewardBreakdown, Session, assign, session_weights
from trajectories.assign import assistant_turns

if TYPE_CHECKING:
    from agent_rl.run.contract import ExperimentContract


@dataclass
class TrainSequence:
    """One session rendered for the loss, with its advantage and loss weight."""

    episode_id: str
    session_id: str
    group_id: str
    rendered: Rendered
    advantage: float | torch.Tensor  # one for the session, or [rendered.num_trained] per token
    weight: float
    policy_revision: int | None = None  # optimizer steps of the weights that sampled it


@dataclass
class RolloutBatch:
    episodes: list[Episode]  # every generated episode, with its filter decision
    sequences: list[TrainSequence]
    report: dict[str, Any]
    advantage_stats: dict[str, Any] = field(default_factory=dict)
    drops: list[dict] = field(default_factory=list)  # the dropped groups (filter_groups)

    @property
    def kept(self) -> list[Episode]:
        return [e for e in self.episodes if e.filter and e.filter.get("kept")]


HINT_SCHEDULES = ("constant", "linear", "step")
HINT_STREAM = 0x68696E74  # "hint": keeps the hint draw apart from TaskSampler's [seed, epoch]


def hint_share(step: int, schedule: str, start: float, end: float, over_steps: int) -> float:
    """Step 0 of the module docstring: the share of step ``step``'s (from 1) training
    episodes shown a hint."""
    if step < 1 or over_steps < 1:
        raise ValueError(f"hint_share: step ({step}) and over_steps ({over_steps}) count from 1")
    if schedule == "constant":
        return start
    if schedule == "linear":
        t = min(step - 1, over_steps) / over_steps
        return (1 - t) * start + t * end
    if schedule == "step":
        return start if step <= over_steps else end
    raise ValueError(f"unknown hint schedule {schedule!r}; use one of {', '.join(HINT_SCHEDULES)}")


def hinted_jobs(share: float, jobs: int, seed: int, step: int) -> list[bool]:
    """Which of a step's ``jobs`` show their hint (step 0): exactly floor(share * jobs + 1/2)
    of them, the first of a permutation seeded by (seed, step)."""
    # + 1e-9: a share computed as 0.1 gives 0.1 x 5 = 0.4999999999999999, which rounds to 1
    n = min(jobs, math.floor(share * jobs + 0.5 + 1e-9))
    shown = [False] * jobs
    for k in np.random.default_rng([seed, step, HINT_STREAM]).permutation(jobs)[:n]:
        shown[int(k)] = True
    return shown


def note_hints(episodes: Sequence[Episode], note: dict[str, Any] | None) -> list[Episode]:
    """Step 0's provenance: ``note`` (the schedule, step and share that chose them) recorded as
    ``hint["schedule"]`` on every episode that showed a hint; None leaves them as they are."""
    if note is None:
        return list(episodes)
    return [e.evolve(hint={**e.hint, "schedule": note}) if e.hint else e for e in episodes]


def shown_hint(episode: Episode) -> bool:
    """Did the episode show its task's hint? (What its ``hint`` provenance records.)"""
    return bool(episode.hint and episode.hint.get("shown"))


def is_overlong(episode: Episode) -> bool:
    return any(t.finish_reason == "length" for s in episode.sessions for t in s.turns)


def generated_tokens(episode: Episode) -> int:
    return sum(s.generated_tokens for s in episode.sessions)


def prompt_too_long(episode: Episode) -> bool:
    """Did the episode end before its policy generated a token, its first prompt longer than
    the prompt limit (``Sampling.max_prompt_tokens``)? Nothing of it can be trained."""
    return (generated_tokens(episode) == 0
            and episode.reward.audit.get("truncated_by") == "max_prompt_tokens")


def too_long_prompts(episodes: Sequence[Episode]) -> list[tuple[str, int | None]]:
    """``(task_id, prompt tokens)`` of every episode ``prompt_too_long`` (None where the
    episode did not record its prompt's length)."""
    return [(e.task_id, e.reward.audit.get("prompt_tokens")) for e in episodes if prompt_too_long(e)]


def masked_overlong(episode: Episode) -> bool:
    """Step 2's ``mask``: an overlong episode, in its group's baseline but out of the loss."""
    decided = episode.filter or {}
    return bool(decided.get("overlong")) and decided.get("truncation") == "mask"


TRUNCATIONS = ("mask", "penalize", "keep")


def apply_truncation(episode: Episode, policy: str, penalty: float) -> Episode:
    """Record the overlong policy on the episode; ``penalize`` replaces its reward."""
    if policy not in TRUNCATIONS:
        raise ValueError(f"unknown truncation policy {policy!r}; use one of {', '.join(TRUNCATIONS)}")
    if not is_overlong(episode) or policy == "keep":
        return episode.evolve(filter={"overlong": is_overlong(episode), "truncation": policy})
    if policy == "mask":
        return episode.evolve(filter={"overlong": True, "truncation": "mask"})
    if policy == "penalize":
        reward = RewardBreakdown.from_components(
            {"overlong": 1.0}, {"overlong": penalty}, Outcome.truncated, episode.reward.verifier,
            audit={**episode.reward.audit, "unpenalized": episode.reward.model_dump(mode="json")})
        return episode.evolve(reward=reward, filter={"overlong": True, "truncation": "penalize"})


LENGTH = "length"  # the component name of step 4's length reward


def length_lambdas(lengths: Sequence[int]) -> list[float]:
    """Kimi k1.5's lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len) over one group's
    lengths; 0 for every member when they are all equal."""
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    return [0.5 - (n - lo) / (hi - lo) for n in lengths]


def length_reward(lam: float, correct: bool) -> float:
    """lambda for a correct response, min(0, lambda) otherwise: a wrong answer is pushed down
    for being long but never rewarded for being short."""
    return lam if correct else min(0.0, lam)


def apply_length_reward(episodes: Sequence[Episode], weight: float) -> list[Episode]:
    """Step 4 of the module docstring: the component ``length`` (weight ``weight``) added to
    every valid episode's reward, per group. ``weight`` 0 returns the episodes as they are."""
    if not weight:
        return list(episodes)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(episodes):
        if not e.reward.is_infrastructure_fault:  # a fault leaves its group (step 3)
            groups[e.group_id].append(i)
    shaped = list(episodes)
    for members in groups.values():
        lengths = [generated_tokens(episodes[i]) for i in members]
        for i, n, lam in zip(members, lengths, length_lambdas(lengths), strict=True):
            r = episodes[i].reward
            if LENGTH in r.components:
                raise ValueError(f"episode {episodes[i].episode_id}: its reward ({r.verifier}) "
                                 f"already has a {LENGTH!r} component; length shaping would "
                                 "overwrite it (turn reward_shaping.length off)")
            audit = {"unshaped_total": r.total, "tokens": n, "lambda": lam,
                     "min_tokens": min(lengths), "max_tokens": max(lengths)}
            shaped[i] = episodes[i].evolve(reward=RewardBreakdown.from_components(
                {**r.components, LENGTH: length_reward(lam, r.outcome == Outcome.correct)},
                {**r.weights, LENGTH: weight}, r.outcome, r.verifier,
                audit={**r.audit, "length_shaping": audit}))
    return shaped


def task_total(reward: RewardBreakdown) -> float:
    """The verifier's total before step 4's length reward: what dynamic sampling judges."""
    shaping = reward.audit.get("length_shaping")
    return shaping["unshaped_total"] if shaping else reward.total


def _task_weights(reward: RewardBreakdown) -> dict[str, float]:
    if "length_shaping" not in reward.audit:
        return reward.weights
    return {k: w for k, w in reward.weights.items() if k != LENGTH}


def best_total(episodes: Sequence[Episode]) -> float:
    """The verifier's best total over these episodes (the sum of its positive weights, the
    length reward's left out); an overlong penalty (``truncation="penalize"``) says nothing
    about it. +inf when unknown."""
    return max((sum(w for w in _task_weights(e.reward).values() if w > 0) for e in episodes
                if "unpenalized" not in e.reward.audit), default=math.inf)


def filter_groups(episodes: list[Episode], dynamic_sampling: bool) -> tuple[list[Episode], list[dict]]:
    """Decide, per group, what is trained on. Returns (episodes with `filter.kept`, drops)."""
    groups: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        groups[e.group_id].append(e)
    decided: dict[str, Episode] = {}
    drops = []
    for group_id, members in groups.items():
        valid = [e for e in members if not e.reward.is_infrastructure_fault]
        rewards = {round(task_total(e.reward), 12) for e in valid}  # length contrast alone: none
        reason = None
        if len(valid) < (2 if dynamic_sampling else 1):
            reason = "too_few_valid"
        elif dynamic_sampling and len(rewards) == 1:
            value = next(iter(rewards))
            # a group of penalised episodes is never saturated (best_total is then inf)
            reason = ("all_wrong" if value <= 0.0 else
                      "all_correct" if value >= best_total(valid) - 1e-9 else
                      "zero_contrast")
        if reason:
            drops.append({"group_id": group_id, "reason": reason, "env": members[0].env_id,
                          "skills": members[0].task_meta.get("skills", []),
                          "difficulty": members[0].task_meta.get("difficulty"),
                          "episodes": len(members),
                          "tokens": sum(generated_tokens(e) for e in members)})
        for e in members:
            fault = e.reward.is_infrastructure_fault
            kept = reason is None and not fault
            why = "infrastructure_fault" if fault else (reason or "kept")
            decided[e.episode_id] = e.evolve(filter={**(e.filter or {}), "kept": kept, "reason": why})
    return [decided[e.episode_id] for e in episodes], drops


def acceptance(episodes: list[Episode], drops: list[dict]) -> dict[str, dict[str, float]]:
    """Fraction of groups kept, per env, per skill and per difficulty."""
    dropped = {d["group_id"] for d in drops}
    first: dict[str, Episode] = {}
    for e in episodes:
        first.setdefault(e.group_id, e)
    tallies: dict[str, Counter] = {"env": Counter(), "skill": Counter(), "difficulty": Counter()}
    kept: dict[str, Counter] = {k: Counter() for k in tallies}
    for group_id, e in first.items():
        keys = {"env": [e.env_id], "skill": e.task_meta.get("skills", []),
                "difficulty": [str(e.task_meta.get("difficulty"))]}
        for kind, values in keys.items():
            for v in values:
                tallies[kind][v] += 1
                kept[kind][v] += group_id not in dropped
    return {kind: {v: kept[kind][v] / n for v, n in tallies[kind].items()} for kind in tallies}


NO_GROUPS = {"groups": 0, "zero_contrast": 0, "all_correct": 0, "all_wrong": 0,
             "zero_contrast_other": 0}


class Advantages(dict):
    """``{(episode_id, session_id): advantage}`` with the group statistics (``stats``); an
    advantage is a float, or a tuple with one per assistant turn under a turn-level credit
    (``trajectories.assign.TurnCredit``)."""

    def __init__(self, values: dict[tuple[str, str], float], stats: dict[str, int]):
        super().__init__(values)
        self.stats = stats


def session_advantages(
    episodes: Sequence[Episode],
    assigner: str = "broadcast",
    assigner_params: dict[str, Any] | None = None,
    std: str = "population",
    eps: float = 1e-6,
    scale: str = "group",
) -> Advantages:
    """Step 7 of the module docstring, for every session of ``episodes`` that generated
    tokens. Groups are the episodes' ``group_id``; infrastructure faults must already be out."""
    if not episodes:
        return Advantages({}, dict(NO_GROUPS))
    baseline = _baseline(episodes, [e.reward.total for e in episodes], std, scale, eps)
    keys, credits, members = [], [], []
    for i, e in enumerate(episodes):
        credit = assign(e, assigner, **(assigner_params or {}))
        for s in e.sessions:
            if s.generated_tokens:
                keys.append((e.episode_id, s.session_id))
                credits.append(credit[s.session_id])
                members.append(i)
    if not keys:
        return Advantages({}, baseline.stats)
    turns = [len(c) if isinstance(c, tuple) else 1 for c in credits]  # values per session
    flat = [v for c in credits for v in (c if isinstance(c, tuple) else (c,))]  # [V]
    index = torch.tensor(members).repeat_interleave(torch.tensor(turns))  # [V] each value's episode
    per_value = GroupBaseline(baseline.mean[index], baseline.scale[index],
                              baseline.flat[index], baseline.stats)
    values = iter(per_value.advantages(torch.tensor(flat, dtype=baseline.mean.dtype)).tolist())  # [V]
    out = {key: tuple(next(values) for _ in range(len(c))) if isinstance(c, tuple) else next(values)
           for key, c in zip(keys, credits, strict=True)}
    return Advantages(out, baseline.stats)


def stored_advantages(
    episodes: Iterable[Episode],
    assigner: str = "broadcast",
    assigner_params: dict[str, Any] | None = None,
    std: str = "population",
    eps: float = 1e-6,
) -> Iterator[tuple[Episode, dict[str, float]]]:
    """``episodes`` in the order a rollout store holds them, each with its sessions'
    advantages ``{session_id: advantage}`` as ``build_sequences`` computed them:
    ``session_advantages`` over the kept episodes of its group (consecutive episodes sharing
    ``group_id``: the trainer appends each step's batch whole), scaled by the group's own
    spread (``advantage.scale: group``; a ``batch`` run's step batches are not recorded). An
    episode the trainer did not keep (``filter.kept`` false: a dropped group, a fault), or
    that no trainer filtered (an evaluation's), gets ``{}``. Lazy: a group is computed once
    the next one starts, or the episodes end."""

    def scored(group: list[Episode]) -> Iterator[tuple[Episode, dict[str, float]]]:
        kept = [e for e in group if e.filter and e.filter.get("kept")]
        values = session_advantages(kept, assigner, assigner_params, std=std, eps=eps)
        for e in group:
            yield e, {sid: v for (eid, sid), v in values.items() if eid == e.episode_id}

    group: list[Episode] = []
    for episode in episodes:
        if group and episode.group_id != group[0].group_id:
            yield from scored(group)
            group = []
        group.append(episode)
    yield from scored(group)


def build_sequences(
    tokenizer,
    episodes: list[Episode],
    assigner: str,
    assigner_params: dict[str, Any],
    session_weighting: str,
    std: str,
    scale: str,
    eps: float,
) -> tuple[list[TrainSequence], dict[str, Any]]:
    """Credit -> advantages -> rendered sequences, for the kept episodes."""
    kept = [e for e in episodes if e.filter and e.filter.get("kept")]
    advantages = session_advantages(kept, assigner, assigner_params, std=std, eps=eps, scale=scale)
    sequences = []
    memo: dict = {}  # template renderings shared by the sessions (render._template_ids)
    for e in kept:  # masked overlong episodes served the baseline; they are not rendered
        if masked_overlong(e):
            continue
        weights = session_weights(e, session_weighting)
        for s in e.sessions:
            if (e.episode_id, s.session_id) in advantages:
                rendered = render_session(tokenizer, s, memo=memo)
                advantage = advantages[e.episode_id, s.session_id]
                if isinstance(advantage, tuple):
                    advantage = token_advantages(rendered, s, advantage)
                sequences.append(TrainSequence(
                    e.episode_id, s.session_id, e.group_id, rendered, advantage,
                    weights[s.session_id], s.policy_revision))
    return sequences, advantages.stats


def token_advantages(rendered: Rendered, session: Session, per_turn: tuple[float, ...]) -> torch.Tensor:
    """``[rendered.num_trained]``: each trained token takes the advantage of the assistant
    turn that generated it (``per_turn``: one value per assistant turn of ``session``)."""
    of_turn = dict(zip(assistant_turns(session), per_turn, strict=True))  # turn index -> value
    values = [of_turn[span.turn] for span in rendered.spans if span.kind == "generated"
              for _ in range(span.end - span.start)]
    out = torch.tensor(values, dtype=torch.float32)  # [num_trained]
    if len(out) != rendered.num_trained:
        raise ValueError(f"session {session.session_id}: {len(out)} generated tokens but "
                         f"{rendered.num_trained} trained ones; per-turn advantages need every "
                         "generated token trained")
    return out


def contrast_stats(episodes: Sequence[Episode]) -> dict[str, int]:
    """Zero-contrast group counts over every valid episode's task reward (before any drop)."""
    valid = [e for e in episodes if not e.reward.is_infrastructure_fault]
    if not valid:
        return dict(NO_GROUPS)
    return _baseline(valid, [task_total(e.reward) for e in valid], "population", "group", 1e-6).stats


def _baseline(episodes: Sequence[Episode], rewards: Sequence[float], std: str, scale: str,
              eps: float) -> GroupBaseline:
    r = torch.tensor(rewards, dtype=torch.float64)  # [N]
    return group_baseline(r, [e.group_id for e in episodes], std=std, scale=scale, eps=eps,
                          correct_threshold=best_total(episodes) - 1e-9)  # as filter_groups


def budget_report(episodes: list[Episode], drops: list[dict], truncation: str) -> dict[str, Any]:
    kept = [e for e in episodes if e.filter and e.filter.get("kept")]
    all_tokens = sum(generated_tokens(e) for e in episodes)
    kept_tokens = sum(generated_tokens(e) for e in kept)
    too_long = [n for _, n in too_long_prompts(episodes)]
    return {
        "episodes": len(episodes),
        "episodes_kept": len(kept),
        "groups": len({e.group_id for e in episodes}),
        "groups_dropped": len(drops),
        "drop_reasons": dict(Counter(d["reason"] for d in drops)),
        "tokens_generated": all_tokens,
        "tokens_kept": kept_tokens,
        "tokens_discarded": all_tokens - kept_tokens,
        "overlong": sum(is_overlong(e) for e in episodes),
        "overlong_masked": sum(map(masked_overlong, episodes)),
        "prompt_too_long": len(too_long),  # episodes: nothing generated, the prompt over the limit
        "prompt_too_long_tokens": max((n for n in too_long if n is not None), default=None),
        "truncation": truncation,
        "infrastructure_faults": sum(e.reward.is_infrastructure_fault for e in episodes),
        # of which an agent written as code failed (Agent-v0), by reason (envs.agents.AgentFault)
        "agent_faults": dict(Counter(e.reward.audit["agent_fault"] for e in episodes
                                     if e.reward.is_infrastructure_fault
                                     and "agent_fault" in e.reward.audit)),
        "acceptance": acceptance(episodes, drops),
    }


def zero_contrast_step(stats: dict[str, int]) -> bool:
    """Did every group of a step (``contrast_stats``) have one reward for all its samples? Its
    advantages are then all 0: no policy gradient (normal on hard tasks)."""
    return stats.get("groups", 0) > 0 and stats.get("zero_contrast") == stats["groups"]


def empty_reason(report: dict[str, Any], trained_tokens: int, stale: int) -> EmptyStep | None:
    """Why a step trained on no token, from its batch's ``report`` (``budget_report``), the
    tokens it trained and the sessions it dropped as stale; None when it trained some. Every
    episode blocked by a limit (prompt too long, or overlong under ``mask``) names the limit
    that blocked more of them; otherwise a dropped group (no contrast) comes first."""
    if trained_tokens:
        return None
    if stale:
        return EmptyStep.stale
    too_long, masked = report["prompt_too_long"], report["overlong_masked"]
    if report["episodes"] and too_long + masked == report["episodes"]:
        return EmptyStep.prompt_too_long if too_long >= masked else EmptyStep.overlong_masked
    if report["groups_dropped"]:
        return EmptyStep.zero_contrast
    if report["infrastructure_faults"]:
        return EmptyStep.infrastructure_faults
    return EmptyStep.nothing_generated


@dataclass(frozen=True)
class RolloutSettings:
    """How ``rollout_batch`` turns tasks into a training batch (steps 1-8 of the module
    docstring): what stays fixed for a whole run, built once from the contract
    (``from_contract``). What changes per step (the tasks, the seed, the hints) is an argument
    of ``rollout_batch``."""

    env_id: str
    group_size: int  # G samples per task form a group
    sampling: Sampling  # the sampling seed: ``seeded`` sets each step's
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    truncation: str = "mask"  # step 2: mask | penalize | keep
    truncation_penalty: float = 0.0
    length_weight: float = 0.0  # step 4: 0 is off
    dynamic_sampling: bool = True  # step 5
    assigner: str = "broadcast"  # step 6: a trajectories.ASSIGNERS name
    assigner_params: dict[str, Any] = field(default_factory=dict)
    session_weighting: str = "per_episode"
    std: str = "population"  # step 7: population | sample | none
    scale: str = "group"  # group | batch
    eps: float = 1e-6

    @classmethod
    def from_contract(cls, contract: ExperimentContract) -> RolloutSettings:
        """The settings an experiment contract's rollout, reward_shaping, credit and advantage
        sections give (the sampling seed unset: ``seeded``)."""
        rollout = contract.rollout
        return cls(
            env_id=contract.env.id, group_size=rollout.group_size,
            sampling=Sampling(temperature=rollout.temperature, top_p=rollout.top_p,
                              max_new_tokens=rollout.max_response_tokens,
                              max_prompt_tokens=rollout.max_prompt_tokens),
            env_kwargs=contract.env.kwargs, truncation=rollout.truncation,
            truncation_penalty=rollout.truncation_penalty,
            length_weight=contract.reward_shaping.length,
            dynamic_sampling=rollout.dynamic_sampling, assigner=contract.credit.assigner,
            assigner_params=contract.credit.params,
            session_weighting=contract.credit.session_weighting,
            std=contract.advantage.std, scale=contract.advantage.scale, eps=contract.advantage.eps)

    def seeded(self, seed: int) -> RolloutSettings:
        """These settings with ``seed`` as the sampling seed (the trainer's: one per step)."""
        return replace(self, sampling=replace(self.sampling, seed=seed))


def rollout_batch(
    policy: Policy,
    tokenizer,
    tasks: Sequence[TaskSpec],
    settings: RolloutSettings,
    *,
    seed: int,
    group_prefix: str = "",
    hints: Sequence[bool] | None = None,
    hint_note: dict[str, Any] | None = None,
) -> RolloutBatch:
    """Steps 0-8 of the module docstring, in order, for ``tasks`` under ``settings``.
    ``seed``: the jobs' seed (job k of the call draws from ``seed + k``); ``group_prefix``
    starts every group id; ``hints``: one bool per job (task i, sample j -> i * group_size +
    j; ``hinted_jobs``), None: as the envs are built; ``hint_note``: recorded on every shown
    hint (``note_hints``)."""
    s = settings
    # 1. collect: G episodes of every task, [len(tasks) * G], a group's members side by side
    episodes = run_episodes(s.env_id, tasks, policy, sampling=s.sampling,
                            samples_per_task=s.group_size, num_envs=len(tasks) * s.group_size,
                            seed=seed, env_kwargs=s.env_kwargs, group_prefix=group_prefix,
                            hints=hints)
    episodes = note_hints(episodes, hint_note)
    # 2-4. overlong responses, infrastructure faults, the length reward
    episodes = [apply_truncation(e, s.truncation, s.truncation_penalty) for e in episodes]
    episodes = apply_length_reward(episodes, s.length_weight)
    # 5. keep or drop each group (every episode records why)
    episodes, drops = filter_groups(episodes, s.dynamic_sampling)
    # 6-8. credit -> advantages -> the loss batch: [S] rendered sessions of the kept episodes
    sequences, _ = build_sequences(tokenizer, episodes, s.assigner, s.assigner_params,
                                   s.session_weighting, s.std, s.scale, s.eps)
    return RolloutBatch(episodes, sequences, budget_report(episodes, drops, s.truncation),
                        contrast_stats(episodes), drops)


def merge_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """One step's batch from the batches of its shards (contiguous slices of the step's tasks,
    in order; one per rank): what ``rollout_batch`` gives for all the tasks at once. A group
    never spans shards, so filtering, credit and advantages were already per group; the budget
    report and the group statistics are recounted over every episode."""
    episodes = [e for b in batches for e in b.episodes]
    drops = [d for b in batches for d in b.drops]
    truncation = batches[0].report["truncation"]
    return RolloutBatch(episodes, [q for b in batches for q in b.sequences],
                        budget_report(episodes, drops, truncation), contrast_stats(episodes), drops)
