"""CodeTests-v0's tasks: one small function per task, a chain of 1-3 operations over one input
type, its hidden tests drawn and computed here (trusted expressions, never agent code).

``make_task(seed, i)`` is task ``i`` of pool ``seed``, drawn from ``(seed, i)`` alone (pools are
prefix-stable); ``envs/codetests/env.py``'s docstring describes the operations and the tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.core import TaskMeta, TaskSpec

N_TESTS = 5


@dataclass(frozen=True)
class Op:
    """One operation: ``code`` is a Python expression over ``x`` (``{k}``: its parameter)."""

    name: str  # the skill
    takes: str  # "str" | "list" | "int"
    gives: str  # "str" | "list" | "int" | "bool"
    phrase: str  # what it does, in the prompt
    code: str
    params: tuple[int, ...] = ()  # the values ``k`` is drawn from
    needs_nonempty: bool = False  # fails on an empty list
    may_empty: bool = False  # may return an empty list

    def bind(self, k: int | None) -> tuple[str, str, str]:
        """(function-name part, phrase, expression) with the parameter filled in."""
        part = self.name if k is None else f"{self.name}{k}"
        return part, self.phrase.format(k=k), self.code.format(k=k)


_CASE = ("upper", "lower", "swapcase")
OPS: tuple[Op, ...] = (
    Op("reverse", "str", "str", "reverse it", "x[::-1]"),
    Op("upper", "str", "str", "convert it to upper case", "x.upper()"),
    Op("lower", "str", "str", "convert it to lower case", "x.lower()"),
    Op("swapcase", "str", "str", "swap the case of every letter", "x.swapcase()"),
    Op("remove_spaces", "str", "str", "remove every space", "x.replace(' ', '')"),
    Op("repeat", "str", "str", "repeat it {k} times", "x * {k}", params=(2, 3)),
    Op("sort", "str", "str", "sort its characters", "''.join(sorted(x))"),
    Op("length", "str", "int", "take its length", "len(x)"),
    Op("count_vowels", "str", "int", "count its vowels (a, e, i, o, u, either case)",
       "sum(c in 'aeiouAEIOU' for c in x)"),
    Op("is_palindrome", "str", "bool", "tell whether it reads the same backwards",
       "x == x[::-1]"),
    Op("reverse", "list", "list", "reverse it", "x[::-1]"),
    Op("sort", "list", "list", "sort it in increasing order", "sorted(x)"),
    Op("multiply_each", "list", "list", "multiply every element by {k}", "[v * {k} for v in x]",
       params=(2, 3)),
    Op("add_each", "list", "list", "add {k} to every element", "[v + {k} for v in x]",
       params=(1, 2, 5)),
    Op("keep_evens", "list", "list", "keep only the even elements",
       "[v for v in x if v % 2 == 0]", may_empty=True),
    Op("length", "list", "int", "count its elements", "len(x)"),
    Op("sum", "list", "int", "add up its elements", "sum(x)"),
    Op("max", "list", "int", "take its largest element", "max(x)", needs_nonempty=True),
    Op("min", "list", "int", "take its smallest element", "min(x)", needs_nonempty=True),
    Op("add", "int", "int", "add {k}", "x + {k}", params=(1, 2, 3, 5, 7, 10)),
    Op("multiply", "int", "int", "multiply it by {k}", "x * {k}", params=(2, 3, 4, 5)),
    Op("square", "int", "int", "square it", "x * x"),
    Op("negate", "int", "int", "negate it", "-x"),
    Op("abs", "int", "int", "take its absolute value", "abs(x)"),
    Op("digit_sum", "int", "int", "add up its decimal digits (ignoring the sign)",
       "sum(int(d) for d in str(abs(x)))"),
    Op("is_even", "int", "bool", "tell whether it is even", "x % 2 == 0"),
)
FAMILIES = {"str": ("strings", "s", "str"), "list": ("lists", "nums", "list[int]"),
            "int": ("integers", "n", "int")}  # type -> (entity group, argument, annotation)
RETURNS = {"str": "str", "list": "list[int]", "int": "int", "bool": "bool"}
LENGTHS, LENGTH_P = (1, 2, 3), (0.35, 0.4, 0.25)
_WORDS = ("apple", "Banana", "cherry", "Delta", "echo", "level", "Kayak", "mango", "noon",
          "Orbit", "piano", "Racecar", "river", "Stone", "tiger", "Refer", "ocean", "Python")


def _follows(prev: Op | None, op: Op) -> bool:
    """May ``op`` come right after ``prev`` in a chain?"""
    if prev is None:
        return True
    if op.takes != prev.gives or op.name == prev.name:
        return False
    if prev.name == "sort" and op.name == "is_palindrome":  # (almost) never true
        return False
    return not (prev.name in _CASE and op.name in _CASE)  # upper, lower: the first does nothing


def _chain(rng: np.random.Generator, family: str, length: int) -> list[tuple[Op, int | None]]:
    """``length`` compatible operations starting from ``family``'s type, parameters drawn."""
    chain: list[tuple[Op, int | None]] = []
    prev: Op | None = None
    maybe_empty = False  # the list so far may be empty (``max`` would fail)
    for step in range(length):
        rest = length - step - 1  # operations still to come after this one
        ok = [op for op in OPS if (op.takes == family if prev is None else _follows(prev, op))
              and not (maybe_empty and op.needs_nonempty)
              and (rest == 0 or any(_follows(op, nxt) for nxt in OPS))]
        op = ok[int(rng.integers(len(ok)))]
        k = int(rng.choice(op.params)) if op.params else None
        chain.append((op, k))
        prev = op
        maybe_empty = op.gives == "list" and (maybe_empty or op.may_empty)
    return chain


def _evaluate(expressions: Sequence[str]) -> Callable[[Any], Any]:
    """The chain as a function (the env's own trusted expressions, compiled once)."""
    steps = [eval(compile(f"lambda x: {e}", "<codetests-op>", "eval")) for e in expressions]

    def run(x: Any) -> Any:
        for step in steps:
            x = step(x)
        return x

    return run


def _draw_input(rng: np.random.Generator, family: str) -> Any:
    if family == "str":
        words = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(1, 3)))]
        return " ".join(w.lower() if rng.random() < 0.5 else w for w in words)
    if family == "list":
        return [int(v) for v in rng.integers(-5, 16, size=int(rng.integers(1, 7)))]
    return int(rng.integers(-30, 61))


def _test_cases(rng: np.random.Generator, family: str,
                fn: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
    """``N_TESTS + 1`` distinct inputs and their values (the first pair is the worked example).
    A yes/no task gets both answers among its hidden tests when 200 draws offer both."""
    drawn: dict[str, tuple[Any, Any]] = {}  # distinct inputs in draw order -> (input, value)
    for _ in range(200):
        x = _draw_input(rng, family)
        drawn.setdefault(json.dumps(x), (x, fn(x)))
        if len(drawn) >= 12 * N_TESTS:
            break
    pairs = list(drawn.values())
    chosen = pairs[: N_TESTS + 1]
    if type(chosen[-1][1]) is bool:
        missing = {True, False} - {v for _, v in chosen[1:]}
        spare = [p for p in pairs[N_TESTS + 1:] if p[1] in missing]
        if spare:
            chosen[-1] = spare[0]
    return [x for x, _ in chosen], [v for _, v in chosen]


def make_task(seed: int, i: int) -> TaskSpec:
    """Task ``i`` of pool ``seed`` (drawn from ``(seed, i)`` alone: pools are prefix-stable)."""
    rng = np.random.default_rng([seed, 13, i])
    family = str(rng.choice(list(FAMILIES)))
    length = int(rng.choice(LENGTHS, p=LENGTH_P))
    for _ in range(100):  # a chain whose hidden values differ: no constant may pass
        chain = _chain(rng, family, length)
        bound = [op.bind(k) for op, k in chain]
        inputs, values = _test_cases(rng, family, _evaluate([e for _, _, e in bound]))
        if len({json.dumps(v) for v in values[1:]}) > 1:
            break
    else:
        raise RuntimeError(f"task {i} of seed {seed}: no chain with varying values")
    group, arg, annotation = FAMILIES[family]
    name = f"{family}_" + "_".join(part for part, _, _ in bound)
    returns = RETURNS[chain[-1][0].gives]
    signature = f"{name}({arg}: {annotation}) -> {returns}"
    doing = ", then ".join(phrase for _, phrase, _ in bound)
    what = {"str": "the string", "list": "the list", "int": "the number"}[family]
    prompt = (f"Write a Python function `{signature}`: take {what} `{arg}`, {doing}, and "
              f"return the result.\n\n"
              f"Example: `{name}({inputs[0]!r})` returns `{values[0]!r}`.")
    skills = [op.name for op, _ in chain]
    return TaskSpec(
        task_id=f"code-{seed}-{i}",
        prompt=prompt,
        meta=TaskMeta(skills=skills, structure=">".join(skills), entity_group=group,
                      length=length, difficulty=length, returns=returns),
        target=values[1:],
        data={"function": name, "signature": signature, "inputs": [[x] for x in inputs[1:]],
              "solution": _solution(signature, arg, [e for _, _, e in bound])},
    )


def _solution(signature: str, arg: str, expressions: Sequence[str]) -> str:
    """The reference solution: one expression per line, the last one returned."""
    lines = [f"def {signature}:", f"    x = {arg}"]
    lines += [f"    x = {e}" for e in expressions[:-1]]
    lines.append(f"    return {expressions[-1]}")
    return "\n".join(lines) + "\n"
