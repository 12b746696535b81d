"""Compositional splits: what the trainer sees and what is held out, decided from task metadata.

A pool of ``TaskSpec`` (from ``env.unwrapped.task_pool``) is split in three steps:

1. **Deduplicate, before splitting**, keeping the first occurrence in pool order:

   - same ``task_id``;
   - exact duplicates of the *normalised* prompt: NFKC, lower case, words and symbols split
     apart and re-joined by single spaces, sentence punctuation (``. , ; : ! ? " ' ```) dropped.
     Digits and operators (``+ - * / ( ) = ...``) are kept: ``7 + 5`` and ``7 * 5`` differ;
   - near duplicates: word ``ngram``-shingle Jaccard ``|A & B| / |A | B| >= ngram_threshold``
     against every task kept so far. A prompt shorter than ``ngram`` words is one shingle (so it
     is only ever an exact duplicate). The search is exact, not MinHash: a prefix-filtered
     inverted index (All-Pairs, Bayardo et al. 2007) over shingles ordered rarest first; a pair
     with Jaccard >= t must share a shingle within the first ``|X| - ceil(t |X|) + 1`` of
     each, so only those are indexed and probed, then candidates are verified exactly.

2. **Assign buckets.** A task goes to the first matching bucket in the order
   ``holdout_structure`` (``meta.structure`` held out), ``holdout_entity`` (``meta.entity_group``
   held out), ``holdout_length`` (``meta.length >= min_holdout_length``), ``holdout_iid`` (its
   ``task_id`` is in ``holdout_task_ids``); otherwise to ``train``. So train holds no held-out
   structure, no held-out entity group, no named task, and only tasks strictly shorter than
   every length-held-out task. Then ``iid_fraction`` of train moves to ``holdout_iid`` too.

3. **Order.** Each bucket is shuffled with ``numpy.random.default_rng(seed)``: same pool, same
   arguments, same seed -> the same splits, item for item.

``check_leakage(train, eval)`` fails loudly (``LeakageError``) on a shared ``task_id``, a shared
normalised prompt or a near duplicate across the two sides. ``sealed_eval_set(tasks)`` freezes a
hint-free evaluation set with a manifest hash that ``verify()`` recomputes.
``default_splits(env, pool_size, seed, holdouts=None)`` picks holdouts from what the pool's
metadata shows (see ``choose_holdouts``), or takes them from ``holdouts`` (the contract's
``env.holdout``): it is what the trainer uses. A pool with no compositional axis at all (one
length, one entity group, no composed structure) and no explicit holdouts is split by unseen
task only: ``IID_FALLBACK_FRACTION`` of it (or ``iid_fraction`` when > 0) becomes
``holdout_iid``; ``holdout`` is then empty, and ``Splits.evaluated`` evaluates ``holdout_iid``
where ``holdout`` is asked for. A ``HoldoutFallbackWarning`` says so, unless the caller asked
for ``holdout_iid`` and not ``holdout`` (then nothing happened that it did not ask for).
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import gymnasium
import numpy as np
from pydantic import BaseModel, ConfigDict

from envs.core import TaskSpec
from envs.registry import make
from trajectories.hashing import canonical_hash

BUCKETS = ("train", "holdout_structure", "holdout_entity", "holdout_length")
HOLDOUT_BUCKETS = BUCKETS[1:]
SPLIT_NAMES = (*BUCKETS, "holdout_iid", "holdout")  # what ``Splits[name]`` answers

# ---------------------------------------------------------------------------------------------
# Text normalisation and near-duplicate search
# ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\w+|[^\w\s]")
_SENTENCE_PUNCT = frozenset(".,;:!?\"'`")


def normalize_text(text: str) -> str:
    """Lower-cased words and symbols joined by single spaces; sentence punctuation dropped."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(tok for tok in _TOKEN.findall(text) if tok not in _SENTENCE_PUNCT)


def shingles(text: str, ngram: int = 8) -> frozenset[str]:
    """Word ``ngram``-shingles of the normalised text (the whole text when it is shorter)."""
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    words = normalize_text(text).split()
    if len(words) <= ngram:
        return frozenset({" ".join(words)}) if words else frozenset()
    return frozenset(" ".join(words[i:i + ngram]) for i in range(len(words) - ngram + 1))


def prompt_hash(prompt: str) -> str:
    """sha256 of the normalised prompt."""
    return hashlib.sha256(normalize_text(prompt).encode("utf-8")).hexdigest()


class _NearDuplicateIndex:
    """Exact Jaccard search with prefix filtering.

    Shingles are ordered globally by (document frequency, text), rarest first; any fixed total
    order is correct, frequency order keeps common template shingles out of the prefixes.
    """

    def __init__(self, threshold: float, frequency: Counter[str]):
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.frequency = frequency
        self.sets: dict[str, frozenset[str]] = {}
        self.postings: dict[str, list[str]] = defaultdict(list)

    def _prefix(self, s: frozenset[str]) -> list[str]:
        ordered = sorted(s, key=lambda g: (self.frequency.get(g, 0), g))
        keep = len(ordered) - math.ceil(self.threshold * len(ordered) - 1e-9) + 1
        return ordered[:keep]

    def add(self, key: str, s: frozenset[str]) -> None:
        if not s:
            return
        self.sets[key] = s
        for g in self._prefix(s):
            self.postings[g].append(key)

    def query(self, s: frozenset[str]) -> list[tuple[str, float]]:
        """Indexed keys whose Jaccard with ``s`` is >= threshold, best first."""
        if not s:
            return []
        seen: set[str] = set()
        hits = []
        for g in self._prefix(s):
            for key in self.postings.get(g, ()):
                if key in seen:
                    continue
                seen.add(key)
                other = self.sets[key]
                inter = len(s & other)
                jaccard = inter / (len(s) + len(other) - inter)
                if jaccard >= self.threshold:
                    hits.append((key, jaccard))
        return sorted(hits, key=lambda h: (-h[1], h[0]))


def _frequency(shingle_sets: Sequence[frozenset[str]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for s in shingle_sets:
        counts.update(s)
    return counts


# ---------------------------------------------------------------------------------------------
# Deduplication
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Duplicate:
    """A dropped task: which kept task it duplicates, how, and how close (1.0 for exact)."""

    task_id: str
    duplicate_of: str
    reason: Literal["task_id", "exact", "near"]
    similarity: float = 1.0


def deduplicate(
    tasks: Sequence[TaskSpec], ngram: int = 8, threshold: float = 0.8
) -> tuple[list[TaskSpec], list[Duplicate]]:
    """(kept tasks in pool order, dropped duplicates); the first occurrence is kept."""
    sets = [shingles(t.prompt, ngram) for t in tasks]
    index = _NearDuplicateIndex(threshold, _frequency(sets))
    kept: list[TaskSpec] = []
    dropped: list[Duplicate] = []
    by_id: set[str] = set()
    by_text: dict[str, str] = {}
    for task, s in zip(tasks, sets, strict=True):
        text = normalize_text(task.prompt)
        if task.task_id in by_id:
            dropped.append(Duplicate(task.task_id, task.task_id, "task_id"))
            continue
        if text in by_text:
            dropped.append(Duplicate(task.task_id, by_text[text], "exact"))
            continue
        near = index.query(s)
        if near:
            dropped.append(Duplicate(task.task_id, near[0][0], "near", round(near[0][1], 6)))
            continue
        kept.append(task)
        by_id.add(task.task_id)
        by_text[text] = task.task_id
        index.add(task.task_id, s)
    return kept, dropped


# ---------------------------------------------------------------------------------------------
# Leakage
# ---------------------------------------------------------------------------------------------


class LeakageError(ValueError):
    """Evaluation tasks that also appear (by id, normalised prompt or near duplicate) in train.

    ``pairs``: (eval task_id, train task_id, reason, similarity); ``offending``: eval ids.
    """

    def __init__(self, pairs: list[tuple[str, str, str, float]]):
        self.pairs = pairs
        self.offending = sorted({p[0] for p in pairs})
        shown = "; ".join(
            f"{e} ~ train {t} ({why}" + (f", jaccard {sim:.3f})" if why == "near" else ")")
            for e, t, why, sim in pairs[:50])
        more = f"; ... and {len(pairs) - 50} more" if len(pairs) > 50 else ""
        super().__init__(
            f"{len(self.offending)} eval task(s) leak from train: {self.offending}. Pairs: "
            f"{shown}{more}. Deduplicate the pool before splitting (compositional_splits(..., "
            "dedup=True)) or remove these tasks from one side.")


def check_leakage(
    train: Sequence[TaskSpec], eval: Sequence[TaskSpec], ngram: int = 8, threshold: float = 0.8
) -> None:
    """Raise ``LeakageError`` naming every eval task that shares with a train task its
    ``task_id``, its normalised prompt, or ``ngram``-shingles with Jaccard >= ``threshold``."""
    train_sets = [shingles(t.prompt, ngram) for t in train]
    eval_sets = [shingles(t.prompt, ngram) for t in eval]
    index = _NearDuplicateIndex(threshold, _frequency(train_sets + eval_sets))
    ids = {t.task_id for t in train}
    texts: dict[str, str] = {}
    for task, s in zip(train, train_sets, strict=True):
        texts.setdefault(normalize_text(task.prompt), task.task_id)
        index.add(task.task_id, s)
    pairs: list[tuple[str, str, str, float]] = []
    for task, s in zip(eval, eval_sets, strict=True):
        text = normalize_text(task.prompt)
        if task.task_id in ids:
            pairs.append((task.task_id, task.task_id, "task_id", 1.0))
        elif text in texts:
            pairs.append((task.task_id, texts[text], "exact", 1.0))
        else:
            near = index.query(s)
            if near:
                pairs.append((task.task_id, near[0][0], "near", near[0][1]))
    if pairs:
        raise LeakageError(pairs)


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Splits:
    """Named lists of tasks. ``splits["train"]``, ``splits["holdout"]`` (the union of the three
    holdout buckets, interleaved), ``splits["dropped_duplicates"]``; ``criteria`` records what was held out."""

    train: list[TaskSpec]
    holdout_structure: list[TaskSpec]
    holdout_entity: list[TaskSpec]
    holdout_length: list[TaskSpec]
    holdout_iid: list[TaskSpec] = field(default_factory=list)  # unseen tasks: named, then a share
    dropped_duplicates: list[Duplicate] = field(default_factory=list)
    criteria: dict[str, Any] = field(default_factory=dict)

    @property
    def holdout(self) -> list[TaskSpec]:
        """The union of the three holdout buckets, taken from each in turn (round robin), so
        that its first n tasks mix every kind of holdout the pool has."""
        seen: set[str] = set()
        out = []
        buckets = [getattr(self, name) for name in HOLDOUT_BUCKETS]
        for rank in range(max(map(len, buckets), default=0)):
            for bucket in buckets:
                if rank < len(bucket) and bucket[rank].task_id not in seen:
                    seen.add(bucket[rank].task_id)
                    out.append(bucket[rank])
        return out

    def evaluated(self, names: Sequence[str]) -> list[str]:
        """The splits evaluated when ``names`` are asked for, in order, each once:
        ``holdout_iid`` in place of ``holdout`` when the pool had nothing compositional to
        hold out (``criteria["holdouts"] == "iid_fallback"``: ``holdout`` is empty there, and
        unseen tasks are what is held out), every other name as it is."""
        fallback = self.criteria.get("holdouts") == "iid_fallback"
        out: list[str] = []
        for name in names:
            name = "holdout_iid" if fallback and name == "holdout" else name
            if name not in out:
                out.append(name)
        return out

    def __getitem__(self, name: str) -> list[Any]:
        if name not in (*self.keys(), "dropped_duplicates"):
            raise KeyError(f"no split {name!r}; splits are {[*self.keys(), 'dropped_duplicates']}")
        return getattr(self, name)

    def keys(self) -> tuple[str, ...]:
        """Names of the task lists."""
        return SPLIT_NAMES

    def items(self) -> Iterator[tuple[str, list[TaskSpec]]]:
        return ((name, self[name]) for name in self.keys())

    def counts(self) -> dict[str, int]:
        return {**{name: len(tasks) for name, tasks in self.items()},
                "dropped_duplicates": len(self.dropped_duplicates)}

    def sealed_holdout(self) -> SealedSet:
        """The hint-free, hashed holdout (what the trainer evaluates on)."""
        return sealed_eval_set(self.holdout)


def compositional_splits(
    tasks: Sequence[TaskSpec],
    holdout_structures: Sequence[str] = (),
    holdout_entity_groups: Sequence[str] = (),
    min_holdout_length: int | None = None,
    seed: int = 0,
    dedup: bool = True,
    ngram: int = 8,
    ngram_threshold: float = 0.8,
    iid_fraction: float = 0.0,
    holdout_task_ids: Sequence[str] = (),
) -> Splits:
    """Deduplicate ``tasks``, then hold out whole structures, entity groups and long tasks.

    ``holdout_task_ids`` names tasks (not already held out by the three criteria) that go to
    ``holdout_iid``; ``iid_fraction`` then moves that share of what is left for training
    (seeded) there too: unseen tasks of trained structures, the in-distribution control that
    ``holdout`` (compositional) is compared with. It is not part of ``holdout``.

    A task matching several criteria goes to the first of structure, entity, length, task id,
    never to train. Raises ``HoldoutError`` (a ``ValueError``) for a held-out structure, entity
    group or task id that no task has, or a ``min_holdout_length`` no task reaches (a typo would
    otherwise hold out nothing), and ``ValueError`` when nothing is left to train on. With
    ``dedup=True`` the result is also checked with ``check_leakage`` (train vs holdout and
    holdout_iid).
    """
    structures = set(holdout_structures)
    groups = set(holdout_entity_groups)
    task_ids = set(holdout_task_ids)
    problems = [p for p in (
        _unknown("structure", structures, {t.meta.structure for t in tasks}),
        _unknown("entity_group", groups, {t.meta.entity_group for t in tasks}),
        _unknown("task_id", task_ids, {t.task_id for t in tasks}),
        _unreached(min_holdout_length, {t.meta.length for t in tasks})) if p is not None]
    if problems:
        raise HoldoutError(problems)

    dropped: list[Duplicate] = []
    if dedup:
        tasks, dropped = deduplicate(tasks, ngram, ngram_threshold)
    else:
        tasks = list(tasks)

    buckets: dict[str, list[TaskSpec]] = {name: [] for name in (*BUCKETS, "holdout_iid")}
    for task in tasks:
        meta = task.meta
        if meta.structure in structures:
            buckets["holdout_structure"].append(task)
        elif meta.entity_group in groups:
            buckets["holdout_entity"].append(task)
        elif min_holdout_length is not None and meta.length >= min_holdout_length:
            buckets["holdout_length"].append(task)
        elif task.task_id in task_ids:
            buckets["holdout_iid"].append(task)
        else:
            buckets["train"].append(task)
    if not buckets["train"]:
        raise ValueError(
            f"every one of the {len(tasks)} tasks is held out; hold out fewer structures "
            f"({sorted(structures)}), entity groups ({sorted(groups)}) or a longer "
            f"min_holdout_length ({min_holdout_length})")

    if not 0.0 <= iid_fraction < 1.0:
        raise ValueError(f"iid_fraction must be in [0, 1), got {iid_fraction}")
    rng = np.random.default_rng(seed)
    for name in (*BUCKETS, "holdout_iid"):
        buckets[name] = [buckets[name][i] for i in rng.permutation(len(buckets[name]))]
    n_iid = int(round(iid_fraction * len(buckets["train"])))
    if n_iid >= len(buckets["train"]):
        raise ValueError(f"iid_fraction {iid_fraction} leaves nothing to train on")
    buckets["holdout_iid"] += buckets["train"][:n_iid]  # named tasks first, then the share
    buckets["train"] = buckets["train"][n_iid:]
    splits = Splits(**buckets, dropped_duplicates=dropped, criteria={
        "holdout_structures": sorted(structures), "holdout_entity_groups": sorted(groups),
        "min_holdout_length": min_holdout_length, "seed": seed, "dedup": dedup,
        "ngram": ngram, "ngram_threshold": ngram_threshold, "iid_fraction": iid_fraction,
        "holdout_task_ids": sorted(task_ids)})
    if dedup:
        check_leakage(splits.train, splits.holdout + splits.holdout_iid, ngram, ngram_threshold)
    return splits


@dataclass(frozen=True)
class UnknownHoldout:
    """A named holdout that matches no task of the pool. ``what``: ``structure``,
    ``entity_group``, ``task_id`` or ``length``; ``unknown``: the names (or the minimum length)
    that match nothing; ``known``: what the pool has."""

    what: Literal["structure", "entity_group", "task_id", "length"]
    unknown: list[Any]
    known: list[Any]

    @property
    def message(self) -> str:
        if self.what == "length":
            return (f"min_holdout_length {self.unknown[0]} holds out nothing: the longest task "
                    f"has length {max(self.known, default=0)}")
        shown = (f"{self.known[:20]} and {len(self.known) - 20} more" if len(self.known) > 20
                 else f"{self.known}")
        return f"held-out {self.what} {self.unknown} appears in no task; known: {shown}"


class HoldoutError(ValueError):
    """Held-out names that match no task (``problems``: one ``UnknownHoldout`` per kind), all
    said at once."""

    def __init__(self, problems: list[UnknownHoldout]):
        self.problems = problems
        super().__init__("; ".join(p.message for p in problems))


def _unknown(what: str, wanted: set[str], seen: set[str]) -> UnknownHoldout | None:
    unknown = sorted(wanted - seen)
    return UnknownHoldout(what, unknown, sorted(seen)) if unknown else None


def _unreached(min_length: int | None, lengths: set[int]) -> UnknownHoldout | None:
    if min_length is None or min_length <= max(lengths, default=0):
        return None
    return UnknownHoldout("length", [min_length], sorted(lengths))


# ---------------------------------------------------------------------------------------------
# Default holdouts (what the trainer uses)
# ---------------------------------------------------------------------------------------------

STRUCTURE_HOLDOUT_FRACTION = 0.25
IID_FALLBACK_FRACTION = 0.25  # share held out as holdout_iid when nothing compositional can be
HOLDOUT_KWARGS = ("holdout_structures", "holdout_entity_groups", "min_holdout_length",
                  "holdout_task_ids")  # what ``default_splits(holdouts=...)`` may name


class HoldoutFallbackWarning(UserWarning):
    """``default_splits`` found nothing compositional to hold out and held out unseen tasks
    (``holdout_iid``) instead."""


def _steps(structure: str) -> int:
    return len([s for s in structure.split(">") if s]) if structure else 0


def choose_holdouts(tasks: Sequence[TaskSpec], seed: int = 0) -> dict[str, Any]:
    """Holdout criteria for ``compositional_splits`` read off the pool's metadata.

    - length: with two or more distinct ``meta.length`` values, the longest tasks
      (``min_holdout_length = max length``);
    - entity group: with two or more distinct non-empty groups, the last one in sorted order;
    - structure: among the *composed* structures (tasks with more than one skill) left in train
      by the two rules above, the most complex ones (most steps, then most distinct skills;
      ties in a ``seed``-shuffled order), ``max(1, 25%)`` of them, skipping any whose skills
      would then no longer appear in train (a held-out structure tests a new *composition* of
      skills the policy has trained on, not a new skill).

    Returns ``{"holdout_structures", "holdout_entity_groups", "min_holdout_length"}``; raises
    ``ValueError`` when the pool offers nothing to hold out.
    """
    chosen = _automatic_holdouts(tasks, seed)
    if chosen is None:
        raise ValueError(f"{_no_axis(tasks)}; pass holdouts to compositional_splits explicitly")
    return chosen


def _no_axis(tasks: Sequence[TaskSpec]) -> str:
    return (f"the {len(tasks)} tasks show one length, one entity group and no composed "
            "structure to hold out")


def _automatic_holdouts(tasks: Sequence[TaskSpec], seed: int) -> dict[str, Any] | None:
    """``choose_holdouts``' criteria, or None when the pool has no compositional axis."""
    lengths = sorted({t.meta.length for t in tasks})
    min_length = lengths[-1] if len(lengths) >= 2 else None
    groups = sorted({t.meta.entity_group for t in tasks if t.meta.entity_group})
    held_groups = groups[-1:] if len(groups) >= 2 else []

    def in_train(t: TaskSpec) -> bool:
        return t.meta.entity_group not in held_groups and (
            min_length is None or t.meta.length < min_length)

    rest = [t for t in tasks if in_train(t)]
    complexity: dict[str, tuple[int, int]] = {}
    for t in rest:
        if len(t.meta.skills) > 1 and t.meta.structure:
            c = (max(_steps(t.meta.structure), len(t.meta.skills)), len(set(t.meta.skills)))
            complexity[t.meta.structure] = max(complexity.get(t.meta.structure, (0, 0)), c)
    rng = np.random.default_rng(seed)
    candidates = sorted(complexity)
    order = rng.permutation(len(candidates))
    tiebreak = {candidates[i]: rank for rank, i in enumerate(order)}
    ranked = sorted(candidates, key=lambda s: (-complexity[s][0], -complexity[s][1], tiebreak[s]))
    want = max(1, int(len(ranked) * STRUCTURE_HOLDOUT_FRACTION)) if ranked else 0
    held_structures: list[str] = []
    for structure in ranked:
        if len(held_structures) >= want:
            break
        remaining = [t for t in rest if t.meta.structure not in {*held_structures, structure}]
        trained_skills = {s for t in remaining for s in t.meta.skills}
        skills = {s for t in rest if t.meta.structure == structure for s in t.meta.skills}
        if remaining and skills <= trained_skills:
            held_structures.append(structure)
    if min_length is None and not held_groups and not held_structures:
        return None
    return {"holdout_structures": sorted(held_structures), "holdout_entity_groups": held_groups,
            "min_holdout_length": min_length}


def default_splits(
    env: str | gymnasium.Env,
    pool_size: int,
    seed: int = 0,
    holdouts: dict[str, Any] | None = None,
    iid_fraction: float = 0.0,
    require: Sequence[str] = (),
    **kwargs: Any,
) -> Splits:
    """Train/holdout splits of ``env.unwrapped.task_pool(pool_size, seed)``.

    What is held out: ``holdouts`` (keywords of ``compositional_splits``, any of
    ``HOLDOUT_KWARGS``) when given, else ``choose_holdouts`` read from the deduplicated pool.
    When that finds nothing (one length, one entity group, no composed structure) the split is
    by unseen task only: ``iid_fraction`` of the tasks, or ``IID_FALLBACK_FRACTION`` when it is
    0, become ``holdout_iid``, ``holdout`` is empty (``Splits.evaluated`` puts ``holdout_iid``
    in its place), ``criteria["holdouts"]`` says ``"iid_fallback"`` (else ``"explicit"`` or
    ``"automatic"``) and a ``HoldoutFallbackWarning`` says why and how to name holdouts, unless
    ``require`` names ``holdout_iid`` and not ``holdout``.

    ``require``: split names that must hold tasks (the trainer's train and evaluation splits,
    as ``Splits.evaluated`` resolves them); an empty one is a ``ValueError`` that says why and
    what to set. ``env`` is an env or a
    registered id; ``kwargs`` go to ``compositional_splits`` (``ngram``, ``ngram_threshold``).
    """
    own = isinstance(env, str)
    instance = make(env) if own else env
    env_id = env if own else getattr(instance.spec, "id", None) or type(instance.unwrapped).__name__
    try:
        pool = instance.unwrapped.task_pool(pool_size, seed=seed)
    finally:
        if own:
            instance.close()
    if holdouts is not None:
        unknown = sorted(set(holdouts) - set(HOLDOUT_KWARGS))
        if unknown:
            raise TypeError(f"holdouts: unknown keys {unknown}; known: {list(HOLDOUT_KWARGS)}")
        chosen, how = dict(holdouts), "explicit"
    else:
        kept, _ = deduplicate(pool, kwargs.get("ngram", 8), kwargs.get("ngram_threshold", 0.8))
        chosen, how = _automatic_holdouts(kept, seed), "automatic"
        if chosen is None:
            chosen, how = {}, "iid_fallback"
            iid_fraction = iid_fraction or IID_FALLBACK_FRACTION
            if "holdout" in require or "holdout_iid" not in require:  # else it asked for this
                warnings.warn(_fallback_notice(env_id, kept, iid_fraction),
                              HoldoutFallbackWarning, stacklevel=2)
    splits = compositional_splits(pool, **chosen, seed=seed, iid_fraction=iid_fraction, **kwargs)
    splits = replace(splits, criteria={**splits.criteria, "holdouts": how})
    if not splits.holdout and not splits.holdout_iid:
        raise ValueError(f"{env_id}: the {how} holdouts {chosen} (iid_fraction {iid_fraction}) "
                         f"hold out none of the {len(pool)} tasks; enlarge env.pool_size or "
                         "name what to hold out (env.holdout)")
    empty = [name for name in splits.evaluated(require) if not splits[name]]
    if empty:
        raise ValueError(f"{env_id}: " + "; ".join(_why_empty(splits, name) for name in empty))
    return splits


def _fallback_notice(env_id: str, kept: Sequence[TaskSpec], iid_fraction: float) -> str:
    """``HoldoutFallbackWarning``'s message: why nothing compositional is held out, what is
    instead, and the keys that say so or name holdouts."""
    return (f"{env_id}: {_no_axis(kept)}, so nothing compositional is held out: "
            f"{iid_fraction:.0%} of them are held out as unseen tasks (split holdout_iid), and "
            "split holdout is evaluated as holdout_iid. Set eval.split: holdout_iid to say so "
            "(and drop this notice), or name what to hold out: env.holdout: {structures: "
            "[...], entity_groups: [...], min_length: N, task_ids_file: PATH}")


_CRITERION = {"holdout_structure": ("holdout_structures", "env.holdout.structures"),
              "holdout_entity": ("holdout_entity_groups", "env.holdout.entity_groups"),
              "holdout_length": ("min_holdout_length", "env.holdout.min_length")}


def _why_empty(splits: Splits, name: str) -> str:
    """Why split ``name`` of ``default_splits`` holds no task, and what to set."""
    c = splits.criteria
    n = sum(len(splits[b]) for b in (*BUCKETS, "holdout_iid"))
    if c["holdouts"] == "iid_fallback" and name in HOLDOUT_BUCKETS:
        return (f"split {name!r} does not exist: the {n} tasks show one length, one entity "
                "group and no composed structure, so they are split by unseen task only "
                "(holdout_iid). Evaluate on holdout_iid (eval.split: holdout_iid), or name "
                "what to hold out (env.holdout: {structures, entity_groups, min_length, "
                "task_ids_file})")
    if name == "holdout_iid":
        return ("split 'holdout_iid' is empty: iid_fraction is 0 and no task ids are held out; "
                "set env.iid_fraction > 0 or env.holdout.task_ids_file")
    if name == "holdout":
        return (f"split 'holdout' is empty: the holdouts hold out only task ids "
                f"({len(splits.holdout_iid)} tasks, split holdout_iid); evaluate on holdout_iid "
                "or name env.holdout.structures, entity_groups or min_length")
    if name in _CRITERION:
        arg, key = _CRITERION[name]
        return (f"split {name!r} is empty: {arg} is {c[arg]!r} ({c['holdouts']}); name "
                f"what to hold out with {key}, or evaluate on holdout")
    return f"split {name!r} is empty in a pool of {n} tasks; enlarge env.pool_size"


# ---------------------------------------------------------------------------------------------
# Sealed evaluation set
# ---------------------------------------------------------------------------------------------


class SealedSetError(ValueError):
    """A sealed evaluation set no longer matches its manifest (or carries hints)."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _manifest(tasks: Sequence[TaskSpec]) -> dict[str, dict[str, str]]:
    """task_id -> {prompt: sha256 of the prompt, spec: sha256 of the task's canonical JSON}."""
    return {t.task_id: {
        "prompt": _sha256(t.prompt),
        "spec": canonical_hash(t.model_dump(mode="json")),
    } for t in tasks}


def _manifest_hash(manifest: dict[str, dict[str, str]]) -> str:
    return canonical_hash(sorted(manifest.items()))


class SealedSet(BaseModel):
    """A hint-free evaluation set and the hash that pins it.

    ``manifest_hash`` = sha256 of the canonical JSON of the task_id-sorted list of
    ``(task_id, {prompt: sha256(prompt), spec: sha256(canonical task JSON)})``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tasks: tuple[TaskSpec, ...]
    manifest: dict[str, dict[str, str]]
    manifest_hash: str

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[TaskSpec]:  # type: ignore[override]
        return iter(self.tasks)

    def verify(self) -> bool:
        """Recompute the manifest; raise ``SealedSetError`` naming what changed."""
        hinted = [t.task_id for t in self.tasks if t.hint is not None]
        if hinted:
            raise SealedSetError(f"sealed set carries hints on tasks {hinted}")
        current = _manifest(self.tasks)
        changed = sorted(k for k in current.keys() | self.manifest.keys()
                         if current.get(k) != self.manifest.get(k))
        if changed or _manifest_hash(current) != self.manifest_hash:
            raise SealedSetError(
                f"sealed set does not match its manifest hash {self.manifest_hash[:12]}: "
                f"tasks changed, added or removed: {changed or 'manifest itself edited'}")
        return True


def sealed_eval_set(tasks: Sequence[TaskSpec]) -> SealedSet:
    """Strip hints (``hint=None``) and pin the set with a manifest hash."""
    ids = Counter(t.task_id for t in tasks)
    repeated = sorted(k for k, n in ids.items() if n > 1)
    if repeated:
        raise ValueError(f"task ids repeat in the eval set: {repeated}")
    clean = tuple(t.model_copy(update={"hint": None}) for t in tasks)
    manifest = _manifest(clean)
    return SealedSet(tasks=clean, manifest=manifest, manifest_hash=_manifest_hash(manifest))
