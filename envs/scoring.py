"""Rewards under a wall-clock bound: what an environment does with a reply it could not score.

Environments that run a reward they do not control (a user's function, a regex from a data
file, a verifiers taskset's reward functions) run it in a deadline worker (``envs.deadline``)
stopped after ``reward_timeout_s`` seconds (default ``REWARD_TIMEOUT_S``; a finite number > 0,
checked by ``check_reward_timeout``). A reward that runs past it, raises an infrastructure
error or kills its worker is not the agent's fault: ``reward_fault`` makes the episode a
``sandbox_error`` (masked out of the loss, counted in ``reward/infra_error_rate``) with the
reason in ``audit["reward_error"]`` and the task in ``audit["task_id"]``, and warns
``RewardFaultWarning`` naming the task. Agent text never hangs scoring.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from envs import deadline
from trajectories import Outcome, RewardBreakdown

__all__ = ["REWARD_TIMEOUT_S", "RewardFaultWarning", "check_reward_timeout", "fault_reason",
           "reward_fault"]

REWARD_TIMEOUT_S = 10.0


class RewardFaultWarning(RuntimeWarning):
    """A reply could not be scored (the reward raised, or ran past ``reward_timeout_s``): the
    episode is a ``sandbox_error``, masked out of the loss and counted."""


def check_reward_timeout(value: Any) -> float:
    """``value`` as seconds, or a ``ValueError`` naming ``reward_timeout_s``."""
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"reward_timeout_s must be a finite number of seconds > 0, got "
                         f"{value!r}")
    return float(value)


def fault_reason(exc: Exception, reward_timeout_s: float) -> str:
    """What stopped a scoring call, for ``audit["reward_error"]``."""
    if isinstance(exc, deadline.DeadlineExceeded):
        return (f"DeadlineExceeded: no reward within reward_timeout_s={reward_timeout_s:g} s "
                "(stopped)")
    return f"{type(exc).__name__}: {exc}"


def reward_fault(env_id: str, task_id: str, reward: str, reason: str,
                 weights: Mapping[str, float], verifier: str) -> RewardBreakdown:
    """The ``sandbox_error`` breakdown of a reply that ``reward`` could not score (every
    component 0), warned naming the task."""
    warnings.warn(f"{env_id} task {task_id}: reward {reward} failed ({reason:.300}); the "
                  "episode is a sandbox_error (masked out of the loss, counted in "
                  "reward/infra_error_rate)", RewardFaultWarning, stacklevel=3)
    return RewardBreakdown.from_components(
        dict.fromkeys(weights, 0.0), dict(weights), Outcome.sandbox_error, verifier,
        audit={"reward_error": reason[:2000], "task_id": task_id})
