"""The turn-level assigner ``turn_discount``: credit per assistant turn, by hand."""

from __future__ import annotations

import pytest

from trajectories import Session, Turn
from trajectories.assign import ASSIGNERS, assign, check_params
from trajectories.testing import assistant, episode, session


def two_turn_root() -> Session:
    """A root session with two assistant turns (the episode's turns 1 and 2)."""
    root = session("root")
    return root.model_copy(update={"turns": [*root.turns, Turn(role="user", content="go on"),
                                             assistant("second turn")]})


def three_turn_episode(reward: float = 1.0, episode_id: str = "ep-0"):
    """2 sessions, 3 assistant turns along the path: root's two, then the compression's one."""
    return episode([two_turn_root(), session("next", "root", "compression")], reward=reward,
                   episode_id=episode_id)


def test_turn_discount_by_hand():
    credit = assign(three_turn_episode(1.0), "turn_discount", gamma=0.5)
    # the last turn gets R = 1; one turn before it 0.5; two turns before it 0.25
    assert dict(credit) == {"root": (0.25, 0.5), "next": (1.0,)}
    assert (credit.method, credit.unit, credit.params) == ("turn_discount", "turn", {"gamma": 0.5})


def test_turn_discount_counts_sibling_branches_in_creation_order():
    ep = episode([session("root"), session("b1", "root", "branch"), session("b2", "root", "branch")],
                 reward=2.0, final_session_id="root")
    # path order is creation order: root, b1, b2 (3 turns); b2's turn is last
    assert dict(assign(ep, "turn_discount", gamma=0.5)) == {"root": (0.5,), "b1": (1.0,), "b2": (2.0,)}


def test_turn_discount_default_gamma_is_0_9():
    credit = assign(three_turn_episode(1.0), "turn_discount")
    assert credit["root"] == pytest.approx((0.81, 0.9)) and credit["next"] == (1.0,)


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5])
def test_turn_discount_refuses_gamma_outside_half_open_interval(gamma):
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        assign(three_turn_episode(), "turn_discount", gamma=gamma)
    with pytest.raises(ValueError, match="'turn_discount' refuses .*gamma"):
        check_params("turn_discount", {"gamma": gamma})


def test_turn_discount_is_registered_as_a_turn_assigner():
    assert ASSIGNERS["turn_discount"][1] == "turn"
    check_params("turn_discount", {"gamma": 0.5})  # accepted


def test_a_turn_credit_of_the_wrong_length_is_refused(monkeypatch):
    monkeypatch.setitem(ASSIGNERS, "short", (lambda ep: {s.session_id: (1.0,) for s in ep.sessions}, "turn"))
    with pytest.raises(ValueError, match="session root has 2 assistant turns but its credit has 1"):
        assign(three_turn_episode(), "short")



def test_the_tree_and_the_summary_show_turn_credit():
    import io

    from rich.console import Console

    from trajectories.display import episode_tree, summary_table

    ep = three_turn_episode(1.0)
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    console.print(episode_tree(ep, assign(ep, "turn_discount", gamma=0.5),
                               {"root": (-0.5, 0.0), "next": (1.0,)}))
    console.print(summary_table([ep], "turn_discount", {"gamma": 0.5}))
    text = out.getvalue()
    assert "credit [0.25, 0.5]" in text and "advantage [-0.5, +0]" in text
    assert "credit [1]" in text and "advantage [+1]" in text
    # a session's credit is the mean over its turns: (0.375 + 1.0) / 2 sessions
    assert "0.6875" in text
