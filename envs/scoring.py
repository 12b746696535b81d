"""Scoring an answer: the numeric-answer scorer, the outcome rule, and rewards under a
wall-clock bound.

**Numeric answers** (``numeric_answer``; Arithmetic-v0, Dataset-v0's ``numeric`` reward, the
scaffold's template). Numbers are read as numbers (``numbers``): an optional minus, digits,
commas only between groups of three digits (``1,000`` is 1000; ``1,5`` is 1 and 5), an
optional decimal part (``12.0`` is 12; ``12.`` is 12 before a full stop); no exponents
(``1e3`` is 1 and 3), no plus sign, any length (``Decimal``). Components, each 0 or 1, as many
as the weights name: ``accuracy`` (the *last* number equals the target, or is within
``tolerance * max(1, |target|)`` of it), ``format`` (the reply is a bare number, a final full
stop allowed), ``exact`` (both).

**The outcome rule** (``answer_breakdown``): ``correct`` when the reply is right,
``format_error`` when it holds no answer at all (for a numeric answer: no number), ``wrong``
otherwise.

**Rewards under a wall-clock bound.** Environments that run a reward they do not control (a
user's function, a regex from a data file, a verifiers taskset's reward functions) run it in a
deadline worker (``envs.deadline``) stopped after ``reward_timeout_s`` seconds (default
``REWARD_TIMEOUT_S``; a finite number > 0, checked by ``check_reward_timeout``). A reward that
runs past it, raises an infrastructure error or kills its worker is not the agent's fault:
``reward_fault`` makes the episode a ``sandbox_error`` (masked out of the loss, counted in
``reward/infra_error_rate``) with the reason in ``audit["reward_error"]`` and the task in
``audit["task_id"]``, and warns ``RewardFaultWarning`` naming the task. Agent text never hangs
scoring.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal
from typing import Any

from envs import deadline
from trajectories import Outcome, RewardBreakdown

__all__ = ["NUMERIC_COMPONENTS", "REWARD_TIMEOUT_S", "RewardFaultWarning", "answer_breakdown",
           "check_reward_timeout", "fault_reason", "numbers", "numeric_answer",
           "numeric_components", "numeric_reward", "reward_fault"]

# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------

NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_BARE = re.compile(rf"\s*{NUMBER.pattern}\s*\.?\s*")
_WIDE = Context(prec=60, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[])  # replies may hold 1e6 digits
NUMERIC_COMPONENTS = ("accuracy", "format", "exact")


def numbers(text: str) -> list[Decimal]:
    """The numbers written in ``text``, in order, exactly (Decimal: no digit limit)."""
    return [Decimal(n.replace(",", "")) for n in NUMBER.findall(text)]


def _decimal(target: int | str | Decimal | float) -> Decimal:
    return Decimal(repr(target)) if isinstance(target, float) else Decimal(target)


def numeric_reward(reply: str, target: int | str | Decimal, tolerance: float = 0.0) -> float:
    """1.0 when the last number in ``reply`` is within ``tolerance * max(1, |target|)`` of
    ``target`` (``tolerance=0``: equal as numbers), else 0.0."""
    said = numbers(reply)
    if not said:
        return 0.0
    target = _decimal(target)
    if not tolerance:
        return float(said[-1] == target)
    bound = _WIDE.multiply(Decimal(repr(float(tolerance))), max(Decimal(1), abs(target)))
    return float(_WIDE.abs(_WIDE.subtract(said[-1], target)) <= bound)


def numeric_components(reply: str, target: int | str | Decimal,
                       names: Sequence[str] = ("accuracy",),
                       tolerance: float = 0.0) -> dict[str, float]:
    """The components ``names`` (of ``NUMERIC_COMPONENTS``) of a reply whose answer is its last
    number (module docstring): a small pure function evaluation can reuse."""
    unknown = [n for n in names if n not in NUMERIC_COMPONENTS]
    if unknown:
        raise ValueError(f"numeric answer components {unknown} are unknown; name only "
                         f"{list(NUMERIC_COMPONENTS)} in the weights")
    accuracy = numeric_reward(reply, target, tolerance)
    bare = float(_BARE.fullmatch(reply) is not None)
    every = {"accuracy": accuracy, "format": bare, "exact": accuracy * bare}
    return {n: every[n] for n in names}


def numeric_answer(reply: str, target: int | str | Decimal, weights: Mapping[str, float],
                   verifier: str, tolerance: float = 0.0) -> RewardBreakdown:
    """The reward of a reply whose answer is its last number: the components the ``weights``
    name (``numeric_components``), ``correct`` when that number matches the target,
    ``format_error`` when the reply holds no number, ``wrong`` otherwise."""
    components = numeric_components(reply, target, list(weights), tolerance)
    return answer_breakdown(components, weights, verifier,
                            correct=numeric_reward(reply, target, tolerance) == 1.0,
                            answered=bool(numbers(reply)))


def answer_breakdown(components: Mapping[str, float], weights: Mapping[str, float],
                     verifier: str, *, correct: bool, answered: bool = True) -> RewardBreakdown:
    """``components`` weighted by ``weights``, with the outcome rule: ``correct`` when
    ``correct``, ``format_error`` when the reply gave no answer (``answered`` false),
    ``wrong`` otherwise."""
    outcome = (Outcome.correct if correct else
               Outcome.wrong if answered else Outcome.format_error)
    return RewardBreakdown.from_components(dict(components), dict(weights), outcome, verifier)


# ---------------------------------------------------------------------------------------------
# Rewards under a wall-clock bound
# ---------------------------------------------------------------------------------------------

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
