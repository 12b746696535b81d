"""RolloutStore: an append-only, hash-checked file of episodes (one JSON object per line).

Plain ``.jsonl`` or zstd-compressed (``.jsonl.zst``: every ``append`` call writes one
independent zstd frame, so earlier frames are never rewritten).

Crash safety. A process killed mid-write leaves a *torn tail*: a last line without its newline
(plain) or an unfinished frame (zstd). Readers ignore it and report it (``store.torn_tail``).
The next ``append`` moves those bytes, unchanged, to ``<path>.torn`` and cuts the file back to
its last complete record, so the torn bytes are never merged with new data and never lost.
Nothing already complete is ever rewritten. An undecodable zstd frame with frames after it is
corruption, not a torn tail: reading raises StoreError, ``verify`` reports it, ``append`` refuses.

Cursor. ``cursor`` is the number of complete records; ``read(cursor=k)`` skips the first k.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from trajectories.models import Episode

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class StoreError(ValueError):
    """A record in a rollout store cannot be read (``record``: its 1-based number, ``reason``: why)."""

    def __init__(self, message: str, record: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.record = record
        self.reason = reason or message


@dataclass
class VerifyReport:
    path: str
    records: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)  # (1-based record number, why)
    torn_tail_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def __str__(self) -> str:
        lines = [f"{self.path}: {self.records} records, {len(self.errors)} bad"]
        lines += [f"  record {n}: {why}" for n, why in self.errors]
        if self.torn_tail_bytes:
            lines.append(f"  torn tail: {self.torn_tail_bytes} bytes after the last complete record")
        return "\n".join(lines)


class RolloutStore:
    def __init__(self, path: str | os.PathLike, compress: bool | None = None, fsync: bool = True):
        self.path = Path(path)
        self.compress = self.path.suffix == ".zst" if compress is None else compress
        self.fsync = fsync
        # ((size, mtime), record count) right after this object's last append: while the file
        # is untouched since, the next append need not re-scan it for its cursor and torn tail.
        self._after_last_append: tuple[tuple[int, int], int] | None = None

    # --- reading ------------------------------------------------------------------------
    def _chunks(self) -> tuple[list[bytes], int, int]:
        """(complete record lines, byte offset where complete data ends, torn tail bytes)."""
        if not self.path.exists():
            return [], 0, 0
        data = self.path.read_bytes()
        if not self.compress:
            end = data.rfind(b"\n") + 1
            lines = data[:end].split(b"\n")[:-1] if end else []
            return lines, end, len(data) - end
        lines: list[bytes] = []
        offset = 0
        while offset < len(data):
            decomp = zstandard.ZstdDecompressor().decompressobj()
            try:
                text = decomp.decompress(data[offset:])
            except zstandard.ZstdError as exc:
                # A truncated frame never raises (it just lacks eof). An unreadable frame with
                # no frame after it is a garbage tail (e.g. zero-filled after a crash): torn.
                # With frames after it, it is corruption: never quarantine good frames with it.
                if data.find(_ZSTD_MAGIC, offset + 1) == -1:
                    break
                number = len(lines) + 1
                reason = f"zstd frame at byte {offset} is corrupt: {exc}"
                raise StoreError(f"{self.path}: record {number} onward: {reason}", number,
                                 reason) from exc
            if not decomp.eof:
                break
            lines += text.split(b"\n")[:-1]
            offset = len(data) - len(decomp.unused_data)
        return lines, offset, len(data) - offset

    @property
    def torn_tail(self) -> int:
        """Bytes after the last complete record (0 when the file ends cleanly)."""
        return self._chunks()[2]

    @property
    def cursor(self) -> int:
        return len(self._chunks()[0])

    def read(self, cursor: int = 0) -> Iterator[Episode]:
        """Episodes from record ``cursor`` on. A corrupt record raises StoreError with its number."""
        lines, _, torn = self._chunks()
        if torn:
            warnings.warn(
                f"{self.path}: ignoring a torn tail of {torn} bytes (an interrupted write)",
                stacklevel=2,
            )
        for number, line in enumerate(lines[cursor:], start=cursor + 1):
            yield self._parse(line, number)

    def _parse(self, line: bytes, number: int) -> Episode:
        try:
            return Episode.model_validate(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            reason = f"not valid JSON: {exc}"
            raise StoreError(f"{self.path}: record {number} is {reason}", number, reason) from exc
        except ValueError as exc:
            reason = f"not a valid episode: {exc}"
            raise StoreError(f"{self.path}: record {number} is {reason}", number, reason) from exc

    def verify(self) -> VerifyReport:
        """Re-read every record and recompute its content hash."""
        try:
            lines, _, torn = self._chunks()
        except StoreError as exc:
            return VerifyReport(str(self.path), errors=[(exc.record, exc.reason)])
        report = VerifyReport(str(self.path), records=len(lines), torn_tail_bytes=torn)
        for number, line in enumerate(lines, start=1):
            try:
                episode = self._parse(line, number)
            except StoreError as exc:
                report.errors.append((number, exc.reason))
                continue
            if not episode.hash_ok():
                report.errors.append(
                    (number, f"content_hash mismatch for episode {episode.episode_id}")
                )
        return report

    # --- writing ------------------------------------------------------------------------
    def append(self, episodes: Iterable[Episode]) -> int:
        """Append episodes; returns the new cursor. Refuses an episode whose hash is wrong."""
        episodes = list(episodes)
        for episode in episodes:
            if not episode.hash_ok():
                raise StoreError(f"episode {episode.episode_id}: content_hash does not match its content")
        if not episodes:
            return self.cursor
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._after_last_append is not None and self._after_last_append[0] == self._stamp():
            count = self._after_last_append[1]
        else:
            lines, end, torn = self._chunks()
            if torn:
                self._quarantine_tail(end)
            count = len(lines)
        payload = "".join(e.to_json() + "\n" for e in episodes).encode("utf-8")
        if self.compress:
            payload = zstandard.ZstdCompressor(level=3).compress(payload)
        with open(self.path, "ab") as fh:
            fh.write(payload)
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        self._after_last_append = (self._stamp(), count + len(episodes))
        return count + len(episodes)

    def _stamp(self) -> tuple[int, int]:
        stat = self.path.stat()
        return stat.st_size, stat.st_mtime_ns

    def _quarantine_tail(self, end: int) -> None:
        quarantine = self.path.with_name(self.path.name + ".torn")
        with open(self.path, "rb+") as fh:
            fh.seek(end)
            tail = fh.read()
            with open(quarantine, "ab") as q:
                q.write(tail)
                q.flush()
                os.fsync(q.fileno())
            fh.truncate(end)
        warnings.warn(
            f"{self.path}: moved a torn tail of {len(tail)} bytes to {quarantine} before appending",
            stacklevel=3,
        )
