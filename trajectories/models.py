"""The episode record: what one agent episode leaves behind, as frozen pydantic models.

An episode is not one prompt/response but a tree of sessions. A child session starts when the
context is compressed (``origin="compression"``: the agent wrote a summary and a fresh context
continues from it) or when the agent branches a sub-agent (``origin="branch"``: the sub-agent's
returned value goes back to the parent as a tool result). Every session keeps its parent id,
its boundary (what crossed from the parent), its own generated tokens and old log-probs.

Every model is frozen. ``Episode.content_hash`` is the sha256 of the canonical JSON of every
other field (sorted keys, no whitespace, UTF-8, NaN forbidden), so a stored record can be
checked byte for byte later (``RolloutStore.verify``).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trajectories.hashing import canonical_hash, canonical_json

SCHEMA_VERSION = 1


class Outcome(str, Enum):
    """How an episode ended, as the verifier saw it.

    ``sandbox_error`` is an infrastructure fault, never a wrong answer: trainers mask such
    episodes out of the loss and count them.
    """

    correct = "correct"
    wrong = "wrong"
    format_error = "format_error"
    tool_error = "tool_error"
    sandbox_error = "sandbox_error"
    timeout = "timeout"
    truncated = "truncated"
    policy_violation = "policy_violation"


INFRASTRUCTURE_OUTCOMES = frozenset({Outcome.sandbox_error})


class _Frozen(BaseModel):
    # ser_json_inf_nan="constants": keep inf/nan as floats in model_dump(mode="json") so that
    # hashing refuses them (the default turns them into None inside dict[str, Any] fields,
    # which silently changed the stored record and its hash).
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class RewardBreakdown(_Frozen):
    """The verifier's score: ``total = sum(weights[k] * components[k])``."""

    components: dict[str, float]
    weights: dict[str, float]
    total: float
    outcome: Outcome
    verifier: str = Field(description="name@version of the verifier that scored the episode")
    audit: dict[str, Any] = Field(default_factory=dict, description="e.g. tamper flags")

    @classmethod
    def from_components(
        cls,
        components: dict[str, float],
        weights: dict[str, float],
        outcome: Outcome | str,
        verifier: str,
        audit: dict[str, Any] | None = None,
    ) -> RewardBreakdown:
        total = sum(weights.get(name, 0.0) * value for name, value in components.items())
        return cls(
            components=components,
            weights=weights,
            total=total,
            outcome=outcome,
            verifier=verifier,
            audit=audit or {},
        )

    @model_validator(mode="after")
    def _check_total(self) -> RewardBreakdown:
        unknown = sorted(set(self.weights) - set(self.components))
        if unknown:
            raise ValueError(f"weights name components that are not in `components`: {unknown}")
        for name, value in {**self.components, "total": self.total}.items():
            if not math.isfinite(value):
                raise ValueError(f"reward `{name}` is not finite: {value}")
        expected = sum(self.weights.get(k, 0.0) * v for k, v in self.components.items())
        if not math.isclose(self.total, expected, rel_tol=1e-9, abs_tol=1e-9):
            raise ValueError(
                f"`total` is {self.total} but sum(weight x component) is {expected}"
            )
        return self

    @property
    def is_infrastructure_fault(self) -> bool:
        return self.outcome in INFRASTRUCTURE_OUTCOMES


class Turn(_Frozen):
    """One chat message. Assistant turns produced by the policy carry what it sampled."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, description="tool name, for tool turns")
    token_ids: list[int] | None = Field(
        default=None, description="policy-sampled token ids, as generated (never re-tokenized)"
    )
    logprobs: list[float] | None = Field(
        default=None, description="old log-probs of token_ids under the rollout policy"
    )
    finish_reason: str | None = Field(default=None, description="stop | length | tool_call | ...")

    @model_validator(mode="after")
    def _check_generated(self) -> Turn:
        if self.role != "assistant" and (self.token_ids is not None or self.logprobs is not None):
            raise ValueError(f"a {self.role} turn cannot carry token_ids/logprobs")
        if self.logprobs is not None:
            if self.token_ids is None:
                raise ValueError("`logprobs` given without `token_ids`")
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(
                    f"`logprobs` has {len(self.logprobs)} entries but `token_ids` "
                    f"has {len(self.token_ids)}"
                )
            bad = [i for i, lp in enumerate(self.logprobs) if not (math.isfinite(lp) and lp <= 0.0)]
            if bad:
                raise ValueError(f"`logprobs` must be finite and <= 0; bad at positions {bad[:5]}")
        return self

    @property
    def generated(self) -> bool:
        return self.token_ids is not None

    def message(self) -> dict[str, Any]:
        """The chat-template message for this turn."""
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.name is not None:
            msg["name"] = self.name
        return msg


class Boundary(_Frozen):
    """What crossed from the parent session into a child session.

    compression: ``before`` (the parent's messages at compression time, or None when only
    ``before_hash`` is kept), ``before_hash`` and ``after`` (the child's opening messages: the
    task plus the summary). branch: ``parent_turn`` (index of the parent turn that spawned
    it), ``after`` (the sub-agent's opening messages) and ``returned`` (the value handed back
    to the parent, None while it has not returned).
    """

    kind: Literal["compression", "branch"]
    parent_turn: int | None = None
    before: list[dict[str, Any]] | None = None
    before_hash: str | None = None
    after: list[dict[str, Any]] = Field(default_factory=list)
    summary: str | None = None
    returned: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Boundary:
        if self.kind == "compression" and self.before is None and self.before_hash is None:
            raise ValueError("a compression boundary needs `before` or `before_hash`")
        if self.before is not None:
            digest = messages_hash(self.before)
            if self.before_hash is not None and self.before_hash != digest:
                raise ValueError("`before_hash` does not match the hash of `before`")
        return self

    @classmethod
    def compression(
        cls,
        before: list[dict[str, Any]],
        after: list[dict[str, Any]],
        summary: str,
        parent_turn: int | None = None,
        keep_before: bool = True,
    ) -> Boundary:
        return cls(
            kind="compression",
            before=before if keep_before else None,
            before_hash=messages_hash(before),
            after=after,
            summary=summary,
            parent_turn=parent_turn,
        )


class Session(_Frozen):
    """One context window of an episode: a root, a compression continuation or a branch."""

    session_id: str
    parent_id: str | None = None
    episode_id: str
    origin: Literal["root", "compression", "branch"] = "root"
    boundary: Boundary | None = None
    turns: list[Turn] = Field(default_factory=list)
    policy_revision: int | str | None = None
    used_by_final: bool | None = Field(
        default=None, description="did this session's output reach the final answer"
    )
    metrics: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_origin(self) -> Session:
        if self.origin == "root":
            if self.parent_id is not None:
                raise ValueError(f"session {self.session_id}: a root session has no parent_id")
            if self.boundary is not None:
                raise ValueError(f"session {self.session_id}: a root session has no boundary")
        else:
            if self.parent_id is None:
                raise ValueError(
                    f"session {self.session_id}: origin={self.origin} needs a parent_id"
                )
            if self.boundary is None or self.boundary.kind != self.origin:
                raise ValueError(
                    f"session {self.session_id}: origin={self.origin} needs a boundary of "
                    f"kind {self.origin!r}"
                )
        return self

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns if t.token_ids is not None)

    def messages(self) -> list[dict[str, Any]]:
        return [t.message() for t in self.turns]

    @property
    def last_reply(self) -> Turn | None:
        """The session's last assistant turn (for a compressed session: its summary)."""
        return next((t for t in reversed(self.turns) if t.role == "assistant"), None)


class Episode(_Frozen):
    """One agent episode: a tree of sessions, its reward and its provenance."""

    schema_version: int = SCHEMA_VERSION
    episode_id: str
    env_id: str
    env_version: str | int
    task_id: str
    group_id: str
    sample_id: int = 0
    seed: int | None = None
    split: str = "train"
    task_meta: dict[str, Any] = Field(default_factory=dict)
    sessions: list[Session]
    final_session_id: str | None = Field(
        default=None,
        description="session that produced the final answer; None: follow compressions from the root",
    )
    reward: RewardBreakdown
    tool_effects: dict[str, Any] = Field(default_factory=dict)
    hint: dict[str, Any] | None = None
    filter: dict[str, Any] | None = None
    generation: dict[str, Any] = Field(default_factory=dict)
    content_hash: str = ""

    @model_validator(mode="after")
    def _check_tree(self) -> Episode:
        from trajectories.tree import SessionTree

        foreign = [s.session_id for s in self.sessions if s.episode_id != self.episode_id]
        if foreign:
            raise ValueError(
                f"episode {self.episode_id}: sessions {foreign} carry another episode_id"
            )
        tree = SessionTree(self.sessions)
        tree.validate()
        if self.final_session_id is not None and self.final_session_id not in tree:
            raise ValueError(
                f"episode {self.episode_id}: final_session_id {self.final_session_id!r} "
                "is not one of its sessions"
            )
        if not self.content_hash:
            # Frozen model: the hash is derived once, here, from every other field.
            object.__setattr__(self, "content_hash", self.compute_hash())
        return self

    @property
    def tree(self):
        from trajectories.tree import SessionTree

        return SessionTree(self.sessions)

    @property
    def final_session(self) -> Session:
        """The session that produced the final answer.

        Explicit ``final_session_id`` wins; otherwise the answer comes from the end of the
        root's compression chain (branches return into their parent, compressions continue it).
        """
        tree = self.tree
        if self.final_session_id is not None:
            return tree[self.final_session_id]
        current = tree.root
        while True:
            continuations = [c for c in tree.children(current.session_id) if c.origin == "compression"]
            if not continuations:
                return current
            current = continuations[-1]

    def compressed_sessions(self) -> list[Session]:
        """The sessions that were compressed (each has a compression child), in order."""
        parents = {s.parent_id for s in self.sessions if s.origin == "compression"}
        return [s for s in self.sessions if s.session_id in parents]

    def evolve(self, **updates: Any) -> Episode:
        """A copy with some fields replaced, re-validated, with a fresh content hash."""
        data = {**self.model_dump(), **updates, "content_hash": ""}
        return Episode.model_validate(data)

    def compute_hash(self) -> str:
        return _hash_payload(self.model_dump(mode="json", exclude={"content_hash"}))

    def hash_ok(self) -> bool:
        return self.compute_hash() == self.content_hash

    def to_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))


def _hash_payload(payload: dict[str, Any]) -> str:
    try:
        return canonical_hash(payload)
    except ValueError as exc:
        raise ValueError(f"episode holds a non-finite number and cannot be hashed: {exc}") from exc


def messages_hash(messages: list[dict[str, Any]]) -> str:
    """sha256 of the canonical JSON of a message list (compression boundaries)."""
    return canonical_hash(messages)
