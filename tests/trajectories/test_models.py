"""Frozen episode models: content hash, validation messages, JSON round trip, final session."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from tests.trajectories.hand_trees import branch_return, chain, compressed_branch
from trajectories.models import (
    Boundary,
    Episode,
    Outcome,
    RewardBreakdown,
    Session,
    Turn,
    messages_hash,
)
from trajectories.testing import assistant, episode, session


def reward(total: float = 1.0, **kw) -> RewardBreakdown:
    return RewardBreakdown.from_components({"accuracy": total}, {"accuracy": 1.0},
                                           kw.pop("outcome", "correct"), "hand@1", **kw)


# --- content hash -----------------------------------------------------------------------


def test_content_hash_is_deterministic_sha256_of_the_rest():
    a, b = compressed_branch(), compressed_branch()
    assert a.content_hash == b.content_hash
    assert len(a.content_hash) == 64 and int(a.content_hash, 16) >= 0
    assert a.hash_ok() and a.compute_hash() == a.content_hash


def _changed_sessions(ep: Episode) -> list[dict]:
    sessions = ep.model_dump()["sessions"]
    sessions[2]["turns"][1]["content"] = "a different answer"
    return sessions


# A new value for every field of Episode; the test below fails if a field is added without one.
CHANGES = {
    "schema_version": 2,
    "episode_id": None,  # handled specially: the sessions carry it too
    "env_id": "agent_rl/Other-v0",
    "env_version": "0",  # a str, not the int 0
    "task_id": "task-1",
    "group_id": "group-1",
    "sample_id": 3,
    "seed": 7,
    "split": "holdout",
    "task_meta": {"skills": ["search"]},
    "sessions": None,  # handled specially
    "final_session_id": "b1",
    "reward": reward(0.5, outcome="wrong").model_dump(),
    "tool_effects": {"records/1": "updated"},
    "hint": {"source": "teacher"},
    "filter": {"kept": True},
    "generation": {"temperature": 0.7},
}


def test_every_episode_field_has_a_change_case():
    assert set(CHANGES) == set(Episode.model_fields) - {"content_hash"}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_content_hash_changes_when_any_field_changes(field):
    base = compressed_branch()
    data = base.model_dump(exclude={"content_hash"})
    if field == "episode_id":
        data["episode_id"] = "ep-9"
        for s in data["sessions"]:
            s["episode_id"] = "ep-9"
    elif field == "sessions":
        data["sessions"] = _changed_sessions(base)
    else:
        assert data[field] != CHANGES[field]
        data[field] = CHANGES[field]
    changed = Episode(**data)
    assert changed.content_hash != base.content_hash
    assert changed.hash_ok()
    # and the unchanged data gives back the same hash
    assert Episode(**base.model_dump(exclude={"content_hash"})).content_hash == base.content_hash


@pytest.mark.parametrize(
    "path, value",
    [
        (("turns", 1, "logprobs", 0), -0.25),
        (("turns", 1, "token_ids", 0), 99),
        (("used_by_final",), False),
        (("metrics",), {"usage": 0.5}),
        (("boundary", "returned"), "something else"),
        (("policy_revision",), 3),
    ],
)
def test_content_hash_changes_with_nested_session_fields(path, value):
    base = compressed_branch()
    data = base.model_dump(exclude={"content_hash"})
    target = data["sessions"][2]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert Episode(**data).content_hash != base.content_hash


def test_explicit_wrong_hash_is_kept_and_detected():
    data = chain().model_dump()
    data["content_hash"] = "0" * 64
    ep = Episode(**data)
    assert ep.content_hash == "0" * 64
    assert not ep.hash_ok()


# --- frozen -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "get, attr, value",
    [
        (lambda ep: ep, "episode_id", "x"),
        (lambda ep: ep, "content_hash", "0" * 64),
        (lambda ep: ep.reward, "total", 5.0),
        (lambda ep: ep.sessions[1], "parent_id", None),
        (lambda ep: ep.sessions[1].boundary, "summary", "rewritten"),
        (lambda ep: ep.sessions[0].turns[1], "content", "rewritten"),
    ],
)
def test_frozen_models_refuse_mutation(get, attr, value):
    ep = compressed_branch()
    obj = get(ep)
    before = getattr(obj, attr)
    with pytest.raises(ValidationError, match="frozen"):
        setattr(obj, attr, value)
    assert getattr(obj, attr) == before
    assert ep.hash_ok()


# --- malformed records ------------------------------------------------------------------


def _ok_session(**update) -> dict:
    data = {"session_id": "c1", "parent_id": "r", "episode_id": "ep-0", "origin": "compression",
            "boundary": Boundary.compression([{"role": "user", "content": "x"}], [], "s"),
            "turns": []}
    data.update(update)
    return data


MALFORMED = {
    "logprobs length mismatch": (
        lambda: Turn(role="assistant", content="hi", token_ids=[1, 2, 3], logprobs=[-0.1, -0.2]),
        ["logprobs", "2 entries", "token_ids", "3"],
    ),
    "positive logprob": (
        lambda: Turn(role="assistant", content="hi", token_ids=[1, 2], logprobs=[-0.1, 0.3]),
        ["logprobs", "<= 0", "positions [1]"],
    ),
    "nan logprob": (
        lambda: Turn(role="assistant", content="hi", token_ids=[1], logprobs=[math.nan]),
        ["logprobs", "positions [0]"],
    ),
    "-inf logprob": (
        lambda: Turn(role="assistant", content="hi", token_ids=[1, 2], logprobs=[-0.1, -math.inf]),
        ["logprobs", "finite", "positions [1]"],
    ),
    "logprobs without token_ids": (
        lambda: Turn(role="assistant", content="hi", logprobs=[-0.1]),
        ["logprobs", "token_ids"],
    ),
    "tool turn with token_ids": (
        lambda: Turn(role="tool", content="result", name="search", token_ids=[1]),
        ["tool turn", "token_ids"],
    ),
    "unknown role": (
        lambda: Turn(role="robot", content="hi"),
        ["role"],
    ),
    "reward total inconsistent": (
        lambda: RewardBreakdown(components={"acc": 1.0, "fmt": 1.0}, weights={"acc": 1.0, "fmt": 0.5},
                                total=2.0, outcome="correct", verifier="v@1"),
        ["total", "2.0", "1.5"],
    ),
    "non-finite reward component": (
        lambda: RewardBreakdown(components={"acc": math.inf}, weights={"acc": 1.0}, total=math.inf,
                                outcome="correct", verifier="v@1"),
        ["acc", "not finite"],
    ),
    "non-finite reward total": (
        lambda: RewardBreakdown(components={}, weights={}, total=math.nan, outcome="wrong",
                                verifier="v@1"),
        ["total", "not finite"],
    ),
    "weight for unknown component": (
        lambda: RewardBreakdown(components={"acc": 1.0}, weights={"acc": 1.0, "len": 0.1}, total=1.0,
                                outcome="correct", verifier="v@1"),
        ["weights", "len"],
    ),
    "unknown outcome": (
        lambda: reward(outcome="great"),
        ["outcome"],
    ),
    "compression session without boundary": (
        lambda: Session(**_ok_session(boundary=None)),
        ["c1", "origin=compression", "boundary"],
    ),
    "branch session with a compression boundary": (
        lambda: Session(**_ok_session(origin="branch")),
        ["c1", "origin=branch", "boundary", "'branch'"],
    ),
    "compression session without parent": (
        lambda: Session(**_ok_session(parent_id=None)),
        ["c1", "parent_id"],
    ),
    "root with parent_id": (
        lambda: Session(session_id="r", parent_id="p", episode_id="ep-0", origin="root"),
        ["r", "root", "parent_id"],
    ),
    "compression boundary without before": (
        lambda: Boundary(kind="compression", after=[], summary="s"),
        ["compression boundary", "before"],
    ),
    "boundary before_hash mismatch": (
        lambda: Boundary(kind="compression", before=[{"role": "user", "content": "x"}],
                         before_hash="f" * 64),
        ["before_hash"],
    ),
    "unknown extra field on Episode": (
        lambda: episode([session("r")], bogus_field=1),
        ["bogus_field", "Extra inputs are not permitted"],
    ),
    "unknown extra field on Turn": (
        lambda: Turn(role="user", content="hi", temperature=1.0),
        ["temperature", "Extra inputs are not permitted"],
    ),
    "session of another episode": (
        lambda: episode([session("r"), session("c1", "r", "compression", episode_id="ep-x")]),
        ["c1", "another episode_id"],
    ),
    "final_session_id not in tree": (
        lambda: episode([session("r")], final_session_id="zz"),
        ["final_session_id", "zz"],
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_names_the_field(case):
    build, words = MALFORMED[case]
    with pytest.raises(ValidationError) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_nested_error_location_points_at_the_turn():
    data = chain().model_dump(exclude={"content_hash"})
    data["sessions"][2]["turns"][1]["logprobs"] = [0.5] * len(data["sessions"][2]["turns"][1]["token_ids"])
    with pytest.raises(ValidationError) as info:
        Episode.model_validate(data)
    (error,) = info.value.errors()
    assert error["loc"] == ("sessions", 2, "turns", 1)
    assert "logprobs" in error["msg"]


@pytest.mark.parametrize(
    "build",
    [
        lambda: episode([session("r")], generation={"temperature": math.inf}),
        lambda: episode([session("r")], task_meta={"difficulty": math.nan}),
        lambda: episode([session("r")], tool_effects={"rows": [1.0, -math.inf]}),
        lambda: episode([session("r", usage=math.nan)]),
    ],
)
def test_non_finite_value_in_free_form_field_cannot_be_hashed(build):
    # NaN/inf must not be silently stored as null (which would change the record and its hash)
    with pytest.raises(ValidationError, match="non-finite"):
        build()


# --- JSON round trip --------------------------------------------------------------------


@pytest.mark.parametrize("build", [chain, branch_return, compressed_branch])
def test_json_round_trip_keeps_hash(build):
    ep = build()
    text = ep.to_json()
    assert json.loads(text)["content_hash"] == ep.content_hash
    again = Episode.model_validate_json(text)
    assert again == ep
    assert again.content_hash == ep.content_hash
    assert again.hash_ok()
    assert again.to_json() == text


def test_round_trip_keeps_types_that_json_could_blur():
    ep = episode([session("r")], env_version="3", seed=0, task_meta={"length": 2, "w": 2.0},
                 hint=None, generation={"top_p": 1.0})
    again = Episode.model_validate(json.loads(ep.to_json()))
    assert again.env_version == "3" and isinstance(again.env_version, str)
    assert again.task_meta == {"length": 2, "w": 2.0}
    assert again.content_hash == ep.content_hash and again.hash_ok()


# --- final session, outcome, helpers ----------------------------------------------------


@pytest.mark.parametrize(
    "build, final",
    [(chain, "c3"), (branch_return, "r"), (compressed_branch, "c1")],
)
def test_final_session_follows_compressions_from_root(build, final):
    assert build().final_session.session_id == final


def test_final_session_takes_the_last_compression_child():
    ep = episode([session("r"), session("c1", "r", "compression"), session("c2", "r", "compression")])
    assert ep.final_session.session_id == "c2"


def test_explicit_final_session_wins():
    ep = episode(compressed_branch().sessions, final_session_id="b1")
    assert ep.final_session.session_id == "b1"


def test_outcome_values():
    assert [o.value for o in Outcome] == [
        "correct", "wrong", "format_error", "tool_error", "sandbox_error", "timeout",
        "truncated", "policy_violation",
    ]
    assert Outcome("timeout") is Outcome.timeout
    assert Outcome.correct == "correct" and isinstance(Outcome.correct, str)
    faults = [o for o in Outcome if reward(outcome=o).is_infrastructure_fault]
    assert faults == [Outcome.sandbox_error]
    with pytest.raises(ValueError):
        Outcome("right")


def test_reward_from_components_sums_weights():
    r = RewardBreakdown.from_components({"acc": 1.0, "fmt": 0.5, "len": 2.0},
                                        {"acc": 1.0, "fmt": 0.2}, "correct", "v@1")
    assert r.total == pytest.approx(1.0 + 0.1)  # len has no weight: counts 0
    assert r.outcome is Outcome.correct


def test_compression_boundary_keeps_hash_without_messages():
    before = [{"role": "user", "content": "long context"}]
    kept = Boundary.compression(before, [{"role": "user", "content": "task + summary"}], "sum")
    dropped = Boundary.compression(before, [], "sum", keep_before=False)
    assert kept.before == before and dropped.before is None
    assert kept.before_hash == dropped.before_hash == messages_hash(before)


def test_session_helpers():
    s = session("r", text="one two three")
    assert s.generated_tokens == 4  # testing.assistant: words + 1 token ids
    assert s.messages() == [{"role": "user", "content": "task"},
                            {"role": "assistant", "content": "one two three"}]
    assert assistant("x", token_ids=[5, 6]).generated
    assert not Turn(role="user", content="x").generated
