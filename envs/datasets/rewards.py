"""Built-in rewards of Dataset-v0 and their verifiers.

The rewards are small pure functions of ``(reply, target)``, also usable by evaluation. A
``Verifier`` says how a reward kind reads an answer cell (``prepare``), scores a reply, tells
whether the reply answered at all, and writes a correct reply (rules: ``envs.datasets.env``).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from envs.core import TaskSpec
from envs.datasets.errors import DatasetError
from envs.scoring import NUMBER, numbers, numeric_reward

# ---------------------------------------------------------------------------------------------
# Rewards: small pure functions of (reply, target), also usable by evaluation
# ---------------------------------------------------------------------------------------------

_LETTER = re.compile(r"\s*(?:[(\[]\s*)?([A-Za-z])\s*(?:[)\]]\s*)?(?:[.:]\s*)?")
_SAID = re.compile(  # one \s* per whitespace run, none adjacent: linear on any reply
    r"(?i:\b(?:answer|option|choice))\s*(?:(?i:is)\b\s*)?(?::\s*)?[(\[]?([A-Z])(?![A-Za-z0-9])")
_LEADING = re.compile(r"\s*([A-Z])[.):](?:\s|$)")
_BRACKETED = re.compile(r"[(\[]([A-Za-z])[)\]]")
_NUMBER_CELL = re.compile(rf"\s*{NUMBER.pattern}\s*")


def normalize(text: str) -> str:
    """NFKC, case-folded, trimmed, whitespace runs made one space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exact_reward(reply: str, answer: str) -> float:
    return float(normalize(reply) == normalize(answer))


def contains_reward(reply: str, answer: str) -> float:
    return float(normalize(answer) in normalize(reply))


def regex_reward(reply: str, pattern: str) -> float:
    return float(re.search(pattern, reply) is not None)


def read_choice(reply: str) -> str | None:
    """The option letter a reply chose (upper case), or None (rules: module docstring)."""
    whole = _LETTER.fullmatch(reply)
    if whole:
        return whole.group(1).upper()
    said = _SAID.findall(reply)
    if said:
        return said[-1]
    leading = _LEADING.match(reply)
    if leading:
        return leading.group(1)
    bracketed = _BRACKETED.findall(reply)
    return bracketed[-1].upper() if bracketed else None


def choice_reward(reply: str, letter: str) -> float:
    return float(read_choice(reply) == letter.upper())


# ---------------------------------------------------------------------------------------------
# Verifiers: how each reward kind reads an answer cell, scores a reply and solves a task
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verifier:
    """``prepare`` turns an answer cell into the target (``ValueError`` saying why it cannot);
    ``score`` is the reward of a reply; ``answered`` whether the reply gave any answer;
    ``solve`` a correct reply (None: none known)."""

    name: str
    prepare: Callable[[Any], Any]
    score: Callable[[str, TaskSpec], float | dict[str, float]]
    answered: Callable[[str], bool]
    solve: Callable[[Any], str | None]
    instructions: str


def _answer_text(cell: Any) -> str:
    if isinstance(cell, bool) or not isinstance(cell, str | int | float):
        raise ValueError(f"is {type(cell).__name__} {cell!r:.60}; it must be text or a number")
    if isinstance(cell, float) and not math.isfinite(cell):
        raise ValueError(f"is {cell!r}, not a finite number")
    text = cell if isinstance(cell, str) else (str(cell) if isinstance(cell, int) else repr(cell))
    if not text.strip():
        raise ValueError("is empty")
    return text


def _numeric_target(cell: Any) -> str:
    text = _answer_text(cell)
    if not _NUMBER_CELL.fullmatch(text):
        raise ValueError(f"is {text!r:.60}, not one number (write it as 72, -3.5 or 1,000; "
                         "reward='numeric' reads the last number of the reply against it)")
    return str(Decimal(text.strip().replace(",", "")))


def _choice_target(cell: Any) -> str:
    match = _LETTER.fullmatch(_answer_text(cell))
    if not match:
        raise ValueError(f"is {cell!r:.60}, not one option letter such as B or (B) "
                         "(reward='choice')")
    return match.group(1).upper()


def _regex_target(cell: Any) -> str:
    text = _answer_text(cell)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"is not a valid regular expression ({exc}) (reward='regex')") from None
    return text


def nonblank(reply: str) -> bool:
    return bool(reply.strip())


ANSWER_ONLY = "Answer the question. Reply with the final answer only, nothing else."
REWARDS = ("exact", "numeric", "regex", "choice", "contains")


def built_in(kind: str, tolerance: float = 0.0) -> Verifier:
    """The verifier of a built-in reward kind (one of ``REWARDS``)."""
    if kind == "exact":
        return Verifier(kind, _answer_text, lambda r, t: exact_reward(r, t.target), nonblank,
                        str, ANSWER_ONLY)
    if kind == "numeric":
        return Verifier(kind, _numeric_target,
                        lambda r, t: numeric_reward(r, t.target, tolerance),
                        lambda r: bool(numbers(r)), str,
                        "Solve the problem. End your reply with the final number.")
    if kind == "regex":
        return Verifier(kind, _regex_target, lambda r, t: regex_reward(r, t.target), nonblank,
                        lambda target: None, ANSWER_ONLY)
    if kind == "choice":
        return Verifier(kind, _choice_target, lambda r, t: choice_reward(r, t.target),
                        lambda r: read_choice(r) is not None, str,
                        "Answer the multiple-choice question. Reply with the letter of the "
                        "correct option only.")
    if kind == "contains":
        return Verifier(kind, _answer_text, lambda r, t: contains_reward(r, t.target),
                        nonblank, str, ANSWER_ONLY)
    raise DatasetError(f"reward {kind!r} is not one of {list(REWARDS)}, nor a "
                       "'module:function' path to your own function", key="reward")
