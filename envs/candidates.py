"""Candidates-v0: propose a set of k different candidates, one per line, in one reply.

Description
    One episode (one session, one reply) proposes a *set*: "Name 4 different words that start
    with the letter b" (family ``letter_words``) or "List 3 different even numbers from 20 to
    50" (``even_numbers``, ``odd_numbers``; ranges 20, 30 or 40 wide starting at 0 to 30). Tasks
    vary by letter (18 letters) or range and by the count k (``meta.length``, 3 to 5), so a
    count or a family can be held out. Each member is scored
    for validity and for novelty against the members *before* it (Wadhwa et al.'s
    candidate-set reward). The set is one episode: splits, dynamic sampling, the GRPO group
    and the bootstrap (``candidate_intervals``, clustered by episode) keep its members together.

Tools
    None.

Observation
    ``[system, (example user, example assistant) x 2, user]``: instructions, two worked
    examples (words starting with t, odd numbers from 1 to 9; never pool tasks) and the task.

Reward
    Members are the reply's first k non-empty pieces split at line breaks, commas and
    semicolons (the prompt asks for one per line; a 135M model often writes ``10, 12, 14``),
    a list marker (``-``, ``*``, ``1.``, ``2)``) and trailing full stops removed; pieces past
    k are ignored, missing members score 0.
    member score = validity x novelty; ``set`` = sum of member scores / k (weight 1.0), so
    the reward is in [0, 1]. Validity (0 or 1): ``letter_words``: one word of 3 to 20 letters
    a-z holding a vowel (a e i o u y), starting with the letter (a form check, no dictionary);
    numbers: an integer written alone, inside the inclusive range, of the right parity.
    Novelty against every earlier member, on the normal form (NFKC, case-folded, everything
    but letters and digits removed; for numbers the integer value): the same normal form is a
    duplicate (0); for words, a near duplicate is 0.5: the same stem (one suffix of ``ing ed
    es er ly s`` removed, the stem kept at 3 letters or more) or, when both are at least 5
    letters long, one letter inserted or deleted (``balloon``/``baloon``); otherwise 1. A
    changed letter is a different word (``house``/``horse``, ``bat``/``bag``). Numbers have no
    near duplicates (12 and 13 are different numbers).
    Components of weight 0: ``valid`` (valid members / k), ``novel`` (mean novelty of the
    members given, 0 when none), ``count`` (members given / k). ``audit["members"]``: per
    member its text (first 64 characters), ``valid``, ``novelty`` and ``score``; ``audit["k"]``.

Episode end
    The first reply ends the episode: ``correct`` when ``set`` is 1.0, ``format_error`` when
    the reply has no non-empty line, ``wrong`` otherwise.

Version history
    v0: first release.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from envs.core import TaskMeta, TaskSpec, ToolEnv
from trajectories import Outcome, RewardBreakdown

__all__ = ["FAMILIES", "WEIGHTS", "CandidatesEnv", "Member",
           "split_members", "score_members", "set_reward"]

WEIGHTS = {"set": 1.0, "valid": 0.0, "novel": 0.0, "count": 0.0}
FAMILIES = ("letter_words", "even_numbers", "odd_numbers")
COUNTS = (3, 4, 5)
MAX_MEMBER_CHARS = 64  # longer members are invalid and shown cut in the audit
_WORDS = {  # the scripted solver's words; the letters tasks are drawn from
    "b": "ball bird book bread boat", "c": "cat cake cloud chair coin",
    "d": "dog door desk drum duck", "f": "fish frog farm flag fork",
    "g": "goat game gift glass grape", "h": "hat house horse hill honey",
    "l": "lamp lion leaf lake lemon", "m": "moon milk mouse map music",
    "p": "pen pig park plant piano", "r": "rain road rock river rose",
    "s": "sun sock star salt snake", "w": "wind wolf water wall wheel",
    "n": "nest nose nail night note", "k": "kite king key kettle kitten",
    "j": "jam jar jelly jacket juice", "v": "van vase vest violin valley",
    "e": "egg eagle engine earth elbow", "o": "owl orange ocean olive oven",
}
_EXAMPLES = [("Name 3 different words that start with the letter t. Write one per line and "
              "nothing else.", "tree\ntable\ntiger"),
             ("List 3 different odd numbers from 1 to 9. Write one per line and nothing else.",
              "3\n5\n7")]
_SEPARATOR = re.compile(r"[\n\r\v\f\x1c-\x1e\x85\u2028\u2029,;]")
_MARKER = re.compile(r"^(?:[-*\u2022]+|\(?\d{1,2}[.)])\s+")
_SUFFIXES = ("ing", "ed", "es", "er", "ly", "s")


@dataclass(frozen=True)
class Member:
    """One scored member of a candidate set."""

    text: str  # its first MAX_MEMBER_CHARS characters, as written
    valid: float  # 0 or 1
    novelty: float  # 0, 0.5 or 1 against the earlier members
    score: float  # valid x novelty


def split_members(reply: str, k: int) -> list[str]:
    """The first ``k`` non-empty pieces of ``reply`` split at line breaks, commas and
    semicolons, list markers and trailing full stops removed."""
    members: list[str] = []
    for piece in _SEPARATOR.split(reply):
        text = _MARKER.sub("", piece.strip()).rstrip(". \t")
        if text:
            members.append(text)
            if len(members) == k:
                break
    return members


def _normal(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKC", text).casefold() if c.isalnum())


def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def _one_letter_more(a: str, b: str) -> bool:
    """Is one of ``a``, ``b`` the other with one letter inserted? In O(len) (members can be
    long)."""
    if abs(len(a) - len(b)) != 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return a[i:] == b[i + 1:]


def _integer(text: str) -> int | None:
    return int(text) if re.fullmatch(r"-?\d{1,6}", text) else None


def _valid(task: dict, text: str) -> bool:
    if len(text) > MAX_MEMBER_CHARS:
        return False
    if task["family"] == "letter_words":
        return (re.fullmatch(r"[a-z]{3,20}", text.lower()) is not None
                and text.lower().startswith(task["letter"])
                and any(v in text.lower() for v in "aeiouy"))
    value = _integer(text)
    parity = 0 if task["family"] == "even_numbers" else 1
    return value is not None and task["lo"] <= value <= task["hi"] and value % 2 == parity


def _key(task: dict, text: str) -> int | str:
    """What two members must share to be duplicates: the integer for numbers, else the normal
    form."""
    value = _integer(text) if task["family"] != "letter_words" else None
    return _normal(text) if value is None else value


def _novelty(task: dict, text: str, earlier: Sequence[str]) -> float:
    key = _key(task, text)
    before = [_key(task, e) for e in earlier]
    if key in before:
        return 0.0
    if task["family"] != "letter_words":
        return 1.0
    near = any(_stem(key) == _stem(b) or (min(len(key), len(b)) >= 5 and _one_letter_more(key, b))
               for b in before)
    return 0.5 if near else 1.0


def score_members(task: dict, reply: str) -> list[Member]:
    """Each of the first ``task['k']`` members of ``reply`` scored (``Member``), in order."""
    texts = split_members(reply, task["k"])
    members = []
    for i, text in enumerate(texts):
        valid = 1.0 if _valid(task, text) else 0.0
        novelty = _novelty(task, text, texts[:i])
        members.append(Member(text[:MAX_MEMBER_CHARS], valid, novelty, valid * novelty))
    return members


def set_reward(task: dict, reply: str, verifier: str = "agent_rl/Candidates-v0@0") -> RewardBreakdown:
    """The set's reward: ``set`` = sum of member scores / k, with the per-member audit."""
    k = task["k"]
    members = score_members(task, reply)
    n = len(members)
    components = {"set": sum(m.score for m in members) / k,
                  "valid": sum(m.valid for m in members) / k,
                  "novel": sum(m.novelty for m in members) / n if n else 0.0,
                  "count": n / k}
    outcome = (Outcome.correct if components["set"] == 1.0 else
               Outcome.wrong if n else Outcome.format_error)
    return RewardBreakdown.from_components(components, dict(WEIGHTS), outcome, verifier,
                                           {"k": k, "members": [asdict(m) for m in members]})


class CandidatesEnv(ToolEnv):
    env_id = "agent_rl/Candidates-v0"
    version = 0
    instructions = ("You propose sets of different answers. Write each answer on its own line, "
                    "with nothing else.")
    reward_weights = WEIGHTS

    def __init__(self, families: Sequence[str] = FAMILIES, counts: Sequence[int] = COUNTS,
                 **kwargs):
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown or not families:
            raise ValueError(f"families must be some of {list(FAMILIES)}, got {list(families)}")
        if not counts or any(not 2 <= int(c) <= 8 for c in counts):
            raise ValueError(f"counts must each be in 2..8, got {list(counts)}")
        super().__init__(**kwargs)
        self.families = tuple(families)
        self.counts = tuple(int(c) for c in counts)

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        return [self._make_task(rng, f"cand-{seed}-{i}") for i in range(n)]

    def _make_task(self, rng: np.random.Generator, prefix: str) -> TaskSpec:
        family = str(rng.choice(self.families))
        k = int(rng.choice(self.counts))
        if family == "letter_words":
            letter = str(rng.choice(sorted(_WORDS)))
            task = {"family": family, "k": k, "letter": letter}
            prompt = f"Name {k} different words that start with the letter {letter}."
            task_id = f"{prefix}-{k}-words-{letter}"
        else:
            lo = int(rng.integers(0, 4)) * 10
            hi = lo + int(rng.integers(2, 5)) * 10
            task = {"family": family, "k": k, "lo": lo, "hi": hi}
            kind = family.split("_")[0]
            prompt = f"List {k} different {kind} numbers from {lo} to {hi}."
            task_id = f"{prefix}-{k}-{kind}-{lo}-{hi}"
        return TaskSpec(
            task_id=task_id, prompt=prompt + " Write one per line and nothing else.",
            meta=TaskMeta(skills=[family], structure=family, entity_group=family.split("_")[-1],
                          length=k, difficulty=k),
            target=task)

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        return list(_EXAMPLES) if compressions == 0 else []

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        return set_reward(task.target, answer, f"{self.env_id}@{self.version}")

    def reference_action(self) -> str | None:
        if self.task is None:
            return None
        task = self.task.target
        if task["family"] == "letter_words":
            return "\n".join(_WORDS[task["letter"]].split()[: task["k"]])
        parity = 0 if task["family"] == "even_numbers" else 1
        start = task["lo"] + (task["lo"] % 2 != parity)
        return "\n".join(str(v) for v in range(start, task["hi"] + 1, 2)[: task["k"]])
