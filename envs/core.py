"""The environment contract: a Gymnasium env whose observations are chat messages and whose
actions are the policy's text, emitting one `trajectories.Episode` (a session tree) per episode.

What a subclass sets (class attributes) and implements (one-method hooks)::

    env_id: str                      "agent_rl/Name-v0"
    version: int                     bumped whenever tasks or scoring change
    instructions: str                system prompt text (the tool list is appended)
    reward_weights: dict             the verifier's components and weights
    task_pool(n, seed) -> list[TaskSpec]        deterministic task generation
    new_state(task) -> state                    the world the tools act on (None if no tools)
    score(task, answer, state) -> RewardBreakdown   the verifier; a small pure function
    reference_action() -> str | None            the scripted solver's next action
    tool_effects(task, state) -> dict           the final state diff (optional)
    session_used(session, episode) -> bool | None   did the session's output reach the answer
                                                (default: data flow, ``envs.sessions``)
    compression_due() -> bool                   must the active session be compressed now
                                                (default: its messages exceed context_budget)
    summary_request(compressions) -> str        the request for a summary
    continuation_prompt(summary, compressions) -> str   the root thread's prompt after one
    examples(compressions) -> [(user, assistant)]   worked examples opening a root-thread
                                                session (default none)

Tools are methods decorated with ``@tool``; their typed arguments become a JSON schema
(``envs.tools``: parsing, schemas, permissions, dispatch). The session tree is recorded by
``envs.sessions.SessionRecorder``; control actions (``Summary``, ``Spawn``, ``Return``) are
types of their own there.

The loop. ``reset`` opens the root session: system message, worked examples (if any), task
prompt (and asks for a summary at once when ``compression_due``: a request joins the user's
message when the session has not replied yet). Each ``step(action)`` appends the action as an
assistant turn of the *active* session, then:

* awaiting a summary: the action is the ``Summary``; a child session opens
  (``origin="compression"``) whose input is the task plus that summary.
* tool calls in the text: ``spawn`` (top level, ``branching=True``) opens a sub-agent session
  (``origin="branch"``) that becomes active; ``return`` (in a sub-agent) hands its value back;
  every other call is dispatched and its result comes back as a ``tool`` turn.
* no tool call: in a sub-agent, the text is its return value; at the top level it is the final
  answer, scored by ``score``; the episode terminates.

After every step, if ``compression_due()``, the env asks for a summary. Exceeding ``max_turns``
assistant turns, ``max_sessions`` sessions, or a prompt the policy refused as longer than its
prompt limit (``finish_reason == "prompt_too_long"``) ends the episode ``truncated``; that one
records the prompt's length (the action's ``prompt_tokens``) in ``reward.audit["prompt_tokens"]``.
Nothing the agent sends raises: malformed calls (deep nesting and huge numbers included),
unknown tools and bad arguments come back as tool errors, counted, and the episode ends
``format_error`` only when it ends on one; lone surrogates in the text become U+FFFD.
``step()`` before ``reset()`` or after the end raises ``RuntimeError`` (a driver bug).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import gymnasium
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from envs.sessions import (
    RETURN_SCHEMA,
    SPAWN_SCHEMA,
    SUMMARY_HEADER,
    SUMMARY_REQUEST,
    Return,
    SessionRecorder,
    Spawn,
    Summary,
    approx_token_count,
    control_action,
    used_by_data_flow,
)
from envs.tools import (
    HermesParser,
    ParseError,
    PermissionDenied,
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolResult,
    ToolSpec,
    allowed_specs,
    clean_text,
    collect_tools,
    dispatch,
)
from trajectories import Episode, Outcome, RewardBreakdown, Session, Turn

__all__ = ["ChatSpace", "HermesParser", "ParseError", "PermissionDenied", "TaskMeta", "TaskSpec",
           "TextSpace", "ToolCall", "ToolCallParser", "ToolEnv", "ToolError", "ToolSpec",
           "approx_token_count", "tool"]

PROMPT_TOO_LONG = "prompt_too_long"  # a Completion's finish_reason: the policy did not generate

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
    """Observations: a list of chat messages ``{"role": ..., "content": str, ...}``; an
    assistant message the policy sampled also carries its ``"token_ids"``."""

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
# Tools
# ---------------------------------------------------------------------------------------------


def tool(fn: Callable | None = None, *, name: str | None = None, writes: bool = False):
    """Declare an env method as a tool. Typed arguments become the JSON schema (pydantic);
    ``writes=True`` marks a tool that changes the world (canary shadows run it on a copy)."""

    def decorate(f: Callable) -> Callable:
        f.__tool__ = ToolSpec.from_function(f, name=name, writes=writes)
        return f

    return decorate(fn) if fn is not None else decorate


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


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
    concurrent_steps: ClassVar[bool] = False
    """True when a step mostly waits outside the interpreter (a sandboxed program, a remote
    service) and an instance shares no state with the others: ``run_episodes`` may then step
    several of them at once from threads."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        split: str | None = None,
        context_budget: int | None = None,
        token_counter: Callable[[Sequence[dict[str, Any]]], int] | None = None,
        max_turns: int = 24,
        max_sessions: int = 16,
        max_tool_calls_per_turn: int = 8,
        parser: ToolCallParser | None = None,
        hints: bool = False,
        branching: bool = False,
        render_mode: str | None = None,
    ):
        """``token_counter`` counts a message list for ``context_budget``; None: the driving
        policy's tokenizer when a runner provides one (``use_token_counter``), else
        ``approx_token_count``."""
        self.split = split or self.default_split
        self.context_budget = context_budget
        self.token_counter = token_counter or approx_token_count
        self._counter_given = token_counter is not None
        self.max_turns = max_turns
        self.max_sessions = max_sessions
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.parser = parser or HermesParser()
        self.hints = hints
        self.branching = branching
        self.render_mode = render_mode
        self.observation_space = ChatSpace()
        self.action_space = TextSpace()
        self._tools = collect_tools(type(self))
        self.task: TaskSpec | None = None
        self.state: Any = None
        self._running = False  # between reset() and the episode's end

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

    def session_used(self, session: Session, episode: Episode) -> bool | None:
        """Did ``session``'s output reach the final answer (None: unknown, treated as used)?
        Default: data flow (``envs.sessions.used_by_data_flow``)."""
        return used_by_data_flow(episode, self.parser.parse)[session.session_id]

    def compression_due(self) -> bool:
        """Must the active session be compressed now? Default: its messages exceed
        ``context_budget`` tokens by ``token_counter``."""
        return (self.context_budget is not None
                and self.token_counter(self._recorder.messages()) > self.context_budget)

    def summary_request(self, compressions: int) -> str:
        """The user turn asking for a summary (``compressions``: done so far in the thread)."""
        return SUMMARY_REQUEST

    def continuation_prompt(self, summary: str, compressions: int) -> str:
        """The user prompt of the root thread's session after compression number
        ``compressions`` (1 for the first): the task (and hint) plus the summary."""
        return self._task_prompt() + SUMMARY_HEADER + summary

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        """Worked examples, (user message, assistant reply) pairs, shown after the system
        message of the root thread's session that follows ``compressions`` compressions (0:
        the root). They are part of the prompt: rendered, never trained on."""
        return []

    # --- Gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """``options``: ``task`` (a TaskSpec or its dict; default: drawn from the env's split),
        ``episode_id``, ``group_id``, ``sample_id``, ``generation`` (sampling config, recorded),
        ``split`` (recorded on the episode; default: the env's split) and ``hints`` (show the
        task's hint; default: the env's ``hints``)."""
        super().reset(seed=seed)
        options = dict(options or {})
        task = options.get("task")
        if task is None:
            task = self.task_pool(1, seed=self._draw_seed())[0]
        self.task = task if isinstance(task, TaskSpec) else TaskSpec.model_validate(task)
        self.state = self.new_state(self.task)
        episode_id = options.get("episode_id") or f"ep-{int(self.np_random.integers(2**62)):016x}"
        self._group_id = options.get("group_id", self.task.task_id)
        self._sample_id = int(options.get("sample_id", 0))
        self._episode_split = str(options.get("split") or self.split)
        self._seed = seed
        self._generation = dict(options.get("generation", {}))
        self._turns_used = 0
        self._tool_errors = 0
        self._violations: list[dict[str, Any]] = []
        self._last_error: str | None = None  # "format" | "tool" | None, for the last turn
        show_hint = options.get("hints", self.hints)
        self._hint = self.task.hint if (show_hint and self.task.hint) else None
        self._running = True
        self._awaiting_summary = False
        self._recorder = SessionRecorder(episode_id, self._opening(self._task_prompt(), compressions=0))
        if self.compression_due():
            self._request_summary()
        return self._observation(), self._info()

    def step(self, action: str | dict[str, Any]):
        if not self._running:
            raise RuntimeError("step() called before reset()" if self.task is None else
                               "step() called after the episode ended; call reset()")
        turn, revision = self._assistant_turn(action)
        if turn.finish_reason == PROMPT_TOO_LONG:  # nothing was generated for this prompt
            return self._finish(answer=None, truncated=True, why="max_prompt_tokens",
                                audit={"prompt_tokens": action.get("prompt_tokens")})
        self._recorder.add(turn, revision)
        self._turns_used += 1
        text = turn.content

        if self._awaiting_summary:
            self._last_error = None
            self._compress(Summary(text))
        else:
            calls = self.parser.parse(text)
            if calls:
                self._run_calls(calls[: self.max_tool_calls_per_turn], len(calls))
            elif self._recorder.in_branch:
                self._recorder.return_(Return(text))
            else:
                return self._finish(answer=text)

        if not self._awaiting_summary and self.compression_due():
            if self._recorder.n_sessions >= self.max_sessions:
                return self._finish(answer=None, truncated=True, why="max_sessions")
            self._request_summary()
        if self._turns_used >= self.max_turns:
            return self._finish(answer=None, truncated=True, why="max_turns")
        return self._observation(), 0.0, False, False, self._info()

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.task is None:
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self._observation())

    # --- what the policy and drivers see ---------------------------------------------------
    @property
    def active_messages(self) -> list[dict[str, Any]]:
        return self._observation()

    @property
    def awaiting_summary(self) -> bool:
        return self._awaiting_summary

    @property
    def in_branch(self) -> bool:
        return self._recorder.in_branch

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The schemas the active session shows: the task's tools, then ``return`` in a
        sub-agent or ``spawn`` at the top level when branching."""
        return self._schemas(in_branch=self.task is not None and self._recorder.in_branch)

    def use_token_counter(self, counter: Callable[[Sequence[dict[str, Any]]], int]) -> None:
        """Count ``context_budget`` with ``counter`` (the driving policy's tokenizer), unless
        a counter was given when the env was built."""
        if not self._counter_given:
            self.token_counter = counter

    # --- the loop's pieces ---------------------------------------------------------------
    def _observation(self) -> list[dict[str, Any]]:
        return self._recorder.messages()

    def _info(self) -> dict[str, Any]:
        return {"session_id": self._recorder.active, "tools": self.tool_schemas(),
                "awaiting_summary": self._awaiting_summary}

    def _schemas(self, in_branch: bool) -> list[dict[str, Any]]:
        allowed = self.task.allowed_tools if self.task else None
        schemas = [spec.schema() for spec in allowed_specs(self._tools, allowed)]
        if in_branch:
            schemas.append(RETURN_SCHEMA)
        elif self.branching:
            schemas.append(SPAWN_SCHEMA)
        return schemas

    def _task_prompt(self) -> str:
        assert self.task is not None
        hint = f"\n\nHint: {self._hint['text']}" if self._hint else ""
        return self.task.prompt + hint

    def _opening(self, prompt: str, in_branch: bool = False, compressions: int = 0) -> list[Turn]:
        intro = self.branch_instructions if in_branch else self.instructions
        tools_text = self.parser.format_instructions(self._schemas(in_branch))
        system = intro + ("\n\n" + tools_text if tools_text else "")
        shown = [] if in_branch else self.examples(compressions)
        worked = [Turn(role=role, content=text) for pair in shown
                  for role, text in zip(("user", "assistant"), pair, strict=True)]
        return [Turn(role="system", content=system), *worked, Turn(role="user", content=prompt)]

    def _assistant_turn(self, action: str | dict[str, Any]) -> tuple[Turn, int | None]:
        """The action as an assistant turn; lone surrogates become U+FFFD (``clean_text``) so
        the episode stays valid UTF-8 JSON."""
        if isinstance(action, str):
            return Turn(role="assistant", content=clean_text(action)), None
        if not isinstance(action, dict) or not isinstance(action.get("text"), str):
            raise TypeError("action must be a str or a dict with 'text' (and optionally "
                            "'token_ids', 'logprobs', 'finish_reason', 'policy_revision')")
        turn = Turn(role="assistant", content=clean_text(action["text"]),
                    token_ids=action.get("token_ids"),
                    logprobs=action.get("logprobs"), finish_reason=action.get("finish_reason"))
        return turn, action.get("policy_revision")

    def _run_calls(self, calls: list[ToolCall | ParseError], n_found: int) -> None:
        self._last_error = None
        rec = self._recorder
        can_spawn = self.branching and not rec.in_branch
        known = ["return"] if rec.in_branch else (["spawn"] if can_spawn else [])
        for call in calls:
            control = control_action(call, can_spawn, rec.in_branch)
            if isinstance(control, Spawn):
                if rec.n_sessions >= self.max_sessions:
                    control = ToolResult("spawn", "error: session limit reached; do it yourself",
                                         "tool")
                else:
                    rec.branch(control, self._opening(control.task, in_branch=True))
                    return  # the branch is active now; later calls in this turn are dropped
            if isinstance(control, Return):
                rec.return_(control)
                return
            allowed = self.task.allowed_tools
            self._add_result(control if isinstance(control, ToolResult)
                         else dispatch(self, self._tools, allowed, call, known))
        if n_found > len(calls):
            self._add_result(ToolResult("error", f"error: only {self.max_tool_calls_per_turn} tool "
                                    f"calls per turn; {n_found - len(calls)} ignored", "format"))

    def _add_result(self, result: ToolResult) -> None:
        self._recorder.add(Turn(role="tool", name=result.name, content=result.content))
        if result.violation:
            self._violations.append(result.violation)
        if result.error:
            self._tool_errors += 1
            self._last_error = result.error

    def _request_summary(self) -> None:
        self._awaiting_summary = True
        self._recorder.ask(self.summary_request(self._recorder.compressions))

    def _compress(self, summary: Summary) -> None:
        rec = self._recorder
        task = rec.branch_task()
        if task is not None:
            opening = self._opening(task + SUMMARY_HEADER + summary.text, in_branch=True)
        else:
            k = rec.compressions + 1
            opening = self._opening(self.continuation_prompt(summary.text, k), compressions=k)
        rec.compress(summary, opening)
        self._awaiting_summary = False

    def _draw_seed(self) -> int:
        offset = {"train": 0, "test": 1 << 20, "holdout": 2 << 20}.get(self.split, 3 << 20)
        return offset + int(self.np_random.integers(1 << 20))

    # --- ending ----------------------------------------------------------------------------
    def _finish(self, answer: str | None, truncated: bool = False, why: str | None = None,
                audit: dict[str, Any] | None = None):
        """End the episode: scored, or ``truncated`` (``why``, and ``audit``, recorded)."""
        assert self.task is not None
        self._running = False
        if truncated:
            # Out of budget: no answer to score. Ending right after a malformed call or a
            # failing tool says more than "truncated" about what went wrong.
            outcome = {"format": Outcome.format_error, "tool": Outcome.tool_error}.get(
                self._last_error, Outcome.truncated)
            reward = RewardBreakdown.from_components(
                dict.fromkeys(self.reward_weights, 0.0), dict(self.reward_weights), outcome,
                f"{self.env_id}@{self.version}", audit={"truncated_by": why, **(audit or {})})
        else:
            reward = self.score(self.task, answer, self.state)
            if self._violations:
                reward = RewardBreakdown.from_components(
                    dict.fromkeys(reward.components, 0.0), reward.weights, Outcome.policy_violation,
                    reward.verifier, audit={**reward.audit, "violations": self._violations,
                                            "scored_components": reward.components})
        reward = reward.model_copy(update={"audit": {
            **reward.audit, "tool_errors": self._tool_errors, "assistant_turns": self._turns_used}})
        episode = self._episode(reward, answered=not truncated)
        info = self._info()
        info["episode"] = episode
        return self._observation(), float(reward.total), not truncated, truncated, info

    def _episode(self, reward: RewardBreakdown, answered: bool) -> Episode:
        assert self.task is not None
        rec = self._recorder
        fields = dict(
            episode_id=rec.episode_id, env_id=self.env_id, env_version=self.version,
            task_id=self.task.task_id, group_id=str(self._group_id), sample_id=self._sample_id,
            seed=self._seed, split=self._episode_split, task_meta=self.task.meta.model_dump(),
            sessions=rec.sessions(), final_session_id=rec.final_session_id if answered else None,
            reward=reward, tool_effects=self.tool_effects(self.task, self.state),
            hint=({**self._hint, "shown": True} if self._hint else None),
            generation=self._generation,
        )
        # which sessions the answer used, asked of an unvalidated draft: the episode is
        # validated (and hashed) once, with the answer's use recorded on its sessions
        draft = Episode.model_construct(**fields)
        try:
            used = {s.session_id: self.session_used(s, draft) for s in draft.sessions}
        except Exception:
            Episode(**fields)  # a malformed episode: its validation error names the problem
            raise
        data = draft.model_dump()  # a deep copy: nothing in the record is shared with the env
        for session in data["sessions"]:
            session["used_by_final"] = used[session["session_id"]]
        return Episode.model_validate(data)
