"""Assigner functions named by ``module:function`` in the tests (not registered)."""

from __future__ import annotations


def depth_share(episode, scale: float = 1.0) -> dict[str, float]:
    """credit(s) = scale * R / (1 + depth(s)): the root gets R, its child R / 2, ..."""
    tree = episode.tree
    return {s.session_id: scale * episode.reward.total / (1 + tree.depth(s.session_id))
            for s in episode.sessions}


depth_share.unit = "session"


def takes_nothing() -> dict[str, float]:
    return {}


def wrong_unit(episode) -> dict[str, float]:
    return {s.session_id: 0.0 for s in episode.sessions}


wrong_unit.unit = "paragraph"

NOT_A_FUNCTION = 3
