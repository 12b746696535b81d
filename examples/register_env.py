"""Register a custom environment and drive it with its scripted solver.

``CapitalsEnv`` below is a complete ToolEnv in a few dozen lines: one ``@tool``, a deterministic
``task_pool``, a pure reward function (its outcome by ``envs.scoring.answer_breakdown``) and a
scripted ``reference_action``. ``envs.register`` puts it in the registry under a versioned id;
``envs.make`` builds it; ``envs.runner`` runs episodes with any object that has ``generate``
(here a policy that asks the env's own solver); ``envs.checks`` runs the contract checks every
built-in environment passes.

    python examples/register_env.py
"""

from __future__ import annotations

import json

import envs
from envs import TaskMeta, TaskSpec, ToolEnv, ToolError, tool
from envs.checks import check_env_id
from envs.runner import Completion, run_episodes
from envs.scoring import answer_breakdown
from trajectories import RewardBreakdown

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
            "Canada": "Ottawa", "Egypt": "Cairo", "Norway": "Oslo", "Chile": "Santiago"}
CONTINENT = {"France": "europe", "Norway": "europe", "Japan": "asia", "Kenya": "africa",
             "Egypt": "africa", "Peru": "americas", "Canada": "americas", "Chile": "americas"}
WEIGHTS = {"accuracy": 1.0}


def capital_reward(reply: str, capital: str) -> dict[str, float]:
    """1 when the reply names the capital (case and surrounding text ignored)."""
    return {"accuracy": float(capital.lower() in reply.lower())}


class CapitalsEnv(ToolEnv):
    """Capitals-v0: look up a country's capital with the ``lookup`` tool and name it.

    Description
        Each task names a country; the agent calls ``lookup`` and replies with the capital.
    Tools
        ``lookup(country)``: the capital of a country in the atlas.
    Observation
        ``[system, user]``, then the agent's turns and the tool results.
    Reward
        ``accuracy`` (weight 1.0): the final reply names the capital.
    Episode end
        The first reply without a tool call; ``max_turns`` replies end it truncated.
    Version history
        v0: the example.
    """

    env_id = "examples/Capitals-v0"
    version = 0
    instructions = "Use the tools to answer, then reply with just the city name."
    reward_weights = WEIGHTS

    @tool
    def lookup(self, country: str) -> str:
        """The capital of `country`."""
        if country not in CAPITALS:
            raise ToolError(f"unknown country {country!r}; known: {sorted(CAPITALS)}")
        return CAPITALS[country]

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        countries = sorted(CAPITALS)
        tasks = []
        for i in range(n):
            country = countries[(seed + i) % len(countries)]
            tasks.append(TaskSpec(task_id=f"capital-{seed}-{i}",
                                  prompt=f"What is the capital of {country}?",
                                  meta=TaskMeta(skills=["lookup"], structure="lookup",
                                                entity_group=CONTINENT[country], length=2),
                                  target=CAPITALS[country], data={"country": country}))
        return tasks

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        components = capital_reward(answer, task.target)
        return answer_breakdown(components, WEIGHTS, f"{self.env_id}@{self.version}",
                                correct=components["accuracy"] == 1.0)

    def reference_action(self) -> str | None:
        """Call ``lookup`` once, then answer with the capital."""
        if self.task is None:
            return None
        if not any(m["role"] == "tool" for m in self.active_messages):
            call = {"name": "lookup", "arguments": {"country": self.task.data["country"]}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return self.task.target


class ScriptedPolicy:
    """A ``Policy`` that answers with the env's own solver (one env, so one conversation)."""

    def __init__(self, env):
        self.env = env

    def generate(self, batch, sampling):
        assert len(batch) == 1, "one env, one conversation per round"
        return [Completion(text=self.env.unwrapped.reference_action())]


def main() -> None:
    envs.register("examples/Capitals-v0", CapitalsEnv)
    print("registered:", "examples/Capitals-v0" in envs.list_envs())

    env = envs.make("examples/Capitals-v0")
    tasks = env.unwrapped.task_pool(4, seed=0)
    episodes = run_episodes([env], tasks, ScriptedPolicy(env))
    for episode in episodes:
        turns = [t for s in episode.sessions for t in s.turns if t.role == "assistant"]
        print(f"{episode.task_id}: reward {episode.reward.total:g} "
              f"({episode.reward.outcome.value}, {len(turns)} assistant turns)")
    print(f"mean reward {sum(e.reward.total for e in episodes) / len(episodes):g}")

    print(check_env_id("examples/Capitals-v0", episodes=8))


if __name__ == "__main__":
    main()
