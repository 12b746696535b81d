"""Agent-v0: train and evaluate an agent you already wrote, unchanged.

Description
    The agent is plain code, ``def run(task: dict, base_url: str, api_key: str) -> str`` (or
    ``async def``), that talks to ``base_url`` with the official ``openai`` client or any HTTP
    client and returns its final answer (``envs.agents``). It runs against the policy server
    (``envs.agent_proxy.PolicyServer``), which serves the policy being trained or evaluated
    and records every call's exact tokens; the episode's session tree is inferred from those
    calls (``trajectories.sessions_from_calls``: docs/concepts.md, "Trees from an agent's own
    model calls").

    Keywords (``env.kwargs``):

    * ``agent``: ``"package.module:function"`` or ``"path/to/file.py:function"`` (relative
      paths from the working directory). Required.
    * ``tasks``: the tasks, read as ``Dataset-v0`` reads them: a ``.jsonl``/``.csv`` path or
      ``datasets`` folder with ``prompt``, ``answer`` and metadata columns, or a mapping of
      ``Dataset-v0``'s data keywords (``path``, ``prompt``, ``answer``, ``meta``, ``task_id``,
      ``solution``, ``dataset_split``: ``TASK_KEYS``). Required.
    * ``reward``: a ``Dataset-v0`` reward (``exact | numeric | regex | choice | contains``) or
      ``"module:function"`` with ``(answer, task) -> float | dict``; with ``tolerance``,
      ``weights`` and ``reward_timeout_s`` as ``Dataset-v0`` takes them.
    * ``timeout_s``: seconds an agent may run on one task (default 300).

    ``check_arguments`` checks them without importing the agent or reading the tasks (the
    experiment contract calls it); construction then imports the agent and reads the tasks,
    failing on a missing function or a bad row before any work.

Tools
    None of its own: the agent offers its tools in its requests (``tools``), the server shows
    them to the policy and parses its tool calls back into OpenAI ``tool_calls``; the agent
    runs them.

Observation
    None to step: the agent builds its own messages. ``reset`` and ``step`` raise; the runner
    (``envs.runner.run_episodes``) hands a batch of tasks to ``run_whole_episodes``, which
    runs up to ``num_envs`` agents at once against one server batching their calls.

Reward
    ``Dataset-v0``'s scorer on the agent's return value (``reward_weights`` as it sets them),
    computed in a deadline worker. The agent is given ``{"task_id", "prompt", "meta"}``,
    never the answer.

Episode end
    The agent returns. An agent that raises, runs past ``timeout_s``, returns something other
    than a string, never calls the model, or leaves calls that form no tree ends its episode
    as an infrastructure fault (``sandbox_error``: masked out of the loss, counted in
    ``reward/infra_error_rate`` and by reason in ``faults/agent_<reason>``), warned with the
    task id; an agent that raises after a prompt was refused as too long is ``truncated``.

Tasks
    ``task_pool(n, seed)``: ``Dataset-v0``'s (the rows in a seeded permutation), so splits and
    holdouts come from the task metadata exactly as for ``Dataset-v0``. Tasks carry no hints.

Version history
    v0: first release.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium

from envs.agents import ENV_ID, TIMEOUT_S, load_agent, run_agent_episodes
from envs.core import TaskSpec
from envs.datasets import DatasetEnv, DatasetError
from envs.datasets import check_arguments as check_dataset_arguments
from envs.runner import Policy, Sampling
from envs.scoring import REWARD_TIMEOUT_S
from envs.spaces import ChatSpace, TextSpace
from trajectories import Episode
from trajectories.functions import FunctionSpecError, function_source, is_passed

TASK_KEYS = ("path", "prompt", "answer", "meta", "task_id", "solution", "dataset_split")


class AgentSpecError(ValueError):
    """An ``Agent-v0`` keyword argument that is wrong; ``key`` names it (``agent``,
    ``tasks.path``, ``timeout_s``, ...)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def task_kwargs(tasks: Any) -> dict[str, Any]:
    """``tasks`` as ``Dataset-v0``'s data keywords: a path is ``{"path": path}``."""
    if isinstance(tasks, str) and tasks:
        return {"path": tasks}
    if isinstance(tasks, Mapping):
        unknown = sorted(set(tasks) - set(TASK_KEYS))
        if unknown:
            raise AgentSpecError(f"tasks has the key {unknown[0]!r}, which a dataset spec does "
                                 f"not take; it takes {list(TASK_KEYS)}", key=f"tasks.{unknown[0]}")
        if not isinstance(tasks.get("path"), str) or not tasks["path"]:
            raise AgentSpecError("tasks needs a path: the file (or datasets folder) of the tasks, "
                                 "e.g. tasks: {path: tasks.jsonl, prompt: question}",
                                 key="tasks.path")
        return dict(tasks)
    raise AgentSpecError(f"tasks must be a .jsonl/.csv path or a dataset spec {{path, prompt, "
                         f"answer, meta, ...}}, got {tasks!r:.80}", key="tasks")


def check_arguments(agent: Any = None, tasks: Any = None, reward: Any = "exact",
                    timeout_s: Any = TIMEOUT_S, tolerance: Any = 0.0, weights: Any = None,
                    reward_timeout_s: Any = REWARD_TIMEOUT_S, **_: Any) -> None:
    """``Agent-v0``'s keywords, checked without importing the agent or reading the tasks: an
    ``AgentSpecError`` or ``DatasetError`` naming the key (``key``). The agent's source file
    (or module) must exist."""
    if not isinstance(agent, str) or not agent:
        raise AgentSpecError("agent names your agent function, 'package.module:function' or "
                             f"'path/to/file.py:function' (got {agent!r:.80})", key="agent")
    if is_passed(agent):
        raise AgentSpecError(f"agent {agent!r}: name a function of a module or file "
                             "('module:function' or 'path/to/file.py:function')", key="agent")
    try:
        source = function_source(agent, "agent")
    except (FunctionSpecError, ImportError) as exc:
        raise AgentSpecError(str(exc), key="agent") from None
    if not source.is_file():
        raise AgentSpecError(f"agent {agent!r}: no file {source} (relative paths are read from "
                             f"the working directory {Path.cwd()})", key="agent")
    data = task_kwargs(tasks)
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise AgentSpecError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}",
                             key="timeout_s")
    try:
        check_dataset_arguments(**{k: v for k, v in data.items() if k != "path"},
                                reward=reward, tolerance=tolerance, weights=weights,
                                reward_timeout_s=reward_timeout_s)
    except DatasetError as exc:
        key = f"tasks.{exc.key}" if exc.key in TASK_KEYS else exc.key
        raise DatasetError(str(exc), key=key) from None


class AgentEnv(gymnasium.Env):
    env_id = ENV_ID
    version = 0

    def __init__(self, agent: str | None = None, tasks: str | Mapping[str, Any] | None = None,
                 reward: str = "exact", timeout_s: float = TIMEOUT_S, tolerance: float = 0.0,
                 weights: Mapping[str, float] | None = None,
                 reward_timeout_s: float = REWARD_TIMEOUT_S):
        """Keywords: module docstring."""
        check_arguments(agent, tasks, reward, timeout_s, tolerance, weights, reward_timeout_s)
        try:
            self.agent = load_agent(agent)
        except (FunctionSpecError, ImportError) as exc:
            raise AgentSpecError(str(exc), key="agent") from None
        self.agent_spec, self.timeout_s = agent, float(timeout_s)
        self.scorer = DatasetEnv(**task_kwargs(tasks), reward=reward, tolerance=tolerance,
                                 weights=weights, reward_timeout_s=reward_timeout_s)
        self.reward_weights = self.scorer.reward_weights
        self.data_hash = self.scorer.data_hash
        self.observation_space, self.action_space = ChatSpace(), TextSpace()

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return self.scorer.task_pool(n, seed)

    def reference_action(self) -> str | None:
        return None  # the agent is the user's code: there is no scripted solver

    def run_whole_episodes(self, tasks: Sequence[TaskSpec], policy: Policy, sampling: Sampling,
                           samples_per_task: int, seed: int, group_prefix: str,
                           split: str | None, concurrency: int) -> list[Episode]:
        """The runner's hook (``envs.runner.run_episodes``): every task ``samples_per_task``
        times, up to ``concurrency`` agents at once, episodes in job order."""
        return run_agent_episodes(self.agent, tasks, policy, self.scorer, sampling,
                                  samples_per_task=samples_per_task, seed=seed,
                                  timeout_s=self.timeout_s, concurrency=concurrency,
                                  group_prefix=group_prefix, split=split)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        raise RuntimeError(f"{ENV_ID} runs whole episodes of your agent, not steps: use "
                           "envs.runner.run_episodes (agent-rl train and eval do)")

    def step(self, action: Any):
        raise RuntimeError(f"{ENV_ID} runs whole episodes of your agent, not steps: use "
                           "envs.runner.run_episodes (agent-rl train and eval do)")
