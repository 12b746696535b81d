"""Credit assignment: turn an episode's verifiable reward into credit per session.

Copying the terminal reward to every session is a credit-assignment *choice*, not a neutral
default; the method and its reward unit are recorded with every result (``Credit.method``,
``Credit.unit``). With R the episode reward (``episode.reward.total``) and F the session that
produced the final answer (``Episode.final_session``):

==================  ===========================================================  =============
method              credit of session s                                          unit
==================  ===========================================================  =============
``broadcast``       R                                                            episode
``terminal_only``   R if s is F, else 0                                          session
``uniform_split``   R / number of sessions                                       episode
``discounted``      R * gamma ** d(s, F), d = tree edges between s and F         session
``usage_weighted``  used_by_final: R * usage(s); unused: ``unused_value``        session
``turn_discount``   per assistant turn: R * gamma ** k, k = turns after it       turn
``candidate_set``   R (the set's reward: ``envs.candidates``)                   candidate_set
==================  ===========================================================  =============

``candidate_set`` is ``broadcast`` under its own reward unit: the episode is one candidate
set (``agent_rl/Candidates-v0``) whose members are scored together (validity x novelty against
the earlier members), so every session gets the set's reward and the set stays one unit in
the GRPO group, dynamic sampling and the bootstrap.

``turn_discount`` is AReaL's discounted-to-turn credit. The episode's assistant turns are
ordered along the path the episode ran: sessions in creation order (``episode.sessions``, the
order the tree iterates them; a sibling branch counts in that order like any other session),
turns in order within a session. The last turn gets R, a turn k turns before it gets
R * gamma ** k. Its credit of a session is a tuple with one value per assistant turn of that
session (``TurnCredit``), not one float; the trainer gives each generated token its turn's
advantage.

``usage_weighted`` follows Mosaic's idea of crediting sessions by whether their output reached
the answer. usage(s) is the session's marginal use in [0, 1], read from
``session.metrics["usage"]`` (1.0 when absent); F always counts as used. A session whose
``used_by_final`` is None (unknown) is treated as used. Note that usage signals computed with
the gold answer are a training-time signal, not something available at deployment.

Your own assigner: a function ``fn(episode, **params) -> dict[session_id, float]``, either
registered by name (``@register_assigner("name")``) or named in a contract as
``"module:function"`` / ``"path/to/file.py:function"`` (``credit.assigner``), or passed from
Python (``agent_rl.train(..., assigner=fn)``; ``trajectories.functions``). Its reward unit is
its ``unit`` attribute (default ``session``). ``check_params`` proves it before any work: it
must import, take the episode and the contract's ``credit.params``, and credit exactly the
sessions of a two-session probe episode.

Loss weights are separate from credit (``session_weights``): ``per_episode`` gives each of an
episode's n sessions 1/n, so an episode cut into more sessions is not up-weighted;
``per_session`` gives every session 1.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, Literal

from trajectories import functions
from trajectories.models import Episode, Session

RewardUnit = Literal["token", "turn", "session", "episode", "candidate_set"]
TurnCredit = tuple[float, ...]  # one value per assistant turn of a session, in order
Assigner = Callable[..., dict[str, float | TurnCredit]]


class Credit(dict):
    """dict[session_id, credit] that remembers how it was made; a credit is a float, or a
    ``TurnCredit`` (one float per assistant turn) from a turn-level assigner."""

    def __init__(self, values: dict[str, float], method: str, unit: RewardUnit, params: dict):
        super().__init__(values)
        self.method = method
        self.unit = unit
        self.params = params

    def __repr__(self) -> str:
        return f"Credit({dict(self)!r}, method={self.method!r}, unit={self.unit!r})"


ASSIGNERS: dict[str, tuple[Assigner, RewardUnit]] = {}


def register_assigner(name: str, unit: RewardUnit = "session") -> Callable[[Assigner], Assigner]:
    """Register ``fn(episode, **params) -> dict[session_id, float]`` under ``name``."""

    def decorator(fn: Assigner) -> Assigner:
        if name in ASSIGNERS:
            raise ValueError(f"assigner {name!r} is already registered")
        ASSIGNERS[name] = (fn, unit)
        return fn

    return decorator


def find_assigner(method: str) -> tuple[Assigner, RewardUnit]:
    """A registered assigner, or the function ``method`` names as ``"module:function"`` /
    ``"path/to/file.py:function"`` (or one passed from Python: ``trajectories.functions``),
    with its ``unit`` attribute or ``session``. ``ValueError`` naming the problem."""
    if method in ASSIGNERS:
        return ASSIGNERS[method]
    if ":" not in method:
        raise ValueError(f"unknown assigner {method!r}; registered: {sorted(ASSIGNERS)}, or "
                         "name your own function as 'module:function'")
    try:
        fn = functions.load_function(method, "assigner")
    except (ImportError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    unit = getattr(fn, "unit", "session")
    if unit not in typing.get_args(RewardUnit):
        raise ValueError(f"assigner {method!r}: its unit attribute {unit!r} is not one of "
                         f"{typing.get_args(RewardUnit)}")
    return fn, unit


def assign(episode: Episode, method: str = "broadcast", **params) -> Credit:
    fn, unit = find_assigner(method)
    values = fn(episode, **params)
    ids = [s.session_id for s in episode.sessions]
    if sorted(values) != sorted(ids):
        raise ValueError(f"assigner {method!r} must credit exactly the sessions {ids}, got {sorted(values)}")
    for s in episode.sessions:
        if isinstance(values[s.session_id], (tuple, list)):
            values[s.session_id] = _turn_credit(method, s, values[s.session_id])
    return Credit(values, method, unit, params)


def assistant_turns(session: Session) -> list[int]:
    """Indices into ``session.turns`` of its assistant turns, in order."""
    return [i for i, t in enumerate(session.turns) if t.role == "assistant"]


def session_credit(value: float | TurnCredit) -> float:
    """One number for a session's credit: itself, or the mean over its assistant turns."""
    if isinstance(value, tuple):
        return sum(value) / len(value) if value else 0.0
    return value


def _turn_credit(method: str, session: Session, values: typing.Sequence[float]) -> TurnCredit:
    n = len(assistant_turns(session))
    if len(values) != n:
        raise ValueError(f"assigner {method!r}: session {session.session_id} has {n} assistant "
                         f"turns but its credit has {len(values)} values (one per turn)")
    return tuple(float(v) for v in values)


def check_params(method: str, params: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the problem when ``method`` is no assigner (unknown, or a
    ``module:function`` that does not import) or ``params`` do not fit it: keywords its
    signature does not take (or lacks; an assigner is ``fn(episode, **params) -> dict``), or
    values it refuses on a dry run over a two-session episode (root + compression)."""
    fn, _ = find_assigner(method)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"assigner {method!r}: its signature cannot be read; an assigner is "
                         "fn(episode, **params) -> dict[session_id, float]") from None
    try:
        signature.bind(None, **params)
    except TypeError as exc:
        takes = [name for name in list(signature.parameters)[1:]]
        raise ValueError(f"assigner {method!r} cannot take {sorted(params)} ({exc}); it takes "
                         f"{takes or 'no parameters'}") from None
    from trajectories.testing import episode, session

    probe = episode([session("root"), session("next", "root", "compression")])
    try:
        assign(probe, method, **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"assigner {method!r} refuses {params}: {exc}") from None


@register_assigner("broadcast", unit="episode")
def broadcast(episode: Episode) -> dict[str, float]:
    return {s.session_id: episode.reward.total for s in episode.sessions}


# broadcast's rule under the reward unit of a candidate set (the module docstring)
candidate_set = register_assigner("candidate_set", unit="candidate_set")(broadcast)


@register_assigner("terminal_only")
def terminal_only(episode: Episode) -> dict[str, float]:
    final = episode.final_session.session_id
    return {s.session_id: episode.reward.total if s.session_id == final else 0.0 for s in episode.sessions}


@register_assigner("uniform_split", unit="episode")
def uniform_split(episode: Episode) -> dict[str, float]:
    share = episode.reward.total / len(episode.sessions)
    return {s.session_id: share for s in episode.sessions}


@register_assigner("discounted")
def discounted(episode: Episode, gamma: float = 0.9) -> dict[str, float]:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discounted: gamma must be in [0, 1], got {gamma}")
    tree = episode.tree
    final = episode.final_session.session_id
    return {s.session_id: episode.reward.total * gamma ** tree.distance(s.session_id, final) for s in tree}


@register_assigner("usage_weighted")
def usage_weighted(episode: Episode, unused_value: float = 0.0) -> dict[str, float]:
    final = episode.final_session.session_id
    credit = {}
    for s in episode.sessions:
        used = s.session_id == final or s.used_by_final is not False
        usage = 1.0 if s.session_id == final else float(s.metrics.get("usage", 1.0))
        if not 0.0 <= usage <= 1.0:
            raise ValueError(f"session {s.session_id}: metrics['usage'] must be in [0, 1], got {usage}")
        credit[s.session_id] = episode.reward.total * usage if used else unused_value
    return credit


@register_assigner("turn_discount", unit="turn")
def turn_discount(episode: Episode, gamma: float = 0.9) -> dict[str, TurnCredit]:
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"turn_discount: gamma must be in (0, 1], got {gamma}")
    counts = [len(assistant_turns(s)) for s in episode.sessions]  # creation order
    after = sum(counts)  # turns from the first one to the end of the episode
    credit = {}
    for s, n in zip(episode.sessions, counts, strict=True):
        credit[s.session_id] = tuple(episode.reward.total * gamma ** (after - 1 - k) for k in range(n))
        after -= n
    return credit


SESSION_WEIGHTINGS = ("per_episode", "per_session")


def session_weights(episode: Episode, mode: str = "per_episode") -> dict[str, float]:
    """Per-session loss weights (separate from credit)."""
    if mode == "per_episode":
        return {s.session_id: 1.0 / len(episode.sessions) for s in episode.sessions}
    if mode == "per_session":
        return {s.session_id: 1.0 for s in episode.sessions}
    raise ValueError(f"unknown session_weighting {mode!r}; use one of {SESSION_WEIGHTINGS}")
