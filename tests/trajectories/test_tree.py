"""SessionTree: structure queries on hand-built trees, malformed trees, random trees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.trajectories.hand_trees import branch_return, chain, compressed_branch, tree_sessions
from trajectories.testing import episode, session
from trajectories.tree import SessionTree


def ids(sessions) -> list[str]:
    return [s.session_id for s in sessions]


# --- hand-built trees -------------------------------------------------------------------


def test_chain_of_three_compressions():
    tree = chain().tree
    assert tree.root.session_id == "r"
    assert ids(tree) == ["r", "c1", "c2", "c3"]
    assert len(tree) == 4
    assert ids(tree.children("r")) == ["c1"]
    assert ids(tree.children("c3")) == []
    assert tree.parent("r") is None
    assert tree.parent("c2").session_id == "c1"
    assert ids(tree.path_to_root("c3")) == ["c3", "c2", "c1", "r"]
    assert ids(tree.path_to_root("r")) == ["r"]
    assert ids(tree.leaves()) == ["c3"]
    assert [tree.depth(s) for s in ["r", "c1", "c2", "c3"]] == [0, 1, 2, 3]
    assert tree.distance("r", "c3") == 3
    assert tree.distance("c3", "r") == 3
    assert tree.distance("c1", "c3") == 2
    assert tree.distance("c2", "c2") == 0
    assert tree["c2"].origin == "compression"
    assert tree["c2"].parent_id == "c1"
    assert "c3" in tree and "c4" not in tree


def test_branch_and_return():
    tree = branch_return().tree
    assert tree.root.session_id == "r"
    assert ids(tree) == ["r", "b1"]
    assert len(tree) == 2
    assert ids(tree.children("r")) == ["b1"]
    assert tree.parent("b1").session_id == "r"
    assert ids(tree.path_to_root("b1")) == ["b1", "r"]
    assert ids(tree.leaves()) == ["b1"]
    assert tree.depth("b1") == 1
    assert tree.distance("b1", "r") == 1
    assert tree["b1"].boundary.returned == "done"


def test_branch_inside_compressed_session():
    tree = compressed_branch().tree
    assert tree.root.session_id == "r"
    assert ids(tree) == ["r", "c1", "b1"]
    assert len(tree) == 3
    assert ids(tree.children("r")) == ["c1"]
    assert ids(tree.children("c1")) == ["b1"]
    assert tree.parent("b1").session_id == "c1"
    assert ids(tree.path_to_root("b1")) == ["b1", "c1", "r"]
    assert ids(tree.leaves()) == ["b1"]
    assert tree.depth("b1") == 2
    assert tree.distance("b1", "r") == 2
    assert tree.distance("b1", "c1") == 1
    assert tree["b1"].origin == "branch"


def test_siblings_keep_creation_order_and_distance_goes_through_parent():
    # r has children x2, then c1 (created in that order, not sorted), c1 has b1
    tree = SessionTree(
        [
            session("r"),
            session("x2", "r", "branch"),
            session("c1", "r", "compression"),
            session("b1", "c1", "branch"),
        ]
    ).validate()
    assert ids(tree.children("r")) == ["x2", "c1"]
    assert ids(tree.leaves()) == ["x2", "b1"]
    assert tree.distance("x2", "c1") == 2  # x2 -> r -> c1
    assert tree.distance("x2", "b1") == 3  # x2 -> r -> c1 -> b1


def test_getitem_missing_names_the_id():
    with pytest.raises(KeyError, match="nope"):
        chain().tree["nope"]


def test_validate_returns_the_tree():
    tree = SessionTree(chain().sessions)
    assert tree.validate() is tree


# --- malformed trees --------------------------------------------------------------------

MALFORMED = {
    "two roots": (
        lambda: [session("r1"), session("r2"), session("c1", "r1", "compression")],
        ["exactly one root", "r1", "r2"],
    ),
    "cycle": (
        lambda: [
            session("r"),
            session("a", "b", "compression"),
            session("b", "a", "branch"),
        ],
        ["cycle", "a", "b"],
    ),
    "cycle without root": (
        lambda: [session("a", "b", "compression"), session("b", "a", "compression")],
        ["cycle", "'a'", "'b'"],
    ),
    "own parent": (
        lambda: [session("r"), session("x", "x", "compression")],
        ["own parent", "x"],
    ),
    "missing parent": (
        lambda: [session("r"), session("c1", "ghost", "compression")],
        ["parent is missing", "c1", "ghost"],
    ),
    "duplicate ids": (
        lambda: [session("r"), session("c1", "r", "compression"), session("c1", "r", "branch")],
        ["duplicate session ids", "c1"],
    ),
    "empty": (lambda: [], ["empty"]),
}


@pytest.mark.parametrize("fault", sorted(MALFORMED))
def test_malformed_tree_validate_names_fault_and_ids(fault):
    build, words = MALFORMED[fault]
    with pytest.raises(ValueError) as info:
        SessionTree(build()).validate()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("fault", sorted(MALFORMED))
def test_malformed_tree_is_refused_by_episode(fault):
    build, words = MALFORMED[fault]
    with pytest.raises(ValidationError) as info:
        episode(build())
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_root_property_refuses_two_roots():
    with pytest.raises(ValueError, match="exactly one root"):
        _ = SessionTree([session("r1"), session("r2")]).root


# --- random trees -----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(tree_sessions())
def test_random_valid_trees_validate(sessions):
    tree = SessionTree(sessions).validate()
    assert ids(tree) == ids(sessions)
    assert tree.root.session_id == "s0"
    assert len(tree) == len(sessions)
    parent = {s.session_id: s.parent_id for s in sessions}

    def depth(sid):
        return 0 if parent[sid] is None else 1 + depth(parent[sid])

    for s in sessions:
        assert tree.depth(s.session_id) == depth(s.session_id)
        assert tree.distance(s.session_id, "s0") == depth(s.session_id)
        assert ids(tree.path_to_root(s.session_id))[-1] == "s0"
    has_child = {p for p in parent.values() if p is not None}
    assert ids(tree.leaves()) == [s.session_id for s in sessions if s.session_id not in has_child]
    # and an Episode accepts it
    assert episode(sessions).tree.root.session_id == "s0"


def corrupt(data, sessions: list) -> tuple[list, str]:
    """Apply one random corruption; return the sessions and a word the error must contain."""
    kind = data.draw(st.sampled_from(["duplicate", "missing parent", "second root", "2-cycle"]))
    sessions = list(sessions)
    if kind == "duplicate":
        victim = data.draw(st.sampled_from(sessions))
        sessions.insert(data.draw(st.integers(0, len(sessions))), victim)
        return sessions, "duplicate"
    if kind == "missing parent":
        non_roots = [i for i, s in enumerate(sessions) if s.parent_id is not None]
        if non_roots:
            i = data.draw(st.sampled_from(non_roots))
            sessions[i] = sessions[i].model_copy(update={"parent_id": "ghost"})
        else:
            sessions.append(session("orphan", "ghost", "branch"))
        return sessions, "missing"
    if kind == "second root":
        sessions.insert(data.draw(st.integers(0, len(sessions))), session("extra-root"))
        return sessions, "root"
    # 2-cycle: rewire a non-root session under one of its own children, else add a pair
    by_id = {s.session_id: i for i, s in enumerate(sessions)}
    pairs = [
        (by_id[s.parent_id], i)
        for i, s in enumerate(sessions)
        if s.parent_id is not None and sessions[by_id[s.parent_id]].parent_id is not None
    ]
    if pairs:
        j, k = data.draw(st.sampled_from(pairs))  # j is k's parent and not the root
        sessions[j] = sessions[j].model_copy(update={"parent_id": sessions[k].session_id})
    else:
        sessions += [session("x", "y", "branch"), session("y", "x", "compression")]
    return sessions, "cycle"


@settings(max_examples=300, deadline=None)
@given(tree_sessions(), st.data())
def test_random_corruptions_never_validate(sessions, data):
    broken, word = corrupt(data, sessions)
    with pytest.raises(ValueError, match=word):
        SessionTree(broken).validate()
    with pytest.raises(ValidationError, match=word):
        episode(broken)
