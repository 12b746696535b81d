"""Arithmetic-v0: numbers are read as numbers (decimals, thousands, signs, any length)."""

from __future__ import annotations

from decimal import Decimal

import pytest

import envs
from envs.arithmetic import WEIGHTS, arithmetic_reward, numbers


@pytest.mark.parametrize(("reply", "value", "components"), [
    ("12", 12, (1, 1, 1)),
    ("12.0", 12, (1, 1, 1)),  # v0 read "0"
    ("12.", 12, (1, 1, 1)),  # a full stop, not a decimal part
    ("The answer is 12.00.", 12, (1, 0, 0)),
    ("1,000", 1000, (1, 1, 1)),  # v0 read "000"
    ("-7", -7, (1, 1, 1)),
    ("12.5", 12, (0, 1, 0)),
    ("1,5", 5, (1, 0, 0)),  # not a thousands group: the numbers 1 and 5
    ("9" * 4301, 12, (0, 1, 0)),  # v0 raised ValueError (int conversion limit)
    ("no number", 12, (0, 0, 0)),
])
def test_reward_reads_numbers_as_numbers(reply, value, components):
    assert arithmetic_reward(reply, value) == dict(zip(WEIGHTS, map(float, components),
                                                       strict=True))


def test_numbers():
    assert numbers("(7 + 5) * 3 - 4 = 32, or -32") == [7, 5, 3, 4, 32, -32]
    assert numbers("1,234,567.5 and 1,0000") == [Decimal("1234567.5"), 1, 0]
    assert numbers("x" + "9" * 5000) == [Decimal("9" * 5000)]


def test_a_decimal_answer_scores_through_the_env():
    env = envs.make("agent_rl/Arithmetic-v0")
    env.reset(seed=0)
    target = env.unwrapped.task.target
    *_, info = env.step(f"{target}.0")
    assert info["episode"].reward.total == pytest.approx(1.0)
    assert info["episode"].reward.verifier == "agent_rl/Arithmetic-v0@1"
