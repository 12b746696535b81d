"""Rows -> tasks: each row of a dataset as a ``TaskSpec`` (prompt, target, metadata, id,
reference reply), every cell checked, a bad one a ``DatasetError`` naming the file, the row
and the column (rules: ``envs.datasets.env``)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from envs.core import TaskMeta, TaskSpec
from envs.datasets.files import data_sha256, read_rows, row_error
from envs.datasets.rewards import built_in

META_FIELDS = ("skills", "structure", "entity_group", "length", "difficulty")

def jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
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
        raise row_error(path, where, f"column {column!r} ({role}) is {state}; the row has columns "
                                     f"{sorted(map(str, record))}")
    try:
        return read(record[column])
    except ValueError as exc:
        raise row_error(path, where, f"column {column!r} ({role}) {exc}") from None


@lru_cache(maxsize=16)
def load_tasks(path: Path, fingerprint: tuple, prompt: str, answer: str, kind: str,
               meta: tuple[tuple[str, str], ...] | None, task_id: str | None,
               solution: str | None, dataset_split: str | None) -> tuple[tuple[TaskSpec, ...], str]:
    """Every row as a task, and the data's sha256. ``kind``: a built-in reward or ``custom``;
    ``fingerprint`` (the files' mtimes and sizes) makes an edited file be read again."""
    rows = read_rows(path, dataset_split)
    verifier = built_in(kind) if kind != "custom" else None
    prepare = verifier.prepare if verifier else jsonable
    mapping = (dict(meta) if meta is not None else
               {f: f for f in META_FIELDS if any(f in record for _, record in rows)})
    seen: dict[str, str] = {}
    tasks = []
    for number, (where, record) in enumerate(rows, 1):
        cell = partial(_cell, path, where, record)
        text = cell(prompt, _text, "prompt")
        target = cell(answer, prepare, "answer")
        fields = {field: cell(column, _META_READERS.get(field, jsonable), f"meta {field}")
                  for field, column in mapping.items()}
        if "skills" in fields and "structure" not in fields:
            fields["structure"] = ">".join(fields["skills"])
        if "structure" in fields and "skills" not in fields:
            fields["skills"] = [s for s in fields["structure"].split(">") if s]
        tid = (cell(task_id, lambda v: _text(str(v)).strip(), "task id") if task_id
               else f"{path.stem}-{number}")
        if tid in seen:
            raise row_error(path, where,
                            f"task id {tid!r} repeats {seen[tid]} (column {task_id!r})")
        seen[tid] = where
        if solution:
            reference = cell(solution, _text, "solution")
        elif verifier:
            reference = verifier.solve(target)
        else:  # a user function: the answer cell is the best guess at a correct reply
            reference = target if isinstance(target, str) else json.dumps(target)
        tasks.append(TaskSpec(task_id=tid, prompt=text, meta=TaskMeta(**fields), target=target,
                              data={"row": number, "record": jsonable(record),
                                    "reference": reference}))
    return tuple(tasks), data_sha256(path)
