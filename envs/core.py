"""The environment contract: a Gymnasium env whose observations are chat messages and whose
actions are the policy's text, emitting one `trajectories.Episode` (a session tree) per episode.

What a subclass sets (class attributes) and implements (one-method hooks)::

    env_id: str                      "agent_rl/Name-v0"
    version: int                     bumped whenever tasks or scoring change
    instructions: str                system prompt text (the tool list is appended)
    task_pool(n, seed) -> list[TaskSpec]        deterministic task generation
    new_state(task) -> state                    the world the tools act on (None if no tools)
    score(task, answer, state) -> RewardBreakdown   the verifier; a small pure function
    reference_action() -> str | None            the scripted solver's next action
    tool_effects(task, state) -> dict           the final state diff (optional)

Tools are methods decorated with ``@tool``; their typed arguments become a JSON schema.

The loop. ``reset`` opens the root session: system message + task prompt. Each ``step(action)``
appends the action as an assistant turn of the *active* session, then:

* awaiting a summary (compression was requested): the action is the summary; a child session
  opens (``origin="compression"``) whose input is the task plus that summary.
* tool calls in the text (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` by
  default): each is run; results come back as ``tool`` turns. ``spawn(task)`` opens a branch
  session (``origin="branch"``) that becomes active; its final text (or ``return(value)``)
  goes back to the parent as the ``spawn`` tool result.
* no tool call: in a branch, the text is its return value; at the top level it is the final
  answer, scored by ``score``; the episode terminates.

After every step, if the active session's messages exceed ``context_budget`` tokens (counted
by ``token_counter``), the env asks for a summary. Exceeding ``max_turns`` assistant turns
ends the episode ``truncated`` with outcome ``truncated``. Nothing the agent sends raises:
malformed calls, unknown tools and bad arguments come back as tool errors, counted, and the
episode ends ``format_error`` only when it ends on one.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import gymnasium
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from trajectories import Boundary, Episode, Outcome, RewardBreakdown, Session, Turn

# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


class TaskMeta(BaseModel):
    """What splits and evals slice on. Extra keys are kept."""

    model_config = ConfigDict(frozen=True, extra="allow")

    skills: list[str] = Field(default_factory=list, description="tool skills the task exercises")
    structure: str = Field("", description="composition structure, e.g. 'search>transform>update'")
    entity_group: str = Field("", description="which family of entities the task is about")
    length: int = Field(1, description="steps a correct agent needs")
    difficulty: int = Field(0, description="coarse difficulty level")


class TaskSpec(BaseModel):
    """One task. What the verifier needs stays in ``target``/``data``, out of the prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    prompt: str
    meta: TaskMeta = Field(default_factory=TaskMeta)
    target: Any = Field(None, description="what the verifier checks against (never shown)")
    data: dict[str, Any] = Field(default_factory=dict, description="the task's world (records, ...)")
    allowed_tools: list[str] | None = Field(None, description="None: every tool of the env")
    write_scopes: list[str] | None = Field(None, description="ids a write tool may touch; None: any")
    hint: dict[str, Any] | None = Field(None, description="{'text': ..., 'provenance': ...}")


# ---------------------------------------------------------------------------------------------
# Spaces
# ---------------------------------------------------------------------------------------------

_ROLES = ("system", "user", "assistant", "tool")
_WORDS = ("search", "record", "answer", "summary", "tool", "value", "the", "of", "42", "{", "}")


class ChatSpace(gymnasium.Space):
    """Observations: a list of chat messages ``{"role": ..., "content": str, ...}``."""

    def __init__(self, max_messages: int = 10_000, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages

    def contains(self, x: Any) -> bool:
        return (
            isinstance(x, list)
            and 0 < len(x) <= self.max_messages
            and all(
                isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
                for m in x
            )
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, str]]:
        n = int(self.np_random.integers(1, 6))
        return [
            {"role": str(self.np_random.choice(_ROLES)), "content": _random_text(self.np_random)}
            for _ in range(n)
        ]

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ChatSpace()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ChatSpace) and other.max_messages == self.max_messages


class TextSpace(gymnasium.Space):
    """Actions: any string (the policy's raw text)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return _random_text(self.np_random)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


def _random_text(rng: np.random.Generator) -> str:
    return " ".join(str(rng.choice(_WORDS)) for _ in range(int(rng.integers(1, 12))))


# ---------------------------------------------------------------------------------------------
# Tools and tool-call parsing
# ---------------------------------------------------------------------------------------------


class ToolError(Exception):
    """Raised by a tool: the message goes back to the agent as the tool result."""


class PermissionDenied(ToolError):
    """Raised by a tool for a call outside the task's permissions: recorded as a violation."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    args_model: type[BaseModel]
    writes: bool
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (a fresh copy each call)."""
        return copy.deepcopy(_schema(self.name, self.description, self.args_model))


@functools.cache
def _schema(name: str, description: str, args_model: type[BaseModel]) -> dict[str, Any]:
    params = args_model.model_json_schema()
    params.pop("title", None)
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": params}}


def tool(fn: Callable | None = None, *, name: str | None = None, writes: bool = False):
    """Declare an env method as a tool. Typed arguments become the JSON schema (pydantic)."""

    def decorate(f: Callable) -> Callable:
        params = list(inspect.signature(f).parameters.values())[1:]  # drop self
        fields = {}
        for p in params:
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {f.__name__}: argument {p.name!r} needs a type annotation")
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[p.name] = (p.annotation, default)
        model = create_model(f"{f.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
        doc = inspect.getdoc(f) or ""
        f.__tool__ = ToolSpec(name or f.__name__, doc.split("\n\n")[0], model, writes, f)
        return f

    return decorate(fn) if fn is not None else decorate


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    message: str


class ToolCallParser(Protocol):
    """Finds tool calls in the policy's text."""

    def parse(self, text: str) -> list[ToolCall | ParseError]: ...

    def format_instructions(self, tools: list[dict[str, Any]]) -> str: ...


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _strict_json(text: str) -> Any:
    """json.loads without NaN/Infinity: a non-finite argument would make the episode unhashable."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant)


class HermesParser:
    """Hermes/Qwen style: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``."""

    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | ParseError]:
        calls: list[ToolCall | ParseError] = []
        for raw in self.pattern.findall(text):
            try:
                obj = _strict_json(raw.strip())
            except json.JSONDecodeError as exc:
                calls.append(ParseError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
                continue
            except ValueError as exc:  # NaN/Infinity, 1e999, integers of > 4300 digits
                calls.append(ParseError(f"tool call is not valid JSON ({exc})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ParseError('tool call must be an object with a string "name"'))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models double-encode
                try:
                    args = _strict_json(args)
                except ValueError:
                    pass
            if not isinstance(args, dict):
                calls.append(ParseError(f'tool call "{obj["name"]}": "arguments" must be an object'))
                continue
            calls.append(ToolCall(obj["name"], args))
        return calls

    def format_instructions(self, tools: list[dict[str, Any]]) -> str:
        if not tools:
            return ""
        lines = [json.dumps(t["function"], sort_keys=True) for t in tools]
        return (
            "You can call tools. To call one, write exactly:\n"
            '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>\n'
            "Tools:\n" + "\n".join(lines)
        )


def approx_token_count(messages: Sequence[dict[str, Any]]) -> int:
    """Default context counter: ~4 characters a token, plus 4 per message."""
    return sum(math.ceil(len(m.get("content", "")) / 4) + 4 for m in messages)


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


@dataclass
class _Thread:
    """A line of work: the root agent or one sub-agent, across its compressions."""

    session_ids: list[str]
    parent: _Thread | None = None
    spawn_turn: int | None = None  # index of the parent turn that spawned it
    returned: str | None = None

    @property
    def current(self) -> str:
        return self.session_ids[-1]


@dataclass
class _SessionDraft:
    session_id: str
    parent_id: str | None
    origin: str
    boundary: Boundary | None
    turns: list[Turn] = field(default_factory=list)


SUMMARY_REQUEST = (
    "Your context is full. Write a short summary of the task and everything you found so far "
    "(ids, values, what is left to do). The conversation will continue from your summary alone."
)


class ToolEnv(gymnasium.Env):
    env_id: ClassVar[str] = "agent_rl/ToolEnv-v0"
    version: ClassVar[int] = 0
    instructions: ClassVar[str] = "Solve the task."
    branch_instructions: ClassVar[str] = (
        "You are a sub-agent. Solve the sub-task you are given, then reply with the result only "
        "(plain text, no tool call)."
    )
    default_split: ClassVar[str] = "train"
    reward_weights: ClassVar[dict[str, float]] = {"accuracy": 1.0}

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        split: str | None = None,
        context_budget: int | None = None,
        token_counter: Callable[[Sequence[dict[str, Any]]], int] = approx_token_count,
        max_turns: int = 24,
        max_sessions: int = 16,
        max_tool_calls_per_turn: int = 8,
        parser: ToolCallParser | None = None,
        hints: bool = False,
        branching: bool = False,
        render_mode: str | None = None,
    ):
        self.split = split or self.default_split
        self.context_budget = context_budget
        self.token_counter = token_counter
        self.max_turns = max_turns
        self.max_sessions = max_sessions
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.parser = parser or HermesParser()
        self.hints = hints
        self.branching = branching
        self.render_mode = render_mode
        self.observation_space = ChatSpace()
        self.action_space = TextSpace()
        self._tools = self._collect_tools()
        self.task: TaskSpec | None = None
        self.state: Any = None

    # --- hooks for subclasses -----------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        raise NotImplementedError

    def new_state(self, task: TaskSpec) -> Any:
        return None

    def score(self, task: TaskSpec, answer: str, state: Any) -> RewardBreakdown:
        raise NotImplementedError

    def reference_action(self) -> str | None:
        return None

    def tool_effects(self, task: TaskSpec, state: Any) -> dict[str, Any]:
        return {}

    # --- built-in tools ------------------------------------------------------------------
    @tool
    def spawn(self, task: str) -> str:
        """Start a sub-agent on a sub-task; its final reply comes back as this tool's result."""
        raise AssertionError("handled by the env loop")  # pragma: no cover

    @tool(name="return")
    def return_(self, value: str) -> str:
        """(Sub-agents only) Finish the sub-task and hand `value` back to the parent agent."""
        raise AssertionError("handled by the env loop")  # pragma: no cover

    # --- Gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        task = options.get("task")
        if task is None:
            task = self.task_pool(1, seed=self._draw_seed())[0]
        self.task = task if isinstance(task, TaskSpec) else TaskSpec.model_validate(task)
        self.state = self.new_state(self.task)
        self._episode_id = options.get("episode_id") or f"ep-{int(self.np_random.integers(2**62)):016x}"
        self._group_id = options.get("group_id", self.task.task_id)
        self._sample_id = int(options.get("sample_id", 0))
        self._seed = seed
        self._generation = dict(options.get("generation", {}))
        self._drafts: dict[str, _SessionDraft] = {}
        self._turns_used = 0
        self._tool_errors = 0
        self._violations: list[dict[str, Any]] = []
        self._last_error: str | None = None  # "format" | "tool" | None, for the last turn
        self._finished_threads: list[_Thread] = []
        self._awaiting_summary = False
        self._done = False
        self._hint = self.task.hint if (self.hints and self.task.hint) else None
        root = self._open_session(None, "root", None, self._opening_messages(branch_task=None))
        self._thread = _Thread([root])
        self._root_thread = self._thread
        return self._observation(), self._info()

    def step(self, action: str | dict[str, Any]):
        if self._done:
            raise RuntimeError("step() called after the episode ended; call reset()")
        turn = self._assistant_turn(action)
        draft = self._drafts[self._thread.current]
        draft.turns.append(turn)
        self._turns_used += 1
        text = turn.content

        if self._awaiting_summary:
            self._last_error = None
            self._compress(summary=text)
        else:
            calls = self.parser.parse(text)
            if calls:
                self._run_calls(calls[: self.max_tool_calls_per_turn], len(calls))
            elif self._thread.parent is not None:
                self._return_from_branch(text)
            else:
                return self._finish(answer=text)

        if self._over_budget() and not self._awaiting_summary:
            if len(self._drafts) >= self.max_sessions:
                return self._finish(answer=None, truncated=True, why="max_sessions")
            self._awaiting_summary = True
            self._drafts[self._thread.current].turns.append(Turn(role="user", content=SUMMARY_REQUEST))
        if self._turns_used >= self.max_turns:
            return self._finish(answer=None, truncated=True, why="max_turns")
        return self._observation(), 0.0, False, False, self._info()

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.task is None:
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self._observation())

    # --- what the policy sees ------------------------------------------------------------
    @property
    def active_messages(self) -> list[dict[str, Any]]:
        return self._observation()

    @property
    def awaiting_summary(self) -> bool:
        return self._awaiting_summary

    @property
    def in_branch(self) -> bool:
        return self._thread.parent is not None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [spec.schema() for spec in self._visible_tools()]

    def _observation(self) -> list[dict[str, Any]]:
        return [t.message() for t in copy.deepcopy(self._drafts[self._thread.current].turns)]

    def _info(self) -> dict[str, Any]:
        return {"session_id": self._thread.current, "tools": self.tool_schemas(),
                "awaiting_summary": self._awaiting_summary}

    def _visible_tools(self) -> list[ToolSpec]:
        return self._tools_for(self.in_branch)

    def _opening_messages(self, branch_task: str | None, summary: str | None = None) -> list[Turn]:
        assert self.task is not None
        intro = self.branch_instructions if branch_task else self.instructions
        tools_text = self.parser.format_instructions(
            [s.schema() for s in self._tools_for(in_branch=branch_task is not None)])
        system = intro + ("\n\n" + tools_text if tools_text else "")
        prompt = branch_task or self.task.prompt
        if branch_task is None and self._hint:
            prompt += f"\n\nHint: {self._hint['text']}"
        if summary is not None:
            prompt += f"\n\nSummary of your progress so far:\n{summary}"
        return [Turn(role="system", content=system), Turn(role="user", content=prompt)]

    def _tools_for(self, in_branch: bool) -> list[ToolSpec]:
        """The task's allowed env tools, then ``return`` (sub-agents) or ``spawn`` (branching)."""
        specs = [s for s in self._tools.values() if s.name not in ("spawn", "return")]
        if self.task and self.task.allowed_tools is not None:
            specs = [s for s in specs if s.name in self.task.allowed_tools]
        if in_branch:
            specs.append(self._tools["return"])
        elif self.branching:
            specs.append(self._tools["spawn"])
        return specs

    # --- the loop's pieces ---------------------------------------------------------------
    def _assistant_turn(self, action: str | dict[str, Any]) -> Turn:
        if isinstance(action, str):
            return Turn(role="assistant", content=action)
        if not isinstance(action, dict) or not isinstance(action.get("text"), str):
            raise TypeError("action must be a str or a dict with 'text' (and optionally "
                            "'token_ids', 'logprobs', 'finish_reason')")
        return Turn(role="assistant", content=action["text"], token_ids=action.get("token_ids"),
                    logprobs=action.get("logprobs"), finish_reason=action.get("finish_reason"))

    def _open_session(self, parent_id: str | None, origin: str, boundary: Boundary | None,
                      turns: list[Turn]) -> str:
        session_id = f"{self._episode_id}/s{len(self._drafts)}"
        self._drafts[session_id] = _SessionDraft(session_id, parent_id, origin, boundary, list(turns))
        return session_id

    def _run_calls(self, calls: list[ToolCall | ParseError], n_found: int) -> None:
        draft = self._drafts[self._thread.current]
        self._last_error = None
        for call in calls:
            if isinstance(call, ParseError):
                self._tool_result(draft, "error", f"error: {call.message}", error="format")
                continue
            if call.name == "spawn" and self.branching and not self.in_branch:
                self._spawn(call)
                return  # the branch is active now; later calls in this turn are dropped
            if call.name == "return" and self.in_branch:
                self._return_from_branch(str(call.arguments.get("value", "")))
                return
            self._tool_result(draft, call.name, *self._invoke(call))
        if n_found > len(calls):
            self._tool_result(draft, "error", f"error: only {self.max_tool_calls_per_turn} tool "
                              f"calls per turn; {n_found - len(calls)} ignored", error="format")

    def _invoke(self, call: ToolCall) -> tuple[str, str | None]:
        """Run one call: (result text, error kind: None | "format" | "tool")."""
        spec = self._tools.get(call.name)
        visible = {s.name for s in self._visible_tools()}
        if spec is None or spec.name in ("spawn", "return"):
            return f"error: unknown tool {call.name!r}; available: {sorted(visible)}", "format"
        if spec.name not in visible:
            self._violations.append({"tool": call.name, "reason": "tool not allowed for this task"})
            return f"error: tool {call.name!r} is not allowed for this task", "tool"
        try:
            args = spec.args_model.model_validate(call.arguments)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                                 for e in exc.errors())
            return f"error: bad arguments for {call.name}: {problems}", "format"
        try:
            result = spec.fn(self, **args.model_dump())
        except PermissionDenied as exc:
            self._violations.append({"tool": call.name, "arguments": call.arguments, "reason": str(exc)})
            return f"error: permission denied: {exc}", "tool"
        except ToolError as exc:
            return f"error: {exc}", "tool"
        return (result if isinstance(result, str) else json.dumps(result, sort_keys=True)), None

    def _tool_result(self, draft: _SessionDraft, name: str, content: str,
                     error: str | None = None) -> None:
        draft.turns.append(Turn(role="tool", name=name, content=content))
        if error:
            self._tool_errors += 1
            self._last_error = error

    def _spawn(self, call: ToolCall) -> None:
        parent = self._drafts[self._thread.current]
        sub_task = call.arguments.get("task")
        if not isinstance(sub_task, str) or not sub_task.strip():
            self._tool_result(parent, "spawn", 'error: spawn needs a non-empty string "task"', error="format")
            return
        if len(self._drafts) >= self.max_sessions:
            self._tool_result(parent, "spawn", "error: session limit reached; do it yourself", error="tool")
            return
        opening = self._opening_messages(branch_task=sub_task)
        boundary = Boundary(kind="branch", parent_turn=len(parent.turns) - 1,
                            after=[t.message() for t in opening])
        child = self._open_session(parent.session_id, "branch", boundary, opening)
        self._thread = _Thread([child], parent=self._thread, spawn_turn=len(parent.turns) - 1)

    def _return_from_branch(self, value: str) -> None:
        thread = self._thread
        thread.returned = value
        first = self._drafts[thread.session_ids[0]]
        first.boundary = first.boundary.model_copy(update={"returned": value})
        self._thread = thread.parent
        self._finished_threads.append(thread)
        self._tool_result(self._drafts[self._thread.current], "spawn", value)

    def _compress(self, summary: str) -> None:
        old = self._drafts[self._thread.current]
        before = [t.message() for t in old.turns]
        opening = self._opening_messages(
            branch_task=self._thread_task(self._thread),
            summary=summary)
        boundary = Boundary.compression(before, [t.message() for t in opening], summary=summary,
                                        parent_turn=len(old.turns) - 1)
        child = self._open_session(old.session_id, "compression", boundary, opening)
        self._thread.session_ids.append(child)
        self._awaiting_summary = False

    def _over_budget(self) -> bool:
        if self.context_budget is None:
            return False
        return self.token_counter(self._observation()) > self.context_budget

    def _draw_seed(self) -> int:
        offset = {"train": 0, "test": 1 << 20, "holdout": 2 << 20}.get(self.split, 3 << 20)
        return offset + int(self.np_random.integers(1 << 20))

    @classmethod
    def _collect_tools(cls) -> dict[str, ToolSpec]:
        tools: dict[str, ToolSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass).values():
                spec = getattr(attr, "__tool__", None)
                if spec is not None:
                    tools[spec.name] = spec
        return tools

    # --- ending ----------------------------------------------------------------------------
    def _finish(self, answer: str | None, truncated: bool = False, why: str | None = None):
        assert self.task is not None
        self._done = True
        if truncated:
            # Out of budget: no answer to score. Ending right after a malformed call or a
            # failing tool says more than "truncated" about what went wrong.
            outcome = {"format": Outcome.format_error, "tool": Outcome.tool_error}.get(
                self._last_error, Outcome.truncated)
            reward = RewardBreakdown.from_components(
                dict.fromkeys(self.reward_weights, 0.0), dict(self.reward_weights), outcome,
                f"{self.env_id}@{self.version}", audit={"truncated_by": why})
        else:
            reward = self.score(self.task, answer, self.state)
            if self._violations:
                reward = RewardBreakdown.from_components(
                    dict.fromkeys(reward.components, 0.0), reward.weights, Outcome.policy_violation,
                    reward.verifier, audit={**reward.audit, "violations": self._violations,
                                            "scored_components": reward.components})
        reward = reward.model_copy(update={"audit": {
            **reward.audit, "tool_errors": self._tool_errors, "assistant_turns": self._turns_used}})
        episode = self._build_episode(reward, answered=not truncated)
        info = self._info()
        info["episode"] = episode
        return self._observation(), float(reward.total), not truncated, truncated, info

    def _build_episode(self, reward: RewardBreakdown, answered: bool) -> Episode:
        assert self.task is not None
        used = self._used_sessions(answered)
        sessions = [
            Session(session_id=d.session_id, parent_id=d.parent_id, episode_id=self._episode_id,
                    origin=d.origin, boundary=d.boundary, turns=d.turns,
                    used_by_final=d.session_id in used,
                    metrics={"generated_tokens": sum(len(t.token_ids or []) for t in d.turns)})
            for d in self._drafts.values()
        ]
        return Episode(
            episode_id=self._episode_id, env_id=self.env_id, env_version=self.version,
            task_id=self.task.task_id, group_id=str(self._group_id), sample_id=self._sample_id,
            seed=self._seed, split=self.split, task_meta=self.task.meta.model_dump(),
            sessions=sessions, final_session_id=self._root_thread.current if answered else None,
            reward=reward, tool_effects=self.tool_effects(self.task, self.state),
            hint=({**self._hint, "shown": True} if self._hint else None),
            generation=self._generation,
        )

    def _used_sessions(self, answered: bool) -> set[str]:
        """Sessions whose output reached the final answer.

        The root thread (root and its compressions) is used when the episode was answered. A
        sub-agent's thread is used when it returned and its returned value is referenced by a
        later assistant turn of its parent thread.
        """
        if not answered:
            return set()
        used = set(self._root_thread.session_ids)
        for thread in self._finished_threads:
            if thread.parent is not None and thread.parent.session_ids[0] in used and \
                    self._referenced_later(thread):
                used.update(thread.session_ids)
        return used

    def _referenced_later(self, thread: _Thread) -> bool:
        value = (thread.returned or "").strip().lower()
        tokens = {t for t in re.findall(r"[\w.@-]+", value) if len(t) > 1}
        if not tokens or thread.parent is None:
            return False
        spawning = self._drafts[thread.session_ids[0]].parent_id
        parent_ids = thread.parent.session_ids
        later: list[str] = []
        for sid in parent_ids[parent_ids.index(spawning):]:
            turns = self._drafts[sid].turns
            if sid == spawning:
                turns = turns[(thread.spawn_turn or 0) + 1:]
            later += [t.content.lower() for t in turns if t.role == "assistant"]
        text = "\n".join(later)
        return any(tok in text for tok in tokens)

    def _thread_task(self, thread: _Thread) -> str | None:
        """The sub-task of a branch thread (None for the root thread)."""
        first = self._drafts[thread.session_ids[0]]
        if first.origin != "branch":
            return None
        return next(t.content for t in first.turns if t.role == "user")
