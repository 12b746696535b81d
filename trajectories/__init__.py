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
    "Credit",
    "Episode",
    "Outcome",
    "RewardBreakdown",
    "RolloutStore",
    "Session",
    "SessionTree",
    "StoreError",
    "Turn",
    "VerifyReport",
    "assign",
    "messages_hash",
    "register_assigner",
    "session_weights",
]
