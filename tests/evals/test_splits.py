"""Compositional splits: held-out structures/entities/lengths never reach train, duplicates are
removed before splitting, leakage fails loudly, splits are deterministic, sealed sets pin."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs import TaskMeta, TaskSpec
from evals.splits import (
    IID_FALLBACK_FRACTION,
    HoldoutError,
    HoldoutFallbackWarning,
    LeakageError,
    SealedSetError,
    Splits,
    check_leakage,
    choose_holdouts,
    compositional_splits,
    deduplicate,
    default_splits,
    normalize_text,
    sealed_eval_set,
    shingles,
)

ARITH = "agent_rl/Arithmetic-v0"
RECORDS = "agent_rl/Records-v0"
ENV_IDS = [
    ARITH,
    pytest.param(RECORDS, marks=pytest.mark.skipif(
        RECORDS not in envs.list_envs(), reason="Records-v0 is not registered yet")),
]

# A long prompt (51 words once punctuation is dropped: 44 8-shingles) and a copy differing in
# its last word: the last shingle differs, Jaccard = 43 / (44 + 44 - 43) = 43 / 45 = 0.9556.
LONG = ("A shop sells 12 apples on Monday , 7 apples on Tuesday and 9 apples on Wednesday ; "
        "each apple costs 3 coins and the owner pays 5 coins of rent per day , plus 2 coins "
        "for the market stall . Compute the profit over the three days and answer with just "
        "the number")
NEAR = LONG[: -len("number")] + "value"


def pool(env_id: str, n: int = 400, seed: int = 0) -> list[TaskSpec]:
    env = envs.make(env_id)
    try:
        return env.unwrapped.task_pool(n, seed=seed)
    finally:
        env.close()


def ids(tasks) -> list[str]:
    return [t.task_id for t in tasks]


def word_task(task_id: str, prompt: str, structure: str = "add") -> TaskSpec:
    skills = structure.split(">")
    return TaskSpec(task_id=task_id, prompt=prompt, target=0, meta=TaskMeta(
        skills=skills, structure=structure, entity_group="integers", length=len(skills)))


# ----------------------------------------------------------------------------- holdouts


def assert_compositional(splits: Splits, n_pool: int) -> None:
    c = splits.criteria
    train = splits["train"]
    assert train and splits["holdout"]
    for task in train:
        assert task.meta.structure not in c["holdout_structures"]
        assert task.meta.entity_group not in c["holdout_entity_groups"]
        if c["min_holdout_length"] is not None:
            assert task.meta.length < c["min_holdout_length"]
    assert all(t.meta.structure in c["holdout_structures"] for t in splits["holdout_structure"])
    assert all(t.meta.entity_group in c["holdout_entity_groups"] for t in splits["holdout_entity"])
    longest_train = max(t.meta.length for t in train)
    assert all(t.meta.length > longest_train for t in splits["holdout_length"])
    # buckets partition the deduplicated pool; holdout is the union of the three
    buckets = [ids(splits[name]) for name in ("train", "holdout_structure", "holdout_entity",
                                              "holdout_length")]
    flat = list(itertools.chain(*buckets))
    assert len(flat) == len(set(flat)) == n_pool - len(splits["dropped_duplicates"])
    assert sorted(ids(splits["holdout"])) == sorted(itertools.chain(*buckets[1:]))
    check_leakage(train, splits["holdout"])


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_default_splits_hold_out_structure_entity_and_length(env_id):
    splits = default_splits(env_id, 400, seed=0)
    assert_compositional(splits, 400)
    c = splits.criteria
    assert c["holdout_structures"] and splits["holdout_structure"]
    assert c["min_holdout_length"] is not None and splits["holdout_length"]
    # a held-out structure is a new composition of skills that train has seen
    train_skills = {s for t in splits["train"] for s in t.meta.skills}
    for task in splits["holdout_structure"]:
        assert len(task.meta.skills) > 1 and set(task.meta.skills) <= train_skills


def test_default_splits_arithmetic_criteria():
    # Arithmetic: 1-3 ops, one entity group. Length 3 is held out; of the 9 two-op structures
    # int(9 * 0.25) = 2 with two distinct skills are held out; no entity group to hold out.
    c = default_splits(ARITH, 400, seed=0).criteria
    assert c["min_holdout_length"] == 3
    assert c["holdout_entity_groups"] == []
    assert len(c["holdout_structures"]) == 2
    for structure in c["holdout_structures"]:
        a, b = structure.split(">")
        assert a != b


@pytest.mark.skipif(RECORDS not in envs.list_envs(), reason="Records-v0 is not registered yet")
def test_default_splits_records_hold_out_an_entity_group():
    splits = default_splits(RECORDS, 400, seed=0)
    groups = sorted({t.meta.entity_group for t in pool(RECORDS)})
    assert splits.criteria["holdout_entity_groups"] == groups[-1:]
    assert splits["holdout_entity"]
    assert {t.meta.entity_group for t in splits["train"]} == set(groups[:-1])


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_explicit_holdouts(env_id):
    tasks = pool(env_id)
    structures = sorted({t.meta.structure for t in tasks})
    groups = sorted({t.meta.entity_group for t in tasks})
    lengths = sorted({t.meta.length for t in tasks})
    splits = compositional_splits(tasks, holdout_structures=structures[:2],
                                  holdout_entity_groups=groups[-1:] if len(groups) > 1 else (),
                                  min_holdout_length=lengths[-1], seed=3)
    assert_compositional(splits, len(tasks))


def test_first_matching_bucket_wins():
    tasks = pool(ARITH)
    three_op = next(t.meta.structure for t in tasks if t.meta.length == 3)
    splits = compositional_splits(tasks, holdout_structures=[three_op], min_holdout_length=3)
    in_structure = splits["holdout_structure"]
    assert in_structure and all(t.meta.structure == three_op for t in in_structure)
    assert three_op not in {t.meta.structure for t in splits["holdout_length"]}
    # structure, then entity, then length, never train
    def task(tid, structure, group, length):
        return TaskSpec(task_id=tid, prompt=f"Task {tid}.", meta=TaskMeta(
            skills=structure.split(">"), structure=structure, entity_group=group, length=length))

    small = [task("all3", "a>b", "g2", 5), task("ent+len", "a", "g2", 5), task("len", "b", "g1", 5),
             task("plain", "a>a", "g1", 1)]
    s = compositional_splits(small, holdout_structures=["a>b"], holdout_entity_groups=["g2"],
                             min_holdout_length=5)
    assert [ids(s[name]) for name in ("holdout_structure", "holdout_entity", "holdout_length",
                                      "train")] == [["all3"], ["ent+len"], ["len"], ["plain"]]
    # holding out the only entity group leaves nothing to train on
    with pytest.raises(ValueError, match="every one of the"):
        compositional_splits(tasks, holdout_entity_groups=["integers"])


def test_unknown_holdout_names_fail():
    with pytest.raises(ValueError, match="appears in no task"):
        compositional_splits(pool(ARITH), holdout_structures=["add>mull"])
    with pytest.raises(ValueError, match="appears in no task"):
        compositional_splits(pool(ARITH), holdout_entity_groups=["floats"])


def test_choose_holdouts_needs_something_to_hold_out():
    flat = [word_task(f"t{i}", f"Compute {i} + 1.") for i in range(10)]
    with pytest.raises(ValueError, match="nothing|no composed"):
        choose_holdouts(flat)


# ----------------------------------------------------------------------------- dedup, leakage


def test_normalisation_keeps_digits_and_operators():
    assert normalize_text("  Compute 7+5.\nAnswer WITH just the number!") == \
        normalize_text("compute 7 + 5 answer with just the number")
    assert normalize_text("Compute 7 + 5.") != normalize_text("Compute 7 * 5.")
    assert normalize_text("Compute 7 + 5.") != normalize_text("Compute 7 + 6.")
    assert len(shingles("one two three", ngram=8)) == 1  # shorter than n: one shingle


def test_planted_exact_duplicate_is_dropped_before_splitting():
    tasks = pool(ARITH)
    original = tasks[5]
    dup = original.model_copy(update={"task_id": "planted-dup",
                                      "prompt": "  " + original.prompt.upper().replace(" ", "  ")})
    splits = compositional_splits([*tasks, dup], min_holdout_length=3)
    dropped = {d.task_id: d for d in splits["dropped_duplicates"]}
    assert dropped["planted-dup"].reason == "exact"
    assert dropped["planted-dup"].duplicate_of == original.task_id
    assert "planted-dup" not in ids(splits["train"]) + ids(splits["holdout"])
    # the same pair across train / eval is leakage, named by both ids
    with pytest.raises(LeakageError) as err:
        check_leakage(tasks, [dup])
    assert "planted-dup" in str(err.value) and original.task_id in str(err.value)
    assert err.value.offending == ["planted-dup"]


def test_planted_near_duplicate_is_dropped_and_caught():
    original = word_task("word-1", LONG, structure="add")
    near = word_task("word-2", NEAR, structure="add>mul")
    kept, dropped = deduplicate([original, near])
    assert ids(kept) == ["word-1"]
    assert dropped[0].reason == "near" and dropped[0].duplicate_of == "word-1"
    assert dropped[0].similarity == pytest.approx(43 / 45, abs=1e-6)
    # with a stricter threshold they are different tasks
    assert len(deduplicate([original, near], threshold=0.96)[0]) == 2

    tasks = [*pool(ARITH), original, near]
    # dedup=False keeps both; the near copy lands in the held-out structure -> leakage
    raw = compositional_splits(tasks, holdout_structures=["add>mul"], dedup=False)
    with pytest.raises(LeakageError) as err:
        check_leakage(raw["train"], raw["holdout"])
    assert "word-2" in str(err.value) and "word-1" in str(err.value)
    assert "jaccard 0.956" in str(err.value)
    # dedup=True drops it before splitting
    clean = compositional_splits(tasks, holdout_structures=["add>mul"])
    assert "word-2" in {d.task_id for d in clean["dropped_duplicates"]}
    check_leakage(clean["train"], clean["holdout"])


def test_leakage_by_task_id():
    a = word_task("same-id", "Compute 1 + 2.")
    b = word_task("same-id", "Compute 9 * 9.")
    with pytest.raises(LeakageError, match="same-id"):
        check_leakage([a], [b])
    check_leakage([a], [word_task("other", "Compute 9 * 9.")])


def brute_force_near(sets, threshold):
    kept, dropped = [], []
    for i, s in enumerate(sets):
        hit = any(s and sets[j] and len(s & sets[j]) / len(s | sets[j]) >= threshold for j in kept)
        (dropped if hit else kept).append(i)
    return kept


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.5, 0.7, 0.8, 0.9]))
def test_prefix_filter_matches_brute_force(seed, threshold):
    # Random short word sequences over a tiny vocabulary: many near duplicates.
    rng = np.random.default_rng(seed)
    prompts = [" ".join(f"w{int(w)}" for w in rng.integers(0, 4, size=int(rng.integers(3, 9))))
               for _ in range(25)]
    tasks = [word_task(f"t{i}", p) for i, p in enumerate(prompts)]
    kept, _ = deduplicate(tasks, ngram=2, threshold=threshold)
    # exact duplicates are near duplicates at Jaccard 1, so brute force over shingles agrees
    sets = [shingles(p, 2) for p in prompts]
    assert ids(kept) == [f"t{i}" for i in brute_force_near(sets, threshold)]


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_splits_are_deterministic_by_seed(env_id):
    a, b = default_splits(env_id, 300, seed=7), default_splits(env_id, 300, seed=7)
    for name in a.keys():
        assert ids(a[name]) == ids(b[name])
    assert a.criteria == b.criteria
    assert a.dropped_duplicates == b.dropped_duplicates
    tasks = pool(env_id, 300)
    s1 = compositional_splits(tasks, min_holdout_length=2, seed=1)
    s2 = compositional_splits(tasks, min_holdout_length=2, seed=2)
    assert sorted(ids(s1["train"])) == sorted(ids(s2["train"]))  # same membership ...
    assert ids(s1["train"]) != ids(s2["train"])  # ... shuffled by the seed


# ----------------------------------------------------------------------------- sealed set


def test_sealed_set_is_hint_free_and_verifies():
    holdout = default_splits(ARITH, 200, seed=0)["holdout"]
    assert all(t.hint is not None for t in holdout)  # Arithmetic tasks carry hints
    sealed = sealed_eval_set(holdout)
    assert len(sealed) == len(holdout) and all(t.hint is None for t in sealed)
    assert ids(sealed) == ids(holdout)
    assert sealed.verify() is True
    assert sealed_eval_set(holdout).manifest_hash == sealed.manifest_hash
    assert sealed_eval_set(holdout[::-1]).manifest_hash == sealed.manifest_hash  # sorted ids


def test_sealed_set_detects_tampering():
    sealed = sealed_eval_set(pool(ARITH, 20))
    victim = sealed.tasks[3]
    edited = victim.model_copy(update={"prompt": victim.prompt + " (it is 4)"})
    tampered = sealed.model_copy(update={"tasks": (*sealed.tasks[:3], edited, *sealed.tasks[4:])})
    with pytest.raises(SealedSetError, match=victim.task_id):
        tampered.verify()
    retargeted = victim.model_copy(update={"target": 4})
    with pytest.raises(SealedSetError, match=victim.task_id):
        sealed.model_copy(update={"tasks": (retargeted, *sealed.tasks[:3], *sealed.tasks[4:])}).verify()
    with pytest.raises(SealedSetError):
        sealed.model_copy(update={"tasks": sealed.tasks[1:]}).verify()
    hinted = victim.model_copy(update={"hint": {"text": "x", "provenance": "test"}})
    with pytest.raises(SealedSetError, match="hints"):
        sealed.model_copy(update={"tasks": (*sealed.tasks[:3], hinted, *sealed.tasks[4:])}).verify()
    with pytest.raises(ValueError, match="repeat"):
        sealed_eval_set([victim, victim])


def test_iid_holdout_is_unseen_tasks_of_trained_structures():
    tasks = pool(ARITH)
    plain = compositional_splits(tasks, min_holdout_length=3, seed=0)
    splits = compositional_splits(tasks, min_holdout_length=3, seed=0, iid_fraction=0.25)
    iid = splits["holdout_iid"]
    # a quarter of what would have been trained on, rounded, moves out of train
    assert len(iid) == round(0.25 * len(plain.train))
    assert len(splits.train) + len(iid) == len(plain.train)
    assert set(ids(splits.train)).isdisjoint(ids(iid))
    assert {t.meta.structure for t in iid} <= {t.meta.structure for t in splits.train}
    assert ids(splits.holdout) == ids(plain.holdout)  # the compositional holdout is unchanged
    assert splits.criteria["iid_fraction"] == 0.25
    with pytest.raises(ValueError, match="iid_fraction"):
        compositional_splits(tasks, min_holdout_length=3, iid_fraction=1.0)


# ----------------------------------------------------------------------------- named holdouts


class PoolEnv:
    """Stands in for an env: ``default_splits`` reads only ``unwrapped.task_pool`` and ``spec``."""

    spec = None

    def __init__(self, tasks: list[TaskSpec]):
        self.tasks, self.unwrapped = tasks, self

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return self.tasks[:n]


def meta_task(tid: str, structure: str, group: str, length: int) -> TaskSpec:
    return TaskSpec(task_id=tid, prompt=f"Task {tid}.", meta=TaskMeta(
        skills=structure.split(">"), structure=structure, entity_group=group, length=length))


# by hand: which bucket each task must land in under HAND_HOLDOUTS
HAND_POOL = [meta_task("s1", "a>b", "g1", 2), meta_task("s2", "a>b", "g2", 4),
             meta_task("e1", "a", "g2", 1), meta_task("l1", "b", "g1", 4),
             meta_task("i1", "a", "g1", 1), meta_task("i2", "b", "g1", 1),
             *(meta_task(f"t{i}", "ab"[i % 2], "g1", 1 + i % 2) for i in range(6))]
HAND_HOLDOUTS = {"holdout_structures": ["a>b"], "holdout_entity_groups": ["g2"],
                 "min_holdout_length": 4, "holdout_task_ids": ["i1", "i2", "s2"]}
HAND_SPLITS = {"holdout_structure": {"s1", "s2"}, "holdout_entity": {"e1"},
               "holdout_length": {"l1"}, "holdout_iid": {"i1", "i2"},
               "train": {f"t{i}" for i in range(6)}}


def test_explicit_holdouts_give_exactly_the_expected_membership():
    for splits in (compositional_splits(HAND_POOL, **HAND_HOLDOUTS, seed=5),
                   default_splits(PoolEnv(HAND_POOL), 100, seed=5, holdouts=HAND_HOLDOUTS)):
        assert {name: set(ids(splits[name])) for name in HAND_SPLITS} == HAND_SPLITS
        assert set(ids(splits.holdout)) == {"s1", "s2", "e1", "l1"}  # named ids are not in it
        assert splits.criteria["holdout_task_ids"] == ["i1", "i2", "s2"]
    # each criterion alone, through default_splits (nothing is chosen automatically then)
    pool = PoolEnv(HAND_POOL)
    alone = {"holdout_structures": ["a>b"]}, {"holdout_entity_groups": ["g2"]}, \
        {"min_holdout_length": 4}, {"holdout_task_ids": ["i1"]}
    want = [{"s1", "s2"}, {"s2", "e1"}, {"s2", "l1"}, {"i1"}]
    for holdouts, held in zip(alone, want, strict=True):
        splits = default_splits(pool, 100, holdouts=holdouts)
        assert set(ids(splits.holdout + splits.holdout_iid)) == held, holdouts
        assert set(ids(splits.train)) == {t.task_id for t in HAND_POOL} - held
        assert splits.criteria["holdouts"] == "explicit"
    # an iid share comes on top of the named tasks, out of train
    splits = compositional_splits(HAND_POOL, **HAND_HOLDOUTS, iid_fraction=0.5)
    assert {"i1", "i2"} < set(ids(splits.holdout_iid)) and len(splits.holdout_iid) == 2 + 3
    assert len(splits.train) == 3


def test_unknown_holdouts_are_all_named_at_once():
    with pytest.raises(HoldoutError) as info:
        compositional_splits(HAND_POOL, holdout_structures=["a>b", "a>c"],
                             holdout_entity_groups=["g9"], holdout_task_ids=["i1", "zz"],
                             min_holdout_length=7)
    assert [(p.what, p.unknown) for p in info.value.problems] == [
        ("structure", ["a>c"]), ("entity_group", ["g9"]), ("task_id", ["zz"]), ("length", [7])]
    message = str(info.value)
    for part in ("['a>c']", "['g9']", "['zz']", "min_holdout_length 7", "longest task has length 4",
                 "known: ['a', 'a>b', 'b']"):
        assert part in message
    with pytest.raises(TypeError, match="unknown keys"):
        default_splits(PoolEnv(HAND_POOL), 100, holdouts={"structures": ["a>b"]})


FLAT = [word_task(f"f{i}", f"Compute {i} + 1.") for i in range(40)]  # one structure, no axis


def test_no_compositional_axis_falls_back_to_unseen_tasks_with_a_notice():
    with pytest.warns(HoldoutFallbackWarning) as caught:
        splits = default_splits(PoolEnv(FLAT), 40, seed=0)
    notice = str(caught[0].message)
    for part in ("the 40 tasks show one length, one entity group and no composed structure",
                 "25%", "holdout_iid", "env.holdout: {structures"):
        assert part in notice
    assert IID_FALLBACK_FRACTION == 0.25
    assert len(splits.holdout_iid) == 10 and len(splits.train) == 30
    assert splits.holdout == [] and splits.criteria["holdouts"] == "iid_fallback"
    assert set(ids(splits.train) + ids(splits.holdout_iid)) == {t.task_id for t in FLAT}
    check_leakage(splits.train, splits.holdout_iid)
    # env.iid_fraction, when > 0, is the share
    with pytest.warns(HoldoutFallbackWarning, match="10%"):
        assert len(default_splits(PoolEnv(FLAT), 40, iid_fraction=0.1).holdout_iid) == 4
    # the compositional holdout does not exist: holdout is evaluated as holdout_iid, with the
    # notice; a compositional bucket asked for by name says what to do instead
    with pytest.warns(HoldoutFallbackWarning, match="split holdout is evaluated as holdout_iid"):
        asked = default_splits(PoolEnv(FLAT), 40, require=["train", "holdout"])
    assert asked.evaluated(["holdout"]) == ["holdout_iid"]
    assert asked.evaluated(["holdout_iid", "holdout"]) == ["holdout_iid"]  # each once
    with pytest.warns(HoldoutFallbackWarning), \
            pytest.raises(ValueError, match="split 'holdout_structure' does not exist.*holdout_iid"):
        default_splits(PoolEnv(FLAT), 40, require=["train", "holdout_structure"])
    # a caller that asks for holdout_iid (and not holdout) gets no notice: nothing it did not ask
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_splits(PoolEnv(FLAT), 40, require=["train", "holdout_iid"]).holdout_iid
    # explicit holdouts never fall back
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named = default_splits(PoolEnv(FLAT), 40, holdouts={"holdout_task_ids": ["f1", "f2"]})
        assert set(ids(named.holdout_iid)) == {"f1", "f2"} and len(named.train) == 38
        with pytest.raises(ValueError, match="split 'holdout' is empty.*only task ids"):
            default_splits(PoolEnv(FLAT), 40, holdouts={"holdout_task_ids": ["f1"]},
                           require=["holdout"])


def test_required_splits_say_why_they_are_empty():
    with pytest.raises(ValueError, match="holdout_iid' is empty.*env.iid_fraction > 0"):
        default_splits(ARITH, 200, require=["train", "holdout_iid"])
    assert default_splits(ARITH, 200, iid_fraction=0.2, require=["holdout_iid", "holdout"])
    with pytest.raises(ValueError, match="holdout_entity' is empty.*env.holdout.entity_groups"):
        default_splits(ARITH, 200, require=["holdout_entity"])
    with pytest.raises(KeyError, match="no split"):
        default_splits(ARITH, 200, require=["holdot"])


def test_evaluated_is_the_name_asked_for_where_a_compositional_holdout_exists():
    splits = default_splits(ARITH, 200, iid_fraction=0.2)
    assert splits.criteria["holdouts"] == "automatic"
    assert splits.evaluated(["holdout", "holdout_iid", "holdout"]) == ["holdout", "holdout_iid"]
