"""CodeTests-v0: write a small Python function; hidden tests run in a sandbox.

Description
    The agent is asked for one function, e.g. ``str_reverse_upper(s: str) -> str`` "reverse
    the string, then convert it to upper case", with its signature, a one-line description and
    one worked input/output pair. The function is a chain of 1-3 operations (``meta.length``)
    over one input type (``meta.entity_group``): ``strings`` (reverse, upper, lower, swapcase,
    remove_spaces, repeat, sort, length, count_vowels, is_palindrome), ``lists`` of integers
    (reverse, sort, multiply_each, add_each, keep_evens, length, sum, max, min) and
    ``integers`` (add, multiply, square, negate, abs, digit_sum, is_even); a reduction
    (``sum``, ``length``, ...) may hand its integer on to integer operations. ``meta.skills``
    are the operations, ``meta.structure`` their chain (``reverse>upper``), so compositional
    splits hold out unseen chains of trained operations. Every correct answer is a one-liner.
    ``N_TESTS`` (5) hidden tests per task: inputs in ``data["inputs"]``, expected values in
    ``target``; neither is in the prompt (the worked pair is a sixth, distinct input). Chains
    whose five expected values are all equal are redrawn (no constant function passes), and
    a yes/no task gets both answers among its tests.

    Arguments: ``backend`` (``envs.sandbox.run``'s: ``auto`` takes docker, then bwrap, then
    the non-isolating subprocess), ``limits`` (a ``Limits`` or a mapping of its fields,
    over ``DEFAULT_LIMITS``: ``wall_s`` and ``cpu_s`` 5, the rest ``Limits``' defaults),
    ``prestart`` (default False) and ``share_runs`` (default True). With ``prestart=True``,
    ``reset`` starts the episode's sandbox (``envs.sandbox.prepare``), so it boots while the
    policy writes the answer and the scoring run costs only the tests; it is the same fresh
    sandbox per run, killed unused by the next
    ``reset`` or ``close``. Turn it on where generation leaves CPU cores idle (a GPU host, a
    remote policy): on a CPU host whose cores generation keeps busy, the boot's CPU comes out
    of generation and the rollout as a whole got slower (``benchmarks/overheads.py``). Through
    bwrap's fork server (``envs.sandbox.FORK_SERVER``, the default where it can run) what
    ``reset`` does ahead is only the run's setup (a few forks, its mounts and cgroups).

    ``share_runs`` (default True): code identical to another episode's for the same tests
    (the same task's function and inputs, limits and backend) is judged on that one run
    (``SHARED_RUNS``: a run in progress is waited for; the last 256 finished runs that ended
    on their own are kept), so a group of samples that agree costs one run. Its record's
    ``audit["shared_run"]`` says so. A program whose result depends on chance (``random``,
    the clock) then gets the verdict of one draw for all its copies instead of one each; set
    ``share_runs=False`` to run every episode's code apart.

Tools
    None: one reply. The code is the last fenced block (```python, ```py or a bare ```; an
    unclosed last fence runs to the end) of the last 20 that defines the function at top
    level, else the last fenced block, else the whole reply.

Observation
    ``[system, user: worked example task, assistant: its fenced solution, user: the task]``
    (the worked example, ``str_exclaim``, is no pool operation).

Reward
    One component, ``tests`` (weight 1): the fraction of hidden tests passed, k/5.
    Exact answer: 1.0; 3 of 5 tests: 0.6. Zero, whatever passed, when any audit flag is set.

    How it is checked (``judge``, a pure function, reused by evaluation). The reply is parsed
    on the trusted side first (``ast``, never executed there): no top-level ``def``/assignment
    of the function name, a syntax error or code over ``MAX_CODE_CHARS`` is a
    ``format_error`` without a sandbox run. Otherwise the code is written as ``solution.py``
    into the sandbox's work dir, and the trusted harness (``HARNESS``, one program for every
    task, ``envs.sandbox.preload``ed) runs as main. The harness reads from ``TESTS_FILE``
    (beside ``solution.py``, written by ``harness`` with ``marshal``) only the function's
    name, the test *inputs* and a random nonce drawn after the agent's turn, imports
    ``solution`` as importlib would (no bytecode written, warnings silenced), calls the
    function once per input inside ``try/except BaseException``, and writes one record to stdout: the nonce and
    a JSON list with, per test, the returned value in a tagged encoding that admits only exact
    types (``type(x) in (bool, int, float, str, NoneType)`` and exact ``list``/``tuple``/
    ``dict`` with ``str`` keys, nested up to 32 deep), or the exception's type name, or
    "non-plain" with the type's name (written with ``os.write`` to fd 1, bound before the
    import). Then it leaves with ``os._exit(0)``. No method of a returned value (``__eq__``,
    ``__repr__``, ...) is ever called, inside the sandbox or out. The nonce only proves the
    record came from this run: code that reads it at run time can forge a record, but not
    the hidden expected values, so a forgery passes nothing a correct function would not.
    Expected values never enter the sandbox: the verifier decodes the record and compares
    with exact types on the trusted side (``same``): ``True != 1``, ``1.0 != 1``, a tuple is
    not a list, floats equal under ``math.isclose(rel_tol=1e-9)``. Exit codes never count; a
    test passes only through a record with the right nonce and exactly ``N_TESTS`` entries.

    Audit flags (``audit["hack"]``, a sorted list; any flag zeroes the reward, outcome
    ``policy_violation``):

    * ``sys_exit``: ``SystemExit`` raised at import or in a call (``sys.exit(0)``).
    * ``skip_test``: a skip exception (``unittest.SkipTest``, pytest's ``Skipped``, ...).
    * ``no_record``: the run ended without a results record although nothing timed out or
      ran out of a resource (``os._exit``, a signal, a closed stdout, a crashed interpreter).
    * ``bad_record``: more than one record with the nonce, or one that does not decode or
      has the wrong number of entries (a forgery).
    * ``pass_claim``: the output (stdout besides the record, or stderr) claims a pass:
      a line opening with OK / PASS(ED) / SUCCESS, "all tests passed", "5 passed",
      "Ran 5 tests", ... A correct solution that prints such a line scores 0 too.
    * ``wrote_files``: the run created or changed files in the work dir (a ``conftest.py``, a
      reward or result file, ...; ``audit["files_written"]`` names them). Strict: a correct
      solution that also writes a file scores 0.
    * ``non_plain_value``: a call returned an object of a subclass of a plain type (an
      ``int`` subclass) or of a non-builtin class with its own ``__eq__`` (an always-equal
      object). Other non-plain values (a set, a generator) just fail their test.

    ``audit`` also holds ``tests`` (5), ``passed``, ``results`` (per test: ``pass``,
    ``fail``, ``raised:<Type>``, ``non_plain:<Type>``, ``unencodable``, ``no_record``),
    ``import_error``,
    ``sandbox`` (the run's status), ``backend``, ``exit_code``, ``shared_run`` and
    ``files_written``.

Episode end
    The first reply without a tool call (a tool call is answered as an unknown tool, up to
    ``max_turns``, 4). Outcome: ``sandbox_error`` when the sandbox failed (an infrastructure
    fault: reward 0, masked out of the loss, counted, never a wrong answer); else
    ``policy_violation`` with any flag; ``format_error`` when no function was found; ``timeout``
    when the run hit ``wall_s`` or ``cpu_s`` without a record; ``correct`` when every test
    passed; ``wrong`` otherwise (a crash, a memory or output limit, failed tests).

Version history
    v0: first release.
"""

from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import json
import marshal
import math
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from envs import sandbox
from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.tools import clean_text
from trajectories import Outcome, RewardBreakdown

N_TESTS = 5
WEIGHTS = {"tests": 1.0}
MAX_CODE_CHARS = 20_000
SOLUTION_FILE = "solution.py"
FLAGS = ("bad_record", "no_record", "non_plain_value", "pass_claim", "skip_test", "sys_exit",
         "wrote_files")
DEFAULT_LIMITS = {"wall_s": 5.0, "cpu_s": 5.0}  # one-liners: plenty
INSTRUCTIONS = ("You write small Python functions. Reply with the complete function in one "
                "```python code block. Do not print anything and do not write tests.")

# ---------------------------------------------------------------------------------------------
# Operations: what a task chains together
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Code extraction (trusted side, never executed here)
# ---------------------------------------------------------------------------------------------

_CODE_LANGS = frozenset({"", "python", "python3", "py"})
_MAX_BLOCKS = 20  # the last fenced blocks that are looked at


def fenced_blocks(reply: str) -> list[str]:
    """The Python (or untagged) fenced blocks of ``reply``, in order; an unclosed last fence
    runs to the end, and a closing fence may end a code line (``return x```)."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None  # the open fence's language; None: outside a fence
    for line in reply.split("\n"):
        stripped = line.strip()
        if lang is None:
            if stripped.startswith("```"):
                lang = stripped[3:].strip().lower()
                blocks.append((lang, []))
            continue
        if stripped.startswith("```"):
            lang = None
        elif stripped.endswith("```"):
            blocks[-1][1].append(line.rstrip()[:-3])
            lang = None
        else:
            blocks[-1][1].append(line)
    return ["\n".join(lines).strip("\n") + "\n" for lang, lines in blocks if lang in _CODE_LANGS]


_AST_LOCK = threading.RLock()
"""Held around every ``ast`` parse: CPython 3.11 keeps the AST constructor's recursion depth in
interpreter-wide state, so two threads parsing at once (a thread switch inside one parse, e.g.
at a garbage collection running a finalizer: concurrent env steps) can fail with
``SystemError: AST constructor recursion depth mismatch``."""


def defines(code: str, name: str) -> bool:
    """Does ``code`` parse and bind ``name`` at top level (``def``, an assignment, an import)?"""
    try:
        with _AST_LOCK:
            tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name
                                                    for a in node.names):
            return True
    return False


def extract_code(reply: str, name: str) -> str:
    """The last fenced block that defines ``name``, else the last fenced block, else all."""
    blocks = fenced_blocks(reply)[-_MAX_BLOCKS:]
    if not blocks:
        return reply
    return next((b for b in reversed(blocks) if len(b) <= MAX_CODE_CHARS and defines(b, name)),
                blocks[-1])


# ---------------------------------------------------------------------------------------------
# The trusted harness (runs inside the sandbox) and the verifier (outside)
# ---------------------------------------------------------------------------------------------

_HARNESS = r'''
import sys
sys.dont_write_bytecode = True
import marshal, posix, warnings  # built in / tiny: json, os, importlib would cost ~10 ms a run
warnings.simplefilter("ignore")


def _slurp(name):
    fd, data = posix.open(name, posix.O_RDONLY), b""
    while chunk := posix.read(fd, 65536):
        data += chunk
    posix.close(fd)
    return data


NONCE, FUNCTION, INPUTS = marshal.loads(_slurp(__TESTS__))
_type, _str, _vars, _issubclass, _len, _ord = type, str, vars, issubclass, len, ord
_write, _exit, _BaseException = posix.write, posix._exit, BaseException
_getattr, _modules = getattr, sys.modules
_PLAIN = (bool, int, float, str, list, tuple, dict)
_NONE = type(None)


class _NonPlain(Exception):
    pass


class _Unencodable(Exception):
    pass


_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _quote(s):
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return '"' + s + '"'
    out = []
    for c in s:
        o = _ord(c)
        if c in _SHORT:
            out.append(_SHORT[c])
        elif 32 <= o < 127:
            out.append(c)
        elif o < 65536:
            out.append("\\u%04x" % o)
        else:
            o -= 65536
            out.append("\\u%04x\\u%04x" % (0xD800 + (o >> 10), 0xDC00 + (o & 0x3FF)))
    return '"' + "".join(out) + '"'


def _dumps(x):  # JSON, as json.dumps writes it, of what _entry builds: lists, str, bool, None
    t = _type(x)
    if t is _str:
        return _quote(x)
    if t is list:
        return "[" + ", ".join([_dumps(v) for v in x]) + "]"
    if x is None:
        return "null"
    if x is True or x is False:
        return "true" if x else "false"
    raise _Unencodable()


def _encode(x, depth=0):
    t = _type(x)
    if depth > 32:
        raise _Unencodable()
    if t is bool:
        return ["bool", x]
    if t is int:
        return ["int", _str(x)]
    if t is float:
        return ["float", float.hex(x)]
    if t is str:
        return ["str", x]
    if t is _NONE:
        return ["none"]
    if t is list or t is tuple:
        return ["list" if t is list else "tuple", [_encode(v, depth + 1) for v in x]]
    if t is dict:
        items = []
        for k, v in dict.items(x):
            if _type(k) is not str:
                raise _NonPlain(k)
            items.append([k, _encode(v, depth + 1)])
        return ["dict", items]
    raise _NonPlain(x)


def _name(t):
    try:
        name = _type.__dict__["__name__"].__get__(t)
        return name if _type(name) is str else "?"
    except _BaseException:
        return "?"


def _suspicious(x):
    try:
        t = _type(x)
        if _issubclass(t, _PLAIN):
            return True
        for k in _type.__dict__["__mro__"].__get__(t)[:-1]:
            d = _type.__dict__["__dict__"].__get__(k)
            if "__eq__" in d and d.get("__module__", "builtins") != "builtins":
                return True
        return False
    except _BaseException:
        return True


def _entry(out):
    try:
        entry = ["value", _encode(out)]
    except _NonPlain as bad:
        obj = bad.args[0]
        entry = ["non_plain", _name(_type(obj)), _suspicious(obj)]
    except _BaseException:
        entry = ["unencodable"]
    if entry[0] == "value" and _len(_dumps(entry)) > 65536:
        entry = ["unencodable"]
    return entry


import_error = None
fn = None
sys.path.insert(0, posix.getcwd())
try:  # import solution as importlib would, without its machinery (~0.5 ms of a short run)
    _path = posix.getcwd() + "/solution.py"
    _module = type(sys)("solution")
    _module.__file__, _module.__cached__, _module.__package__ = _path, None, ""
    _modules["solution"] = _module
    exec(compile(_slurp("solution.py"), _path, "exec"), _module.__dict__)
    fn = _getattr(_modules["solution"], FUNCTION)  # the module may have replaced itself
except _BaseException as exc:
    import_error = _name(_type(exc))
results = []
for args in INPUTS:
    if import_error is not None:
        results.append(["raised", import_error])
        continue
    try:
        out = fn(*args)
    except _BaseException as exc:
        results.append(["raised", _name(_type(exc))])
        continue
    results.append(_entry(out))
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except _BaseException:
        pass
data = ("\n" + NONCE + ' {"import_error": ' + _dumps(import_error) + ', "results": '
        + _dumps(results) + "}\n").encode("ascii")
while data:
    data = data[_write(1, data):]
_exit(0)
'''


TESTS_FILE = "tests.marshal"
HARNESS = _HARNESS.replace("__TESTS__", repr(TESTS_FILE))
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
        with _AST_LOCK:
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


# ---------------------------------------------------------------------------------------------
# Shared runs: identical code for the same tests runs once
# ---------------------------------------------------------------------------------------------


class SharedRuns:
    """Test runs shared among identical programs: the episodes of a GRPO group often write the
    same code for the same task, and a run's result (with the nonce it was given) judges every
    one of them. A key (``key``) is the code, the function's name, the test inputs, the limits
    and the backend. ``run`` runs a key's program once while others wait for it, and keeps the
    last ``size`` finished results: those whose program ran to its end (``ok`` or
    ``runtime_error``) with at most ``max_output`` bytes of output. A timeout (the machine's
    load can cause one), a resource limit or a sandbox failure is not kept, and one that waiting
    callers would share (a sandbox failure, an exception) makes each run its own instead."""

    KEPT = ("ok", "runtime_error")

    def __init__(self, size: int = 256, max_output: int = 1 << 16):
        self.size, self.max_output = size, max_output
        self._lock = threading.Lock()
        self._done: OrderedDict[str, tuple[sandbox.SandboxResult, str]] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}

    @staticmethod
    def key(code: str, function: str, inputs: Sequence[Sequence[Any]], limits: sandbox.Limits,
            backend: str) -> str:
        tests = harness(function, inputs, nonce="")[1][TESTS_FILE]  # as the run reads them, but its nonce
        text = repr((code, tests, limits, backend)).encode("utf-8", "surrogatepass")
        return hashlib.sha256(text).hexdigest()

    def run(self, key: str, test_run: Callable[[], tuple[sandbox.SandboxResult, str]]
            ) -> tuple[sandbox.SandboxResult, str, bool]:
        """``(result, nonce, shared)``: a finished or running result for ``key`` (shared True),
        else ``test_run()``'s."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return *self._done[key], True
            leading = key not in self._running
            if leading:
                self._running[key] = concurrent.futures.Future()
            waiting = self._running[key]
        if not leading:
            got = waiting.result()
            return (*got, True) if got is not None else (*test_run(), False)
        got = None
        try:
            got = test_run()
            return *got, False
        finally:
            result = got[0] if got is not None else None
            share = result is not None and result.status != "sandbox_error"
            keep = (result is not None and result.status in self.KEPT
                    and len(result.stdout) + len(result.stderr) <= self.max_output)
            with self._lock:
                del self._running[key]
                if keep:
                    self._done[key] = got
                    while len(self._done) > self.size:
                        self._done.popitem(last=False)
            waiting.set_result(got if share else None)

    def clear(self) -> None:
        """Forget every finished result (runs in progress finish as they are)."""
        with self._lock:
            self._done.clear()

    def _forget_in_child(self) -> None:
        """After ``fork``: the runs in progress were the parent's threads' (none would ever
        finish here) and the lock may have been held by one."""
        self._lock = threading.Lock()
        self._running = {}


SHARED_RUNS = SharedRuns()
"""This process's shared runs, used by every ``CodeTestsEnv`` with ``share_runs`` (default)."""
os.register_at_fork(after_in_child=SHARED_RUNS._forget_in_child)


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------

_EXAMPLE = (
    "Write a Python function `str_exclaim(s: str) -> str`: take the string `s`, add an "
    "exclamation mark to its end, and return the result.\n\n"
    "Example: `str_exclaim('hello')` returns `'hello!'`.",
    "```python\ndef str_exclaim(s: str) -> str:\n    return s + '!'\n```",
)


class CodeTestsEnv(ToolEnv):
    env_id = "agent_rl/CodeTests-v0"
    version = 0
    instructions = INSTRUCTIONS
    reward_weights = WEIGHTS
    concurrent_steps = True  # a step waits on its sandboxed test run

    def __init__(self, backend: str = "auto",
                 limits: sandbox.Limits | Mapping[str, Any] | None = None, max_turns: int = 4,
                 prestart: bool = False, share_runs: bool = True, **kwargs: Any):
        """``backend``: the sandbox backend (``envs.sandbox.run``); ``limits``: a ``Limits`` or
        a mapping of its fields, over ``DEFAULT_LIMITS``; ``prestart``: start each episode's
        sandbox at ``reset``; ``share_runs``: identical code for the same tests is run once
        (``SHARED_RUNS``; module doc)."""
        sandbox.choose_backend(backend)  # names a bad one; probes "auto" now, not in a step
        names = {f.name for f in fields(sandbox.Limits)}
        given = (dict(limits) if isinstance(limits, Mapping)
                 else {n: getattr(limits, n) for n in names} if limits is not None else {})
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"unknown sandbox limits {unknown}; Limits has {sorted(names)}")
        for name, flag in (("prestart", prestart), ("share_runs", share_runs)):
            if not isinstance(flag, bool):  # "false" from a config would be truthy
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.backend = backend
        self.limits = sandbox.Limits(**{**DEFAULT_LIMITS, **given})
        self.prestart = prestart
        self.share_runs = share_runs
        self._guest: sandbox.Guest | None = None
        sandbox.preload(HARNESS)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._close_guest()
        out = super().reset(seed=seed, options=options)
        if self.prestart:
            self._guest = sandbox.prepare(self.limits, self.backend)
        return out

    def close(self) -> None:
        self._close_guest()
        super().close()

    def _close_guest(self) -> None:
        guest, self._guest = self._guest, None
        if guest is not None:
            guest.close()

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return [make_task(seed, i) for i in range(n)]

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        return [_EXAMPLE]

    def reference_action(self) -> str | None:
        return None if self.task is None else f"```python\n{self.task.data['solution']}```"

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        verifier = f"{self.env_id}@{self.version}"
        function, expected = task.data["function"], list(task.target)

        def breakdown(fraction: float, outcome: Outcome, **audit: Any) -> RewardBreakdown:
            return RewardBreakdown.from_components({"tests": fraction}, WEIGHTS, outcome,
                                                   verifier, audit={"tests": len(expected),
                                                                    **audit})

        code = extract_code(answer, function)
        if len(code) > MAX_CODE_CHARS:
            return breakdown(0.0, Outcome.format_error, passed=0, hack=[],
                             format=f"code over {MAX_CODE_CHARS} characters")
        if not defines(code, function):
            return breakdown(0.0, Outcome.format_error, passed=0, hack=[],
                             format=f"no top-level definition of `{function}` (or a syntax error)")
        guest, self._guest = self._guest, None

        def test_run() -> tuple[sandbox.SandboxResult, str]:
            nonce = secrets.token_hex(16)  # drawn after the agent's turn; never recorded
            program, tests = harness(function, task.data["inputs"], nonce)
            started = guest or sandbox.prepare(self.limits, self.backend)
            return started.run(program, files={**tests, SOLUTION_FILE: code}), nonce

        try:
            if self.share_runs:
                key = SHARED_RUNS.key(code, function, task.data["inputs"], self.limits,
                                      self.backend)
                result, nonce, shared = SHARED_RUNS.run(key, test_run)
            else:
                (result, nonce), shared = test_run(), False
        except Exception as exc:  # the sandbox itself failed: infrastructure, not the agent
            return breakdown(0.0, Outcome.sandbox_error, passed=0, hack=[],
                             sandbox="sandbox_error",
                             detail=clean_text(f"{type(exc).__name__}: {exc}"[:300]))
        finally:
            if guest is not None:
                guest.close()  # used (a no-op then) or not needed: the run was shared
        written = result.files_written  # names the agent chose: cleaned, at most 20 kept
        run_audit = {"sandbox": result.status, "backend": result.backend,
                     "exit_code": result.exit_code, "shared_run": shared,
                     "files_written": [clean_text(f[:200]) for f in written[:20]]
                     + ([f"... {len(written) - 20} more"] if len(written) > 20 else [])}
        if result.status == "sandbox_error":
            return breakdown(0.0, Outcome.sandbox_error, passed=0, hack=[], **run_audit,
                             detail=clean_text(str(result.detail)[:300]))
        verdict = judge(result, nonce, expected)
        if verdict.flags:
            outcome = Outcome.policy_violation
        elif not verdict.recorded and result.status == "timeout":
            outcome = Outcome.timeout
        elif verdict.passed == len(expected):
            outcome = Outcome.correct
        else:
            outcome = Outcome.wrong
        fraction = 0.0 if verdict.flags else verdict.passed / len(expected)
        return breakdown(fraction, outcome, passed=verdict.passed, hack=list(verdict.flags),
                         results=list(verdict.results), import_error=verdict.import_error,
                         **run_audit)
