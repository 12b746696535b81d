"""Reading the rows of a dataset: a JSONL file, a CSV file or a ``datasets`` folder, as
``(where, record)`` pairs, ``where`` naming the row (1-based) and its line or index. A row
that cannot be read is a ``DatasetError`` naming the file, the row and the line. Also the
files' fingerprint (paths, mtimes, sizes: the cache key) and their sha256 (``data_hash``)."""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from envs.datasets.errors import DatasetError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAX_DEPTH = 100  # JSON nesting levels a row may have


def row_error(path: Path, where: str, message: str) -> DatasetError:
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
                raise row_error(path, where, f"byte {exc.start + 1} of the line "
                                             f"(0x{raw[exc.start]:02x}) is not UTF-8; save the "
                                             "file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_int=_json_int)
            except json.JSONDecodeError as exc:
                raise row_error(path, where, f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                             "each line must be one JSON object") from None
            except _LongInteger as exc:
                raise row_error(path, where, str(exc)) from None
            except RecursionError:
                raise row_error(path, where, f"nested deeper than JSON can be read here; a row "
                                             f"nests at most {MAX_DEPTH} levels") from None
            if not isinstance(record, dict):
                raise row_error(path, where, f"a JSON {type(record).__name__}, not an object "
                                             '({"prompt": ..., "answer": ...})')
            if _depth(record) > MAX_DEPTH:
                raise row_error(path, where, f"nested {_depth(record)} levels deep; a row nests at "
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
            raise row_error(path, where, f"not readable as CSV ({exc}); a .csv cell holds at most "
                                         f"{limit} characters: put longer ones in a .jsonl file"
                            ) from None
    return rows


def _csv_record(path: Path, where: str, record: dict, header: list[str]) -> dict[str, Any]:
    if None in record:
        raise row_error(path, where, f"{len(record[None])} more cell(s) than the header's "
                                     f"{len(header)} columns")
    short = [c for c, v in record.items() if v is None]
    if short:
        raise row_error(path, where, f"fewer cells than the header's {len(header)} columns "
                                     f"(no {short})")
    for column, cell in record.items():
        if (at := _undecodable(cell)) is not None:
            raise row_error(path, where, f"column {column!r} holds byte "
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


def read_rows(path: Path, dataset_split: str | None) -> list[tuple[str, dict[str, Any]]]:
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


def fingerprint(path: Path) -> tuple:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def data_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        digest.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
