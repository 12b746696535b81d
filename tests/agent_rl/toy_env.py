"""tests/Digits-v0: a test-only environment whose reward gives random text partial credit.

Description
    The task asks for a number of 1-3 digits, e.g. ``Reply with the number 42.``. It exists so
    that trainer tests on the tiny random model see reward *contrast* inside a group (on
    Arithmetic-v0 every reward of a random model is 0, so every group is dropped and nothing
    is trained). Registered by importing this module.

Tools
    None.

Observation
    ``[system, user]``: instructions and the request.

Reward
    ``digits`` (weight 0.5): the fraction of the reply's non-space characters that are digits,
    a graded score that random text earns a little of, unevenly; ``exact`` (weight 0.5): the
    stripped reply is the number. The reference answer scores 1.0.

Episode end
    The first reply ends the episode: outcome ``correct`` when exact, ``format_error`` when
    the reply holds no digit, ``wrong`` otherwise.

Task metadata (varied so that ``evals.splits.default_splits`` finds all three holdouts)
    ``skills``: one per digit, ``low`` (0-4) or ``high`` (5-9); ``structure``: the skills
    joined by ``>``; ``length`` and ``difficulty``: the number of digits; ``entity_group``:
    ``even`` or ``odd``.

Version history
    v0: first release.
"""

from __future__ import annotations

import gymnasium
import numpy as np

import envs
import envs.registry
from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.scoring import answer_breakdown
from trajectories import RewardBreakdown

ENV_ID = "tests/Digits-v0"
WEIGHTS = {"digits": 0.5, "exact": 0.5}


def digits_reward(reply: str, target: str) -> dict[str, float]:
    """The two reward components of a reply."""
    chars = [c for c in reply if not c.isspace()]
    share = sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
    return {"digits": share, "exact": float(reply.strip() == target)}


class DigitsEnv(ToolEnv):
    env_id = ENV_ID
    version = 0
    instructions = "Reply with just the number you are asked for."
    reward_weights = WEIGHTS

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        tasks = []
        for i in range(n):
            length = int(rng.integers(1, 4))
            number = str(int(rng.integers(1, 10))) + "".join(
                str(int(d)) for d in rng.integers(0, 10, size=length - 1))
            skills = ["low" if int(d) < 5 else "high" for d in number]
            tasks.append(TaskSpec(
                task_id=f"digits-{seed}-{i}",
                prompt=f"Reply with the number {number}.",
                meta=TaskMeta(skills=skills, structure=">".join(skills),
                              entity_group="even" if int(number) % 2 == 0 else "odd",
                              length=length, difficulty=length),
                target=number))
        return tasks

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        components = digits_reward(answer, task.target)
        return answer_breakdown(components, WEIGHTS, f"{self.env_id}@{self.version}",
                                correct=components["exact"] == 1.0,
                                answered=components["digits"] > 0.0)

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.target


def register() -> str:
    if ENV_ID not in envs.list_envs():
        envs.register(ENV_ID, "tests.agent_rl.toy_env:DigitsEnv")
    return ENV_ID


def unregister() -> None:
    envs.registry._REGISTERED.pop(ENV_ID, None)
    gymnasium.registry.pop(ENV_ID, None)
