"""agent-rl data model: session trees, episodes, credit assigners and the rollout store.

This layer imports none of the other agent-rl packages.
"""

from trajectories.assign import (
    ASSIGNERS,
    SESSION_WEIGHTINGS,
    Credit,
    assign,
    register_assigner,
    session_weights,
)
from trajectories.calls import CallTree, Continuation, ModelCall, StatedPlace, sessions_from_calls
from trajectories.models import (
    Boundary,
    Episode,
    Outcome,
    RewardBreakdown,
    Session,
    Turn,
    messages_hash,
)
from trajectories.store import RolloutStore, StoreError, VerifyReport
from trajectories.tree import SessionTree

__all__ = [
    "ASSIGNERS",
    "SESSION_WEIGHTINGS",
    "Boundary",
    "CallTree",
    "Continuation",
    "Credit",
    "Episode",
    "ModelCall",
    "Outcome",
    "RewardBreakdown",
    "RolloutStore",
    "Session",
    "SessionTree",
    "StatedPlace",
    "StoreError",
    "Turn",
    "VerifyReport",
    "assign",
    "messages_hash",
    "register_assigner",
    "session_weights",
    "sessions_from_calls",
]
