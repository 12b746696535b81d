"""A multi-turn verifiers environment with tools, run through agent-rl's episode runner.

    python examples/verifiers_tools.py

A ``verifiers.v1`` taskset (the ``verifiers`` extra) whose task declares a ``vf.Toolset``: the
agent looks prices up with the ``@vf.tool`` method ``price`` over several turns, then answers
the total. The bridge (``envs.verifiers_bridge``) hosts the toolset in this process (each tool
call reads and writes the rollout's ``vf.State`` as verifiers' state channel would) and scores
the whole conversation with the task's own ``@vf.reward`` functions, offline.

A scripted policy plays here so the output is the same everywhere; to train on it, register
the taskset the same way and name its id in a contract (``agent_rl.train({"env": {"id":
"examples/Shelf-v0"}, ...})``, in the process that registered it). The taskset is passed by
name (``"verifiers_tools:ShelfTaskset"``) because a scoring worker cannot import a script's
``__main__``; this file's own folder is on ``sys.path`` when it runs, so the worker imports it
as the module ``verifiers_tools``.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf

SHELVES = [{"pen": 3, "cup": 4}, {"pen": 5, "cup": 11}, {"pen": 2, "cup": 9}]


class ShelfState(vf.State):
    lookups: list[str] = []  # what the tools wrote, read by the rewards


class ShelfData(vf.TaskData):
    prices: dict[str, int]
    answer: str


class ShelfTools(vf.Toolset[vf.ToolsetConfig, ShelfState]):
    async def setup_task(self, task):  # per rollout: this row's shelf
        self.prices = dict(task.prices)

    @vf.tool
    def price(self, item: str) -> str:
        """The price of one item on the shelf."""
        self.state.lookups.append(item)
        if item not in self.prices:
            raise KeyError(f"no item {item!r} on the shelf")
        return str(self.prices[item])


class ShelfTask(vf.Task[ShelfData, ShelfState, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [ShelfTools(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def looked_up(self, trace) -> float:
        return float(set(trace.state.lookups) >= set(self.data.prices))


class ShelfTaskset(vf.Taskset[ShelfTask, vf.TasksetConfig]):
    def load(self):
        for shelf in SHELVES:
            yield ShelfTask(ShelfData(
                prompt="What do a pen and a cup cost together? Look up each price, then reply "
                       "with the total only.", prices=shelf, answer=str(sum(shelf.values()))),
                self.config.task)


class Shopper:
    """A scripted policy: one ``price`` call per item, then the sum of what the tool said."""

    def generate(self, batch, sampling):
        from envs.runner import Completion

        replies = []
        for messages in batch:
            asked = sum(m["role"] == "assistant" for m in messages)
            if asked < 2:
                call = {"name": "shelf_tools_price", "arguments": {"item": ["pen", "cup"][asked]}}
                replies.append(Completion(f"<tool_call>{json.dumps(call)}</tool_call>"))
            else:
                said = [int(m["content"]) for m in messages if m["role"] == "tool"]
                replies.append(Completion(str(sum(said))))
        return replies


def main() -> None:
    import envs
    from envs.runner import run_episodes
    from envs.verifiers_bridge import register_taskset
    from trajectories.display import escape_terminal

    register_taskset("examples/Shelf-v0", "verifiers_tools:ShelfTaskset")
    env = envs.make("examples/Shelf-v0")
    tasks = env.unwrapped.task_pool(3, seed=0)
    for episode in run_episodes([env], tasks, Shopper()):
        turns = episode.sessions[0].turns
        print(f"{episode.task_id}: {sum(t.role == 'assistant' for t in turns)} assistant turns, "
              f"tools said {escape_terminal(str([t.content for t in turns if t.role == 'tool']))}, "
              f"answer {escape_terminal(turns[-1].content)!r}")
        print(f"  reward {episode.reward.total:g} ({episode.reward.outcome.value}): "
              f"{episode.reward.components}")


if __name__ == "__main__":
    main()
