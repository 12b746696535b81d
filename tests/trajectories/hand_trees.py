"""Hand-built session trees shared by the trajectories tests, and a hypothesis strategy.

    chain               r -> c1 -> c2 -> c3         (three compressions; final answer in c3)
    branch_return       r -> b1                     (a branch that returned; final answer in r)
    compressed_branch   r -> c1 -> b1               (a branch inside the compressed session;
                                                     final answer in c1)
"""

from __future__ import annotations

from hypothesis import strategies as st

from trajectories.models import Episode, Session
from trajectories.testing import episode, session


def chain(reward: float = 1.0, **kw) -> Episode:
    return episode(
        [
            session("r", **kw.get("r", {})),
            session("c1", "r", "compression", **kw.get("c1", {})),
            session("c2", "c1", "compression", **kw.get("c2", {})),
            session("c3", "c2", "compression", **kw.get("c3", {})),
        ],
        reward=reward,
    )


def branch_return(reward: float = 1.0, **kw) -> Episode:
    return episode(
        [session("r", **kw.get("r", {})), session("b1", "r", "branch", **kw.get("b1", {}))],
        reward=reward,
    )


def compressed_branch(reward: float = 1.0, **kw) -> Episode:
    return episode(
        [
            session("r", **kw.get("r", {})),
            session("c1", "r", "compression", **kw.get("c1", {})),
            session("b1", "c1", "branch", **kw.get("b1", {})),
        ],
        reward=reward,
    )


HAND_TREES = {"chain": chain, "branch_return": branch_return, "compressed_branch": compressed_branch}


@st.composite
def tree_sessions(draw, max_size: int = 12, episode_id: str = "ep-0") -> list[Session]:
    """A random valid tree: session i's parent is some j < i; order then shuffled or not."""
    n = draw(st.integers(1, max_size))
    sessions = [session("s0", episode_id=episode_id)]
    for i in range(1, n):
        parent = draw(st.integers(0, i - 1))
        origin = draw(st.sampled_from(["compression", "branch"]))
        used = draw(st.sampled_from([True, False, None]))
        sessions.append(
            session(f"s{i}", f"s{parent}", origin, episode_id=episode_id, used_by_final=used)
        )
    if draw(st.booleans()):
        sessions = draw(st.permutations(sessions))
    return list(sessions)
