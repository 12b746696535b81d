"""The session tree of an agent written as code, inferred from its model calls.

An agent that talks to the policy server (``envs.agent_proxy``) leaves a log of calls: each
with its request messages, the prompt token ids as the trainer renders them, the sampled ids
and log-probs, and when it started and ended. ``sessions_from_calls`` turns that log back
into the sessions the agent really had:

1. **Continuation.** A call continues session X when its prompt ids start with the prompt and
   completion ids of X's latest call (which ended before this call started). When several
   sessions qualify, the longest prefix wins, then the most recent. **Without token ids**
   (a policy that reports no prompt ids, such as an OpenAI-compatible endpoint under
   evaluation: some call has empty ``prompt_ids``) the same test runs on messages: a call
   continues X when its request messages start with X's latest call's messages followed by
   that call's reply, each message compared as the server parses it (``message_key``: the
   role, ``developer`` as ``system``; the content as text, text parts joined, ends stripped;
   the tool calls as name and parsed arguments, their ids ignored). ``Continuation`` names
   the two tests; every other rule below is the same for both.
2. **A new session.** A call that continues none opens a session. Its parent is the session
   *active* just before it: the session of the latest call that ended before it started,
   except that a finished sub-agent hands activity back to its parent (a ``branch`` session
   with no call after this one, whose last reply is not in this call's messages, is skipped
   for its parent), so sequential sub-agents are siblings, not a chain.
3. **Origin.** The new session is a ``branch`` when its parent makes another call after it
   starts (its returned value is its last reply), and a ``compression`` when the parent
   never calls again (boundary: the parent's last messages and reply before, the new
   session's first messages after; the parent's last reply is the summary).
4. **Stated.** A call may state its place instead (the request's ``extra_body={"agent_rl":
   {"session": ID, "parent": ID, "origin": "branch" | "compression"}}``); a stated session
   takes every call that names it (each must continue it), and a stated parent and origin win over the rules above.

A session's turns are its latest call's messages with each assistant message the session
generated carrying that call's sampled ids and log-probs (none where the policy reported
none: such episodes are for evaluation, not training), then the latest call's reply.
Assistant messages that were already in the session's first prompt (worked examples) stay
prompt turns. Parallel sub-agents started at the same moment are told apart when their first
calls overlap in time (the server batches them); an agent whose sub-agents race otherwise
should state their parent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from pydantic import Field, model_validator

from trajectories.models import Boundary, Session, Turn, _Frozen


class StatedPlace(_Frozen):
    """A call's own statement of its session (``extra_body={"agent_rl": {...}}``)."""

    session: str | None = None
    parent: str | None = None
    origin: Literal["branch", "compression"] | None = None


class ModelCall(_Frozen):
    """One chat-completion call, as the policy server recorded it."""

    index: int = Field(description="arrival order within the episode, from 0")
    started: float = Field(description="monotonic seconds when the request arrived")
    ended: float = Field(description="monotonic seconds when the reply was sent")
    messages: list[dict[str, Any]] = Field(description="the request's messages")
    prompt_ids: list[int]
    reply: dict[str, Any] = Field(description="the assistant message returned")
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    revision: int | str | None = None
    stated: StatedPlace | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelCall:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"call {self.index}: {len(self.logprobs)} log-probs for "
                             f"{len(self.completion_ids)} completion ids")
        if self.ended < self.started:
            raise ValueError(f"call {self.index} ended before it started")
        return self

    @property
    def context_ids(self) -> list[int]:
        """What a continuing call's prompt starts with: this call's prompt and completion."""
        return [*self.prompt_ids, *self.completion_ids]


class Continuation(str, Enum):
    """Rule 1's prefix test: on token ids, or on messages where the calls carry no ids."""

    tokens = "tokens"
    messages = "messages"

    @classmethod
    def of(cls, calls: Sequence[ModelCall]) -> Continuation:
        """``tokens`` when every call carries its prompt ids, else ``messages``."""
        return cls.tokens if all(c.prompt_ids for c in calls) else cls.messages


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """A message as the message test compares it: (role, content text, tool calls), parsed as
    the policy server parses a request (module docstring, rule 1)."""
    return (_role(message), _content_text(message.get("content")).strip(),
            _tool_call_keys(message.get("tool_calls")))


def _role(message: dict[str, Any]) -> Any:
    """A message's role, ``developer`` (OpenAI's newer name for it) as ``system``."""
    role = message.get("role")
    return "system" if role == "developer" else role


def _content_text(content: Any) -> str:
    """A message's content as text: OpenAI content parts are their text parts, joined."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _tool_call_keys(calls: Any) -> tuple[tuple[str, str], ...]:
    """Tool calls as (name, arguments as canonical JSON): ids are the server's or the agent's
    to choose, and arguments may come as a JSON string or an object."""
    if not isinstance(calls, list):
        return ()
    keys = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            keys.append(("", json.dumps(call, sort_keys=True, default=str)))
            continue
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # compared as the string it is
        keys.append((str(fn.get("name")), json.dumps(arguments, sort_keys=True, default=str)))
    return tuple(keys)


@dataclass(frozen=True)
class _Prefixes:
    """Rule 1's test over one log: each call's prompt and context (what a continuing call's
    prompt starts with: the call's prompt, then its reply), as token ids or message keys."""

    by: Continuation
    prompt: dict[int, tuple[Any, ...]]
    context: dict[int, tuple[Any, ...]]

    @classmethod
    def of(cls, calls: Sequence[ModelCall], by: Continuation) -> _Prefixes:
        if by is Continuation.tokens:
            return cls(by, {c.index: tuple(c.prompt_ids) for c in calls},
                       {c.index: tuple(c.context_ids) for c in calls})
        prompts = {c.index: tuple(map(message_key, c.messages)) for c in calls}
        return cls(by, prompts, {c.index: (*prompts[c.index], message_key(_reply_message(c)))
                                 for c in calls})

    def extends(self, call: ModelCall, earlier: ModelCall) -> bool:
        """Does ``call``'s prompt start with ``earlier``'s prompt and reply (and go on)?"""
        prompt, prefix = self.prompt[call.index], self.context[earlier.index]
        return len(prompt) > len(prefix) and prompt[: len(prefix)] == prefix

    def length(self, call: ModelCall) -> int:
        return len(self.context[call.index])


@dataclass
class _Draft:
    session_id: str
    calls: list[ModelCall]
    parent_id: str | None = None
    origin: Literal["root", "compression", "branch"] = "root"
    opened_by: ModelCall | None = None
    parent_turns: int = 0  # the parent's turn count when this session opened
    children: list[str] = field(default_factory=list)

    @property
    def latest(self) -> ModelCall:
        return self.calls[-1]


@dataclass(frozen=True)
class CallTree:
    """``sessions`` in the order they opened; ``session_of`` maps a call's index to its
    session id; ``by``: the prefix test rule 1 used."""

    sessions: list[Session]
    session_of: dict[int, str]
    by: Continuation


def _continued(call: ModelCall, drafts: list[_Draft], prefixes: _Prefixes) -> _Draft | None:
    """The session ``call`` continues (rule 1), or None."""
    best: _Draft | None = None
    for draft in drafts:
        latest = draft.latest
        if latest.ended > call.started or not prefixes.extends(call, latest):
            continue
        if best is None or prefixes.length(latest) >= prefixes.length(best.latest):
            best = draft
    return best


def _mentions(call: ModelCall, text: str) -> bool:
    """Is ``text`` (a reply) carried in one of ``call``'s messages?"""
    text = text.strip()
    return bool(text) and any(text in str(m.get("content") or "") for m in call.messages)


def _active(call: ModelCall, drafts: list[_Draft], by_id: dict[str, _Draft],
            calls: list[ModelCall], session_of: dict[int, str], prefixes: _Prefixes) -> _Draft:
    """The session active just before ``call`` started (rule 2)."""
    done = [c for c in calls if c.index != call.index and c.ended <= call.started
            and c.index in session_of]
    if not done:  # the first call overlaps every earlier one: the oldest session is active
        return drafts[0]
    active = by_id[session_of[max(done, key=lambda c: (c.ended, c.index)).index]]
    # a sub-agent that has finished (no later call continues it) and whose reply is not
    # carried into this call (not a compression of it) has handed activity back
    while (active.parent_id is not None
           and not any(c.started > call.started and prefixes.extends(c, active.latest)
                       for c in calls)
           and not _mentions(call, _reply_text(active.latest))):
        active = by_id[active.parent_id]
    return active


def _reply_text(call: ModelCall) -> str:
    return str(call.reply.get("content") or "")


def sessions_from_calls(calls: list[ModelCall], episode_id: str,
                        by: Continuation | None = None) -> CallTree:
    """The sessions of one episode from its calls (rules in the module docstring). ``by``:
    rule 1's prefix test (default ``Continuation.of(calls)``: tokens when every call carries
    its prompt ids, else messages). Raises ValueError naming the call when the log cannot
    form a tree (a stated parent that no call opened, indices out of order)."""
    if not calls:
        raise ValueError(f"episode {episode_id}: the agent made no model call")
    by = Continuation.of(calls) if by is None else Continuation(by)
    if by is Continuation.tokens and (bare := [c.index for c in calls if not c.prompt_ids]):
        raise ValueError(f"episode {episode_id}: calls {bare} carry no prompt ids, so the "
                         "token test cannot place them: use by=Continuation.messages")
    ordered = sorted(calls, key=lambda c: (c.started, c.index))
    indices = [c.index for c in calls]
    if len(set(indices)) != len(indices):
        raise ValueError(f"episode {episode_id}: call indices repeat: {sorted(indices)}")
    drafts: list[_Draft] = []
    by_id: dict[str, _Draft] = {}
    session_of: dict[int, str] = {}
    prefixes = _Prefixes.of(calls, by)
    for call in ordered:
        draft = _place(call, drafts, by_id, ordered, session_of, episode_id, prefixes)
        session_of[call.index] = draft.session_id
    _settle_origins(drafts, by_id)
    sessions = [_session(d, by_id, episode_id) for d in drafts]
    return CallTree(sessions=sessions, session_of=session_of, by=by)


def _place(call: ModelCall, drafts: list[_Draft], by_id: dict[str, _Draft],
           ordered: list[ModelCall], session_of: dict[int, str], episode_id: str,
           prefixes: _Prefixes) -> _Draft:
    """Add ``call`` to the session it continues or open a new one; return that session."""
    stated = call.stated or StatedPlace()
    if stated.session is not None and stated.session in by_id:
        draft = by_id[stated.session]
        if not prefixes.extends(call, draft.latest):
            unit = "token" if prefixes.by is Continuation.tokens else "message"
            raise ValueError(
                f"episode {episode_id}: call {call.index} states session {stated.session!r} "
                "but its prompt does not continue that session's last call (prompt and "
                f"reply, {unit} for {unit}); a rewritten context is a new session: state a "
                "new id with origin 'compression'")
        draft.calls.append(call)
        return draft
    if stated.session is None and (draft := _continued(call, drafts, prefixes)) is not None:
        draft.calls.append(call)
        return draft
    session_id = stated.session or f"{episode_id}/s{len(drafts)}"
    draft = _Draft(session_id=session_id, calls=[call], opened_by=call)
    if drafts:
        if stated.parent is not None:
            if stated.parent not in by_id:
                raise ValueError(f"episode {episode_id}: call {call.index} states parent "
                                 f"{stated.parent!r}, which no earlier call opened")
            parent = by_id[stated.parent]
        else:
            parent = _active(call, drafts, by_id, ordered, session_of, prefixes)
        draft.parent_id = parent.session_id
        draft.origin = stated.origin or "branch"  # settled once the whole log is known
        draft.parent_turns = _turn_count(parent)
        parent.children.append(session_id)
    elif stated.parent is not None:
        raise ValueError(f"episode {episode_id}: call {call.index} states parent "
                         f"{stated.parent!r}, but it is the episode's first call")
    drafts.append(draft)
    by_id[session_id] = draft
    return draft


def _settle_origins(drafts: list[_Draft], by_id: dict[str, _Draft]) -> None:
    """Rule 3, with the whole log known: a child whose parent calls again after it opened is
    a branch, otherwise a compression (a stated origin stays)."""
    for draft in drafts:
        if draft.parent_id is None or (draft.opened_by.stated and draft.opened_by.stated.origin):
            continue
        parent = by_id[draft.parent_id]
        continues = any(c.started > draft.opened_by.started for c in parent.calls)
        draft.origin = "branch" if continues else "compression"


def _turn_count(draft: _Draft) -> int:
    return len(draft.latest.messages) + 1


def _session(draft: _Draft, by_id: dict[str, _Draft], episode_id: str) -> Session:
    turns = _turns(draft)
    boundary = None
    first = draft.calls[0].messages
    if draft.origin == "compression":
        parent = by_id[draft.parent_id].latest
        before = [*parent.messages, _reply_message(parent)]
        boundary = Boundary.compression(before=before, after=first,
                                        summary=_reply_text(parent),
                                        parent_turn=draft.parent_turns - 1)
    elif draft.origin == "branch":
        boundary = Boundary(kind="branch", parent_turn=draft.parent_turns - 1, after=first,
                            returned=_reply_text(draft.latest))
    revisions = {c.revision for c in draft.calls}
    return Session(session_id=draft.session_id, parent_id=draft.parent_id,
                   episode_id=episode_id, origin=draft.origin, boundary=boundary, turns=turns,
                   policy_revision=revisions.pop() if len(revisions) == 1 else None,
                   metrics={"model_calls": len(draft.calls)})


def _reply_message(call: ModelCall) -> dict[str, Any]:
    message = {"role": "assistant", "content": _reply_text(call)}
    if call.reply.get("tool_calls"):
        message["tool_calls"] = call.reply["tool_calls"]
    return message


def _turns(draft: _Draft) -> list[Turn]:
    """The latest call's messages, the assistant messages this session generated carrying
    their calls' sampled ids, then the latest reply."""
    latest = draft.latest
    generated_at = {}  # message position in the latest prompt -> the call that generated it
    for call in draft.calls[:-1]:
        generated_at[len(call.messages)] = call
    turns = []
    for position, message in enumerate(latest.messages):
        call = generated_at.get(position)
        if call is not None and message.get("role") == "assistant":
            turns.append(_generated_turn(call))
        else:
            turns.append(_prompt_turn(message))
    turns.append(_generated_turn(latest))
    return turns


def _generated_turn(call: ModelCall) -> Turn:
    return Turn(role="assistant", content=_reply_text(call),
                tool_calls=call.reply.get("tool_calls") or None,
                token_ids=list(call.completion_ids) or None,  # none reported: not trainable
                logprobs=list(call.logprobs) or None, finish_reason=call.finish_reason)


def _prompt_turn(message: dict[str, Any]) -> Turn:
    role = _role(message)
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"a message with role {role!r}: only system, user, assistant and "
                         "tool messages can be recorded")
    return Turn(role=role, content=_content_text(message.get("content")),
                tool_calls=message.get("tool_calls") or None,
                name=message.get("name") if role == "tool" else None)
