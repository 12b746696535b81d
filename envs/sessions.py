"""The session-tree recorder: open, compress, branch, return; boundaries; episode assembly.

An episode is a tree of sessions. A **thread** is one line of work, the root agent or one
sub-agent, across its compressions: its first session is the root (``origin="root"``) or a
branch (``origin="branch"``), and every compression continues it in a child session
(``origin="compression"``). The recorder keeps the active thread and session and records every
boundary (``trajectories.Boundary``): for a compression the messages before it (and their hash)
and the child's opening messages with the summary; for a branch the parent turn that spawned
it, the sub-agent's opening messages and, once it returns, the value it handed back.

**Control actions** are their own types, not tools: ``Summary`` (the reply to a compression
request), ``Spawn`` (open a sub-agent) and ``Return`` (a sub-agent hands back its value). The
agent writes the last two with the tool-call syntax (``spawn`` and ``return`` are shown with
the tools; ``SPAWN_SCHEMA``, ``RETURN_SCHEMA``), and ``control_action`` recognises them.

**Usage by data flow** (``used_by_data_flow``, the default of the env hook ``session_used``):
an episode that produced no final answer uses no session. Otherwise

- the thread holding the final answer and the threads on its path to the root are used: every
  compression on that chain summarised work that led to the answer;
- a branch thread is used when its parent thread is used and the value it returned is
  consumed later by that parent thread: a content token of the value (``content_tokens``:
  normalised words minus stop words and placeholders such as "the", "answer", "unknown")
  appears as a word in a later tool-call argument of the parent thread (its spawning session
  after the spawn, and its compression continuations) or in the parent thread's output (the
  final answer, or the parent sub-agent's own returned value);
- every session of a thread shares the thread's flag.

So a sub-agent that returned "the answer is unknown" is not used, whatever the parent wrote
next; one that returned "PRD-0042" is used when the parent passes PRD-0042 to a tool or
answers with it. Environments refine what counts as content with ``value_tokens`` (Records:
only record ids and values of the task's store).

**One turn** (``SessionRecorder.run_calls``): the calls of an assistant turn, at most
``max_calls`` of them, run in order: ``spawn`` opens a sub-agent and ends the turn, ``return``
ends the active sub-agent, every other call runs through the env's dispatch (``envs.tools``)
and comes back as a ``tool`` turn; further calls are ignored with one format error. The
recorder tallies assistant turns, tool errors, permission violations and the error kind of the
last turn.

**Episode assembly** (``SessionRecorder.reward`` and ``.episode``): an answered episode keeps
its verifier's breakdown, every component zeroed as ``policy_violation`` when a call broke the
task's permissions; one that ran out of budget scores 0 as ``truncated`` (``format_error`` or
``tool_error`` when its last turn ended on a malformed call or a failing tool). The episode
record is validated and hashed once, with each session's ``used_by_final`` asked of the env's
``session_used`` hook on an unvalidated draft.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import create_model

from envs.tools import ParseError, ToolCall, ToolResult, function_schema
from trajectories import Boundary, Episode, Outcome, RewardBreakdown, Session, Turn

# ---------------------------------------------------------------------------------------------
# Control actions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """The agent's reply to a compression request: what the child session starts from."""

    text: str


@dataclass(frozen=True)
class Spawn:
    """Open a sub-agent (a branch session) on ``task``."""

    task: str


@dataclass(frozen=True)
class Return:
    """A sub-agent hands ``value`` back to its parent, as the result of its ``spawn`` call."""

    value: str


ControlAction = Summary | Spawn | Return


def _control_schema(name: str, description: str, argument: str) -> dict[str, Any]:
    params = create_model(f"{name}_args", __config__={"extra": "forbid"},
                          **{argument: (str, ...)}).model_json_schema()
    params.pop("title", None)
    return function_schema(name, description, params)


SPAWN_SCHEMA = _control_schema(
    "spawn", "Start a sub-agent on a sub-task; its final reply comes back as this tool's result.",
    "task")
RETURN_SCHEMA = _control_schema(
    "return", "(Sub-agents only) Finish the sub-task and hand `value` back to the parent agent.",
    "value")


def control_action(call: ToolCall | ParseError, can_spawn: bool,
                   in_branch: bool) -> Spawn | Return | ToolResult | None:
    """The control action a parsed call stands for, an error result for a malformed one, or
    None when it is an ordinary tool call (or a control the agent cannot use here, which
    dispatch then reports as an unknown tool)."""
    if isinstance(call, ParseError):
        return None
    if call.name == "spawn" and can_spawn:
        task = call.arguments.get("task")
        if not isinstance(task, str) or not task.strip():
            return ToolResult("spawn", 'error: spawn needs a non-empty string "task"', "format")
        return Spawn(task)
    if call.name == "return" and in_branch:
        return Return(str(call.arguments.get("value", "")))
    return None


SUMMARY_REQUEST = (
    "Your context is full. Write a short summary of the task and everything you found so far "
    "(ids, values, what is left to do). The conversation will continue from your summary alone."
)
SUMMARY_HEADER = "\n\nSummary of your progress so far:\n"


def session_schemas(tool_schemas: list[dict[str, Any]], in_branch: bool,
                    branching: bool) -> list[dict[str, Any]]:
    """The schemas a session shows: the task's tools, then ``return`` in a sub-agent or
    ``spawn`` at the top level when the env branches."""
    if in_branch:
        return [*tool_schemas, RETURN_SCHEMA]
    return [*tool_schemas, SPAWN_SCHEMA] if branching else list(tool_schemas)


def opening_turns(system: str, prompt: str, examples: Sequence[tuple[str, str]] = ()) -> list[Turn]:
    """The turns a session opens with: the system message, worked examples as (user,
    assistant) pairs (part of the prompt, never trained on), the prompt."""
    worked = [Turn(role=role, content=text) for pair in examples
              for role, text in zip(("user", "assistant"), pair, strict=True)]
    return [Turn(role="system", content=system), *worked, Turn(role="user", content=prompt)]


def approx_token_count(messages: Sequence[dict[str, Any]]) -> int:
    """Fallback context counter: ~4 characters a token, plus 4 per message. Drivers that know
    the policy's tokenizer replace it (``ToolEnv.use_token_counter``)."""
    return sum(math.ceil(len(m.get("content", "")) / 4) + 4 for m in messages)


# ---------------------------------------------------------------------------------------------
# The recorder
# ---------------------------------------------------------------------------------------------


@dataclass
class _Thread:
    session_ids: list[str]
    parent: _Thread | None = None

    @property
    def current(self) -> str:
        return self.session_ids[-1]


@dataclass
class _Draft:
    session_id: str
    parent_id: str | None
    origin: str
    boundary: Boundary | None
    turns: list[Turn] = field(default_factory=list)
    policy_revision: int | None = None
    opening: int = 0  # turns it was opened with: system, worked examples, the prompt


class SessionRecorder:
    """The session tree of one episode while it is being played, and its tallies."""

    def __init__(self, episode_id: str, opening: list[Turn]):
        self.episode_id = episode_id
        self._drafts: dict[str, _Draft] = {}
        self._thread = _Thread([self._open(None, "root", None, opening)])
        self._root = self._thread
        self.awaiting_summary = False  # the next assistant turn is a Summary
        self.assistant_turns = 0
        self.tool_errors = 0
        self.violations: list[dict[str, Any]] = []
        self.last_error: str | None = None  # "format" | "tool" | None, for the last turn

    # --- where the episode is ------------------------------------------------------------
    @property
    def active(self) -> str:
        return self._thread.current

    @property
    def in_branch(self) -> bool:
        return self._thread.parent is not None

    @property
    def n_sessions(self) -> int:
        return len(self._drafts)

    @property
    def final_session_id(self) -> str:
        """Where a top-level answer comes from: the end of the root thread."""
        return self._root.current

    @property
    def compressions(self) -> int:
        """Compressions so far in the active thread."""
        return len(self._thread.session_ids) - 1

    def branch_task(self) -> str | None:
        """The active thread's sub-task (None in the root thread)."""
        first = self._drafts[self._thread.session_ids[0]]
        if first.origin != "branch":
            return None
        return first.turns[first.opening - 1].content  # after any worked examples

    def turns(self) -> list[Turn]:
        return list(self._drafts[self.active].turns)

    def messages(self) -> list[dict[str, Any]]:
        """The active session's chat messages (copies: callers may change them). An assistant
        message the policy sampled also carries its ``token_ids``, so that a chat-template
        policy shows it those very tokens again (``agent_rl.policies.render.conversation_ids``)."""
        out = []
        for t in self._drafts[self.active].turns:
            message = t.message()  # a fresh dict of strings but for its tool calls
            if "tool_calls" in message:
                message["tool_calls"] = copy.deepcopy(message["tool_calls"])
            if t.generated:
                message["token_ids"] = list(t.token_ids)
            out.append(message)
        return out

    # --- changes ---------------------------------------------------------------------------
    def add(self, turn: Turn, policy_revision: int | None = None) -> None:
        draft = self._drafts[self.active]
        draft.turns.append(turn)
        if turn.role == "assistant":
            self.assistant_turns += 1
        if policy_revision is not None:  # a session is as old as its oldest sampled turn
            draft.policy_revision = (policy_revision if draft.policy_revision is None
                                     else min(draft.policy_revision, policy_revision))

    def ask(self, text: str, separator: str = "\n\n") -> None:
        """Put a request to the agent (a compression request): it joins the last message after
        ``separator`` when that is the user's (the session has not replied since), else it is
        a new user turn."""
        turns = self._drafts[self.active].turns
        if turns and turns[-1].role == "user":
            turns[-1] = Turn(role="user", content=f"{turns[-1].content}{separator}{text}")
        else:
            turns.append(Turn(role="user", content=text))

    def ask_summary(self, text: str) -> None:
        """Ask for a summary (``ask``): the next assistant turn is the ``Summary``."""
        self.awaiting_summary = True
        self.ask(text)

    def compress(self, summary: Summary, opening: list[Turn]) -> str:
        """Continue the active thread in a child session opened with ``opening``."""
        old = self._drafts[self.active]
        before = [t.message() for t in old.turns]
        boundary = Boundary.compression(before, [t.message() for t in opening],
                                        summary=summary.text, parent_turn=len(old.turns) - 1)
        child = self._open(old.session_id, "compression", boundary, opening)
        self._thread.session_ids.append(child)
        self.awaiting_summary = False
        self.last_error = None
        return child

    def branch(self, spawn: Spawn, opening: list[Turn]) -> str:
        """Open a sub-agent's thread; it becomes the active one."""
        parent = self._drafts[self.active]
        boundary = Boundary(kind="branch", parent_turn=len(parent.turns) - 1,
                            after=[t.message() for t in opening])
        child = self._open(parent.session_id, "branch", boundary, opening)
        self._thread = _Thread([child], parent=self._thread)
        return child

    def return_(self, ret: Return) -> None:
        """End the active sub-agent: its value goes to the parent as the ``spawn`` result."""
        thread = self._thread
        first = self._drafts[thread.session_ids[0]]
        first.boundary = first.boundary.model_copy(update={"returned": ret.value})
        self._thread = thread.parent
        self.add(Turn(role="tool", name="spawn", content=ret.value))

    def add_result(self, result: ToolResult) -> None:
        """A tool call's result as a ``tool`` turn; its error and violation are tallied."""
        self.add(Turn(role="tool", name=result.name, content=result.content))
        if result.violation:
            self.violations.append(result.violation)
        if result.error:
            self.tool_errors += 1
            self.last_error = result.error

    def run_calls(self, calls: list[ToolCall | ParseError],
                  run_tool: Callable[[ToolCall | ParseError, list[str]], ToolResult],
                  open_branch: Callable[[str], list[Turn]] | None,
                  max_sessions: int, max_calls: int) -> None:
        """Carry out the calls of one assistant turn (module docstring). ``run_tool(call,
        known)`` dispatches an ordinary call (``known``: the control actions the agent can see
        here); ``open_branch(task)`` is a sub-agent's opening, None when the env does not
        branch."""
        self.last_error = None
        can_spawn = open_branch is not None and not self.in_branch
        known = ["return"] if self.in_branch else (["spawn"] if can_spawn else [])
        for call in calls[:max_calls]:
            control = control_action(call, can_spawn, self.in_branch)
            if isinstance(control, Spawn):
                if self.n_sessions >= max_sessions:
                    control = ToolResult("spawn", "error: session limit reached; do it yourself",
                                         "tool")
                else:
                    self.branch(control, open_branch(control.task))
                    return  # the branch is active now; later calls in this turn are dropped
            if isinstance(control, Return):
                self.return_(control)
                return
            self.add_result(control if isinstance(control, ToolResult) else run_tool(call, known))
        if len(calls) > max_calls:
            self.add_result(ToolResult("error", f"error: only {max_calls} tool calls per turn; "
                                       f"{len(calls) - max_calls} ignored", "format"))

    def _open(self, parent_id: str | None, origin: str, boundary: Boundary | None,
              turns: list[Turn]) -> str:
        session_id = f"{self.episode_id}/s{len(self._drafts)}"
        self._drafts[session_id] = _Draft(session_id, parent_id, origin, boundary, list(turns),
                                          opening=len(turns))
        return session_id

    # --- assembly ----------------------------------------------------------------------------
    def sessions(self) -> list[Session]:
        """The recorded sessions in creation order (``used_by_final`` left unknown).
        ``metrics["opening_turns"]``: how many of its turns opened it (the system message,
        worked examples, the prompt); the agent's own turns come after them."""
        return [
            Session(session_id=d.session_id, parent_id=d.parent_id, episode_id=self.episode_id,
                    origin=d.origin, boundary=d.boundary, turns=d.turns,
                    policy_revision=d.policy_revision,
                    metrics={"generated_tokens": sum(len(t.token_ids or []) for t in d.turns),
                             "opening_turns": d.opening})
            for d in self._drafts.values()
        ]

    def reward(self, scored: RewardBreakdown | None, weights: Mapping[str, float], verifier: str,
               truncated_by: str | None = None, audit: dict[str, Any] | None = None
               ) -> RewardBreakdown:
        """The episode's reward (module docstring): ``scored`` is the verifier's breakdown of
        the answer, None when the episode ran out of budget (``truncated_by`` says which, and
        ``audit`` is added); the audit adds ``tool_errors`` and ``assistant_turns``."""
        if scored is None:
            # Out of budget: no answer to score. Ending right after a malformed call or a
            # failing tool says more than "truncated" about what went wrong.
            outcome = {"format": Outcome.format_error, "tool": Outcome.tool_error}.get(
                self.last_error, Outcome.truncated)
            reward = RewardBreakdown.from_components(
                dict.fromkeys(weights, 0.0), dict(weights), outcome, verifier,
                audit={"truncated_by": truncated_by, **(audit or {})})
        elif self.violations:
            reward = RewardBreakdown.from_components(
                dict.fromkeys(scored.components, 0.0), scored.weights, Outcome.policy_violation,
                scored.verifier, audit={**scored.audit, "violations": self.violations,
                                        "scored_components": scored.components})
        else:
            reward = scored
        return reward.model_copy(update={"audit": {
            **reward.audit, "tool_errors": self.tool_errors,
            "assistant_turns": self.assistant_turns}})

    def episode(self, reward: RewardBreakdown, answered: bool,
                session_used: Callable[[Session, Episode], bool | None],
                **fields: Any) -> Episode:
        """The validated, hashed episode: the recorded sessions, ``reward``, the final session
        when ``answered``, each session's ``used_by_final`` from ``session_used`` and the
        other ``Episode`` fields (``env_id``, ``task_id``, ...)."""
        fields.update(episode_id=self.episode_id, sessions=self.sessions(), reward=reward,
                      final_session_id=self.final_session_id if answered else None)
        # which sessions the answer used, asked of an unvalidated draft: the episode is
        # validated (and hashed) once, with the answer's use recorded on its sessions
        draft = Episode.model_construct(**fields)
        try:
            used = {s.session_id: session_used(s, draft) for s in draft.sessions}
        except Exception:
            Episode(**fields)  # a malformed episode: its validation error names the problem
            raise
        data = draft.model_dump()  # a deep copy: nothing in the record is shared with the env
        for session in data["sessions"]:
            session["used_by_final"] = used[session["session_id"]]
        return Episode.model_validate(data)


# ---------------------------------------------------------------------------------------------
# Usage by data flow
# ---------------------------------------------------------------------------------------------

STOP_WORDS = frozenset("""
a an the this that these those it its is are was were be been being am do does did done
of to in on at by for from with as into onto about and or but if then than so not no nor
i me my we our you your he she they them his her their there here what which who whom whose
answer answers result results value values unknown none null nil nothing n/a na empty
found find not-found error errors sorry cannot can't could can would will should may might
know known task sub-task subtask return returned returns reply final ok okay yes
""".split())
_WORD = re.compile(r"[\w@+.-]+")


def words(text: str) -> set[str]:
    """Lower-cased words of ``text`` (ids such as ``PRD-0042`` and emails kept whole), with
    surrounding dots and dashes stripped."""
    out = set()
    for raw in _WORD.findall(text.lower()):
        word = raw.strip(".-+")
        if word:
            out.add(word)
    return out


def content_tokens(text: str) -> set[str]:
    """The words of ``text`` that carry content: no stop words or placeholders, no single
    letters (single digits stay)."""
    return {w for w in words(text) if w not in STOP_WORDS and (len(w) > 1 or w.isdigit())}


def _argument_leaves(value: Any) -> Iterable[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _argument_leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _argument_leaves(v)
    elif value is not None:
        yield str(value)


def _call_arguments(turns: Sequence[Turn], parse: Callable[[str], list]) -> list[str]:
    """The argument values of every tool call the agent wrote in ``turns``."""
    out = []
    for t in turns:
        if t.role == "assistant":
            for call in parse(t.content):
                if isinstance(call, ToolCall):
                    out += list(_argument_leaves(call.arguments))
    return out


def _last_reply(session: Session) -> str:
    replies = [t.content for t in session.turns if t.role == "assistant"]
    return replies[-1] if replies else ""


def used_by_data_flow(
    episode: Episode,
    parse: Callable[[str], list],
    value_tokens: Callable[[str], set[str]] = content_tokens,
) -> dict[str, bool]:
    """``session_id -> used`` by the rule of the module docstring. ``parse`` finds tool calls
    in assistant text (the env's parser); ``value_tokens`` picks a returned value's content."""
    sessions = {s.session_id: s for s in episode.sessions}
    if episode.final_session_id is None:
        return dict.fromkeys(sessions, False)
    head: dict[str, str] = {}  # session -> the first session of its thread
    members: dict[str, list[str]] = {}  # thread head -> its sessions, in creation order
    for s in episode.sessions:  # creation order: a parent precedes its children
        head[s.session_id] = head[s.parent_id] if s.origin == "compression" else s.session_id
        members.setdefault(head[s.session_id], []).append(s.session_id)
    final = sessions[episode.final_session_id]
    used = {head[s.session_id] for s in episode.tree.path_to_root(final.session_id)}

    def output(thread: str) -> str:
        """What a thread hands on: the final answer, or a sub-agent's returned value."""
        if thread == head[final.session_id]:
            return _last_reply(final)
        first = sessions[thread]
        return (first.boundary.returned or "") if first.origin == "branch" else ""

    for s in episode.sessions:
        if s.origin != "branch" or s.session_id in used:
            continue
        parent_thread = head[s.parent_id]
        if parent_thread not in used:
            continue
        later: list[Turn] = []
        spawning = members[parent_thread].index(s.parent_id)
        for sid in members[parent_thread][spawning:]:
            turns = sessions[sid].turns
            later += turns[(s.boundary.parent_turn or 0) + 1:] if sid == s.parent_id else turns
        consumers = words(" ".join([*_call_arguments(later, parse), output(parent_thread)]))
        if value_tokens(s.boundary.returned or "") & consumers:
            used.add(s.session_id)
    return {sid: head[sid] in used for sid in sessions}
