"""verifiers bridge: run a ``verifiers.v1`` Taskset (verifiers 0.4 API) as a ToolEnv, offline.

Description
    Each taskset row (a ``vf.Task``) becomes a ``TaskSpec``: the prompt is the row's prompt text,
    ``data["row"]`` holds the row's ``TaskData`` as JSON (what the taskset's own scoring reads)
    and ``target`` holds the row's reference answer when it has one (an ``answer``-like field).
    The policy answers in one reply; that reply is scored by the taskset's own ``Task.score``.

Tools
    None. Tasksets whose tasks or taskset declare tool servers (``toolsets``) are refused.

Observation
    ``[system, user]``: the row's ``system_prompt`` (or a default) and its prompt text.

Reward
    ``Task.score(trace)`` runs the task's ``@vf.reward`` (and ``@vf.metric``) functions on a
    ``vf.Trace`` holding the prompt and the reply as its sampled assistant turn. Each recorded
    ``vf.Reward(score, weight)`` becomes one component and its weight; ``total`` is
    ``sum(weight * score)`` as in verifiers. Metrics go to ``reward.audit["metrics"]``. A reward
    function that raises scores 0 (outcome ``wrong``, the error in ``audit["scoring_error"]``),
    as verifiers records a failed scoring on the trace rather than crashing.

    Offline only. Refused when the env is built: judges plugged into the task config, reward
    or metric functions that need a runtime (sandbox), ``NEEDS_CONTAINER`` tasks and tasks with
    their own ``setup``/``finalize`` (those need a runtime too). A judge called from inside a
    reward function raises ``OfflineScoringError`` when scoring reaches it.

Episode end
    The first reply without a tool call ends the episode (outcome ``correct`` when every
    positively weighted reward is at its maximum of 1, ``wrong`` otherwise).

Version history
    v0: first release (verifiers 0.4.0).

``verifiers`` is imported lazily, so ``import envs`` never needs it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.registry import register
from trajectories import Outcome, RewardBreakdown

if TYPE_CHECKING:
    from verifiers.v1 import Task, Taskset, Trace

ANSWER_FIELDS = ("answer", "reference", "target", "solution", "expected", "ground_truth")
DEFAULT_INSTRUCTIONS = "Solve the task. Reply with your final answer."


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
    if type(task).toolsets(task.config) or type(taskset).toolsets(taskset.config):
        problems.append("it declares tool servers (toolsets)")
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
# The environment
# ---------------------------------------------------------------------------------------------


class TasksetEnv(ToolEnv):
    env_id = "verifiers/Taskset-v0"
    version = 0

    def __init__(self, taskset: Any, env_id: str | None = None, answer_field: str | None = None,
                 max_rows: int = 10_000, **kwargs: Any):
        super().__init__(**kwargs)
        self.taskset = load_taskset(taskset)
        self._name = type(self.taskset).__name__
        self.env_id = env_id or f"verifiers/{self._name}-v{self.version}"
        self._rows: list[Task] = list(itertools.islice(self.taskset, max_rows))
        if not self._rows:
            raise ValueError(f"taskset {self._name} yielded no tasks")
        first = self._rows[0]
        check_offline(self.taskset, first)
        self._task_cls = type(first)
        self._data_cls = type(first.data)
        self._task_config = first.config
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

    def _task(self, spec: TaskSpec) -> Task:
        return self._task_cls(self._data_cls.model_validate(spec.data["row"]), self._task_config)

    # --- scoring ---------------------------------------------------------------------------
    def score(self, task: TaskSpec, answer: str, state: Any) -> RewardBreakdown:
        vf_task = self._task(task)
        trace = self._trace(vf_task, answer)
        verifier = f"{self.env_id}@{self.version}"
        try:
            with _no_judge_calls():
                _run_async(vf_task.score(trace))
        except Exception as exc:
            offline = _offline_cause(exc)
            if offline is not None:
                raise offline from exc
            zeros = dict.fromkeys(self.reward_weights, 0.0)
            return RewardBreakdown.from_components(
                zeros, dict(self.reward_weights), Outcome.wrong, verifier,
                audit={"scoring_error": f"{type(exc).__name__}: {exc}"})
        components, weights, unscored = {}, {}, []
        for name, reward in trace.rewards.items():
            ok = reward is not None and math.isfinite(reward.score) and math.isfinite(reward.weight)
            if not ok:
                unscored.append(name)
            components[name] = reward.score if ok else 0.0
            weights[name] = reward.weight if ok else self.reward_weights.get(name, 1.0)
        best = all(components[k] >= 1.0 - 1e-9 for k, w in weights.items() if w > 0)
        audit: dict[str, Any] = {"metrics": {k: v for k, v in trace.metrics.items()
                                             if v is not None and math.isfinite(v)}}
        if unscored:
            audit["unscored"] = unscored
        outcome = Outcome.correct if best and not unscored else Outcome.wrong
        return RewardBreakdown.from_components(components, weights, outcome, verifier, audit)

    def _trace(self, task: Task, answer: str) -> Trace:
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

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.target


def register_taskset(id: str, taskset_path: str, **kwargs: Any) -> None:
    """Register a taskset (``"module:attr"`` or an installed taskset id) as environment ``id``."""
    register(id, "envs.verifiers_bridge:TasksetEnv",
             kwargs={"taskset": taskset_path, "env_id": id, **kwargs})
