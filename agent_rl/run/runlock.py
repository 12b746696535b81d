"""One process per run directory: an exclusive lock, held for the run's life.

``hold_run_dir(run_dir)`` opens ``run_dir/run.lock`` (creating the folder and the file: the
first write, so a run directory that cannot be written is refused here, before any model is
loaded) and takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on it. The kernel drops the lock when the
process ends, however it ends (kill -9 included), so a lock is never left held by the dead.
The file holds who took it (pid, host, start time, command): a second process is refused at
once with ``RunDirBusy`` naming the holder; a file left by a process that was killed (no one
holds its lock) is taken over with a warning naming that process.

On release the file is removed (while still locked; a process that opened the old file checks
after locking that it is still the one at that path, and else opens it again), and so is the
folder when this lock created it and nothing else was written there: a run refused before its
first write leaves the disk as it was.

Re-entrant within a process (the CLI holds the lock across its model check and the run; the
run takes it again): a nested hold is a no-op. One writer per run directory: under several
ranks (torchrun) only rank 0 writes it, and only rank 0 holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from agent_rl.run.rundir import LOCK_FILE, RunDirError, nothing_to_resume

_HELD: dict[Path, int] = {}  # run directories this process holds: nesting depth


class RunDirBusy(RunDirError):
    """Another live process holds the run directory's lock."""


@dataclass(frozen=True)
class Holder:
    """Who took a run directory's lock, as its lock file says."""

    pid: int | None
    host: str | None
    started: str | None
    command: str | None

    @classmethod
    def read(cls, text: str) -> Holder:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return cls(None, None, None, None)
        pid = data.get("pid")
        return cls(pid if isinstance(pid, int) else None, *(
            str(data[k]) if data.get(k) is not None else None for k in ("host", "started", "command")))

    def gone(self) -> bool:
        """Is the process that took the lock known to have ended (a pid of this host that
        no longer runs)?"""
        if self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def __str__(self) -> str:
        if self.pid is None:
            return "a process that has not written its pid yet"
        started = f", since {self.started}" if self.started else ""
        command = f": {self.command}" if self.command else ""
        return f"pid {self.pid} on host {self.host or '?'}{started}{command}"


def make_run_dir(run_dir: Path) -> list[Path]:
    """Create ``run_dir`` (and missing folders above it); return those it created, topmost
    first. One that cannot be created (read-only file system, no permission) is a
    ``RunDirError`` naming it and the reason."""
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()][::-1]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(_not_writable(run_dir, exc)) from None
    return missing


@contextlib.contextmanager
def hold_run_dir(run_dir: str | os.PathLike, create: bool = True) -> Iterator[Path]:
    """Hold ``run_dir`` exclusively for the ``with`` block (see the module docstring); yields
    the lock file. ``RunDirBusy`` names the process holding it; ``RunDirError`` a folder that
    cannot be written, or (``create`` False: a run to resume) one that does not exist."""
    run_dir = Path(run_dir)
    if not create and not run_dir.is_dir():
        raise nothing_to_resume(run_dir)
    key = run_dir.resolve()
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield run_dir / LOCK_FILE
        finally:
            _HELD[key] -= 1
        return
    created = make_run_dir(run_dir)
    try:
        fd = _lock(run_dir / LOCK_FILE)
    except BaseException:
        _remove_empty(created)
        raise
    _HELD[key] = 1
    try:
        yield run_dir / LOCK_FILE
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.unlink(run_dir / LOCK_FILE)
        os.close(fd)
        _remove_empty(created)


def _lock(path: Path) -> int:
    """An fd of ``path`` holding its exclusive flock, the file rewritten to name this process."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunDirError(_not_writable(path.parent, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.read(_read(fd))
            os.close(fd)
            gone = ("; that process is gone, but one it forked still holds the lock: "
                    f"`fuser -v {path}` names it" if holder.gone() else "")
            raise RunDirBusy(f"run_dir {path.parent} is in use by another agent-rl process "
                             f"({holder}; lock file {path}{gone}): two runs in one folder "
                             "would corrupt it. Wait for it to end or stop it, or choose "
                             "another run_dir") from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file there now
    previous = _read(fd)
    if previous.strip():
        warnings.warn(f"run_dir {path.parent}: taking over the lock of "
                      f"{Holder.read(previous)}, which ended without releasing it (killed?)",
                      stacklevel=4)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:500]}).encode(), 0)
    return fd


def _read(fd: int) -> str:
    return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _remove_empty(created: list[Path]) -> None:
    """Remove the folders ``make_run_dir`` created (deepest first) that are still empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return


def _not_writable(path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    return (f"run_dir {path} cannot be written ({reason}): make it writable or choose "
            "another run_dir")


def hold_if_main(run_dir: str | os.PathLike, resume: bool = False) -> contextlib.AbstractContextManager:
    """``hold_run_dir`` in the process that writes the run directory: rank 0 of a launch
    (``RANK``, set by torchrun / deepspeed; a process without a launcher is rank 0); a no-op on
    the other ranks, which read the folder but never write it outside collective checkpoints
    that rank 0 joins. ``resume``: the folder must exist already."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext(Path(run_dir) / LOCK_FILE)
    return hold_run_dir(run_dir, create=not resume)
