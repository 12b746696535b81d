"""The verifiers bridge on a multi-turn verifiers tool environment: a real ``vf.Taskset``
whose task declares a ``vf.Toolset`` (``@vf.tool`` methods, a ``vf.State`` the tools write
and the rewards read), run through our episode runner by a scripted policy that calls the
tools and answers from their results."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1", reason="verifiers==0.4.0 is not installed")

from envs.runner import Completion, run_episodes  # noqa: E402
from envs.verifiers_bridge import TasksetEnv  # noqa: E402
from trajectories import Outcome  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import verifiers_tools as shop  # noqa: E402  (the example's state, data and tools)

SHELVES = shop.SHELVES[:2]


class ShelfTask(shop.ShelfTask):
    """The example's task, its rewards and tools, plus metrics these tests read."""

    @vf.metric
    async def tool_results(self, trace) -> float:
        return float(len(trace.tool_messages))

    @vf.metric
    async def cup_called(self, trace) -> float:  # the assistant turns keep their tool calls
        calls = [c for m in trace.assistant_messages for c in m.tool_calls or []]
        return float([json.loads(c.arguments)["item"] for c in calls] == ["pen", "cup"]
                     and all(c.name == "shelf_tools_price" for c in calls))


class ShelfTaskset(vf.Taskset[ShelfTask, vf.TasksetConfig]):
    def load(self):
        for shelf in SHELVES:
            data = shop.ShelfData(prompt="What do a pen and a cup cost together? Look up each "
                                    "price, then reply with the total only.",
                             prices=shelf, answer=str(sum(shelf.values())))
            yield ShelfTask(data, self.config.task)


class Shopper:
    """A scripted policy: looks up ``items`` one per turn with the env's tool, then answers
    the sum of the numbers the tool returned (or ``answer`` when given)."""

    def __init__(self, items: list[str], answer: str | None = None):
        self.items, self.answer = items, answer
        self.seen: list[list[dict]] = []

    def generate(self, batch, sampling):
        out = []
        for messages in batch:
            self.seen.append(messages)
            asked = sum(m["role"] == "assistant" for m in messages)
            if asked < len(self.items):
                call = {"name": "shelf_tools_price", "arguments": {"item": self.items[asked]}}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
            else:
                results = [m["content"] for m in messages if m["role"] == "tool"]
                text = self.answer or str(sum(int(r) for r in results if r.isdigit()))
            out.append(Completion(text, token_ids=[1, 2], logprobs=[-0.5, -0.5]))
        return out


@pytest.fixture(scope="module")
def env():
    return TasksetEnv(ShelfTaskset)


def test_a_tool_env_runs_multi_turn_and_is_scored_on_the_whole_conversation(env):
    tasks = env.task_pool(2, seed=0)
    policy = Shopper(["pen", "cup"])
    episodes = run_episodes([env], tasks, policy)
    assert len(episodes) == 2
    for task, episode in zip(tasks, episodes, strict=True):
        (session,) = episode.sessions
        roles = [t.role for t in session.turns]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        shelf = task.data["row"]["prices"]
        assert [t.content for t in session.turns if t.role == "tool"] == [
            str(shelf["pen"]), str(shelf["cup"])]
        reward = episode.reward
        # correct (weight 1) and looked_up (weight 0.5) both 1: total 1.5, by hand
        assert reward.components == {"correct": 1.0, "looked_up": 1.0}
        assert reward.total == 1.5 and reward.outcome == Outcome.correct
        assert reward.audit["metrics"] == {"tool_results": 2.0, "cup_called": 1.0}
    # the tool is advertised as verifiers names it (<server>_<tool>), with its schema
    system = policy.seen[0][0]["content"]
    assert "shelf_tools_price" in system and "The price of one item" in system


def test_the_state_is_per_episode_and_tool_errors_reach_the_agent(env):
    (task,) = [t for t in env.task_pool(2, seed=0) if t.data["row"]["prices"]["pen"] == 3]
    lazy = run_episodes([env], [task], Shopper(["pen"], answer="7"))[0]
    # the right total without looking the cup up: correct 1, looked_up 0 (a fresh state)
    assert lazy.reward.components == {"correct": 1.0, "looked_up": 0.0}
    assert lazy.reward.total == 1.0 and lazy.reward.outcome == Outcome.wrong
    confused = run_episodes([env], [task], Shopper(["lamp", "pen", "cup"]))[0]
    tool_turns = [t.content for t in confused.sessions[0].turns if t.role == "tool"]
    assert re.match(r"error: KeyError: .*no item 'lamp' on the shelf", tool_turns[0])
    assert tool_turns[1:] == ["3", "4"]
    assert confused.reward.total == 1.5  # a failed call is an observation, not a crash


def test_tools_that_cannot_be_hosted_are_refused_at_construction():
    class Untyped(vf.Toolset[vf.ToolsetConfig, vf.State]):
        @vf.tool
        def look(self, item):
            return item

    class UntypedTask(ShelfTask):
        @classmethod
        def toolsets(cls, config):
            return [Untyped(vf.ToolsetConfig())]

    class UntypedTaskset(vf.Taskset[UntypedTask, vf.TasksetConfig]):
        def load(self):
            yield UntypedTask(shop.ShelfData(prompt="p", prices={}, answer="0"), self.config.task)

    with pytest.raises(TypeError, match="tool look: argument 'item' needs a type annotation"):
        TasksetEnv(UntypedTaskset)

    class Remote(ShelfTask):
        @classmethod
        def toolsets(cls, config):
            return [shop.ShelfTools(vf.ToolsetConfig(url="http://example.invalid/mcp"))]

    class RemoteTaskset(vf.Taskset[Remote, vf.TasksetConfig]):
        def load(self):
            yield Remote(shop.ShelfData(prompt="p", prices={}, answer="0"), self.config.task)

    with pytest.raises(TypeError, match="names a remote server .*in process, offline"):
        TasksetEnv(RemoteTaskset)
