"""CodeTests-v0's verifier: the trusted harness's input (``harness``) and the verdict read off
its run (``judge``, a pure function, reused by evaluation).

The harness (``harness.py`` beside this file, read as text: ``HARNESS``) runs in the sandbox with
the agent's code as ``SOLUTION_FILE`` and ``TESTS_FILE`` (the function's name, the test inputs
and a nonce drawn after the agent's turn). Expected values never enter the sandbox: ``judge``
decodes the harness's record and compares on this side with exact types (``same``), and sets
the audit flags (``FLAGS``) that zero the reward. ``envs/codetests/env.py``'s docstring lists
what each flag catches.
"""

from __future__ import annotations

import ast
import json
import marshal
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from envs import sandbox
from envs.codetests.extract import AST_LOCK
from envs.tools import clean_text

FLAGS = ("bad_record", "no_record", "non_plain_value", "pass_claim", "skip_test", "sys_exit",
         "wrote_files")
SOLUTION_FILE = "solution.py"  # the agent's code, in the work dir (the harness imports it)
TESTS_FILE = "tests.marshal"  # the harness's input, beside it
HARNESS = resources.files(__package__).joinpath("harness.py").read_text(encoding="utf-8")
"""The trusted program, one text for every task (``envs.sandbox.preload``ed: bwrap's fork server
compiles it once): it reads ``TESTS_FILE`` and writes one results record."""


def harness(function: str, inputs: Sequence[Sequence[Any]], nonce: str) -> tuple[str, dict[str, bytes]]:
    """``(HARNESS, {TESTS_FILE: ...})``: the program and its input, the function's name, the
    test inputs and ``nonce`` (``marshal``, which the guest interpreter has built in)."""
    inputs = list(map(list, inputs))
    _check_plain(inputs)
    return HARNESS, {TESTS_FILE: marshal.dumps((nonce, function, inputs), 4)}


def _check_plain(value: Any) -> None:
    """Plain data only (what ``marshal`` carries, compared exactly): a literal's repr comes back
    equal (no NaN, no inf, no other types)."""
    text = repr(value)
    try:
        with AST_LOCK:
            same_back = ast.literal_eval(text) == value
    except (ValueError, SyntaxError):
        same_back = False
    if not same_back:
        raise ValueError(f"test inputs must be plain literals (int, float, str, bool, None, "
                         f"list, tuple, dict); got {text[:200]}")


_SKIPS = frozenset({"SkipTest", "Skipped", "SkipException", "SkipTestException"})
_PASS_CLAIM = re.compile(
    r"^\W*(?:ok|pass(?:ed|es)?|success(?:ful)?)\b"  # a line opening with OK / PASSED
    r"|\b(?:all|\d+)\s+(?:tests?\s+|cases?\s+)?(?:pass(?:ed)?|ok|succeeded)\b"  # "5 passed"
    r"|\btests?\s+(?:pass(?:ed)?|ok|succeeded)\b"  # "tests passed"
    r"|\bran\s+\d+\s+tests?\b",  # unittest's "Ran 5 tests"
    re.IGNORECASE | re.MULTILINE)


def decode(tagged: Any, depth: int = 0) -> Any:
    """A tagged value of the record back to a Python value; ``ValueError`` when malformed."""
    if depth > 40 or not isinstance(tagged, list) or not tagged or type(tagged[0]) is not str:
        raise ValueError("malformed value")
    tag, rest = tagged[0], tagged[1:]
    if tag == "none" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError("malformed value")
    (v,) = rest
    if tag == "bool" and type(v) is bool:
        return v
    if tag == "int" and type(v) is str and len(v) <= 4301:
        return int(v)
    if tag == "float" and type(v) is str and len(v) <= 64:
        return float.fromhex(v)
    if tag == "str" and type(v) is str:
        return v
    if tag in ("list", "tuple") and type(v) is list:
        items = [decode(e, depth + 1) for e in v]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and type(v) is list:
        pairs = [(k, decode(e, depth + 1)) for k, e in
                 (p if type(p) is list and len(p) == 2 and type(p[0]) is str
                  else (None, None) for p in v)]
        if any(k is None for k, _ in pairs):
            raise ValueError("malformed dict")
        return dict(pairs)
    raise ValueError(f"malformed value tagged {tag[:20]!r}")


def same(got: Any, want: Any) -> bool:
    """Equality with exact types: ``True != 1``, ``1.0 != 1``, a tuple is not a list; floats
    under ``math.isclose(rel_tol=1e-9)``."""
    if type(got) is not type(want):
        return False
    if type(want) is float:
        return math.isclose(got, want, rel_tol=1e-9)
    if type(want) in (list, tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if type(want) is dict:
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


@dataclass(frozen=True)
class Verdict:
    """What the verifier read off one sandbox run."""

    results: tuple[str, ...]  # per test: pass | fail | raised:<Type> | non_plain:<Type> | ...
    flags: tuple[str, ...]  # sorted audit flags (FLAGS)
    import_error: str | None = None
    recorded: bool = False  # a valid results record was found

    @property
    def passed(self) -> int:
        return sum(r == "pass" for r in self.results)


def _read_record(stdout: str, nonce: str, n_tests: int):
    """(record or None, flags, the output besides the record lines)."""
    lines = stdout.split("\n")
    mine = [line for line in lines if line.startswith(nonce + " ")]
    others = "\n".join(line for line in lines if not line.startswith(nonce + " "))
    if not mine:
        return None, set(), others
    if len(mine) > 1:
        return None, {"bad_record"}, others
    try:
        record = json.loads(mine[0][len(nonce) + 1:])
        results = record["results"]
        import_error = record["import_error"]
        if (type(results) is not list or len(results) != n_tests
                or not (import_error is None or type(import_error) is str)):
            raise ValueError("wrong shape")
        entries = []
        for e in results:
            kind = e[0]
            if kind == "value" and len(e) == 2:
                entries.append(("value", decode(e[1])))
            elif kind in ("raised", "non_plain") and type(e[1]) is str:
                entries.append((kind, clean_text(e[1][:80]), kind == "non_plain" and e[2] is True))
            elif kind == "unencodable":
                entries.append((kind,))
            else:
                raise ValueError("malformed entry")
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None, {"bad_record"}, others
    return (clean_text(import_error[:80]) if import_error else None, entries), set(), others


def judge(result: sandbox.SandboxResult, nonce: str, expected: Sequence[Any]) -> Verdict:
    """Score one sandbox run of the harness against the hidden ``expected`` values."""
    record, flags, others = _read_record(result.stdout or "", nonce, len(expected))
    if _PASS_CLAIM.search(others) or _PASS_CLAIM.search(result.stderr or ""):
        flags.add("pass_claim")
    if result.files_written:
        flags.add("wrote_files")
    if record is None:
        if "bad_record" not in flags and result.status in ("ok", "runtime_error"):
            flags.add("no_record")
        return Verdict(results=("no_record",) * len(expected), flags=tuple(sorted(flags)))
    import_error, entries = record
    results = []
    for entry, want in zip(entries, expected, strict=True):
        if entry[0] == "value":
            results.append("pass" if same(entry[1], want) else "fail")
        elif entry[0] == "raised":
            results.append(f"raised:{entry[1]}")
            flags |= {"sys_exit"} if entry[1] == "SystemExit" else set()
            flags |= {"skip_test"} if entry[1] in _SKIPS else set()
        elif entry[0] == "non_plain":
            results.append(f"non_plain:{entry[1]}")
            flags |= {"non_plain_value"} if entry[2] else set()
        else:
            results.append("unencodable")
    return Verdict(results=tuple(results), flags=tuple(sorted(flags)), import_error=import_error,
                   recorded=True)
