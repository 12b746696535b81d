"""A run's folder on the host: where it goes (``runs_root``), the checked ``files``, the program
read-only beside the guest's writable work dir, and what the run wrote there.

``files_written`` lists the work dir's regular files, links and other non-directories that the
run created or whose content differs from what ``files`` put there (found by comparing hashes
after the run), so a trusted caller can audit, say, a planted ``conftest.py``. The guest chooses
these names: a byte that is not UTF-8 shows as ``\\xNN`` (Python's ``backslashreplace``), so every
entry is valid text (a name holding that text itself reads the same).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from envs.sandbox import settings
from envs.sandbox.limits import MIB

_RAM_ROOT = "/dev/shm"


def runs_root() -> str:
    """Where runs' temp dirs go now (``settings.RUNS_ROOT``)."""
    if settings.RUNS_ROOT is not None:
        return settings.RUNS_ROOT
    if os.environ.get("TMPDIR"):
        return tempfile.gettempdir()
    return _ram_root() or tempfile.gettempdir()


@functools.cache
def _ram_root() -> str | None:
    """``/dev/shm`` when it is a tmpfs this process may write with room to spare; checked once."""
    try:
        with open("/proc/self/mounts") as f:
            tmpfs = any(line.split()[1:3] == [_RAM_ROOT, "tmpfs"] for line in f)
        st = os.statvfs(_RAM_ROOT)
    except OSError:
        return None
    room = st.f_bavail * st.f_frsize >= settings.RAM_ROOT_MIN_FREE_MB * MIB
    return _RAM_ROOT if tmpfs and room and os.access(_RAM_ROOT, os.W_OK | os.X_OK) else None


def check_files(files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, content in (files or {}).items():
        if not isinstance(name, str) or not name or "\x00" in name:
            raise ValueError(f"file name {name!r}: must be a non-empty str without NUL bytes")
        if "/" not in name and name not in (".", ".."):
            key = name  # a plain name: what PurePosixPath would make of it
        else:
            path = PurePosixPath(name)
            if path.is_absolute() or not path.parts or ".." in path.parts:
                raise ValueError(f"file name {name!r}: must be relative to the work dir, without '..'")
            key = str(path)
        if key in out:
            raise ValueError(f"file name {name!r}: given twice (as {key!r})")
        if isinstance(content, str):
            out[key] = content.encode("utf-8", "surrogatepass")
        elif isinstance(content, (bytes, bytearray, memoryview)):
            out[key] = bytes(content)
        else:
            raise TypeError(f"file {name!r}: content must be str or bytes, got {type(content).__name__}")
    for key in out:
        for parent in PurePosixPath(key).parents if "/" in key else ():
            if str(parent) in out:
                raise ValueError(f"file name {key!r}: {str(parent)!r} is also given as a file")
    return out


def _write_new(path: str, data: bytes, mode: int) -> None:
    """A new file holding ``data``, with exactly ``mode`` (whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _shown_name(path: str) -> str:
    """A path as read from the filesystem (``os.fsdecode``: a byte that is not UTF-8 held as a lone
    surrogate, which no UTF-8 text can carry) with each such byte written ``\\xNN`` instead."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WorkDir:
    """A host temp dir: ``prog/main.py`` (the program, read-only) and ``work/`` (the guest's cwd,
    holding the given files), handed to ``guest_uid`` when that is not us. Made empty (a guest
    can be started before its program is known: ``prepare``), then ``fill``ed."""

    def __init__(self, guest_uid: int | None, parent: Path | None = None):
        self.guest_uid = guest_uid
        self.given: dict[str, str] = {}
        root = tempfile.mkdtemp(prefix="agent-rl-sandbox-", dir=runs_root() if parent is None else parent)
        self.root = Path(root)
        try:
            os.chmod(root, 0o711)
            os.mkdir(root + "/prog", 0o755)
            os.mkdir(root + "/work", 0o755)
            self.prog, self.work = Path(root + "/prog"), Path(root + "/work")
            self.main = Path(root + "/prog/main.py")
        except BaseException:
            self.cleanup()
            raise

    def fill(self, code: str, files: dict[str, bytes]) -> None:
        _write_new(str(self.main), code.encode("utf-8", "surrogatepass"), 0o444)
        self.given = {rel: _digest(data) for rel, data in files.items()}
        work = str(self.work)
        dirs = {work}
        for rel, data in files.items():
            for parent in reversed(PurePosixPath(rel).parents[:-1]):  # made as they were given
                path = os.path.join(work, parent)
                if path not in dirs:
                    os.makedirs(path, exist_ok=True)
                    dirs.add(path)
            _write_new(os.path.join(work, rel), data, 0o644)
        if self.guest_uid is not None and self.guest_uid != os.geteuid():
            self._hand_over(self.guest_uid, dirs, [os.path.join(work, rel) for rel in files])

    def _hand_over(self, uid: int, dirs: set[str], files: list[str]) -> None:
        """Give the fresh work dir and everything ``fill`` made in it to ``uid``."""
        for path in [*dirs, *files]:
            if os.geteuid() == 0:
                os.chown(path, uid, uid, follow_symlinks=False)
            else:  # Docker as a non-root user: the guest's uid differs and cannot be chown'ed to
                os.chmod(path, 0o777 if path in dirs else 0o666)

    def _entries(self) -> Iterator[tuple[str, os.stat_result]]:
        work = str(self.work)
        stack, cut = [work], len(work) + 1
        while stack:
            top = stack.pop()
            try:
                with os.scandir(top) as it:
                    for entry in it:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(entry.path)
                        yield entry.path[cut:], st  # relative to the work dir
            except OSError:
                continue

    def usage(self) -> int:
        """Bytes the work dir holds: allocated blocks, at least 4 KiB per entry."""
        return sum(max(st.st_blocks * 512, 4096) for _, st in self._entries())

    def written(self) -> tuple[str, ...]:
        """``files_written``: what the run made or changed, named as ``_shown_name`` does."""
        out = []
        for rel, st in self._entries():
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISREG(st.st_mode) and rel in self.given and self._hash(rel) == self.given[rel]:
                continue
            out.append(_shown_name(rel))
        return tuple(sorted(out))

    def _hash(self, rel: str) -> str | None:
        try:
            fd = os.open(self.work / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            h = hashlib.sha256()
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return h.hexdigest()

    def cleanup(self) -> None:
        """Remove the whole dir (again: nothing). Only what lies inside it is ever chmod'ed."""
        root = str(self.root)

        def retry(func: Callable, path: str | Path, _exc: object) -> None:
            path = os.fspath(path)
            if path == root or not path.startswith(root + os.sep):
                return  # never the folder holding ours (a second cleanup finds root gone)
            try:  # a guest may leave directories without permissions
                os.chmod(os.path.dirname(path), 0o700)
                if os.path.isdir(path) and not os.path.islink(path):
                    os.chmod(path, 0o700)
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    func(path)
            except OSError:
                pass

        if os.path.lexists(root):
            shutil.rmtree(root, onerror=retry)

