"""From a policy and tasks to training sequences: rollout -> filter -> credit -> advantages -> render.

1. Collect: ``envs.runner.run_episodes`` with G samples per task (a group shares
   ``group_id``); every episode, kept or not, goes to the RolloutStore with its ``filter``.
2. Overlong responses (any assistant turn cut with ``finish_reason == "length"``) follow
   ``truncation``: ``mask`` keeps the episode in its group's baseline but gives its sequences
   loss weight 0 (DAPO's overlong filtering); ``penalize`` replaces its reward by
   ``truncation_penalty`` (component ``overlong``); ``keep`` leaves it alone.
3. Infrastructure faults (outcome ``sandbox_error``) are never scored as wrong: they leave the
   group and the loss, and are counted.
4. Dynamic sampling (DAPO) drops groups whose valid rewards are all equal: no contrast, no
   policy gradient. Each drop is recorded with its reason (``all_correct``, ``all_wrong``,
   ``zero_contrast``, ``too_few_valid``); acceptance rates are kept per env, skill and
   difficulty. The budget report counts *all* generated tokens, kept and discarded.
5. Credit: ``trajectories.assign`` gives each session its credit; ``session_weights`` gives
   each session a loss weight (``per_episode``: an episode's sessions share weight 1).
6. Advantages: ``grpo.group_advantages`` over the *sessions* of a group, with the group's
   sessions' credits as rewards. Under ``broadcast`` with one session per episode this is
   plain GRPO; with several sessions each session is one member of its task's group.
7. Render: each session becomes one sequence (``render.render_session``) with its own loss
   mask and old log-probs, carrying its advantage and weight.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_rl.grpo import group_advantages
from agent_rl.render import Rendered, render_session
from envs.core import TaskSpec
from envs.runner import Policy, Sampling, run_episodes
from trajectories import Episode, Outcome, RewardBreakdown, RolloutStore, assign, session_weights


@dataclass
class TrainSequence:
    """One session rendered for the loss, with its advantage and loss weight."""

    episode_id: str
    session_id: str
    group_id: str
    rendered: Rendered
    advantage: float
    weight: float


@dataclass
class RolloutBatch:
    episodes: list[Episode]  # every generated episode, with its filter decision
    sequences: list[TrainSequence]
    report: dict[str, Any]
    advantage_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def kept(self) -> list[Episode]:
        return [e for e in self.episodes if e.filter and e.filter.get("kept")]


def is_overlong(episode: Episode) -> bool:
    return any(t.finish_reason == "length" for s in episode.sessions for t in s.turns)


def generated_tokens(episode: Episode) -> int:
    return sum(s.generated_tokens for s in episode.sessions)


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


def filter_groups(episodes: list[Episode], dynamic_sampling: bool) -> tuple[list[Episode], list[dict]]:
    """Decide, per group, what is trained on. Returns (episodes with `filter.kept`, drops)."""
    groups: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        groups[e.group_id].append(e)
    decided: dict[str, Episode] = {}
    drops = []
    for group_id, members in groups.items():
        valid = [e for e in members if not e.reward.is_infrastructure_fault]
        rewards = {round(e.reward.total, 12) for e in valid}
        reason = None
        if len(valid) < (2 if dynamic_sampling else 1):
            reason = "too_few_valid"
        elif dynamic_sampling and len(rewards) == 1:
            value = next(iter(rewards))
            # The verifier's best total; an overlong penalty (weights {"overlong": penalty})
            # says nothing about it, and a group of penalised episodes is never saturated.
            best = max((sum(e.reward.weights.values()) for e in valid
                        if "unpenalized" not in e.reward.audit), default=None)
            reason = ("all_wrong" if value <= 0.0 else
                      "all_correct" if best is not None and value >= best - 1e-9 else
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
    rows = []  # (episode, session, credit, weight)
    for e in kept:
        credit = assign(e, assigner, **assigner_params)
        weights = session_weights(e, session_weighting)
        masked = e.filter.get("truncation") == "mask" and e.filter.get("overlong")
        for s in e.sessions:
            if s.generated_tokens:
                rows.append((e, s, credit[s.session_id], 0.0 if masked else weights[s.session_id]))
    if not rows:
        return [], {"groups": 0}
    advantages, stats = group_advantages(torch.tensor([r[2] for r in rows], dtype=torch.float64),
                                         [r[0].group_id for r in rows], std=std, scale=scale, eps=eps)
    sequences = [  # weight-0 rows (masked overlong) served the baseline; they are not rendered
        TrainSequence(e.episode_id, s.session_id, e.group_id, render_session(tokenizer, s),
                      float(a), w)
        for (e, s, _, w), a in zip(rows, advantages.tolist(), strict=True)
        if w > 0
    ]
    return sequences, stats


def budget_report(episodes: list[Episode], drops: list[dict], truncation: str) -> dict[str, Any]:
    kept = [e for e in episodes if e.filter and e.filter.get("kept")]
    all_tokens = sum(generated_tokens(e) for e in episodes)
    kept_tokens = sum(generated_tokens(e) for e in kept)
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
        "truncation": truncation,
        "infrastructure_faults": sum(e.reward.is_infrastructure_fault for e in episodes),
        "acceptance": acceptance(episodes, drops),
    }


def rollout_batch(
    policy: Policy,
    tokenizer,
    env_id: str,
    tasks: Sequence[TaskSpec],
    *,
    group_size: int,
    sampling: Sampling,
    seed: int,
    env_kwargs: dict[str, Any] | None = None,
    truncation: str = "mask",
    truncation_penalty: float = 0.0,
    dynamic_sampling: bool = True,
    assigner: str = "broadcast",
    assigner_params: dict[str, Any] | None = None,
    session_weighting: str = "per_episode",
    std: str = "population",
    scale: str = "group",
    eps: float = 1e-6,
    store: RolloutStore | None = None,
    group_prefix: str = "",
) -> RolloutBatch:
    """Steps 1-7 of the module docstring, in order."""
    episodes = run_episodes(env_id, tasks, policy, sampling=sampling, samples_per_task=group_size,
                            num_envs=len(tasks) * group_size, seed=seed, env_kwargs=env_kwargs,
                            group_prefix=group_prefix)
    episodes = [apply_truncation(e, truncation, truncation_penalty) for e in episodes]
    episodes, drops = filter_groups(episodes, dynamic_sampling)
    if store is not None:
        store.append(episodes)
    sequences, stats = build_sequences(tokenizer, episodes, assigner, assigner_params or {},
                                       session_weighting, std, scale, eps)
    return RolloutBatch(episodes, sequences, budget_report(episodes, drops, truncation), stats)
