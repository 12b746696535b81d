"""Arithmetic-v0: multi-step integer arithmetic, answered with just the number.

Description
    A chain of 1 to ``max_ops`` (default 3) operations (``+``, ``-``, ``*``) over integers up
    to ``max_operand`` (default 19; multipliers up to 9), e.g. ``(7 + 5) * 3 - 4``. The agent
    replies with the value. No tools.

Tools
    None.

Observation
    ``[system, user]``: instructions and the expression.

Reward
    ``envs.scoring.numeric_answer``: components (each 0 or 1) and weights, so a small model can
    earn partial credit: ``accuracy`` (the last number in the reply equals the value; weight
    0.5), ``format`` (the reply is a bare number, a final full stop allowed; weight 0.2),
    ``exact`` (both; weight 0.3). Exact answer: 1.0; right number with extra text: 0.5; a bare
    wrong number: 0.2; anything else: 0. Numbers are read as numbers (``numbers``): an optional
    minus, digits, commas only between groups of three digits (``1,000`` is 1000; ``1,5`` is 1
    and 5), an optional decimal part (``12.0`` is 12; ``12.`` is 12 before a full stop). No
    exponents.

Episode end
    The first reply ends the episode (outcome ``correct`` when accuracy is 1, ``format_error``
    when the reply holds no number, ``wrong`` otherwise).

Hints
    Every task carries a hint (its first intermediate result, provenance
    ``solution-derived``). Hints are shown only with ``hints=True`` and are recorded in
    ``Episode.hint``; evaluation is hint-free by default.

Version history
    v0: first release.
    v1 (same id): numbers are parsed as numbers: "12.0" and "1,000" were read as their last
    digit group ("0", "000"), and a reply of over 4,300 digits raised ``ValueError``.
"""

from __future__ import annotations

import numpy as np

from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.scoring import numbers, numeric_answer, numeric_components
from trajectories import RewardBreakdown

__all__ = ["WEIGHTS", "ArithmeticEnv", "arithmetic_reward", "numbers"]

_OPS = {"+": ("add", lambda a, b: a + b), "-": ("sub", lambda a, b: a - b),
        "*": ("mul", lambda a, b: a * b)}
WEIGHTS = {"accuracy": 0.5, "format": 0.2, "exact": 0.3}


def arithmetic_reward(reply: str, value: int) -> dict[str, float]:
    """The three reward components of a reply (also used by evaluation)."""
    return numeric_components(reply, value, list(WEIGHTS))


class ArithmeticEnv(ToolEnv):
    env_id = "agent_rl/Arithmetic-v0"
    version = 1
    instructions = "You are a careful calculator. Reply with just the final number, nothing else."
    reward_weights = WEIGHTS

    def __init__(self, max_ops: int = 3, max_operand: int = 19, **kwargs):
        if not 1 <= max_ops <= 6:
            raise ValueError(f"max_ops must be in 1..6, got {max_ops}")
        if max_operand < 2:
            raise ValueError(f"max_operand must be >= 2, got {max_operand}")
        super().__init__(**kwargs)
        self.max_ops = max_ops
        self.max_operand = max_operand

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        return [self._make_task(rng, f"arith-{seed}-{i}") for i in range(n)]

    def _make_task(self, rng: np.random.Generator, task_id: str) -> TaskSpec:
        n_ops = int(rng.integers(1, self.max_ops + 1))
        value = int(rng.integers(1, self.max_operand + 1))
        expr = str(value)
        steps = []  # (op, expression so far, its value)
        for k in range(n_ops):
            op = str(rng.choice(list(_OPS)))
            operand = (int(rng.integers(2, min(9, self.max_operand) + 1)) if op == "*"
                       else int(rng.integers(1, self.max_operand + 1)))
            expr = f"{expr} {op} {operand}" if k == 0 else f"({expr}) {op} {operand}"
            value = _OPS[op][1](value, operand)
            steps.append((op, expr, value))
        _, first_expr, first_value = steps[0]
        return TaskSpec(
            task_id=task_id,
            prompt=f"Compute {expr}. Answer with just the number.",
            meta=TaskMeta(skills=[_OPS[op][0] for op, _, _ in steps],
                          structure=">".join(_OPS[op][0] for op, _, _ in steps),
                          entity_group="integers", length=n_ops, difficulty=n_ops),
            target=value,
            hint={"text": f"{first_expr} = {first_value}", "provenance": "solution-derived"},
        )

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        return numeric_answer(answer, task.target, WEIGHTS, f"{self.env_id}@{self.version}")

    def reference_action(self) -> str | None:
        return None if self.task is None else str(self.task.target)
