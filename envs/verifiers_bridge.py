"""verifiers bridge: run a ``verifiers.v1`` Taskset (verifiers 0.4 API) as a ToolEnv, offline,
single-turn or multi-turn with the task's tools.

Description
    Each taskset row (a ``vf.Task``) becomes a ``TaskSpec``: the prompt is the row's prompt text,
    ``data["row"]`` holds the row's ``TaskData`` as JSON (what the taskset's own scoring reads)
    and ``target`` holds the row's reference answer when it has one (an ``answer``-like field).
    Without tools the policy answers in one reply, scored by the taskset's own ``Task.score``;
    with tools it calls them over as many turns as it needs (``max_turns``), and the whole
    conversation is scored.

Tools
    The ``@vf.tool`` methods of the task's toolsets (``Task.toolsets(config)``: built for each
    episode, ``setup()`` then ``setup_task(row data)``) and of the taskset's (``Taskset.toolsets``:
    built once, shared), hosted in this process rather than served over MCP: each is an env
    tool named as verifiers advertises it (``<server>_<tool>``, the server the snake-cased
    class name or ``TOOL_PREFIX``), its typed arguments the JSON schema. A call runs as
    verifiers' ``ServerBase._with_state`` runs it: the rollout's ``vf.State`` (the task's State
    class, fresh per episode) is read into the toolset's State class, the method runs (awaited
    when async), the state is written back, so rewards read what the tools wrote
    (``trace.state``). What a tool raises reaches the agent as a tool error. Refused when the
    env is built: a tool server that is no ``vf.Toolset``, one that names a remote ``url``, a
    tool argument without a type, two tools of one name.

Observation
    ``[system, user]``: the row's ``system_prompt`` (or a default), with the tool list when it
    has tools, and its prompt text; then the tool results as ``tool`` turns.

Reward
    ``Task.score(trace)`` runs the task's ``@vf.reward`` (and ``@vf.metric``) functions on a
    ``vf.Trace`` holding the prompt and the reply as its sampled assistant turn (with tools:
    the whole conversation, each assistant turn's tool calls parsed from its text and the
    tool results answering them, and the episode's ``vf.State``). Each recorded
    ``vf.Reward(score, weight)`` becomes one component and its weight; ``total`` is
    ``sum(weight * score)`` as in verifiers. Metrics go to ``reward.audit["metrics"]``. A reward
    function that raises scores 0 (outcome ``wrong``, the error in ``audit["scoring_error"]``),
    as verifiers records a failed scoring on the trace rather than crashing.

    Bounded: scoring runs in a deadline worker process (``envs.deadline``) stopped after
    ``reward_timeout_s`` seconds (default 10; a finite number > 0, checked before the taskset
    is loaded). A reward function that sleeps, loops or hangs in C code (a regex), or that
    kills its process, makes the episode a ``sandbox_error`` (masked out of the loss, counted)
    with the reason in ``audit["reward_error"]``, the task in ``audit["task_id"]`` and a
    ``RewardFaultWarning`` naming the task (``envs.scoring``); the next reply is scored by a
    fresh worker. How the worker gets the taskset:

    * given by name (a ``"module:attr"`` string or an installed taskset id): the worker loads
      it with ``load_taskset`` itself, once, and keeps it;
    * given as an object (an instance, a class, a factory): what scoring needs (the row's
      ``Task`` and ``TaskData`` classes and the task config, ``ScoringRecipe``) is pickled at
      construction and sent to each worker once, cached there by its sha256.

    A worker loads the taskset outside the reward's deadline (``LOAD_TIMEOUT_S``): once at
    construction, where a taskset that cannot load there fails with a ``TypeError`` saying the
    fix, and again after each stopped call (importing verifiers: about 5 s on 2 busy cores).
    An object whose classes do not pickle (defined inside a function) or live in ``__main__``
    (a script, a notebook) is refused at construction, with that ``TypeError``: pass it by name
    instead, which needs no pickling. It is not scored in a thread of this process instead: a
    thread cannot be stopped, so a hung reward would keep its CPU (and its memory) for the
    life of the run, and a regex or other C code holding the GIL would freeze the trainer
    itself, past any timeout.

    Cost, measured on the test taskset (two rewards and a metric, 2 CPU cores shared with a
    load of about 4): about 1.5 ms a reply scored in process, 2.3 ms through the worker (0.3
    to 1.2 ms more over 5 rounds of 500 replies).

    Offline only. Refused when the env is built: judges plugged into the task config, reward
    or metric functions that need a runtime (sandbox), ``NEEDS_CONTAINER`` tasks and tasks with
    their own ``setup``/``finalize`` (those need a runtime too). Tools run in the trainer's
    process, as an agent-rl env's own ``@tool`` methods do (not in a deadline worker). A judge called from inside a
    reward function raises ``OfflineScoringError`` when scoring reaches it.

Episode end
    The first reply without a tool call ends the episode (outcome ``correct`` when every
    positively weighted reward is at its maximum of 1, ``wrong`` otherwise); ``max_turns``
    replies that only call tools end it ``truncated``. ``@vf.stop`` conditions are not read.

Version history
    v0: first release (verifiers 0.4.0); toolsets hosted, multi-turn scoring.

``verifiers`` is imported lazily, so ``import envs`` never needs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import itertools
import json
import math
import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import TypeAdapter

from envs import deadline
from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.registry import register
from envs.scoring import REWARD_TIMEOUT_S, check_reward_timeout, fault_reason, reward_fault
from envs.tools import ToolCall, ToolError, ToolSpec
from trajectories import Outcome, RewardBreakdown

if TYPE_CHECKING:
    from verifiers.v1 import Task, Taskset, Trace

ANSWER_FIELDS = ("answer", "reference", "target", "solution", "expected", "ground_truth")
DEFAULT_INSTRUCTIONS = "Solve the task. Reply with your final answer."
LOAD_TIMEOUT_S = 120.0  # loading a taskset in a scoring worker (importing verifiers: seconds)
LOAD_TRIES = 3


class OfflineScoringError(RuntimeError):
    """The taskset's scoring needs something the offline bridge does not have (a network
    judge, a runtime/sandbox)."""


# ---------------------------------------------------------------------------------------------
# Loading a taskset
# ---------------------------------------------------------------------------------------------


def load_taskset(spec: Any) -> Taskset:
    """A ``vf.Taskset`` from an instance, a Taskset subclass (built with its default config),
    a zero-argument factory, an import path ``"module:attr"`` naming any of those, or an
    installed taskset id (``"reverse-text"``)."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type

    if isinstance(spec, str):
        if ":" in spec:
            module, _, attr = spec.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            spec = obj
        else:
            return vf.load_taskset(vf.taskset_config_type(spec)(id=spec))
    if isinstance(spec, vf.Taskset):
        return spec
    if isinstance(spec, type) and issubclass(spec, vf.Taskset):
        config_cls = concrete_type(spec, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return spec(config_cls())
    if callable(spec):
        built = spec()
        if isinstance(built, vf.Taskset):
            return built
    raise TypeError(
        f"expected a verifiers.v1 Taskset (instance, subclass, factory or 'module:attr' path), "
        f"got {spec!r}"
    )


def first_row(taskset: Taskset) -> Task:
    """The taskset's first row (``ValueError`` when it has none)."""
    first = next(iter(taskset), None)
    if first is None:
        raise ValueError(f"taskset {type(taskset).__name__} yielded no tasks")
    return first


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def check_offline(taskset: Taskset, task: Task) -> None:
    """Raise ``OfflineScoringError`` naming what in ``task`` cannot be scored offline."""
    import verifiers.v1 as vf

    name = type(task).__name__
    problems = []
    if task.config.judges:
        ids = [j.name or j.id for j in task.config.judges]
        problems.append(f"judges {ids} are plugged into the task config (they call a model "
                        "endpoint over the network)")
    if task.NEEDS_CONTAINER:
        problems.append("it sets NEEDS_CONTAINER")
    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            problems.append(f"it overrides {hook}() (which runs in a runtime)")
    runtime_fns = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)
                   if _needs_runtime(fn)]
    if runtime_fns:
        problems.append(f"reward/metric functions {runtime_fns} need a runtime")
    if not task.hooks("reward"):
        problems.append("it has no @vf.reward function to score with")
    if problems:
        raise OfflineScoringError(
            f"task {name} of taskset {type(taskset).__name__} cannot be scored offline: "
            + "; ".join(problems) + ". The bridge runs Task.score with no network and no runtime."
        )


@contextmanager
def _no_judge_calls() -> Iterator[None]:
    """Make any ``vf.Judge`` call inside scoring raise ``OfflineScoringError``."""
    from verifiers.v1.judge import Judge

    async def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OfflineScoringError(
            f"scoring called the network judge {type(self).__name__} ({self.config.model}); "
            "the verifiers bridge scores offline only. Use a taskset with deterministic rewards."
        )

    original = Judge.complete
    Judge.complete = refuse
    try:
        yield
    finally:
        Judge.complete = original


def _run_async(coro: Any) -> Any:
    """Run a coroutine to completion in a fresh event loop (in a worker thread if this thread
    already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _offline_cause(exc: BaseException) -> OfflineScoringError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OfflineScoringError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# ---------------------------------------------------------------------------------------------
# Tools: a task's toolsets hosted in this process
# ---------------------------------------------------------------------------------------------


@dataclass
class HostedTools:
    """The tools of one episode: every ``@vf.tool`` method of the task's toolsets (built per
    episode: ``setup()`` then ``setup_task(data)``) and of the taskset's (built once, shared),
    as ``ToolSpec``s named as verifiers advertises them (``<server>_<tool>``), and the
    rollout's ``vf.State`` (the task's State class) that the tools read and write, as
    verifiers' state channel gives it to them."""

    specs: dict[str, ToolSpec]
    state: Any


def build_toolsets(toolsets: list[Any], data: Any | None) -> list[Any]:
    """``toolsets`` set up here (``setup()``; ``setup_task(data)`` when ``data`` is given);
    ``TypeError`` for a server that is no ``vf.Toolset`` or names a remote ``url``."""
    import verifiers.v1 as vf

    for toolset in toolsets:
        if not isinstance(toolset, vf.Toolset):
            raise TypeError(f"tool server {type(toolset).__name__} is not a vf.Toolset; the "
                            "bridge hosts Toolset @vf.tool methods only")
        if getattr(toolset.config, "url", None):
            raise TypeError(f"toolset {type(toolset).__name__} names a remote server "
                            f"({toolset.config.url}); the bridge hosts toolsets in process, "
                            "offline")
        _run_async(toolset.setup())
        if data is not None:
            _run_async(toolset.setup_task(data))
    return toolsets


def tool_specs(toolsets: list[Any], hosted: Callable[[], HostedTools]) -> dict[str, ToolSpec]:
    """A ``ToolSpec`` per ``@vf.tool`` method (its typed arguments: the schema), each calling
    the method through ``call_tool`` on the episode's state (``hosted()``)."""
    from verifiers.v1.utils.decorators import discover_decorated

    specs: dict[str, ToolSpec] = {}
    for toolset in toolsets:
        for method in discover_decorated(toolset, "tool"):
            raw = getattr(method, "tool_name", None) or method.__name__
            name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
            if name in specs:
                raise TypeError(f"two toolsets advertise the tool {name!r}; keep MCP tool "
                                "names qualified (TOOL_PREFIX)")
            spec = ToolSpec.from_function(method.__func__, name=name)

            def run(owner: Any, _t: Any = toolset, _m: Any = method, **arguments: Any) -> Any:
                return call_tool(hosted(), _t, _m, arguments)

            specs[name] = replace(spec, fn=run)
    return specs


def call_tool(hosted: HostedTools, toolset: Any, method: Any, arguments: dict[str, Any]) -> Any:
    """One tool call as verifiers' ``ServerBase._with_state`` makes it: the rollout state
    pulled into the toolset's State class, the method run (awaited when async), the state
    pushed back. What the method raises is a ``ToolError`` the agent reads."""
    from verifiers.v1.mcp.server import _call_state
    from verifiers.v1.state import state_cls

    own = state_cls(type(toolset)).model_validate_json(hosted.state.model_dump_json())
    token = _call_state.set(own)
    try:
        result = method(**arguments)
        if inspect.isawaitable(result):
            result = _run_async(result)
    except Exception as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None
    finally:
        _call_state.reset(token)
    hosted.state = type(hosted.state).model_validate_json(own.model_dump_json())
    return result if isinstance(result, str | dict | list) else str(result)


def conversation(messages: list[dict[str, Any]], parse: Callable[[str], list[Any]]
                 ) -> list[dict[str, Any]]:
    """Our session's chat messages as verifiers messages (plain dicts, for a worker): an
    assistant turn's tool calls parsed from its text (ids ``call-N``), each tool result
    answering the next call in order."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for n, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "assistant":
            calls = [c for c in parse(content) if isinstance(c, ToolCall)]
            pending = [{"id": f"call-{n}-{i}", "name": c.name,
                        "arguments": json.dumps(c.arguments)} for i, c in enumerate(calls)]
            out.append({"role": role, "content": content, "tool_calls": list(pending) or None})
        elif role == "tool":
            call = pending.pop(0) if pending else {"id": f"call-{n}", "name": message.get("name")}
            out.append({"role": role, "content": content, "tool_call_id": call["id"],
                        "name": message.get("name") or call["name"]})
        else:
            out.append({"role": role, "content": content})
    return out


# ---------------------------------------------------------------------------------------------
# Scoring in a deadline worker
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoringRecipe:
    """What scoring a reply needs, taken from a taskset's first row: the row's ``Task`` and
    ``TaskData`` classes and its task config (the rows of a taskset share them)."""

    task_cls: type
    data_cls: type
    config: Any

    @classmethod
    def of(cls, first: Task) -> ScoringRecipe:
        return cls(type(first), type(first.data), first.config)

    def task(self, row: dict[str, Any]) -> Task:
        """The ``vf.Task`` of a ``TaskSpec``'s ``data["row"]``."""
        return self.task_cls(self.data_cls.model_validate(row), self.config)


@dataclass(frozen=True)
class TasksetByName:
    """A taskset a scoring worker loads itself, with ``load_taskset(spec)``."""

    spec: str

    @property
    def key(self) -> str:
        return f"name:{self.spec}"

    def recipe(self) -> ScoringRecipe:
        return ScoringRecipe.of(first_row(load_taskset(self.spec)))


@dataclass(frozen=True)
class PickledRecipe:
    """The ``ScoringRecipe`` of an in-memory taskset, pickled by the caller."""

    blob: bytes

    @property
    def key(self) -> str:
        return f"pickle:{hashlib.sha256(self.blob).hexdigest()}"

    def recipe(self) -> ScoringRecipe:
        return pickle.loads(self.blob)


def scoring_source(spec: Any, recipe: ScoringRecipe, name: str
                   ) -> TasksetByName | PickledRecipe:
    """How a scoring worker gets taskset ``spec``: by name when given by name (a string), else
    its ``recipe`` pickled; a ``TypeError`` saying to pass it by name when that cannot work."""
    if isinstance(spec, str):
        return TasksetByName(spec)
    in_main = [c.__qualname__ for c in (recipe.task_cls, recipe.data_cls)
               if c.__module__ == "__main__"]
    if in_main:
        raise unsendable(name, f"its classes {in_main} are defined in __main__ (a script or "
                               "notebook), which a worker process cannot import")
    try:
        return PickledRecipe(pickle.dumps(recipe))
    except Exception as exc:
        raise unsendable(name, f"its task classes or config do not pickle "
                               f"({type(exc).__name__}: {exc})") from None


def unsendable(name: str, why: str) -> TypeError:
    return TypeError(
        f"taskset {name} cannot be scored in a worker process: {why}. The bridge scores "
        "every reply in a worker it can stop at reward_timeout_s; pass the taskset by name "
        "('module:attr' of the taskset, its class or a factory, or an installed taskset id) so "
        "the worker loads it itself, or define its Task and TaskData classes at module level "
        "in an importable module.")


@dataclass(frozen=True)
class Scored:
    """What ``Task.score`` recorded: each reward as ``(score, weight)`` (None: not recorded)
    and each metric, in the trace's order."""

    rewards: dict[str, tuple[float, float] | None]
    metrics: dict[str, float | None]


@dataclass(frozen=True)
class RewardRaised:
    """A reward or metric function raised (``"Type: message"``)."""

    error: str


@dataclass(frozen=True)
class NotLoaded:
    """This worker has not loaded the taskset yet (``load_in_worker`` does)."""


_RECIPES: dict[str, ScoringRecipe] = {}  # in a deadline worker: the tasksets it has loaded


def load_in_worker(source: TasksetByName | PickledRecipe) -> None:
    """Load ``source`` in this (worker) process, once: later calls find it by its key."""
    if source.key not in _RECIPES:
        _RECIPES[source.key] = source.recipe()


def score_in_worker(key: str, row: dict[str, Any], answer: str | list[dict[str, Any]],
                    state: str | None = None) -> Scored | RewardRaised | NotLoaded:
    """``Task.score`` on ``row`` with the taskset loaded under ``key``, as plain data:
    ``answer`` a single reply, or a whole conversation (``conversation``) with the rollout
    state as JSON; ``NotLoaded`` at once when this worker has not loaded it (loading is not
    bounded by the reward's deadline). A network judge reached inside raises
    ``OfflineScoringError``."""
    recipe = _RECIPES.get(key)
    if recipe is None:
        return NotLoaded()
    task = recipe.task(row)
    trace = (reply_trace(task, answer) if isinstance(answer, str)
             else conversation_trace(task, answer, state))
    try:
        with _no_judge_calls():
            _run_async(task.score(trace))
    except Exception as exc:
        offline = _offline_cause(exc)
        if offline is not None:
            raise offline from exc
        return RewardRaised(f"{type(exc).__name__}: {exc}")
    return Scored({name: None if r is None else (r.score, r.weight)
                   for name, r in trace.rewards.items()}, dict(trace.metrics))


def reply_trace(task: Task, answer: str) -> Trace:
    """A ``vf.Trace`` of one exchange: the row's prompt and ``answer`` as the sampled reply."""
    import verifiers.v1 as vf
    from verifiers.v1.state import state_cls

    data = task.data
    prompt = data.prompt
    if isinstance(prompt, str):
        prompt = [vf.UserMessage(content=prompt)]
    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    messages: list[Any] = [*system, *prompt]
    messages.append(vf.AssistantMessage(content=answer))
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=m is messages[-1])
             for i, m in enumerate(messages)]
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="agent_rl", trainable=False),
        state=state_cls(type(task))(), nodes=nodes,
    )


def conversation_trace(task: Task, messages: list[dict[str, Any]], state: str | None) -> Trace:
    """A ``vf.Trace`` of a whole conversation (``conversation``'s dicts): every assistant
    message sampled, ``state`` (JSON) as the rollout's ``vf.State``."""
    import verifiers.v1 as vf
    from verifiers.v1.state import state_cls

    adapter = TypeAdapter(vf.Message)
    built = [adapter.validate_python({k: v for k, v in m.items() if v is not None})
             for m in messages]
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m,
                            sampled=m.role == "assistant") for i, m in enumerate(built)]
    cls = state_cls(type(task))
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="agent_rl", trainable=False),
        state=cls.model_validate_json(state) if state else cls(), nodes=nodes)


def breakdown(result: Scored | RewardRaised, declared: dict[str, float],
              verifier: str) -> RewardBreakdown:
    """The ``RewardBreakdown`` of what scoring returned (``declared``: the reward functions'
    weights). A reward that raised scores 0 (``wrong``), as verifiers records it."""
    if isinstance(result, RewardRaised):
        return RewardBreakdown.from_components(
            dict.fromkeys(declared, 0.0), dict(declared), Outcome.wrong, verifier,
            audit={"scoring_error": result.error})
    components, weights, unscored = {}, {}, []
    for name, reward in result.rewards.items():
        ok = reward is not None and all(math.isfinite(x) for x in reward)
        if not ok:
            unscored.append(name)
        components[name] = reward[0] if ok else 0.0
        weights[name] = reward[1] if ok else declared.get(name, 1.0)
    best = all(components[k] >= 1.0 - 1e-9 for k, w in weights.items() if w > 0)
    audit: dict[str, Any] = {"metrics": {k: v for k, v in result.metrics.items()
                                         if v is not None and math.isfinite(v)}}
    if unscored:
        audit["unscored"] = unscored
    outcome = Outcome.correct if best and not unscored else Outcome.wrong
    return RewardBreakdown.from_components(components, weights, outcome, verifier, audit)


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


class TasksetEnv(ToolEnv):
    env_id = "verifiers/Taskset-v0"
    version = 0

    def __init__(self, taskset: Any, env_id: str | None = None, answer_field: str | None = None,
                 max_rows: int = 10_000, reward_timeout_s: float = REWARD_TIMEOUT_S,
                 **kwargs: Any):
        self.reward_timeout_s = check_reward_timeout(reward_timeout_s)
        super().__init__(**kwargs)
        self.taskset = load_taskset(taskset)
        self._name = type(self.taskset).__name__
        self.env_id = env_id or f"verifiers/{self._name}-v{self.version}"
        self._rows: list[Task] = list(itertools.islice(self.taskset, max_rows))
        if not self._rows:
            raise ValueError(f"taskset {self._name} yielded no tasks")
        first = self._rows[0]
        check_offline(self.taskset, first)
        self._recipe = ScoringRecipe.of(first)
        self._shared = build_toolsets(type(self.taskset).toolsets(self.taskset.config), None)
        self._hosted(first)  # tools that cannot be hosted fail here, before any worker starts
        self._source = scoring_source(taskset, ScoringRecipe.of(first), self._name)
        try:  # a taskset a worker cannot load fails here, not at the first reply
            self._load_worker()
        except Exception as exc:
            raise unsendable(self._name, f"loading it there failed "
                                         f"({type(exc).__name__}: {exc})") from None
        self.answer_field = answer_field or next(
            (f for f in ANSWER_FIELDS if getattr(first.data, f, None) is not None), None)
        self.reward_weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0))
                               for fn in first.hooks("reward")}

    @property
    def instructions(self) -> str:  # the row's own system prompt
        system = self.task.data.get("row", {}).get("system_prompt") if self.task else None
        return system or DEFAULT_INSTRUCTIONS

    # --- tasks -----------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        rounds = math.ceil(n / len(self._rows))
        order = np.concatenate([rng.permutation(len(self._rows)) for _ in range(rounds)])[:n]
        return [self._spec(self._rows[int(i)]) for i in order]

    def _spec(self, task: Task) -> TaskSpec:
        data = task.data
        prompt = data.prompt_text
        if not prompt:
            raise ValueError(f"{self._name} row {data.idx} has no prompt; tasksets whose user "
                             "opens the conversation are not supported")
        answer = getattr(data, self.answer_field, None) if self.answer_field else None
        return TaskSpec(
            task_id=str(data.id or f"{self._name}-{data.idx}"),
            prompt=prompt,
            meta=TaskMeta(entity_group=self._name, name=data.name, key=task.key),
            target=None if answer is None else str(answer),
            data={"row": data.model_dump(mode="json")},
        )

    # --- tools -----------------------------------------------------------------------------
    def new_state(self, task: TaskSpec) -> HostedTools | None:
        """The episode's tools (``HostedTools``; None for a task without toolsets): its own
        toolsets built and set up for the row, the taskset's shared ones, a fresh state."""
        return self._hosted(self._recipe.task(task.data["row"]))

    def _hosted(self, row: Task) -> HostedTools | None:
        from verifiers.v1.state import state_cls

        toolsets = build_toolsets(type(row).toolsets(row.config), row.data) + self._shared
        if not toolsets:
            self._tools = {}
            return None
        hosted = HostedTools({}, state_cls(type(row))())
        hosted.specs = self._tools = tool_specs(toolsets, lambda: hosted)
        return hosted

    # --- scoring ---------------------------------------------------------------------------
    def score(self, task: TaskSpec, answer: str, state: HostedTools | None) -> RewardBreakdown:
        """``Task.score`` in a deadline worker within ``reward_timeout_s``, of ``answer`` (a
        task without tools) or of the whole conversation with the tools' state; a scoring
        that runs past it, kills its worker or cannot run there is a ``sandbox_error``
        (warned, the reason in ``audit["reward_error"]``)."""
        verifier = f"{self.env_id}@{self.version}"
        scored: tuple[Any, ...] = (answer,) if state is None else (
            conversation(self.active_messages, self.parser.parse), state.state.model_dump_json())
        try:
            result = self._scored(task.data["row"], *scored)
        except OfflineScoringError:
            raise
        except Exception as exc:  # the verifier's fault, not the agent's: masked, counted
            return reward_fault(self.env_id, task.task_id, self._name,
                                fault_reason(exc, self.reward_timeout_s), self.reward_weights,
                                verifier)
        return breakdown(result, self.reward_weights, verifier)

    def _scored(self, row: dict[str, Any], *scored: Any) -> Scored | RewardRaised:
        for _ in range(LOAD_TRIES):  # another caller may take the worker just loaded
            result = deadline.call(score_in_worker, self._source.key, row, *scored,
                                   timeout_s=self.reward_timeout_s)
            if not isinstance(result, NotLoaded):
                return result
            self._load_worker()
        raise RuntimeError(f"no scoring worker kept taskset {self._name} loaded "
                           f"after {LOAD_TRIES} loads")

    def _load_worker(self) -> None:
        try:
            deadline.call(load_in_worker, self._source, timeout_s=LOAD_TIMEOUT_S)
        except deadline.DeadlineExceeded:
            raise RuntimeError(f"loading taskset {self._name} in a scoring worker took over "
                               f"{LOAD_TIMEOUT_S:g} s") from None

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.target


def register_taskset(id: str, taskset_path: str, **kwargs: Any) -> None:
    """Register a taskset (``"module:attr"`` or an installed taskset id) as environment ``id``."""
    register(id, "envs.verifiers_bridge:TasksetEnv",
             kwargs={"taskset": taskset_path, "env_id": id, **kwargs})
