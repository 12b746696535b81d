"""Dataset-v0: your own question-answer tasks from a JSONL, CSV or ``datasets`` folder.

Description
    ``envs.from_dataset(path, prompt="prompt", answer="answer", reward="exact", meta=None,
    system=None, **kw)`` (or ``envs.make("agent_rl/Dataset-v0", path=..., ...)``, the same
    keywords) reads every row at construction and makes it a ``TaskSpec``: the ``prompt``
    column is the user message, the ``answer`` column what the verifier checks (never shown).

    ``path``: a ``.jsonl``/``.ndjson`` file (one JSON object per line, blank lines skipped), a
    ``.csv`` file (a header row; UTF-8, a BOM allowed) or a folder written by ``datasets``'
    ``save_to_disk`` (read with ``datasets.load_from_disk``; needs ``pip install datasets``;
    for a ``DatasetDict``, ``dataset_split`` picks the split: default its only split, else
    ``train``). Relative paths are read from the working directory. Without ``path``,
    ``Dataset-v0`` reads the bundled sample ``envs/data/qa_sample.jsonl`` (54 arithmetic word
    problems with metadata). Nothing is downloaded.

    ``meta`` maps ``TaskMeta`` fields to columns, e.g. ``{"entity_group": "topic", "length":
    "steps"}`` (other keys become extra metadata); ``None`` takes each of ``skills``,
    ``structure``, ``entity_group``, ``length``, ``difficulty`` from the column of that name
    where the file has one. ``skills`` is a list of strings or one string split at ``,`` or
    ``>``; without a ``structure`` column it is the skills joined by ``>`` (and skills default to
    the structure's steps). ``length`` is an integer >= 1, ``difficulty`` an integer >= 0.
    Unmapped fields keep ``TaskMeta``'s defaults. ``task_id`` names a column of unique ids
    (default ``"<file stem>-<row>"``); ``solution`` a column holding a correct reply for
    ``reference_action`` (default: the answer itself; a ``regex`` dataset has none without it).

    Bad data fails at construction, before any training, naming the file, the row (1-based,
    with its line in a file) and the column: a missing or null cell, an empty prompt or answer,
    a prompt that is not text, an answer the reward cannot read (``numeric``: not one number;
    ``choice``: not one letter; ``regex``: an invalid pattern), bad metadata, a repeated id, a
    byte that is not UTF-8, a CSV cell over the ``csv`` module's 131072 characters (JSONL has
    no such limit), a JSON integer over Python's 4300 digits (quote it), a row nesting lists or
    objects more than 100 levels deep. No row is dropped silently. Arguments that need no file
    (``check_arguments``) are checked first; a ``DatasetError`` about one names it (``key``).

Tools
    None.

Observation
    ``[system, user]``: ``system`` (default: a one-line instruction for the reward kind) and
    the row's prompt.

Reward
    Built-in kinds have one component, ``accuracy`` (weight 1, or ``weights={"accuracy": w}``),
    1.0 or 0.0. "Normalised" text is NFKC, case-folded, trimmed, with every run of whitespace
    one space.

    * ``exact``: the normalised reply equals the normalised answer.
    * ``numeric``: the *last* number in the reply (``envs.scoring.numeric_reward``; read as
      ``envs.scoring.numbers`` reads them: an optional minus, digits, commas only between groups of three, an optional decimal
      part; ``12.0`` is 12, ``1,000`` is 1000) is within ``tolerance`` of the answer:
      ``|said - answer| <= tolerance * max(1, |answer|)``, i.e. absolute below 1 and relative
      above (default ``tolerance=0``: equal as numbers). The answer cell is a JSON number or a
      string holding exactly one such number.
    * ``regex``: the answer cell is a Python ``re`` pattern (compiled at construction), and
      ``re.search(pattern, reply)`` finds it (anchor with ``^...$`` for a whole-reply match;
      ``(?i)`` for case-insensitive). A pattern that backtracks catastrophically on a reply
      (``^(a+)+$`` on ``"a" * 40 + "!"``) is stopped by ``reward_timeout_s``, as below.
    * ``choice``: the answer cell is one letter (``B``, ``(B)``, ``b.``); the reply's choice is,
      in order: the whole reply as such a letter; the last ``answer/option/choice (is) (:) X``
      with an upper-case ``X``; a leading ``X.``/``X)``/``X:``; the last ``(X)`` or ``[X]``.
    * ``contains``: the normalised answer is a substring of the normalised reply.
    * ``"module:function"`` (or ``"path/to/file.py:function"``): your function ``(answer: str,
      task: TaskSpec) -> float | dict[str, float]`` (``answer`` is the reply; the row's answer
      cell is ``task.target``, the whole row ``task.data["record"]``). A float is
      ``accuracy``; a dict's keys are components, weighted by ``weights`` (default
      ``{"accuracy": 1.0}``: the dict must then hold ``accuracy``; keys without a weight are
      recorded with weight 0). It is called once at construction on the first row's reference
      reply, so a wrong return type fails before training. Later, a function that raises
      scores the episode as an infrastructure fault (``sandbox_error``: masked out of the loss,
      counted by the ``max_verifier_error_rate`` guard), its message in
      ``reward.audit["reward_error"]``; one that returns something else (a bool, a string, a
      NaN) is a bug in the function: ``RewardReturnError`` naming the function and the value.

    ``weights`` are finite and >= 0, at least one of them > 0 (all zero, every reply would be
    ``correct``). Every scoring call (built-in or yours) runs in a worker process
    (``envs.deadline``: about 0.2 ms a call) and is stopped after ``reward_timeout_s`` seconds
    (default 10; a finite number > 0): the episode is then a ``sandbox_error`` like a raising
    function, with a ``RewardFaultWarning`` naming the task. Agent text never hangs scoring.

    Outcome: ``correct`` at the maximum total, ``format_error`` when the reply holds no answer
    (empty; ``numeric``: no number; ``choice``: no letter), otherwise ``wrong``.

Episode end
    The first reply without a tool call is the answer and ends the episode; ``max_turns``
    replies (tool calls only) end it ``truncated``.

Tasks
    ``task_pool(n, seed)``: the rows in a ``numpy.random.default_rng(seed)`` permutation, the
    first ``min(n, rows)``: a pool larger than the file is every row once, never repeats.
    Rows are read once per file version (cached on path, mtime and size). ``data_hash`` is the
    sha256 of the data file(s), for a data manifest.

Version history
    v0: first release.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import json
import math
import numbers as _numbers
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from envs import deadline
from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.scoring import (
    NUMBER,
    REWARD_TIMEOUT_S,
    RewardFaultWarning,
    answer_breakdown,
    check_reward_timeout,
    fault_reason,
    numbers,
    numeric_reward,
    reward_fault,
)
from trajectories import RewardBreakdown

__all__ = ["DEFAULT_PATH", "REWARDS", "DatasetEnv", "DatasetError", "RewardFaultWarning",
           "RewardReturnError", "check_arguments", "choice_reward", "contains_reward",
           "exact_reward", "from_dataset", "normalize", "numeric_reward", "read_choice",
           "regex_reward", "reward_source"]

DEFAULT_PATH = Path(__file__).with_name("data") / "qa_sample.jsonl"
META_FIELDS = ("skills", "structure", "entity_group", "length", "difficulty")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAX_DEPTH = 100  # JSON nesting levels a row may have


class DatasetError(ValueError):
    """A dataset that cannot become tasks: the message names the file, row and column, or
    the keyword argument (``key``) that is wrong."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class RewardReturnError(TypeError):
    """A user reward function returned something that is not a score: a bug in the function,
    raised (never scored), the message naming the function and the value."""


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


def _nonblank(reply: str) -> bool:
    return bool(reply.strip())


_ANSWER = "Answer the question. Reply with the final answer only, nothing else."
REWARDS = ("exact", "numeric", "regex", "choice", "contains")


def built_in(kind: str, tolerance: float = 0.0) -> Verifier:
    """The verifier of a built-in reward kind (one of ``REWARDS``)."""
    if kind == "exact":
        return Verifier(kind, _answer_text, lambda r, t: exact_reward(r, t.target), _nonblank,
                        str, _ANSWER)
    if kind == "numeric":
        return Verifier(kind, _numeric_target,
                        lambda r, t: numeric_reward(r, t.target, tolerance),
                        lambda r: bool(numbers(r)), str,
                        "Solve the problem. End your reply with the final number.")
    if kind == "regex":
        return Verifier(kind, _regex_target, lambda r, t: regex_reward(r, t.target), _nonblank,
                        lambda target: None, _ANSWER)
    if kind == "choice":
        return Verifier(kind, _choice_target, lambda r, t: choice_reward(r, t.target),
                        lambda r: read_choice(r) is not None, str,
                        "Answer the multiple-choice question. Reply with the letter of the "
                        "correct option only.")
    if kind == "contains":
        return Verifier(kind, _answer_text, lambda r, t: contains_reward(r, t.target),
                        _nonblank, str, _ANSWER)
    raise DatasetError(f"reward {kind!r} is not one of {list(REWARDS)}, nor a "
                       "'module:function' path to your own function", key="reward")


def _split_spec(spec: str) -> tuple[str, str]:
    """``(where, function)`` of a user reward ``module:function`` or ``file.py:function``."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise DatasetError(f"reward {spec!r}: a user reward is 'module:function' or "
                           "'path/to/file.py:function'", key="reward")
    return where, name


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def load_reward_function(spec: str) -> Callable[[str, TaskSpec], Any]:
    """The user function ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    where, name = _split_spec(spec)
    if _is_file(where):
        file = Path(where).resolve()
        if not file.is_file():
            raise ImportError(f"reward {spec!r}: no file {file} (relative paths are read from "
                              f"the working directory {Path.cwd()})")
        module_name = "agent_rl_reward_" + hashlib.sha256(str(file).encode()).hexdigest()[:16]
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:
                raise ImportError(f"reward {spec!r}: importing {file} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ImportError(
                f"reward {spec!r}: cannot import module {where!r} ({type(exc).__name__}: {exc}); "
                f"install it, put its folder on PYTHONPATH, or name the file: "
                f"'path/to/{where.rsplit('.', 1)[-1]}.py:{name}'") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise ImportError(f"reward {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise DatasetError(f"reward {spec!r}: {where}.{name} is {type(fn).__name__}, not a function")
    return fn


def user_components(spec: str, value: Any, weights: Mapping[str, float]) -> dict[str, float]:
    """A user function's return value as reward components; ``RewardReturnError`` naming
    ``spec`` and the value for anything but a finite number (not a bool) or a dict of them
    holding every weighted key."""
    def number(v: Any, what: str) -> float:
        if isinstance(v, bool):
            raise RewardReturnError(f"reward function {spec} returned {what}{v!r} (bool); a "
                                    "score is a float: return float(...) or 1.0 / 0.0")
        if not isinstance(v, _numbers.Real) or not math.isfinite(float(v)):
            raise RewardReturnError(f"reward function {spec} returned {what}{v!r:.80} "
                                    f"({type(v).__name__}); it must return a finite float or a "
                                    "dict of them")
        return float(v)

    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RewardReturnError(f"reward function {spec} returned a dict key {k!r}; "
                                        "keys are component names (str)")
            out[k] = number(v, f"component {k!r} = ")
        missing = sorted(set(weights) - set(out))
        if missing:
            raise RewardReturnError(
                f"reward function {spec} returned components {sorted(out)} without the "
                f"weighted {missing}; return them, or pass weights naming your components, "
                f"e.g. weights={dict.fromkeys(sorted(out), 1.0)}")
        return out
    if set(weights) != {"accuracy"}:
        raise RewardReturnError(f"reward function {spec} returned a float, but weights name "
                                f"{sorted(weights)}: return a dict with those keys")
    return {"accuracy": number(value, "")}


def reply_components(reward: str, tolerance: float, weights: tuple[tuple[str, float], ...],
                     reply: str, task: TaskSpec) -> dict[str, float]:
    """The reward components of ``reply`` on ``task`` under reward ``reward`` (a built-in
    kind, or a user function's spec with an absolute file path): what ``DatasetEnv.score``
    runs in a deadline worker (``envs.deadline``)."""
    if ":" in reward:
        return user_components(reward, load_reward_function(reward)(reply, task), dict(weights))
    return {"accuracy": built_in(reward, tolerance).score(reply, task)}


def reward_source(spec: str) -> Path:
    """The source file that defines the user reward ``spec`` (``path/to/file.py:function``:
    that file; ``module:function``: the module's file), found without running the function;
    ``ImportError`` when there is none."""
    where, _ = _split_spec(spec)
    if _is_file(where):
        return Path(where).resolve()
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"reward {spec!r}: cannot find module {where!r} ({exc})") from None
    if found is None:
        raise ImportError(f"reward {spec!r}: no module {where!r}; install it, put its folder "
                          "on PYTHONPATH, or name the file: 'path/to/file.py:function'")
    if not found.origin or not Path(found.origin).is_file():
        raise ImportError(f"reward {spec!r}: module {where!r} has no source file to pin "
                          f"({found.origin}); name a .py file instead")
    return Path(found.origin)


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def _fail(path: Path, where: str, message: str) -> DatasetError:
    return DatasetError(f"{path}: {where}: {message}")


class _LongInteger(ValueError):
    """A JSON integer longer than Python converts (``sys.get_int_max_str_digits``)."""


def _json_int(digits: str) -> int:
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # 0: no limit (before 3.10.7)
    if limit and len(digits.lstrip("-")) > limit:
        raise _LongInteger(f"holds an integer of {len(digits.lstrip('-'))} digits (Python reads "
                           f"at most {limit}); write it as a string: \"{digits[:12]}...\"")
    return int(digits)


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"row {len(rows) + 1} (line {line_no})"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _fail(path, where, f"byte {exc.start + 1} of the line (0x{raw[exc.start]:02x}) "
                                         "is not UTF-8; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_int=_json_int)
            except json.JSONDecodeError as exc:
                raise _fail(path, where, f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                         "each line must be one JSON object") from None
            except _LongInteger as exc:
                raise _fail(path, where, str(exc)) from None
            except RecursionError:
                raise _fail(path, where, f"nested deeper than JSON can be read here; a row "
                                         f"nests at most {MAX_DEPTH} levels") from None
            if not isinstance(record, dict):
                raise _fail(path, where, f"a JSON {type(record).__name__}, not an object "
                                         '({"prompt": ..., "answer": ...})')
            if _depth(record) > MAX_DEPTH:
                raise _fail(path, where, f"nested {_depth(record)} levels deep; a row nests at "
                                         f"most {MAX_DEPTH} levels")
            rows.append((where, record))
    return rows


def _undecodable(text: str) -> int | None:
    """The index of the first byte that was not UTF-8 (decoded with ``surrogateescape``)."""
    return next((i for i, c in enumerate(text) if "\udc80" <= c <= "\udcff"), None)


def _read_csv(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    limit = csv.field_size_limit()
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        where = "row 1 (line 2)"
        try:
            header = reader.fieldnames
            if not header:
                raise DatasetError(f"{path}: no header row; the first line must name the "
                                   "columns (e.g. prompt,answer)")
            for name in header:
                if (at := _undecodable(name)) is not None:
                    raise DatasetError(f"{path}: line 1 (the header): column name {name!r:.60} "
                                       f"holds byte 0x{ord(name[at]) - 0xdc00:02x}, not UTF-8; "
                                       "save the file as UTF-8")
            repeated = sorted({c for c in header if header.count(c) > 1})
            if repeated:
                raise DatasetError(f"{path}: the header repeats column(s) {repeated}")
            for record in reader:
                where = f"row {len(rows) + 1} (line {reader.line_num})"
                rows.append((where, _csv_record(path, where, record, header)))
                where = f"row {len(rows) + 1} (line {reader.line_num + 1})"
        except csv.Error as exc:
            raise _fail(path, where, f"not readable as CSV ({exc}); a .csv cell holds at most "
                                     f"{limit} characters: put longer ones in a .jsonl file"
                        ) from None
    return rows


def _csv_record(path: Path, where: str, record: dict, header: list[str]) -> dict[str, Any]:
    if None in record:
        raise _fail(path, where, f"{len(record[None])} more cell(s) than the header's "
                                 f"{len(header)} columns")
    short = [c for c, v in record.items() if v is None]
    if short:
        raise _fail(path, where, f"fewer cells than the header's {len(header)} columns "
                                 f"(no {short})")
    for column, cell in record.items():
        if (at := _undecodable(cell)) is not None:
            raise _fail(path, where, f"column {column!r} holds byte "
                                     f"0x{ord(cell[at]) - 0xdc00:02x} at character {at + 1}, "
                                     "not UTF-8; save the file as UTF-8")
    return record


def _read_folder(path: Path, dataset_split: str | None) -> list[tuple[str, dict[str, Any]]]:
    if not any((path / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
        raise DatasetError(f"{path}: a folder, but not one written by datasets' save_to_disk "
                           "(no state.json or dataset_dict.json); pass a .jsonl or .csv file "
                           "or a saved datasets folder")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"{path} is a Hugging Face datasets folder, but the `datasets` package is not "
            "installed: `pip install datasets`, or export the rows once where it is installed "
            "(`datasets.load_from_disk(folder).to_json('tasks.jsonl')`) and pass that file"
        ) from exc
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        pick = dataset_split or (names[0] if len(names) == 1 else "train")
        if pick not in loaded:
            raise DatasetError(f"{path}: a DatasetDict with splits {names}; choose one with "
                               "dataset_split=...")
        loaded = loaded[pick]
    elif dataset_split is not None:
        raise DatasetError(f"{path}: one Dataset, not a DatasetDict: drop dataset_split")
    return [(f"row {i} (index {i - 1})", dict(record)) for i, record in enumerate(loaded, 1)]


def _read(path: Path, dataset_split: str | None) -> list[tuple[str, dict[str, Any]]]:
    if path.is_dir():
        rows = _read_folder(path, dataset_split)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        rows = _read_jsonl(path)
    elif path.suffix.lower() == ".csv":
        rows = _read_csv(path)
    else:
        raise DatasetError(f"{path}: unknown format {path.suffix or '(no suffix)'!r}; use a "
                           ".jsonl file (one JSON object per line), a .csv file with a header "
                           "row, or a folder saved with datasets' save_to_disk")
    if dataset_split is not None and not path.is_dir():
        raise DatasetError(f"{path}: dataset_split applies to a datasets folder, not a file")
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def _fingerprint(path: Path) -> tuple:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        digest.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Rows -> tasks
# ---------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"is {type(value).__name__} {value!r:.60}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (not valid Unicode)") from None
    if not value.strip():
        raise ValueError("is empty")
    return value


def _integer(value: Any, low: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"is {value!r:.60}, not an integer >= {low}")
    return value


def _skills(value: Any) -> list[str]:
    parts = (re.split(r"[,>]", value) if isinstance(value, str)
             else value if isinstance(value, list) else None)
    if parts is None or not all(isinstance(p, str) for p in parts):
        raise ValueError(f"is {value!r:.60}; skills are a list of strings or one string "
                         "split at ',' or '>'")
    skills = [p.strip() for p in parts if p.strip()]
    if not skills:
        raise ValueError("is empty")
    return skills


_META_READERS: dict[str, Callable[[Any], Any]] = {
    "skills": _skills, "structure": lambda v: _text(v).strip(),
    "entity_group": lambda v: _text(str(v)).strip(),
    "length": partial(_integer, low=1), "difficulty": partial(_integer, low=0)}


def _cell(path: Path, where: str, record: dict[str, Any], column: str,
          read: Callable[[Any], Any], role: str) -> Any:
    """``read(record[column])``; a missing or null cell, or a ``ValueError``, names the row."""
    if record.get(column) is None:
        state = "null" if column in record else "missing"
        raise _fail(path, where, f"column {column!r} ({role}) is {state}; the row has columns "
                                 f"{sorted(map(str, record))}")
    try:
        return read(record[column])
    except ValueError as exc:
        raise _fail(path, where, f"column {column!r} ({role}) {exc}") from None


@lru_cache(maxsize=16)
def _load_tasks(path: Path, fingerprint: tuple, prompt: str, answer: str, kind: str,
                meta: tuple[tuple[str, str], ...] | None, task_id: str | None,
                solution: str | None, dataset_split: str | None) -> tuple[tuple[TaskSpec, ...], str]:
    """Every row as a task, and the data's sha256. ``kind``: a built-in reward or ``custom``;
    ``fingerprint`` (the files' mtimes and sizes) makes an edited file be read again."""
    rows = _read(path, dataset_split)
    verifier = built_in(kind) if kind != "custom" else None
    prepare = verifier.prepare if verifier else _jsonable
    mapping = (dict(meta) if meta is not None else
               {f: f for f in META_FIELDS if any(f in record for _, record in rows)})
    seen: dict[str, str] = {}
    tasks = []
    for number, (where, record) in enumerate(rows, 1):
        cell = partial(_cell, path, where, record)
        text = cell(prompt, _text, "prompt")
        target = cell(answer, prepare, "answer")
        fields = {field: cell(column, _META_READERS.get(field, _jsonable), f"meta {field}")
                  for field, column in mapping.items()}
        if "skills" in fields and "structure" not in fields:
            fields["structure"] = ">".join(fields["skills"])
        if "structure" in fields and "skills" not in fields:
            fields["skills"] = [s for s in fields["structure"].split(">") if s]
        tid = (cell(task_id, lambda v: _text(str(v)).strip(), "task id") if task_id
               else f"{path.stem}-{number}")
        if tid in seen:
            raise _fail(path, where, f"task id {tid!r} repeats {seen[tid]} (column {task_id!r})")
        seen[tid] = where
        if solution:
            reference = cell(solution, _text, "solution")
        elif verifier:
            reference = verifier.solve(target)
        else:  # a user function: the answer cell is the best guess at a correct reply
            reference = target if isinstance(target, str) else json.dumps(target)
        tasks.append(TaskSpec(task_id=tid, prompt=text, meta=TaskMeta(**fields), target=target,
                              data={"row": number, "record": _jsonable(record),
                                    "reference": reference}))
    return tuple(tasks), _sha256(path)


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


class DatasetEnv(ToolEnv):
    env_id = "agent_rl/Dataset-v0"
    version = 0
    reward_weights = {"accuracy": 1.0}

    def __init__(
        self,
        path: str | os.PathLike = DEFAULT_PATH,
        prompt: str = "prompt",
        answer: str = "answer",
        reward: str = "exact",
        meta: Mapping[str, str] | None = None,
        system: str | None = None,
        tolerance: float = 0.0,
        weights: Mapping[str, float] | None = None,
        task_id: str | None = None,
        solution: str | None = None,
        dataset_split: str | None = None,
        reward_timeout_s: float = REWARD_TIMEOUT_S,
        **kwargs: Any,
    ):
        """Keywords: module docstring. ``kwargs`` go to ``ToolEnv`` (``max_turns``, ...)."""
        super().__init__(**kwargs)
        check_arguments(prompt=prompt, answer=answer, reward=reward, meta=meta,
                        tolerance=tolerance, weights=weights, task_id=task_id,
                        solution=solution, reward_timeout_s=reward_timeout_s)
        custom = ":" in reward
        self.reward_weights = _weights(weights, None if custom else reward)
        self.reward_timeout_s = float(reward_timeout_s)
        self.verifier = (Verifier(reward, _jsonable, load_reward_function(reward), _nonblank,
                                  lambda target: None, _ANSWER)
                         if custom else built_in(reward, tolerance))
        # what a deadline worker computes: picklable, a file path made absolute
        spec = f"{reward_source(reward)}:{_split_spec(reward)[1]}" if custom else reward
        self._components = partial(reply_components, spec, float(tolerance),
                                   tuple(self.reward_weights.items()))
        self.path = Path(path)
        if not self.path.exists():
            raise DatasetError(f"{self.path}: no such file or folder (relative paths are read "
                               f"from the working directory {Path.cwd()}); pass a .jsonl or "
                               ".csv file or a datasets folder")
        self.tasks, self.data_hash = _load_tasks(
            self.path, _fingerprint(self.path), prompt, answer, "custom" if custom else reward,
            tuple(sorted(meta.items())) if meta is not None else None, task_id, solution,
            dataset_split)
        self.instructions = system if system is not None else self.verifier.instructions
        if custom:
            self._probe(self.tasks[0])

    def _probe(self, task: TaskSpec) -> None:
        """Call the user function once, on the first row's reference reply."""
        reply = task.data["reference"] or ""
        checked = f"on {task.task_id} (reply {reply!r:.60}), checked at construction"
        try:
            deadline.call(self._components, reply, task, timeout_s=self.reward_timeout_s)
        except RewardReturnError as exc:
            raise DatasetError(f"{exc} ({checked})") from None
        except deadline.DeadlineExceeded:
            raise DatasetError(f"reward function {self.verifier.name} returned nothing within "
                               f"reward_timeout_s={self.reward_timeout_s:g} s {checked}; make "
                               "it faster or raise reward_timeout_s", key="reward_timeout_s"
                               ) from None
        except Exception as exc:
            raise DatasetError(f"reward function {self.verifier.name} raised "
                               f"{type(exc).__name__}: {exc} {checked}") from exc

    # --- hooks ---------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        order = np.random.default_rng(seed).permutation(len(self.tasks))[:n]
        return [self.tasks[i] for i in order]

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        """The reward of ``answer``, computed in a deadline worker within ``reward_timeout_s``;
        a reward that raises, runs past it or kills its worker is a ``sandbox_error`` (warned,
        the reason in ``audit["reward_error"]``); a user function returning a non-score raises
        ``RewardReturnError``."""
        verifier_id = f"{self.env_id}@{self.version}/{self.verifier.name}"
        try:
            components = deadline.call(self._components, answer, task,
                                       timeout_s=self.reward_timeout_s)
        except RewardReturnError:
            raise
        except Exception as exc:  # the verifier's fault, not the agent's: masked, counted
            return reward_fault(self.env_id, task.task_id, self.verifier.name,
                                fault_reason(exc, self.reward_timeout_s), self.reward_weights,
                                verifier_id)
        total = sum(self.reward_weights.get(k, 0.0) * v for k, v in components.items())
        best = sum(w for w in self.reward_weights.values() if w > 0)
        return answer_breakdown(components, self.reward_weights, verifier_id,
                                correct=total >= best - 1e-9,
                                answered=self.verifier.answered(answer))

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.data["reference"]


def check_arguments(prompt: Any = "prompt", answer: Any = "answer", reward: Any = "exact",
                    meta: Any = None, tolerance: Any = 0.0, weights: Any = None,
                    task_id: Any = None, solution: Any = None,
                    reward_timeout_s: Any = REWARD_TIMEOUT_S, **_: Any) -> None:
    """The keyword arguments of ``DatasetEnv`` that need no file, checked without reading
    one: a ``DatasetError`` naming the argument (``key``). An experiment contract calls it on
    ``env.kwargs`` before any work."""
    for name, value in (("prompt", prompt), ("answer", answer), ("task_id", task_id),
                        ("solution", solution)):
        if value is not None and (not isinstance(value, str) or not value):
            raise DatasetError(f"{name} must name a column (a non-empty string), got {value!r}",
                               key=name)
    if meta is not None and (not isinstance(meta, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in meta.items())):
        raise DatasetError(f"meta maps TaskMeta fields to column names, e.g. "
                           f"{{'entity_group': 'topic'}}; got {meta!r}", key="meta")
    if not _finite(tolerance) or tolerance < 0:
        raise DatasetError(f"tolerance must be a finite number >= 0, got {tolerance!r}",
                           key="tolerance")
    try:
        check_reward_timeout(reward_timeout_s)
    except ValueError as exc:
        raise DatasetError(str(exc), key="reward_timeout_s") from None
    if not isinstance(reward, str):
        raise DatasetError(f"reward must be a string, got {reward!r}", key="reward")
    if ":" in reward:
        _split_spec(reward)
    else:
        built_in(reward)
    _weights(weights, None if ":" in reward else reward)


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _weights(weights: Mapping[str, float] | None, kind: str | None) -> dict[str, float]:
    """The reward weights (``kind``: the built-in reward, None for a user function): finite,
    none negative, some positive (else every reply would score the best total)."""
    if weights is None:
        return {"accuracy": 1.0}
    if not isinstance(weights, Mapping) or not weights or not all(
            isinstance(k, str) and _finite(v) for k, v in weights.items()):
        raise DatasetError(f"weights must map component names to finite numbers, got "
                           f"{weights!r}", key="weights")
    if kind is not None and set(weights) != {"accuracy"}:
        raise DatasetError(f"reward {kind!r} has the one component 'accuracy'; weights "
                           f"{sorted(weights)} name others (they are for a user function)",
                           key="weights")
    negative = sorted(k for k, v in weights.items() if v < 0)
    if negative:
        raise DatasetError(f"weights {negative} are negative ({weights!r}); a weight is >= 0 "
                           "(a penalty is a component your function makes negative)",
                           key="weights")
    if not any(v > 0 for v in weights.values()):
        raise DatasetError(f"weights {weights!r} are all zero: every reply would score the best "
                           "total (outcome correct); give a weight > 0", key="weights")
    return {k: float(v) for k, v in weights.items()}


def from_dataset(path: str | os.PathLike, prompt: str = "prompt", answer: str = "answer",
                 reward: str = "exact", meta: Mapping[str, str] | None = None,
                 system: str | None = None, **kw: Any) -> DatasetEnv:
    """Tasks from a JSONL/CSV file or a ``datasets`` folder as a ``ToolEnv`` (the same
    keywords as ``envs.make("agent_rl/Dataset-v0", ...)``: ``tolerance``, ``weights``,
    ``task_id``, ``solution``, ``dataset_split``, ``reward_timeout_s`` and ``ToolEnv``'s;
    module docstring)."""
    return DatasetEnv(path, prompt=prompt, answer=answer, reward=reward, meta=meta,
                      system=system, **kw)
