"""envs.scoring's numeric-answer scorer and outcome rule, against hand-computed breakdowns; the
environments that score numeric answers (Arithmetic-v0, Dataset-v0's ``numeric``, the
scaffold's template) give exactly its breakdown."""

from __future__ import annotations

import math
import types
from decimal import Decimal
from string import Template

import pytest

from envs.arithmetic import ArithmeticEnv
from envs.core import TaskSpec
from envs.scaffold import ENV, package_names
from envs.scoring import (
    answer_breakdown,
    numbers,
    numeric_answer,
    numeric_components,
    numeric_reward,
)
from trajectories import Outcome

W = {"accuracy": 0.5, "format": 0.2, "exact": 0.3}


@pytest.mark.parametrize("reply, target, components, total, outcome", [
    # a bare right number, however written: 0.5 + 0.2 + 0.3
    ("12", 12, (1, 1, 1), 1.0, "correct"),
    ("12.0", 12, (1, 1, 1), 1.0, "correct"),  # a decimal part is part of the number
    ("12.", 12, (1, 1, 1), 1.0, "correct"),  # a final full stop
    (" 1,000\n", 1000, (1, 1, 1), 1.0, "correct"),  # thousands groups
    ("-7", -7, (1, 1, 1), 1.0, "correct"),
    # the right last number in text: accuracy only, 0.5
    ("The answer is 12", 12, (1, 0, 0), 0.5, "correct"),
    ("1,5", 5, (1, 0, 0), 0.5, "correct"),  # not a thousands group: the numbers 1 and 5
    ("1e3", 3, (1, 0, 0), 0.5, "correct"),  # no exponents: 1 and 3, the last is 3
    # wrong numbers: a bare one earns format, 0.2
    ("13", 12, (0, 1, 0), 0.2, "wrong"),
    ("1e3", 1000, (0, 0, 0), 0.0, "wrong"),
    ("- 7", -7, (0, 0, 0), 0.0, "wrong"),  # a minus apart from its digits is no sign: 7
    ("12 then 13", 12, (0, 0, 0), 0.0, "wrong"),  # the last number counts
    ("1,0000", 10000, (0, 0, 0), 0.0, "wrong"),  # 1 and 0: four digits are no group
    # no number at all
    ("", 12, (0, 0, 0), 0.0, "format_error"),
    ("no idea", 12, (0, 0, 0), 0.0, "format_error"),
    ("-", 0, (0, 0, 0), 0.0, "format_error"),
])
def test_numeric_answer_by_hand(reply, target, components, total, outcome):
    reward = numeric_answer(reply, target, W, "hand@1")
    assert reward.components == dict(zip(W, map(float, components), strict=True))
    assert reward.weights == W and reward.verifier == "hand@1"
    assert math.isclose(reward.total, total, abs_tol=1e-12)
    assert reward.outcome == Outcome(outcome)


def test_numeric_answer_reports_the_components_its_weights_name():
    reward = numeric_answer("The answer is 12", 12, {"accuracy": 1.0}, "hand@1")
    assert (reward.components, reward.total, reward.outcome) == ({"accuracy": 1.0}, 1.0,
                                                                 Outcome.correct)
    assert numeric_components("12", 12, ["exact", "accuracy"]) == {"exact": 1.0, "accuracy": 1.0}
    with pytest.raises(ValueError, match=r"\['length'\] are unknown.*'accuracy', 'format', "
                                         r"'exact'"):
        numeric_answer("12", 12, {"accuracy": 1.0, "length": 0.1}, "hand@1")


def test_tolerance_is_absolute_below_1_and_relative_above():
    # |3.12 - 3.1| = 0.02 <= 0.01 * 3.1 = 0.031; |3.14 - 3.1| = 0.04 > 0.031
    assert numeric_answer("3.12", "3.1", {"accuracy": 1.0}, "v", tolerance=0.01).total == 1.0
    assert numeric_answer("3.14", "3.1", {"accuracy": 1.0}, "v", tolerance=0.01).total == 0.0
    # target 0: bound 0.01 * max(1, 0) = 0.01
    assert numeric_reward("0.01", "0", 0.01) == 1.0 and numeric_reward("0.02", "0", 0.01) == 0.0
    assert numeric_reward("-3", Decimal("-3")) == 1.0
    assert numeric_reward("0.1", 0.1) == 1.0  # a float target is its shortest repr, not 0.1000...055


def test_numbers_of_any_length_never_raise():
    huge = "x" + "9" * 5000
    assert numbers(huge) == [Decimal("9" * 5000)]
    reward = numeric_answer(huge, 12, W, "v")
    assert (reward.total, reward.outcome) == (0.0, Outcome.wrong)


def test_the_outcome_rule():
    c, w = {"a": 1.0, "b": 0.5}, {"a": 0.25, "b": 2.0}
    assert answer_breakdown(c, w, "v", correct=True, answered=False).outcome == Outcome.correct
    assert answer_breakdown(c, w, "v", correct=False).outcome == Outcome.wrong
    wrong = answer_breakdown(c, w, "v", correct=False, answered=False)
    assert wrong.outcome == Outcome.format_error and wrong.total == 0.25 * 1.0 + 2.0 * 0.5


def test_arithmetic_scores_with_the_shared_scorer():
    env = ArithmeticEnv()
    task = TaskSpec(task_id="t", prompt="Compute 7 + 5.", target=12)
    for reply in ("12", "12.0", "it is 12", "13", "1e3", "none"):
        assert env.score(task, reply, None) == numeric_answer(reply, 12, W,
                                                              "agent_rl/Arithmetic-v0@1")


def test_the_scaffold_template_scores_with_the_shared_scorer():
    """The generated env reads numbers as numbers: "12.0" is 12 (its own regex read the "0")."""
    names = package_names("count_check")
    module = types.ModuleType("scaffold_env_check")
    exec(compile(Template(ENV).substitute(names), "env.py", "exec"), module.__dict__)
    env = module.CountCheckEnv()
    task = TaskSpec(task_id="t", prompt="p", target=12)
    reward = env.score(task, "12.0", None)
    assert (reward.components, reward.total, reward.outcome) == ({"accuracy": 1.0}, 1.0,
                                                                 Outcome.correct)
    assert reward.verifier == "count_check/CountCheck-v0@0"
    assert env.score(task, "no idea", None).outcome == Outcome.format_error
    assert module.count_reward("there are 3", 3) == {"accuracy": 1.0}
