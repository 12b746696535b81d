"""Episodes of agents written as code: a user's agent function, run against the policy server.

The agent is plain code, ``def run(task: dict, base_url: str, api_key: str) -> str`` (or
``async def``): it talks to ``base_url`` with any OpenAI-compatible client and returns its
final answer. ``task`` is ``{"task_id", "prompt", "meta"}`` (never the answer).

``agent_episode`` runs one agent on one task: it opens an episode on a ``PolicyServer``, runs
the agent in a thread for at most ``timeout_s`` seconds, closes the episode (later calls get
404), and builds the ``Episode``: the session tree from the calls
(``trajectories.sessions_from_calls``: on token ids, or on messages where the policy reports
no prompt ids, as an ``openai:URL`` policy under evaluation does; the test used is
``reward.audit["sessions_inferred_by"]``), the answer scored by a ``DatasetEnv``'s scorer (the
same rewards as ``Dataset-v0``, run under ``envs.deadline``), each session's
``used_by_final`` by data flow (``envs.sessions.used_by_data_flow``), the final session being
that of the latest call whose reply holds the answer (else the latest call's).

**Agent faults are infrastructure faults.** An agent that raises, runs past ``timeout_s``,
returns something other than a string, never calls the model, or leaves calls that form no
tree ends its episode as ``Outcome.sandbox_error`` (masked out of the loss, counted in
``reward/infra_error_rate``), with ``audit["agent_fault"]`` (an ``AgentFault``),
``audit["agent_error"]`` and ``audit["task_id"]``, and an ``AgentFaultWarning`` naming the
task. One exception: an agent that raises after the server refused its prompt as too long
ran out of context, which is the policy's doing: the episode is ``truncated``. A thread still
running after ``timeout_s`` cannot be killed: it is left behind (a daemon), and its calls get
404 from then on.

``run_agent_episodes`` runs many (task, sample) jobs at once on threads against one server,
which batches their calls into the policy's ``generate``; job k's episode is seeded
``seed + k`` and its c-th call samples from the random stream ``(seed + k, c)``, as
``envs.runner.run_episodes`` seeds and samples job k. ``envs.agent_env.AgentEnv``
(``agent_rl/Agent-v0``) is how the trainer and evaluation reach it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any

from envs import deadline
from envs.agent_proxy import EpisodeLink, PolicyServer
from envs.core import PROMPT_TOO_LONG, TaskSpec
from envs.datasets import DatasetEnv
from envs.runner import Policy, Sampling
from envs.sessions import used_by_data_flow
from envs.tools import HermesParser
from trajectories import Episode, Outcome, RewardBreakdown, Session, Turn, sessions_from_calls
from trajectories.calls import ModelCall
from trajectories.functions import load_function

ENV_ID = "agent_rl/Agent-v0"
TIMEOUT_S = 300.0
# Answers scored at once: as many as envs.deadline keeps idle workers. A rollout's episodes
# end together; scored all at once, each past the idle ones started a worker (~0.4 s apiece,
# one after another), which were closed again after.
_SCORING = threading.BoundedSemaphore(deadline.MAX_IDLE)


class AgentFault(str, Enum):
    """Why an agent's episode is an infrastructure fault."""

    raised = "raised"
    timeout = "timeout"
    bad_return = "bad_return"
    no_model_call = "no_model_call"
    bad_calls = "bad_calls"


class AgentFaultWarning(RuntimeWarning):
    """An agent's episode ended as an infrastructure fault (masked, counted)."""


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent function ``"package.module:function"`` or ``"path/to/file.py:function"``
    (``trajectories.functions.load_function``: a file is imported once per process)."""
    return load_function(str(spec), "agent")


def task_dict(task: TaskSpec) -> dict[str, Any]:
    """What the agent is given: the task's id, prompt and metadata (never its answer)."""
    return {"task_id": task.task_id, "prompt": task.prompt, "meta": task.meta.model_dump()}


def call_agent(agent: Callable[..., Any], task: dict[str, Any], link: EpisodeLink,
               timeout_s: float) -> tuple[Any, AgentFault | None, str]:
    """Run ``agent`` on a thread for at most ``timeout_s``; (its return value, the fault or
    None, the fault's reason). The episode's URL is closed when this returns."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            value = agent(task, link.base_url, link.api_key)
            out["value"] = asyncio.run(value) if inspect.iscoroutine(value) else value
        except BaseException as exc:  # the agent's own failure, reported as a fault
            out["error"] = exc

    thread = threading.Thread(target=target, name=f"agent-{task.get('task_id')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    link.close()
    if thread.is_alive():
        return None, AgentFault.timeout, f"the agent ran past timeout_s={timeout_s:g} s"
    if "error" in out:
        exc = out["error"]
        return None, AgentFault.raised, f"{type(exc).__name__}: {str(exc)[:500]}"
    if not isinstance(out.get("value"), str):
        return None, AgentFault.bad_return, (f"the agent returned {type(out.get('value')).__name__}"
                                             ", not the answer as a str")
    return out["value"], None, ""


def _final_session(answer: str, calls: Sequence[ModelCall], session_of: dict[int, str]) -> str:
    text = answer.strip()
    holding = [c for c in calls if text and text in str(c.reply.get("content") or "")]
    return session_of[max(holding or calls, key=lambda c: (c.ended, c.index)).index]


def _opening(session: Session, calls: Sequence[ModelCall], session_of: dict[int, str]) -> Session:
    first = min((c for c in calls if session_of[c.index] == session.session_id),
                key=lambda c: (c.started, c.index))
    return session.model_copy(update={"metrics": {**session.metrics,
                                                  "opening_turns": len(first.messages)}})


def agent_episode(agent: Callable[..., Any], task: TaskSpec, server: PolicyServer,
                  scorer: DatasetEnv, timeout_s: float = TIMEOUT_S, **fields: Any) -> Episode:
    """One episode of ``agent`` on ``task`` (module docstring). ``fields``: the other
    ``Episode`` fields (``episode_id``, ``group_id``, ``sample_id``, ``seed``, ``split``,
    ``generation``); ``episode_id`` defaults to the task id. The episode's ``seed`` keys its
    calls' random streams (``PolicyServer.open_episode``)."""
    episode_id = fields.pop("episode_id", task.task_id)
    fields.setdefault("group_id", task.task_id)
    link = server.open_episode(stream=fields.get("seed"))
    answer, fault, reason = call_agent(agent, task_dict(task), link, timeout_s)
    calls = link.calls()
    sessions, session_of, inferred = [], {}, {}
    if calls:
        try:
            tree = sessions_from_calls(calls, episode_id)
            session_of, inferred = tree.session_of, {"sessions_inferred_by": tree.by.value}
            sessions = [_opening(s, calls, session_of) for s in tree.sessions]
        except ValueError as exc:
            fault, reason = fault or AgentFault.bad_calls, str(exc)
    elif fault is None:
        fault, reason = AgentFault.no_model_call, "the agent never called the model"
    if not sessions:  # nothing to record but the task
        sessions = [Session(session_id=f"{episode_id}/s0", episode_id=episode_id,
                            turns=[Turn(role="user", content=task.prompt)],
                            metrics={"opening_turns": 1})]
    verifier = f"{ENV_ID}@0/{scorer.verifier.name}"
    if fault is None:
        with _SCORING:
            reward = scorer.score(task, answer, None)
    else:
        reward = _fault_reward(task, fault, reason, link, scorer.reward_weights, verifier)
    assistant_turns = sum(t.role == "assistant" for s in sessions
                          for t in s.turns[s.metrics["opening_turns"]:])
    reward = reward.model_copy(update={"audit": {
        **reward.audit, "assistant_turns": assistant_turns, "refused_calls": list(link.refused),
        "unmet_tool_choice": list(link.unmet_tool_choice), **inferred}})
    final = _final_session(answer, calls, session_of) if fault is None else None
    fields.update(episode_id=episode_id, env_id=ENV_ID, env_version=0, task_id=task.task_id,
                  task_meta=task.meta.model_dump(), sessions=sessions, reward=reward,
                  final_session_id=final)
    draft = Episode.model_construct(**fields)
    used = used_by_data_flow(draft, HermesParser().parse) if final is not None else {}
    data = draft.model_dump()
    for session in data["sessions"]:
        session["used_by_final"] = used.get(session["session_id"], False)
    return Episode.model_validate(data)


def _fault_reward(task: TaskSpec, fault: AgentFault, reason: str, link: EpisodeLink,
                  weights: dict[str, float], verifier: str) -> RewardBreakdown:
    """The reward of an episode the agent did not finish: ``truncated`` when it raised after
    a prompt was refused as too long, else a ``sandbox_error`` (warned, naming the task)."""
    out_of_context = fault is AgentFault.raised and any(
        r["reason"] == PROMPT_TOO_LONG for r in link.refused)
    if not out_of_context:
        warnings.warn(f"{ENV_ID} task {task.task_id}: agent fault {fault.value} ({reason:.300}); "
                      "the episode is a sandbox_error (masked out of the loss, counted in "
                      "reward/infra_error_rate)", AgentFaultWarning, stacklevel=3)
    return RewardBreakdown.from_components(
        dict.fromkeys(weights, 0.0), dict(weights),
        Outcome.truncated if out_of_context else Outcome.sandbox_error, verifier,
        audit={"agent_fault": fault.value, "agent_error": reason[:2000], "task_id": task.task_id})


def run_agent_episodes(agent: Callable[..., Any] | str, tasks: Sequence[TaskSpec], policy: Policy,
                       scorer: DatasetEnv, sampling: Sampling | None = None,
                       samples_per_task: int = 1, seed: int = 0, timeout_s: float = TIMEOUT_S,
                       concurrency: int = 16, group_prefix: str = "", split: str | None = None,
                       window_s: float = 0.05) -> list[Episode]:
    """Every task ``samples_per_task`` times, up to ``concurrency`` agents at once against
    one ``PolicyServer`` (the contract's ``sampling``, whatever the agent asks for); episodes
    in job order, ids as ``envs.runner.run_episodes`` names them."""
    agent = load_agent(agent) if isinstance(agent, str) else agent
    sampling = sampling or Sampling()
    jobs = [(task, j) for task in tasks for j in range(samples_per_task)]
    with PolicyServer(policy, sampling, fixed_sampling=True, window_s=window_s,
                      max_batch=max(concurrency, 1)) as server:

        def one(k: int) -> Episode:
            task, sample = jobs[k]
            extra = {"split": split} if split is not None else {}
            return agent_episode(agent, task, server, scorer, timeout_s,
                                 episode_id=f"{group_prefix}{task.task_id}#{sample}@{seed + k}",
                                 group_id=group_prefix + task.task_id, sample_id=sample,
                                 seed=seed + k, generation=sampling.to_dict(), **extra)

        with ThreadPoolExecutor(max(1, min(concurrency, len(jobs) or 1)),
                                thread_name_prefix="agent-episode") as pool:
            return list(pool.map(one, range(len(jobs))))
