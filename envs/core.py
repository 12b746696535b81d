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
    branch_examples(compressions) -> [(user, assistant)]   the same for a sub-agent's session
                                                (default none)
    return_request(value) -> str | None         a request put to the parent after a sub-agent
                                                returns ``value`` (default none)

Tools are methods decorated with ``@tool``; their typed arguments become a JSON schema
(``envs.tools``: parsing, schemas, permissions, dispatch). The session tree is recorded by
``envs.sessions.SessionRecorder`` (compress, branch, return, the calls of one turn, episode
assembly); control actions (``Summary``, ``Spawn``, ``Return``) are types of their own there.
Observations and actions live in ``ChatSpace`` and ``TextSpace`` (``envs.spaces``).

The loop. ``reset`` opens the root session: system message, worked examples, task prompt.
Each ``step(action)`` appends the action as an assistant turn of the *active* session, then:

* awaiting a summary: the action is the ``Summary``; a child session opens
  (``origin="compression"``) whose input is the task plus that summary.
* tool calls: ``spawn`` (top level, ``branching=True``) opens a sub-agent session
  (``origin="branch"``) that becomes active; ``return`` hands its value back; other calls are
  dispatched and their results come back as ``tool`` turns.
* no tool call: a sub-agent's returned value or, at the top level, the final answer, scored by
  ``score``; the episode terminates.

After a sub-agent returns, ``return_request(value)`` (when not None) follows its result as a
user turn.

After ``reset`` and every step the env asks for a summary when ``compression_due()``.
``max_turns`` assistant turns, ``max_sessions`` sessions, or a prompt the policy refused as too
long (``finish_reason == PROMPT_TOO_LONG``; its length goes to ``reward.audit["prompt_tokens"]``)
end the episode ``truncated``. Agent text never raises: malformed calls (deep nesting, huge
numbers), unknown tools and bad arguments are tool errors, counted (the episode ends
``format_error`` only when it ends on one); lone surrogates become U+FFFD. ``step()`` before ``reset()`` or after the end raises ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

import gymnasium
from pydantic import BaseModel, ConfigDict, Field

from envs import sessions, tools
from envs.sessions import SUMMARY_HEADER, SessionRecorder, approx_token_count
from envs.spaces import ChatSpace, TextSpace
from envs.tools import PermissionDenied, ToolCallParser, ToolError, ToolSpec
from trajectories import Episode, RewardBreakdown, Session, Turn

__all__ = ["PROMPT_TOO_LONG", "PermissionDenied", "TaskMeta", "TaskSpec", "ToolEnv", "ToolError",
           "tool"]

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
        self.parser = parser or tools.HermesParser()
        self.hints = hints
        self.branching = branching
        self.render_mode = render_mode
        self.observation_space = ChatSpace()
        self.action_space = TextSpace()
        self._tools = tools.collect_tools(type(self))
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
        return sessions.used_by_data_flow(episode, self.parser.parse)[session.session_id]

    def compression_due(self) -> bool:
        """Must the active session be compressed now? Default: its messages exceed
        ``context_budget`` tokens by ``token_counter``."""
        return (self.context_budget is not None
                and self.token_counter(self._recorder.messages()) > self.context_budget)

    def summary_request(self, compressions: int) -> str:
        """The user turn asking for a summary (``compressions``: done so far in the thread)."""
        return sessions.SUMMARY_REQUEST

    def continuation_prompt(self, summary: str, compressions: int) -> str:
        """The user prompt of the root thread's session after compression number
        ``compressions`` (1 for the first): the task (and hint) plus the summary."""
        return self._prompt + SUMMARY_HEADER + summary

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        """Worked examples, (user message, assistant reply) pairs, shown after the system
        message of the root thread's session that follows ``compressions`` compressions (0:
        the root). They are part of the prompt: rendered, never trained on."""
        return []

    def branch_examples(self, compressions: int) -> list[tuple[str, str]]:
        """Worked examples opening a sub-agent's session after ``compressions`` compressions
        of its thread (0: the session ``spawn`` opened), as ``examples`` does for the root
        thread. Default none."""
        return []

    def return_request(self, value: str) -> str | None:
        """A request put to the parent as a user turn right after a sub-agent's ``value``
        came back as the ``spawn`` result (e.g. how to answer now). Default None: nothing."""
        return None

    # --- Gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """``options``: ``task`` (a TaskSpec or its dict; default: drawn from the env's split),
        ``episode_id``, ``group_id``, ``sample_id``, ``generation`` (sampling config, recorded),
        ``split`` (recorded on the episode; default: the env's split) and ``hints`` (show the
        task's hint; default: the env's ``hints``)."""
        super().reset(seed=seed)
        options = dict(options or {})
        task = options.get("task")
        if task is None:  # drawn from the split's own range of task seeds
            offset = {"train": 0, "test": 1 << 20, "holdout": 2 << 20}.get(self.split, 3 << 20)
            task = self.task_pool(1, seed=offset + int(self.np_random.integers(1 << 20)))[0]
        self.task = task if isinstance(task, TaskSpec) else TaskSpec.model_validate(task)
        self.state = self.new_state(self.task)
        episode_id = options.get("episode_id") or f"ep-{int(self.np_random.integers(2**62)):016x}"
        hint = self.task.hint if options.get("hints", self.hints) and self.task.hint else None
        self._prompt = self.task.prompt + (f"\n\nHint: {hint['text']}" if hint else "")
        self._header = dict(  # the Episode's fields known at reset
            env_id=self.env_id, env_version=self.version, task_id=self.task.task_id,
            group_id=str(options.get("group_id", self.task.task_id)),
            sample_id=int(options.get("sample_id", 0)), seed=seed,
            split=str(options.get("split") or self.split), task_meta=self.task.meta.model_dump(),
            hint={**hint, "shown": True} if hint else None,
            generation=dict(options.get("generation", {})))
        self._running = True
        self._recorder = SessionRecorder(episode_id, self._opening(self._prompt))
        if self.compression_due():
            self._recorder.ask_summary(self.summary_request(self._recorder.compressions))
        return self.active_messages, self._info()

    def step(self, action: str | dict[str, Any]):
        if not self._running:
            raise RuntimeError("step() called before reset()" if self.task is None else
                               "step() called after the episode ended; call reset()")
        rec = self._recorder
        turn, revision = tools.assistant_turn(action)
        if turn.finish_reason == PROMPT_TOO_LONG:  # nothing was generated for this prompt
            return self._finish(None, truncated_by="max_prompt_tokens",
                                audit={"prompt_tokens": action.get("prompt_tokens")})
        rec.add(turn, revision)
        was_in_branch = rec.in_branch  # spawn opens branches only at the top level
        if rec.awaiting_summary:
            rec.compress(sessions.Summary(turn.content), self._continuation(turn.content))
        elif calls := self.parser.parse(turn.content):
            run_tool = partial(tools.dispatch, self, self._tools, self.task.allowed_tools)
            open_branch = partial(self._opening, in_branch=True) if self.branching else None
            rec.run_calls(calls, run_tool, open_branch, self.max_sessions,
                          self.max_tool_calls_per_turn)
        elif rec.in_branch:
            rec.return_(sessions.Return(turn.content))
        else:
            return self._finish(turn.content)
        returned = rec.turns()[-1].content if was_in_branch and not rec.in_branch else None
        if returned is not None and (request := self.return_request(returned)):
            rec.ask(request)

        if not rec.awaiting_summary and self.compression_due():
            if rec.n_sessions >= self.max_sessions:
                return self._finish(None, truncated_by="max_sessions")
            rec.ask_summary(self.summary_request(rec.compressions))
        if rec.assistant_turns >= self.max_turns:
            return self._finish(None, truncated_by="max_turns")
        return self.active_messages, 0.0, False, False, self._info()

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.task is None:
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self.active_messages)

    # --- what the policy and drivers see ---------------------------------------------------
    @property
    def active_messages(self) -> list[dict[str, Any]]:
        return self._recorder.messages()

    @property
    def awaiting_summary(self) -> bool:
        return self._recorder.awaiting_summary

    @property
    def in_branch(self) -> bool:
        return self._recorder.in_branch

    def tool_schemas(self, in_branch: bool | None = None) -> list[dict[str, Any]]:
        """The schemas a session shows (default: the active one): the task's tools, then
        ``return`` in a sub-agent or ``spawn`` at the top level when branching."""
        if in_branch is None:
            in_branch = self.task is not None and self._recorder.in_branch
        allowed = self.task.allowed_tools if self.task else None
        return sessions.session_schemas(tools.schemas(self._tools, allowed), in_branch,
                                        self.branching)

    def use_token_counter(self, counter: Callable[[Sequence[dict[str, Any]]], int]) -> None:
        """Count ``context_budget`` with ``counter`` (the driving policy's tokenizer), unless
        a counter was given when the env was built."""
        if not self._counter_given:
            self.token_counter = counter

    # --- delegation ------------------------------------------------------------------------
    def _info(self) -> dict[str, Any]:
        return {"session_id": self._recorder.active, "tools": self.tool_schemas(),
                "awaiting_summary": self._recorder.awaiting_summary}

    def _opening(self, prompt: str, in_branch: bool = False, compressions: int = 0) -> list[Turn]:
        """A session's opening turns: instructions with the tool list, examples, ``prompt``."""
        listed = self.parser.format_instructions(self.tool_schemas(in_branch))
        intro = self.branch_instructions if in_branch else self.instructions
        worked = (self.branch_examples if in_branch else self.examples)(compressions)
        return sessions.opening_turns(intro + ("\n\n" + listed if listed else ""), prompt,
                                      worked)

    def _continuation(self, summary: str) -> list[Turn]:
        """The opening of the session that continues the active thread from ``summary``."""
        task = self._recorder.branch_task()
        k = self._recorder.compressions + 1
        if task is not None:
            return self._opening(task + SUMMARY_HEADER + summary, in_branch=True, compressions=k)
        return self._opening(self.continuation_prompt(summary, k), compressions=k)

    def _finish(self, answer: str | None, truncated_by: str | None = None,
                audit: dict[str, Any] | None = None):
        """End the episode: score ``answer`` (none when out of budget, ``truncated_by``; then
        ``audit`` is recorded too)."""
        self._running = False
        rec = self._recorder
        scored = None if truncated_by else self.score(self.task, answer, self.state)
        reward = rec.reward(scored, self.reward_weights, f"{self.env_id}@{self.version}",
                            truncated_by, audit)
        episode = rec.episode(reward, truncated_by is None, self.session_used,
                              tool_effects=self.tool_effects(self.task, self.state),
                              **self._header)
        info = self._info()
        info["episode"] = episode
        truncated = truncated_by is not None
        return self.active_messages, float(reward.total), not truncated, truncated, info
