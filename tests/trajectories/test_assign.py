"""Credit assigners on hand-built trees (values computed by hand) and their properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trajectories.hand_trees import branch_return, chain, compressed_branch, tree_sessions
from trajectories.assign import (
    ASSIGNERS,
    SESSION_WEIGHTINGS,
    Credit,
    assign,
    check_params,
    register_assigner,
    session_weights,
)
from trajectories.functions import function_spec
from trajectories.testing import episode, session

R = 2.0  # episode reward used by the hand trees


def approx(d: dict[str, float]) -> dict:
    return {k: pytest.approx(v) for k, v in d.items()}


# --- chain: r -> c1 -> c2 -> c3, final answer in c3 ----------------------------------------
# tree distances to the final session c3: r 3, c1 2, c2 1, c3 0
CHAIN = {
    "broadcast": ({}, {"r": 2.0, "c1": 2.0, "c2": 2.0, "c3": 2.0}),
    "terminal_only": ({}, {"r": 0.0, "c1": 0.0, "c2": 0.0, "c3": 2.0}),
    # 2 / 4 sessions
    "uniform_split": ({}, {"r": 0.5, "c1": 0.5, "c2": 0.5, "c3": 0.5}),
    # 2 * 0.5**3, 2 * 0.5**2, 2 * 0.5, 2
    "discounted-0.5": ({"gamma": 0.5}, {"r": 0.25, "c1": 0.5, "c2": 1.0, "c3": 2.0}),
    # 2 * 0.729, 2 * 0.81, 2 * 0.9, 2
    "discounted-0.9": ({"gamma": 0.9}, {"r": 1.458, "c1": 1.62, "c2": 1.8, "c3": 2.0}),
    # usage metrics r 0.25, c1 0.5, c2 absent (1.0), c3 final (always 1, its 0.1 is ignored):
    # 2 * 0.25, 2 * 0.5, 2 * 1.0, 2 * 1.0
    "usage_weighted": ({}, {"r": 0.5, "c1": 1.0, "c2": 2.0, "c3": 2.0}),
}


def chain_with_usage():
    return chain(R, r={"usage": 0.25}, c1={"usage": 0.5}, c3={"usage": 0.1})


# --- branch_return: r -> b1 (branch), final answer in r ------------------------------------
# distances to r: r 0, b1 1; b1's output was not used (used_by_final=False)
BRANCH = {
    "broadcast": ({}, {"r": 2.0, "b1": 2.0}),
    "terminal_only": ({}, {"r": 2.0, "b1": 0.0}),
    "uniform_split": ({}, {"r": 1.0, "b1": 1.0}),  # 2 / 2
    "discounted-0.5": ({"gamma": 0.5}, {"r": 2.0, "b1": 1.0}),  # 2 * 0.5
    "discounted-0.9": ({"gamma": 0.9}, {"r": 2.0, "b1": 1.8}),  # 2 * 0.9
    # unused branch gets unused_value, not a share of the reward
    "usage_weighted": ({"unused_value": -0.1}, {"r": 2.0, "b1": -0.1}),
}


def branch_with_unused_branch():
    return branch_return(R, b1={"used_by_final": False, "usage": 0.9})


# --- compressed_branch: r -> c1 -> b1 (branch of c1), final answer in c1 -----------------
# distances to c1: r 1, c1 0, b1 1; r usage 0.5, b1 unused
COMPRESSED_BRANCH = {
    "broadcast": ({}, {"r": 2.0, "c1": 2.0, "b1": 2.0}),
    "terminal_only": ({}, {"r": 0.0, "c1": 2.0, "b1": 0.0}),
    "uniform_split": ({}, {"r": 2 / 3, "c1": 2 / 3, "b1": 2 / 3}),  # 2 / 3
    "discounted-0.5": ({"gamma": 0.5}, {"r": 1.0, "c1": 2.0, "b1": 1.0}),  # 2 * 0.5
    "discounted-0.9": ({"gamma": 0.9}, {"r": 1.8, "c1": 2.0, "b1": 1.8}),  # 2 * 0.9
    # r: 2 * 0.5; c1 final: 2; b1 unused: default unused_value 0
    "usage_weighted": ({}, {"r": 1.0, "c1": 2.0, "b1": 0.0}),
}


def compressed_branch_with_usage():
    return compressed_branch(R, r={"usage": 0.5}, b1={"used_by_final": False})


CASES = [
    (build, name, params, expected)
    for build, table in [
        (chain_with_usage, CHAIN),
        (branch_with_unused_branch, BRANCH),
        (compressed_branch_with_usage, COMPRESSED_BRANCH),
    ]
    for name, (params, expected) in table.items()
]


@pytest.mark.parametrize(
    "build, name, params, expected", CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CASES]
)
def test_builtin_assigners_on_hand_trees(build, name, params, expected):
    method = name.split("-")[0]
    credit = assign(build(), method, **params)
    assert dict(credit) == approx(expected)
    assert list(credit) == list(expected)  # keyed in session order
    assert credit.method == method
    assert credit.params == params


def test_usage_weighted_treats_unknown_use_as_used_and_final_as_used():
    ep = episode(
        [
            session("r", used_by_final=None, usage=0.5),  # unknown -> used: 1 * 0.5
            session("b1", "r", "branch", used_by_final=False),  # unused -> 0.25
            session("b2", "r", "branch", used_by_final=True, usage=0.0),  # used, no marginal use: 0
            session("c1", "r", "compression", used_by_final=False),  # final: always used, 1 * 1
        ],
        reward=1.0,
    )
    assert ep.final_session.session_id == "c1"
    credit = assign(ep, "usage_weighted", unused_value=0.25)
    assert dict(credit) == approx({"r": 0.5, "b1": 0.25, "b2": 0.0, "c1": 1.0})


def test_terminal_only_and_discounted_follow_explicit_final_session():
    ep = episode(compressed_branch().sessions, reward=1.0, final_session_id="b1")
    assert dict(assign(ep, "terminal_only")) == {"r": 0.0, "c1": 0.0, "b1": 1.0}
    # distances to b1: r 2, c1 1, b1 0
    assert dict(assign(ep, "discounted", gamma=0.5)) == approx({"r": 0.25, "c1": 0.5, "b1": 1.0})


def test_default_method_is_broadcast_and_discounted_default_gamma():
    ep = chain(1.0)
    assert assign(ep).method == "broadcast"
    assert dict(assign(ep, "discounted")) == approx({"r": 0.729, "c1": 0.81, "c2": 0.9, "c3": 1.0})


@pytest.mark.parametrize(
    "method, unit",
    [
        ("broadcast", "episode"),
        ("terminal_only", "session"),
        ("uniform_split", "episode"),
        ("discounted", "session"),
        ("usage_weighted", "session"),
    ],
)
def test_credit_records_method_and_unit(method, unit):
    credit = assign(chain(), method)
    assert isinstance(credit, Credit) and isinstance(credit, dict)
    assert (credit.method, credit.unit) == (method, unit)
    assert repr(credit).startswith("Credit(") and repr(credit).endswith(f"method={method!r}, unit={unit!r})")


def test_builtins_are_registered():
    assert {"broadcast", "terminal_only", "uniform_split", "discounted", "usage_weighted"} <= set(
        ASSIGNERS
    )


@pytest.mark.parametrize("gamma", [-0.1, 1.5])
def test_discounted_rejects_gamma_outside_unit_interval(gamma):
    with pytest.raises(ValueError, match="gamma must be in"):
        assign(chain(), "discounted", gamma=gamma)


def test_usage_weighted_rejects_usage_outside_unit_interval():
    with pytest.raises(ValueError, match="session r: metrics\\['usage'\\] must be in"):
        assign(chain(r={"usage": 1.5}), "usage_weighted")


# --- registry ---------------------------------------------------------------------------


@pytest.fixture
def scratch_registry():
    before = dict(ASSIGNERS)
    yield
    ASSIGNERS.clear()
    ASSIGNERS.update(before)


def test_register_custom_assigner(scratch_registry):
    @register_assigner("depth_scaled", unit="turn")
    def depth_scaled(ep, scale=1.0):
        tree = ep.tree
        return {s.session_id: ep.reward.total * scale * tree.depth(s.session_id) for s in tree}

    assert ASSIGNERS["depth_scaled"] == (depth_scaled, "turn")
    credit = assign(chain(2.0), "depth_scaled", scale=0.5)
    # 2 * 0.5 * depth: r 0, c1 1, c2 2, c3 3
    assert dict(credit) == {"r": 0.0, "c1": 1.0, "c2": 2.0, "c3": 3.0}
    assert (credit.method, credit.unit, credit.params) == ("depth_scaled", "turn", {"scale": 0.5})


def test_register_duplicate_name_is_refused(scratch_registry):
    original = ASSIGNERS["broadcast"]
    with pytest.raises(ValueError, match="'broadcast' is already registered"):
        register_assigner("broadcast")(lambda ep: {})
    assert ASSIGNERS["broadcast"] == original


def test_assigner_that_misses_a_session_is_refused(scratch_registry):
    @register_assigner("root_only")
    def root_only(ep):
        return {ep.tree.root.session_id: 1.0}

    with pytest.raises(ValueError, match="must credit exactly the sessions"):
        assign(chain(), "root_only")


def test_unknown_method_lists_registered_names():
    with pytest.raises(ValueError, match="unknown assigner 'nope'.*broadcast"):
        assign(chain(), "nope")


# --- loss weights -----------------------------------------------------------------------


def test_session_weights():
    assert session_weights(chain(), "per_episode") == {"r": 0.25, "c1": 0.25, "c2": 0.25, "c3": 0.25}
    assert session_weights(branch_return()) == {"r": 0.5, "b1": 0.5}  # default per_episode
    assert session_weights(compressed_branch(), "per_session") == {"r": 1.0, "c1": 1.0, "b1": 1.0}
    assert SESSION_WEIGHTINGS == ("per_episode", "per_session")
    with pytest.raises(ValueError, match="unknown session_weighting 'per_token'"):
        session_weights(chain(), "per_token")


# --- properties on random trees ---------------------------------------------------------

rewards = st.floats(-5.0, 5.0, allow_nan=False)


@st.composite
def episodes(draw, reward=rewards):
    sessions = draw(tree_sessions())
    final = draw(st.one_of(st.none(), st.sampled_from([s.session_id for s in sessions])))
    return episode(sessions, reward=draw(reward), final_session_id=final)


@settings(max_examples=150, deadline=None)
@given(episodes())
def test_broadcast_gives_every_session_the_reward(ep):
    credit = assign(ep, "broadcast")
    assert set(credit.values()) == {ep.reward.total}
    assert len(credit) == len(ep.sessions)


@settings(max_examples=150, deadline=None)
@given(episodes())
def test_uniform_split_sums_to_reward(ep):
    credit = assign(ep, "uniform_split")
    assert math.isclose(sum(credit.values()), ep.reward.total, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=150, deadline=None)
@given(episodes())
def test_per_episode_weights_sum_to_one(ep):
    assert math.isclose(sum(session_weights(ep, "per_episode").values()), 1.0)
    assert sum(session_weights(ep, "per_session").values()) == len(ep.sessions)


@settings(max_examples=150, deadline=None)
@given(episodes(reward=st.floats(0.0, 5.0)), st.floats(0.0, 1.0))
def test_discounted_never_increases_with_distance_to_final(ep, gamma):
    credit = assign(ep, "discounted", gamma=gamma)
    tree, final = ep.tree, ep.final_session.session_id
    assert credit[final] == ep.reward.total
    by_distance = sorted(credit, key=lambda sid: tree.distance(sid, final))
    values = [credit[sid] for sid in by_distance]
    assert all(a >= b for a, b in zip(values[:-1], values[1:], strict=True))
    assert all(0.0 <= v <= ep.reward.total for v in values)


# --- your own assigner function, named "module:function" or passed from Python --------------

CUSTOM = "tests.trajectories.custom_assigners"


def test_a_module_function_assigner_gives_the_credit_computed_by_hand():
    # chain r -> c1 -> c2 -> c3, R = 1.2; depth_share: R / (1 + depth)
    credit = assign(chain(reward=1.2), f"{CUSTOM}:depth_share")
    assert credit == approx({"r": 1.2, "c1": 0.6, "c2": 0.4, "c3": 0.3})
    assert (credit.method, credit.unit) == (f"{CUSTOM}:depth_share", "session")
    scaled = assign(branch_return(reward=1.0), f"{CUSTOM}:depth_share", scale=0.5)
    assert scaled == approx({"r": 0.5, "b1": 0.25})
    check_params(f"{CUSTOM}:depth_share", {"scale": 2.0})  # takes its own keyword


def test_a_file_assigner_and_a_passed_function(tmp_path):
    source = tmp_path / "my_credit.py"
    source.write_text("def last_only(episode):\n"
                      "    final = episode.final_session.session_id\n"
                      "    return {s.session_id: float(s.session_id == final) * episode.reward.total\n"
                      "            for s in episode.sessions}\n")
    # compressed_branch r -> c1 -> b1, final answer in c1
    assert assign(compressed_branch(reward=2.0), f"{source}:last_only") == approx(
        {"r": 0.0, "c1": 2.0, "b1": 0.0})

    def halves(episode):  # a closure: not importable by name, kept in this process
        return {s.session_id: episode.reward.total / 2 for s in episode.sessions}

    spec = function_spec(halves, "assigner")
    assert spec == ("tests.trajectories.test_assign:"
                    "test_a_file_assigner_and_a_passed_function.<locals>.halves")
    assert assign(chain(reward=1.0), spec) == approx({"r": 0.5, "c1": 0.5, "c2": 0.5, "c3": 0.5})
    # an importable module-level function is named plainly, as YAML would
    from tests.trajectories.custom_assigners import depth_share
    assert function_spec(depth_share, "assigner") == f"{CUSTOM}:depth_share"


@pytest.mark.parametrize(("spec", "params", "message"), [
    ("no_such_module_xyz:fn", {}, r"cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
    (f"{CUSTOM}:missing", {}, "has no attribute 'missing'"),
    (f"{CUSTOM}:NOT_A_FUNCTION", {}, "is int, not a function"),
    (f"{CUSTOM}:takes_nothing", {}, r"cannot take \[\].*it takes no parameters"),
    (f"{CUSTOM}:depth_share", {"gamma": 1}, r"cannot take \['gamma'\].*it takes \['scale'\]"),
    (f"{CUSTOM}:wrong_unit", {}, "unit attribute 'paragraph' is not one of"),
    ("missing/credit.py:fn", {}, "no file .*credit.py"),
    ("__main__:never_passed", {}, "passed from Python.*pass it again.*assigner=never_passed"),
])
def test_a_bad_assigner_function_is_named_before_any_work(spec, params, message):
    with pytest.raises(ValueError, match=message):
        check_params(spec, params)
