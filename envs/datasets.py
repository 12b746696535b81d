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
    ``choice``: not one letter; ``regex``: an invalid pattern), bad metadata, a repeated id.
    No row is dropped silently.

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
    * ``numeric``: the *last* number in the reply (read as ``envs.arithmetic.numbers`` reads
      them: an optional minus, digits, commas only between groups of three, an optional decimal
      part; ``12.0`` is 12, ``1,000`` is 1000) is within ``tolerance`` of the answer:
      ``|said - answer| <= tolerance * max(1, |answer|)``, i.e. absolute below 1 and relative
      above (default ``tolerance=0``: equal as numbers). The answer cell is a JSON number or a
      string holding exactly one such number.
    * ``regex``: the answer cell is a Python ``re`` pattern (compiled at construction), and
      ``re.search(pattern, reply)`` finds it (anchor with ``^...$`` for a whole-reply match;
      ``(?i)`` for case-insensitive). Patterns are trusted input, applied to the whole reply.
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
      reply, so a wrong return type fails before training. Later, a function that raises or
      returns something else scores the episode as an infrastructure fault
      (``sandbox_error``: masked out of the loss, counted by the ``max_verifier_error_rate``
      guard), its message in ``reward.audit["reward_error"]``.

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
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from envs.arithmetic import numbers
from envs.core import TaskMeta, TaskSpec, ToolEnv
from trajectories import Outcome, RewardBreakdown

__all__ = ["DEFAULT_PATH", "REWARDS", "DatasetEnv", "DatasetError", "choice_reward",
           "contains_reward", "exact_reward", "from_dataset", "normalize", "numeric_reward",
           "read_choice", "regex_reward"]

DEFAULT_PATH = Path(__file__).with_name("data") / "qa_sample.jsonl"
META_FIELDS = ("skills", "structure", "entity_group", "length", "difficulty")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class DatasetError(ValueError):
    """A dataset that cannot become tasks: the message names the file, row and column."""


# ---------------------------------------------------------------------------------------------
# Rewards: small pure functions of (reply, target), also usable by evaluation
# ---------------------------------------------------------------------------------------------

_LETTER = re.compile(r"\s*[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?\s*")
_SAID = re.compile(r"(?i:\b(?:answer|option|choice))\s*(?i:is\b)?\s*:?\s*[(\[]?([A-Z])(?![A-Za-z0-9])")
_LEADING = re.compile(r"\s*([A-Z])[.):](?:\s|$)")
_BRACKETED = re.compile(r"[(\[]([A-Za-z])[)\]]")
_NUMBER_CELL = re.compile(r"\s*-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?\s*")
_WIDE = Context(prec=60, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[])  # replies may hold 1e6 digits


def normalize(text: str) -> str:
    """NFKC, case-folded, trimmed, whitespace runs made one space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exact_reward(reply: str, answer: str) -> float:
    return float(normalize(reply) == normalize(answer))


def contains_reward(reply: str, answer: str) -> float:
    return float(normalize(answer) in normalize(reply))


def numeric_reward(reply: str, answer: str | Decimal, tolerance: float = 0.0) -> float:
    """1.0 when the last number in ``reply`` is within ``tolerance * max(1, |answer|)``."""
    said = numbers(reply)
    if not said:
        return 0.0
    target = Decimal(answer)
    if not tolerance:
        return float(said[-1] == target)
    bound = _WIDE.multiply(Decimal(repr(float(tolerance))), max(Decimal(1), abs(target)))
    return float(_WIDE.abs(_WIDE.subtract(said[-1], target)) <= bound)


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
                       "'module:function' path to your own function")


def load_reward_function(spec: str) -> Callable[[str, TaskSpec], Any]:
    """The user function ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise DatasetError(f"reward {spec!r}: a user reward is 'module:function' or "
                           "'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or os.sep in where:
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
    """A user function's return value as reward components; ``TypeError`` naming ``spec``
    for anything but a finite number or a dict of them holding every weighted key."""
    def number(v: Any, what: str) -> float:
        if not isinstance(v, _numbers.Real) or not math.isfinite(float(v)):
            raise TypeError(f"reward function {spec} returned {what}{v!r:.80} "
                            f"({type(v).__name__}); it must return a finite float or a dict "
                            "of them")
        return float(v)

    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"reward function {spec} returned a dict key {k!r}; keys are "
                                "component names (str)")
            out[k] = number(v, f"component {k!r} = ")
        missing = sorted(set(weights) - set(out))
        if missing:
            raise TypeError(f"reward function {spec} returned components {sorted(out)} without "
                            f"the weighted {missing}; return them, or pass weights naming "
                            f"your components, e.g. weights={dict.fromkeys(sorted(out), 1.0)}")
        return out
    if set(weights) != {"accuracy"}:
        raise TypeError(f"reward function {spec} returned a float, but weights name "
                        f"{sorted(weights)}: return a dict with those keys")
    return {"accuracy": number(value, "")}


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def _fail(path: Path, where: str, message: str) -> DatasetError:
    return DatasetError(f"{path}: {where}: {message}")


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"row {len(rows) + 1} (line {line_no})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(path, where, f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                         "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise _fail(path, where, f"a JSON {type(record).__name__}, not an object "
                                         '({"prompt": ..., "answer": ...})')
            rows.append((where, record))
    return rows


def _read_csv(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        if not header:
            raise DatasetError(f"{path}: no header row; the first line must name the columns "
                               "(e.g. prompt,answer)")
        repeated = sorted({c for c in header if header.count(c) > 1})
        if repeated:
            raise DatasetError(f"{path}: the header repeats column(s) {repeated}")
        for record in reader:
            where = f"row {len(rows) + 1} (line {reader.line_num})"
            if None in record:
                raise _fail(path, where, f"{len(record[None])} more cell(s) than the header's "
                                         f"{len(header)} columns")
            short = [c for c, v in record.items() if v is None]
            if short:
                raise _fail(path, where, f"fewer cells than the header's {len(header)} "
                                         f"columns (no {short})")
            rows.append((where, record))
    return rows


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
        **kwargs: Any,
    ):
        """Keywords: module docstring. ``kwargs`` go to ``ToolEnv`` (``max_turns``, ...)."""
        super().__init__(**kwargs)
        for name, value in (("prompt", prompt), ("answer", answer), ("task_id", task_id),
                            ("solution", solution)):
            if value is not None and (not isinstance(value, str) or not value):
                raise DatasetError(f"{name} must name a column (a non-empty string), got {value!r}")
        if meta is not None and (not isinstance(meta, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in meta.items())):
            raise DatasetError(f"meta maps TaskMeta fields to column names, e.g. "
                               f"{{'entity_group': 'topic'}}; got {meta!r}")
        if (not isinstance(tolerance, int | float) or isinstance(tolerance, bool)
                or not math.isfinite(tolerance) or tolerance < 0):
            raise DatasetError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        if not isinstance(reward, str):
            raise DatasetError(f"reward must be a string, got {reward!r}")
        custom = ":" in reward
        self.reward_weights = _weights(weights, None if custom else reward)
        self._reward_fn = load_reward_function(reward) if custom else None
        self.verifier = (Verifier(reward, _jsonable, self._reward_fn, _nonblank,
                                  lambda target: None, _ANSWER)
                         if custom else built_in(reward, tolerance))
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
        try:
            value = self._reward_fn(reply, task)
        except Exception as exc:
            raise DatasetError(f"reward function {self.verifier.name} raised "
                               f"{type(exc).__name__}: {exc} on {task.task_id} (reply "
                               f"{reply!r:.60}), checked at construction") from exc
        try:
            user_components(self.verifier.name, value, self.reward_weights)
        except TypeError as exc:
            raise DatasetError(f"{exc} (on {task.task_id}, checked at construction)") from None

    # --- hooks ---------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        order = np.random.default_rng(seed).permutation(len(self.tasks))[:n]
        return [self.tasks[i] for i in order]

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        verifier_id = f"{self.env_id}@{self.version}/{self.verifier.name}"
        if self._reward_fn is None:
            components = {"accuracy": self.verifier.score(answer, task)}
        else:
            try:
                components = user_components(self.verifier.name, self._reward_fn(answer, task),
                                             self.reward_weights)
            except Exception as exc:  # the verifier's fault, not the agent's: masked, counted
                return RewardBreakdown.from_components(
                    dict.fromkeys(self.reward_weights, 0.0), self.reward_weights,
                    Outcome.sandbox_error, verifier_id,
                    audit={"reward_error": f"{type(exc).__name__}: {exc}"[:2000]})
        total = sum(self.reward_weights.get(k, 0.0) * v for k, v in components.items())
        best = sum(w for w in self.reward_weights.values() if w > 0)
        if total >= best - 1e-9:
            outcome = Outcome.correct
        elif not self.verifier.answered(answer):
            outcome = Outcome.format_error
        else:
            outcome = Outcome.wrong
        return RewardBreakdown.from_components(components, self.reward_weights, outcome,
                                               verifier_id)

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.data["reference"]


def _weights(weights: Mapping[str, float] | None, kind: str | None) -> dict[str, float]:
    """The reward weights (``kind``: the built-in reward, None for a user function)."""
    if weights is None:
        return {"accuracy": 1.0}
    if not isinstance(weights, Mapping) or not weights or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in weights.items()):
        raise DatasetError(f"weights must map component names to finite numbers, got {weights!r}")
    if kind is not None and set(weights) != {"accuracy"}:
        raise DatasetError(f"reward {kind!r} has the one component 'accuracy'; weights "
                           f"{sorted(weights)} name others (they are for a user function)")
    return {k: float(v) for k, v in weights.items()}


def from_dataset(path: str | os.PathLike, prompt: str = "prompt", answer: str = "answer",
                 reward: str = "exact", meta: Mapping[str, str] | None = None,
                 system: str | None = None, **kw: Any) -> DatasetEnv:
    """Tasks from a JSONL/CSV file or a ``datasets`` folder as a ``ToolEnv`` (the same
    keywords as ``envs.make("agent_rl/Dataset-v0", ...)``: ``tolerance``, ``weights``,
    ``task_id``, ``solution``, ``dataset_split`` and ``ToolEnv``'s; module docstring)."""
    return DatasetEnv(path, prompt=prompt, answer=answer, reward=reward, meta=meta,
                      system=system, **kw)
