"""Run untrusted Python programs: bubblewrap, Docker, or a plain subprocess (not isolation).

    from envs.sandbox import Limits, run
    result = run("print(open('data.txt').read())", files={"data.txt": "hi"},
                 limits=Limits(wall_s=5))
    result.status        # "ok" | "runtime_error" | "timeout" | "resource_limit" | "sandbox_error"
    result.stdout        # "hi\\n"

The program. ``code`` becomes ``/sandbox/main.py``, read-only and outside the work dir, and runs
as ``python3 -I -S /sandbox/main.py`` under the Debian interpreter (``/usr/bin/python3``; in
Docker, the same interpreter copied into the image by ``build_image``): no site-packages, no
``PYTHON*`` variables, no ``site`` (so no ``exit()``/``quit()`` builtins: use ``sys.exit``), and
neither the script's directory nor the cwd on ``sys.path`` (a program importing a file it was
given starts with ``sys.path.insert(0, "")``). The cwd is the writable work dir (``/work`` in
bwrap and Docker) holding ``files``; ``HOME`` is the work dir, ``LANG=C.UTF-8``, stdin is empty.
When this process is root, the guest runs as uid/gid 65534 (``GUEST_UID``) on bwrap and Docker,
and as 65533 (``SUBPROCESS_UID``) on ``subprocess``: its guests see the host, so they share no uid
with any bwrap process (the fork server, whose user namespace that uid owns).

A sandbox can be started before its program is known: ``guest = prepare(limits, backend)``
starts it (bwrap and subprocess: cgroups, rlimits, namespaces and the interpreter, which then
waits for a go on its stdin), and ``guest.run(code, files)`` writes the program and files in
place and lets it go: the same result, limits and isolation as ``run``, one fresh sandbox per
program, but the start-up (most of a short run's cost) is paid while the caller does other work
(CodeTests-v0 starts each episode's sandbox at ``reset``, while the policy writes the answer).
``run`` itself is a guest started and let go at once. Docker containers are not started ahead.
Through bwrap's fork server (below), ``prepare`` sets the run up there: its folder, cgroups and
processes, the program's own waiting for its go.

One status per run:

* ``ok``: exit code 0 within every limit;
* ``runtime_error``: a nonzero exit, or death by a signal that none of our limits sent;
* ``timeout``: ``wall_s`` (from the host) or ``cpu_s`` (``RLIMIT_CPU``: per process, rounded up
  to whole seconds) ran out;
* ``resource_limit``: memory, processes, output bytes (per stream) or disk ran out;
* ``sandbox_error``: the sandbox itself failed (bwrap could not start or was killed, the Docker
  engine is unreachable or lost the container, the image is missing): never the guest's fault.

How each limit is enforced (always from outside the guest: nothing the program does lifts it):

=============  ===============================  ==================================
limit          subprocess / bwrap               docker
=============  ===============================  ==================================
wall_s         host timer, then SIGKILL         host timer, then container kill
cpu_s          RLIMIT_CPU                       RLIMIT_CPU (ulimit)
memory_mb      RLIMIT_AS per process, plus a    ``mem_limit`` = ``memswap_limit``
               memory cgroup for the whole run  (OOMKilled => resource_limit)
processes      pids cgroup (RLIMIT_NPROC when   ``pids_limit``
               no cgroup can be made)
output_bytes   host-side capture; the run is killed when a stream passes the cap
disk_mb        RLIMIT_FSIZE per file, and the work dir's usage polled every 50 ms
               (each entry counts at least 4 KiB) and checked at the end
=============  ===============================  ==================================

The process backends start the guest through ``/bin/sh`` (joins the run's cgroups), util-linux's
``prlimit`` (the rlimits) and, as root, ``setpriv`` (the guest uid), not a ``preexec_fn``: the
child never runs Python, so starting a run costs the same in a process holding gigabytes
(a forked trainer would copy its page tables: tens of milliseconds a run). As root, ``subprocess``
runs also go through util-linux's ``unshare`` into a pid namespace of their own, with a new
``/proc`` (a mount namespace for it) and ``/bin/sh`` as its init (~1.5 ms a run), where the
kernel allows it (not, e.g., in a container without ``CAP_SYS_ADMIN``: checked once).

Nothing of a run outlives ``run``'s return (nor a ``Guest``'s ``close``): every process of the
run is killed (SIGKILL, which no program can ignore) and waited for until it has exited. A
run's processes are those of its session, its cgroups and its pid namespace (bwrap runs always
have one, ``subprocess`` runs as root), whose init exits only once the kernel has ended and
reaped every other process in it: none is left, not even as a zombie, daemons that ``setsid``
and double-fork included. A ``subprocess`` run without a pid namespace leaves the zombies of
its orphans to the host's init, and without cgroups either (not root) cannot find a process
that left its session (``setsid``): such a process outlives the run.

bwrap's fork server (``FORK_SERVER``, on by default; ``envs/_fork_server.py``): as root, with a
pids cgroup, the first bwrap run of a process starts one bwrap sandbox holding a warm guest
interpreter (uid 65534, capabilities only inside that sandbox's user namespace; started with an
empty environment, so none of this process's variables, API keys included, is in any of its
processes, and undumpable, so no other process of that uid can open its ``/proc`` files), and
every bwrap run is then two forks of it instead of a new bwrap and interpreter (~4 ms a run
against ~20). Each run's processes join the run's own cgroups, then get their own mount, pid, net
(loopback only), ipc, uts and cgroup namespaces, a new ``/proc``, the run's ``/work`` and
``/sandbox`` and nothing of any other run's, their rlimits, and no capabilities, before the
program runs; the server itself never runs a program. What differs from a fresh interpreter:
every run shares the server's hash seed (``str`` hashes, set order), ``sys.modules`` holds the
server's few stdlib modules, and at exit the interpreter is not torn down (threads joined,
``atexit`` run, streams flushed, then ``os._exit``: objects alive at exit are not finalized).
Net namespaces are kept by the server and given again to later runs (never to two runs at
once; every process and socket of a run is gone before its namespace is given again; a
CodeTests-v0 scoring run took 4.80 against 5.68 ms of the machine's CPU, measured): a run
sees the loopback device's counters
(``/proc/net/dev``) and any ``TIME_WAIT`` connections that earlier runs left in it.
``preload(code)`` has the server compile a trusted program run many times (a test harness)
once, so that its runs skip compiling it (~2 ms for 4 KB in a fork).
A server that cannot start is said once (``RuntimeWarning``) and every run starts its own
bwrap; a server that dies fails the runs in flight (``sandbox_error``) and the next run
starts a fresh one; one that stops reading fails each run it does not start within its
``wall_s`` (``sandbox_error``, never the program's timeout). A process forked after the server
started starts its own.

Cgroups (v1 ``pids`` and ``memory`` hierarchies, made under this process's own cgroups) need
write access, in practice root; without them the rlimits stand alone. A memory limit hit inside
one process surfaces as Python's ``MemoryError``; a run whose stderr ends with it counts as
``resource_limit`` (a guest can only make its own failure look like that, never like ``ok``).
A limit-bound failure counts as ``resource_limit`` only when the run failed (a program that
meets ``EAGAIN`` from ``fork`` and still exits 0 is ``ok``).

What each backend isolates:

* ``bwrap``: new user, pid, net (loopback only), ipc, uts and cgroup namespaces, no further user
  namespaces, a read-only root holding only ``/usr`` (read-only) and the usrmerge links, a new
  ``/proc``, a minimal ``/dev`` (read-only, with a ``/dev/shm`` tmpfs of ``disk_mb``), the program
  read-only at ``/sandbox`` and a host temp dir (under ``RUNS_ROOT``) bind-mounted at
  ``/work``; ``--die-with-parent``,
  ``--new-session``. Not given: a seccomp filter (the whole kernel syscall surface is reachable)
  and a CPU share (the guest may use every core until ``cpu_s``). Through the fork server the
  same, per run as listed above, with one user namespace for all runs (the server's; none may
  make another) and the root's empty mount points ``/runs`` and ``/cg`` covered by empty
  read-only tmpfs.
* ``docker``: ``network_mode="none"``, read-only image root (only the interpreter, its stdlib
  and its shared libraries), user 65534, all capabilities dropped, ``no-new-privileges``, an
  init process (so the container ends with the program), memory/pids/one-CPU limits, a
  ``/dev/shm`` of ``disk_mb``; the same host temp dir layout bind-mounted (``/sandbox``
  read-only, ``/work``), so the engine must run on this host (``put_archive`` cannot fill a
  tmpfs work dir: it refuses a read-only root and writes beneath a tmpfs, unseen); the container
  is always removed. Not given: anything beyond Docker's default seccomp and AppArmor profiles
  (one kernel shared with the host), and a CPU-time verdict for a program that ignores SIGXCPU
  (its SIGKILL at the hard limit reads as ``runtime_error``).
* ``subprocess``: rlimits, cgroups, a temp work dir and a host timeout only; as root, also a
  uid of its own (``SUBPROCESS_UID``) and a pid namespace with its own ``/proc`` (no host
  process is in sight). The guest sees the whole filesystem its uid can read and the network;
  it is no isolation boundary and says so once (``RuntimeWarning``).

``files_written`` lists the work dir's regular files, links and other non-directories that the
run created or whose content differs from what ``files`` put there (found by comparing hashes
after the run), so a trusted caller can audit, say, a planted ``conftest.py``. The guest chooses
these names: a byte that is not UTF-8 shows as ``\\xNN`` (Python's ``backslashreplace``), so every
entry is valid text (a name holding that text itself reads the same).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import enum
import functools
import hashlib
import io
import itertools
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

SandboxStatus = Literal["ok", "runtime_error", "timeout", "resource_limit", "sandbox_error"]
BACKENDS = ("docker", "bwrap", "subprocess")
PYTHON = "/usr/bin/python3"  # the Debian interpreter, never the venv's
GUEST_UID = 65534  # nobody/nogroup: the guest's uid and gid whenever we can choose
SUBPROCESS_UID = 65533
"""The ``subprocess`` backend's guest uid and gid as root. Not ``GUEST_UID``: such a guest sees the
host's files (bwrap runs' work dirs, that uid's, among them), and the uid that owns the bwrap fork
server's user namespace may trace the server whatever its dumpability. 65533 is outside systemd's
dynamic users (61184-65519), in Debian's reserved, never allocated 65000-65533."""
IMAGE_REPOSITORY = "agent-rl-sandbox"
_GUEST_ARGS = ("-I", "-S")
_MIB = 1 << 20
_DISK_POLL_S = 0.05
_CGROUP_ROOT = Path("/sys/fs/cgroup")

RUNS_ROOT: str | None = None
"""The folder that holds each run's temp dir (and bwrap's fork server's runs folder). None:
``$TMPDIR`` when it is set, else ``/dev/shm`` when that is a writable tmpfs with
``RAM_ROOT_MIN_FREE_MB`` free, else the system's temp dir. In RAM, a run's few folders and files
cost the host less CPU than on a disk filesystem (ext4 looks for an inode to reuse at every
create: ~0.55 ms more of the host's CPU a run through the fork server, measured). What a guest
writes there is also
charged to its memory cgroup (``memory_mb``), as well as counted against ``disk_mb``. Read at
each run (the fork server's folder: at its start)."""
RAM_ROOT_MIN_FREE_MB = 1024
_RAM_ROOT = "/dev/shm"


def runs_root() -> str:
    """Where runs' temp dirs go now (``RUNS_ROOT``)."""
    if RUNS_ROOT is not None:
        return RUNS_ROOT
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
    room = st.f_bavail * st.f_frsize >= RAM_ROOT_MIN_FREE_MB * _MIB
    return _RAM_ROOT if tmpfs and room and os.access(_RAM_ROOT, os.W_OK | os.X_OK) else None


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-run limits; every field must be positive."""

    wall_s: float = 10.0
    """Wall-clock seconds from start to exit, timed by the host."""
    cpu_s: float = 10.0
    """CPU seconds per process (``RLIMIT_CPU``, rounded up to whole seconds)."""
    memory_mb: int = 512
    """MiB of memory for the whole run (per process where only rlimits apply)."""
    processes: int = 64
    """Processes (and threads) the program may have at once, itself included."""
    output_bytes: int = 1_000_000
    """Bytes kept of stdout and of stderr each; more kills the run (``resource_limit``)."""
    disk_mb: int = 64
    """MiB the work dir may hold, the given ``files`` included."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            integral = field.type == "int"
            number = isinstance(value, int if integral else (int, float))
            if isinstance(value, bool) or not number or not math.isfinite(value) or value <= 0:
                kind = "integer" if integral else "number"
                raise ValueError(f"Limits.{field.name} must be a positive {kind}, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did; exactly one ``status``."""

    status: SandboxStatus
    stdout: str
    """Decoded with ``errors="replace"``, at most ``output_bytes`` bytes before decoding."""
    stderr: str
    exit_code: int | None
    """The program's exit status (128 + N after signal N); None when we stopped it or the
    sandbox failed."""
    wall_s: float
    backend: str
    """The backend that actually ran."""
    files_written: tuple[str, ...] = ()
    """Work-dir paths the run created or changed, relative, sorted; bytes that are not UTF-8 as
    ``\\xNN`` (``b"\\xff.txt"`` is ``"\\\\xff.txt"``), so each entry encodes to UTF-8."""
    detail: str = ""
    """Why, for every status but ``ok``."""


def run(code: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None,
        backend: str = "auto") -> SandboxResult:
    """Run ``code`` as the main program with ``files`` in its work dir; see the module doc.

    Bad arguments (an unknown backend, absolute or escaping file names, limits that are not a
    ``Limits``) raise ``ValueError``/``TypeError`` before anything runs; everything else comes
    back as a ``SandboxResult``. ``prepare(limits, backend).run(code, files)`` is the same run
    with the sandbox started ahead.
    """
    backend = choose_backend(backend)
    checked = _check_program(code, files)
    with Guest(backend, _check_limits(limits), ahead=False) as guest:
        return guest._run(code, checked)


def prepare(limits: Limits | None = None, backend: str = "auto") -> Guest:
    """A ``Guest``: a sandbox for one program, started now, before the program is known (the
    caller has other work meanwhile, e.g. generating the agent's answer), so that its ``run``
    costs only the program itself. Same arguments, checks and isolation as ``run``."""
    return Guest(choose_backend(backend), _check_limits(limits), ahead=True)


MAX_WAITING = 32
"""Guests started ahead and not yet given their program, at most, per process (each holds an
idle interpreter, ~10 MB); ``prepare`` beyond it gives a guest that starts in its ``run``."""
_WAITING = 0
_WAITING_LOCK = threading.Lock()


_LAUNCHER: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _launcher_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One thread, kept for the process's life, that starts the guests of ``prepare``: bwrap's
    ``--die-with-parent`` is the kernel's parent-death signal, sent when the *thread* that
    started it exits, so a short-lived starter thread would kill its guest. (Made again in a
    forked child, where the parent's thread does not exist.)"""
    global _LAUNCHER
    with _WAITING_LOCK:
        if _LAUNCHER is None or _LAUNCHER[0] != os.getpid():
            _LAUNCHER = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sandbox-launcher"))
        return _LAUNCHER[1]


class _WaitingSlot:
    """One of ``MAX_WAITING``'s places, held by a guest started ahead from ``prepare`` until its
    program comes, it closes or it is collected; ``give`` hands it back, once."""

    def __init__(self):
        self._held = True

    def give(self) -> None:
        global _WAITING
        with _WAITING_LOCK:
            if self._held:
                self._held = False
                _WAITING -= 1


def _take_waiting_slot() -> _WaitingSlot | None:
    global _WAITING
    with _WAITING_LOCK:
        if _WAITING >= MAX_WAITING:
            return None
        _WAITING += 1
        return _WaitingSlot()


def _close_unused(process: _Process | _ForkedRun, slot: _WaitingSlot | None) -> None:
    """A guest's finalizer: its sandbox killed and removed, its waiting slot given back."""
    if slot is not None:
        slot.give()
    process.close()


class Guest:
    """One sandbox run, its sandbox started ahead of its program (``prepare``).

    The process backends (``bwrap``, ``subprocess``) start the whole sandbox at once (cgroups,
    rlimits, namespaces, the interpreter, which then waits); ``run(code, files)`` writes the
    program and files in place and lets it go, so its result, limits (``wall_s`` counts from
    the go) and isolation are exactly a ``run``'s: one fresh sandbox per program, never reused.
    ``prepare`` returns at once (the launch runs on a thread, joined by ``run``). Docker is not
    started ahead (its ``run`` creates the container). A guest runs one program;
    ``close`` (or leaving a ``with`` block, or the guest being collected) kills one that never
    ran and removes its work dir and cgroups. Past ``MAX_WAITING`` waiting guests, or where the
    process has no pids cgroup (``RLIMIT_NPROC`` counts the guest uid's processes, waiting ones
    too), the sandbox starts in ``run``. bwrap through the fork server (``FORK_SERVER``):
    ``prepare`` sets the run up there (its folder, cgroups, and the forked processes up to the
    program's own, which waits for its go), a millisecond or so of this process's time."""

    def __init__(self, backend: str, limits: Limits, ahead: bool = True):
        self.backend, self.limits = backend, limits
        self._process: _Process | _ForkedRun | None = None
        self._finalizer: weakref.finalize | None = None
        self._starter: concurrent.futures.Future | None = None
        self._failure = ""
        self._used = False
        self._slot: _WaitingSlot | None = None
        if backend == "subprocess":
            _warn_subprocess()
        server = _FORKS.get() if backend == "bwrap" and ahead else None
        if ahead and backend != "docker":
            self._slot = _take_waiting_slot()
        if self._slot is not None and server is not None:  # set up at once: a few forks
            self._process = server.prepare(limits)
            self._finalizer = weakref.finalize(self, _close_unused, self._process, self._slot)
        elif self._slot is not None:
            # on the launcher thread: the caller (an env's reset) does not wait for the launch
            self._starter = _launcher_thread().submit(self._start, True)

    def _start(self, ahead: bool = False) -> None:
        try:
            process = _Process(self.backend, self.limits)
        except _LaunchFailed as exc:
            self._failure = str(exc)
            self._give_slot()
            return
        except OSError as exc:  # no work dir, no pipe: this host, never the program
            self._failure = f"{self.backend} could not start: {exc}"
            self._give_slot()
            return
        if ahead and "pids" not in process.cgroup.dirs:
            process.close()  # its RLIMIT_NPROC counted only the processes then running: in run
            self._give_slot()
            return
        self._process = process
        self._finalizer = weakref.finalize(self, _close_unused, process, self._slot)

    def _give_slot(self) -> None:
        if self._slot is not None:
            self._slot.give()

    def run(self, code: str, files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
        """Run ``code`` with ``files`` in this sandbox (``envs.sandbox.run``'s result); once."""
        return self._run(code, _check_program(code, files))

    def _run(self, code: str, files: dict[str, bytes]) -> SandboxResult:
        if self._used:
            raise RuntimeError("this sandbox Guest already ran its program; prepare() another")
        self._used = True
        self._join_starter()
        self._give_slot()  # its program came: no longer waiting
        try:
            if self.backend == "docker":
                return _run_docker(code, files, self.limits)
            if self.backend == "bwrap" and self._process is None and not self._failure \
                    and (server := _FORKS.get()) is not None:
                return server.run(code, files, self.limits)
            if self._process is None and not self._failure:
                self._start()
            if self._failure:
                return _failed(self.backend, self._failure)
            return self._process.run(code, files)
        finally:
            self.close()

    def close(self) -> None:
        """Kill the guest if it never ran; remove its work dir and cgroups. Idempotent; a
        closed guest runs nothing."""
        self._used = True
        self._join_starter()
        self._give_slot()
        if self._finalizer is not None:
            self._finalizer()  # _close_unused, once
            self._finalizer = None
        self._process = None

    def _join_starter(self) -> None:
        if self._starter is not None:
            self._starter.result()
            self._starter = None

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_limits(limits: Limits | None) -> Limits:
    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be an envs.sandbox.Limits, got {type(limits).__name__}")
    return limits


def _check_program(code: str, files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    return _check_files(files)


def choose_backend(backend: str = "auto") -> str:
    """The backend ``run(backend=...)`` uses: ``backend`` itself, or for ``auto`` the first of
    docker, bwrap and subprocess that is ``available`` (probed once per process)."""
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown sandbox backend {backend!r}: use one of {', '.join(BACKENDS)} or 'auto'")
    if backend != "auto":
        return backend
    return next(b for b in BACKENDS if b == "subprocess" or available(b))


def available(backend: str) -> bool:
    """Can ``backend`` run here? Docker: the SDK imports, the engine answers and the image
    exists or was just built. bwrap: a trivial program really ran in it. Cached per process."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}: use one of {', '.join(BACKENDS)}")
    with _AVAILABLE_LOCK:
        if backend not in _AVAILABLE:
            _AVAILABLE[backend] = _PROBES[backend]()
        return _AVAILABLE[backend]


def unavailable_reason(backend: str) -> str:
    """Why ``available(backend)`` is False (empty when it is True)."""
    return "" if available(backend) else _UNAVAILABLE_WHY.get(backend, "")


# --- inputs: file names and contents ---------------------------------------------------------

def _check_files(files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
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


class _WorkDir:
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


# --- the run's bookkeeping, shared by every backend -----------------------------------------

class _Stop(enum.Enum):
    """Why the host stopped a run."""

    WALL = "wall time"
    OUTPUT = "output"
    DISK = "disk"


class _Watch:
    """Stops a run once (the first reason wins) and captures its two output streams."""

    def __init__(self, limits: Limits, kill: Callable[[], None]):
        self.limits, self._kill = limits, kill
        self.stopped: _Stop | None = None
        self._killer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.done = threading.Event()

    def stop(self, why: _Stop) -> None:
        with self._lock:
            if self.stopped is not None or self.done.is_set():
                return
            self.stopped = why
            # not on the caller's thread: an output pump must keep draining (Docker does not let
            # a container die while its attach stream is full)
            self._killer = threading.Thread(target=self._kill, daemon=True, name="sandbox-kill")
            self._killer.start()

    def finish(self) -> None:
        """No more stops; returns once a kill in flight is done (before the pid is reaped)."""
        with self._lock:
            self.done.set()
        if self._killer is not None:
            self._killer.join()

    def feed(self, buf: bytearray, data: bytes) -> None:
        room = self.limits.output_bytes - len(buf)
        if len(data) <= room:
            buf += data
            return
        buf += data[:max(room, 0)]
        self.stop(_Stop.OUTPUT)

    def pump(self, fd: int, buf: bytearray) -> threading.Thread:
        def loop() -> None:
            try:
                while data := os.read(fd, 1 << 16):
                    self.feed(buf, data)
            except OSError:  # closed under us after an escaped process kept it open
                pass

        thread = threading.Thread(target=loop, daemon=True, name="sandbox-output")
        thread.start()
        return thread

    def check(self, deadline: float, workdir: _WorkDir) -> bool:
        """Stop the run if ``deadline`` passed or the work dir outgrew ``disk_mb``; whether the
        run is stopped (for any reason)."""
        if time.monotonic() >= deadline:
            self.stop(_Stop.WALL)
        elif workdir.usage() > self.limits.disk_mb * _MIB:
            self.stop(_Stop.DISK)
        return self.stopped is not None

    def monitor(self, deadline: float, workdir: _WorkDir) -> threading.Thread:
        """``check`` every ``_DISK_POLL_S`` (and at ``deadline``) on a thread of its own."""
        def loop() -> None:
            while not self.done.wait(max(0.0, min(_DISK_POLL_S, deadline - time.monotonic()))):
                if self.check(deadline, workdir):
                    return

        thread = threading.Thread(target=loop, daemon=True, name="sandbox-monitor")
        thread.start()
        return thread


@dataclass
class _Outcome:
    """The facts a backend gathered; ``_classify`` turns them into one status."""

    exit_code: int | None
    stopped: _Stop | None
    stderr: str
    failure: str = ""  # the sandbox itself failed
    cpu_s: float | None = None  # the run's CPU seconds, where the backend can tell
    oom: bool = False  # a memory cgroup OOM kill / Docker's OOMKilled
    pids_hit: bool = False  # the pids cgroup refused a fork
    disk_used: int = 0  # bytes in the work dir at the end


_MEMORY_ERROR = re.compile(r"^MemoryError\b")


def _cpu_rlimit(limits: Limits) -> int:
    return max(1, math.ceil(limits.cpu_s))


def _classify(o: _Outcome, limits: Limits) -> tuple[SandboxStatus, str]:
    if o.failure:
        return "sandbox_error", o.failure
    if o.stopped is _Stop.WALL:
        return "timeout", f"wall time over {limits.wall_s:g} s"
    if o.stopped is _Stop.OUTPUT:
        return "resource_limit", f"output over {limits.output_bytes} bytes on stdout or stderr"
    if o.stopped is _Stop.DISK or o.disk_used > limits.disk_mb * _MIB:  # more than the poll saw
        return "resource_limit", f"work dir over {limits.disk_mb} MiB"
    if o.exit_code == 0:
        return "ok", ""
    lines = o.stderr.rstrip().splitlines()
    if o.oom or (o.exit_code == 1 and lines and _MEMORY_ERROR.match(lines[-1])):
        return "resource_limit", f"memory over {limits.memory_mb} MiB"
    killed_by_cpu = o.exit_code == 128 + signal.SIGKILL and o.cpu_s is not None \
        and o.cpu_s >= _cpu_rlimit(limits) - 0.05
    if o.exit_code == 128 + signal.SIGXCPU or killed_by_cpu:
        return "timeout", f"CPU time over {_cpu_rlimit(limits)} s"
    if o.pids_hit:
        return "resource_limit", f"more than {limits.processes} processes"
    if o.disk_used >= limits.disk_mb * _MIB:  # a write met RLIMIT_FSIZE
        return "resource_limit", f"work dir reached {limits.disk_mb} MiB"
    if o.exit_code is not None and o.exit_code > 128:
        try:
            return "runtime_error", f"killed by {signal.Signals(o.exit_code - 128).name}"
        except ValueError:
            pass
    return "runtime_error", f"exit code {o.exit_code}"


def _result(o: _Outcome, watch: _Watch, wall_s: float, backend: str, workdir: _WorkDir | None
            ) -> SandboxResult:
    status, detail = _classify(o, watch.limits)
    return SandboxResult(
        status=status,
        stdout=watch.stdout.decode("utf-8", "replace"),
        stderr=watch.stderr.decode("utf-8", "replace"),
        exit_code=None if (o.stopped is not None or o.failure) else o.exit_code,
        wall_s=wall_s,
        backend=backend,
        files_written=workdir.written() if workdir is not None and not o.failure else (),
        detail=detail,
    )


def _failed(backend: str, detail: str, wall_s: float = 0.0) -> SandboxResult:
    return SandboxResult(status="sandbox_error", stdout="", stderr="", exit_code=None,
                         wall_s=wall_s, backend=backend, detail=detail)


# --- cgroups (v1) for the process backends ---------------------------------------------------

_CGROUP_IDS = itertools.count()
_LIVE_CGROUPS: set[str] = set()  # this process's runs in progress


def _cgroup_parents() -> dict[str, Path]:
    """Where this process's run cgroups go, per controller (``pids``, ``memory``) it is in."""
    pid = os.getpid()
    if pid not in _PARENTS:  # a forked child works out its own
        _PARENTS.clear()
        _PARENTS[pid] = {controller: _CGROUP_ROOT / controller / path.lstrip("/") / "agent-rl-sandbox"
                         for controller, path in _own_cgroups().items() if controller in ("pids", "memory")}
    return dict(_PARENTS[pid])


_PARENTS: dict[int, dict[str, Path]] = {}  # pid -> its run cgroups' parents


class _Cgroup:
    """One run's ``pids`` and ``memory`` cgroups (v1), each made under this process's own
    cgroup of that hierarchy when writable; either may be missing. ``owner``: the uid that may
    move processes in (its ``cgroup.procs``; the fork server's runs join their own)."""

    def __init__(self, processes: int, memory_bytes: int, owner: int | None = None):
        self.dirs: dict[str, Path] = {}
        self.emptied = False  # known empty for good (close need not kill)
        self.name = name = f"{os.getpid()}-{next(_CGROUP_IDS)}"
        _LIVE_CGROUPS.add(name)
        settings = {"pids": [("pids.max", processes)],
                    "memory": [("memory.limit_in_bytes", memory_bytes),
                               ("memory.memsw.limit_in_bytes", memory_bytes)]}
        for controller, parent in _cgroup_parents().items():
            _sweep(parent)
            d = f"{parent}/{name}"
            try:
                try:
                    os.mkdir(d)
                except FileNotFoundError:  # the parent too, at first
                    os.makedirs(d)
            except OSError:
                continue
            try:
                for file, value in settings[controller]:
                    try:
                        fd = os.open(f"{d}/{file}", os.O_WRONLY)
                    except FileNotFoundError:  # memsw: no swap accounting in this kernel
                        continue
                    try:
                        os.write(fd, str(value).encode())
                    finally:
                        os.close(fd)
                if owner is not None:
                    os.chown(f"{d}/cgroup.procs", owner, owner)
            except OSError:
                os.rmdir(d)
                continue
            self.dirs[controller] = Path(d)

    def events(self) -> tuple[bool, bool]:
        """(an OOM kill happened, a fork was refused)."""
        oom = pids = False
        if "memory" in self.dirs:
            fields = dict(line.split() for line in _read(f"{self.dirs['memory']}/memory.oom_control"))
            oom = int(fields.get("oom_kill", "0")) > 0
        if "pids" in self.dirs:
            fields = dict(line.split() for line in _read(f"{self.dirs['pids']}/pids.events"))
            pids = int(fields.get("max", "0")) > 0
        return oom, pids

    def kill(self) -> bool:
        """SIGKILL every process in them, each waited for until it has exited, until none is
        left; whether there was any. (``cgroup.procs`` leaves out a process that is exiting: one
        killed in an earlier round is waited for, never merely signalled.)"""
        found = False
        for d in self.dirs.values():
            procs = f"{d}/cgroup.procs"
            for _ in range(1000):
                pids = [int(p) for p in _read(procs)]
                if not pids:
                    break
                found = True
                _end(pids)
        return found

    def close(self) -> None:
        if not self.emptied:
            self.kill()
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last exits are still being accounted
                    time.sleep(0.005)
        _LIVE_CGROUPS.discard(self.name)


_EXIT_WAIT_S = 10.0  # for killed processes to exit (one in uninterruptible I/O may take a while)


def _end(pids: list[int], group: int | None = None) -> None:
    """SIGKILL ``pids`` (and the process group ``group``) and return once each has exited, its
    teardown done (``_EXIT_WAIT_S`` at most): a pidfd per process, opened before any signal, so
    that neither a reused pid nor one reaped meanwhile is mistaken for it."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # gone already
        except OSError:  # no pidfds (Linux before 5.3): signalled, not waited for
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        if group is not None:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        poller = select.poll()
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited, not yet reaped: its pidfd reads ready below
            poller.register(fd, select.POLLIN)  # readable once the process has exited
        waiting, deadline = len(fds), time.monotonic() + _EXIT_WAIT_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                waiting -= 1
    finally:
        for fd in fds:
            os.close(fd)


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux's ``/proc/PID/task/PID/children``)."""
    return [int(child) for line in _read(f"/proc/{pid}/task/{pid}/children") for child in line.split()]


_SWEPT: dict[Path, float] = {}  # a cgroup parent: when it was last swept
_SWEEP_EVERY_S = 1.0


def _sweep(parent: Path) -> None:
    """Remove cgroups left by runs of processes that are gone (a zombie the host's init has not
    reaped yet can keep one busy past its run's ``close``); at most every ``_SWEEP_EVERY_S``."""
    now = time.monotonic()
    if now - _SWEPT.get(parent, -_SWEEP_EVERY_S) < _SWEEP_EVERY_S:
        return
    _SWEPT[parent] = now
    try:
        with os.scandir(parent) as entries:  # d_type: no stat per control file
            names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        pid = name.split("-")[0]
        ours = pid == str(os.getpid())
        if (ours and name not in _LIVE_CGROUPS) or (not ours and not os.path.exists(f"/proc/{pid}")):
            try:
                (parent / name).rmdir()
            except OSError:
                pass


def _read(path: Path | str) -> list[str]:
    """A small kernel file's lines (cgroup and /proc files); none when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return []
    try:
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except OSError:
        return []
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").splitlines()


_OWN_CGROUPS: dict[int, dict[str, str]] = {}  # pid -> its cgroups (a forked child reads its own)


def _own_cgroups() -> dict[str, str]:
    pid = os.getpid()
    if pid not in _OWN_CGROUPS:
        _OWN_CGROUPS.clear()
        _OWN_CGROUPS[pid] = _read_own_cgroups()
    return _OWN_CGROUPS[pid]


def _read_own_cgroups() -> dict[str, str]:
    out = {}
    for line in _read(Path("/proc/self/cgroup")):
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller and (_CGROUP_ROOT / controller).is_dir():
                out[controller] = path
    return out


def _processes_of(uid: int) -> list[int]:
    """Pids whose real uid is ``uid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            for line in _read(Path("/proc", entry, "status")):
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        out.append(int(entry))
                    break
    return out


# --- process backends: subprocess and bwrap --------------------------------------------------

def _guest_uid(backend: str) -> int | None:
    """The uid a process backend's guest runs as; None (this process's own) unless root."""
    if os.geteuid() != 0:
        return None
    return SUBPROCESS_UID if backend == "subprocess" else GUEST_UID


@functools.cache
def _system_tool(name: str) -> str | None:
    return shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin")


_JOIN_AND_EXEC = ('while [ "$1" != -- ]; do { echo $$ > "$1"; } 2>/dev/null || '
                  '{ echo "agent-rl-sandbox: cannot join the cgroup $1" >&2; exit 125; }; '
                  'shift; done; shift; exec "$@"')
# the init of a subprocess run's pid namespace: runs the rest (after ``--``) as its child, with its
# own stderr on /dev/null (sh says "Segmentation fault" when its child dies so), and exits with
# the child's status, 128 + N after signal N; reaps orphans meanwhile
_PID1 = 'exec 3>&2 2>/dev/null; shift; (exec "$@" 2>&3 3>&-); exit $?'
_LAUNCHER_FAILED = re.compile(r"^(?:agent-rl-sandbox|\S*prlimit|\S*unshare|\S*setpriv): ")


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    """A run's rlimits, (soft, hard) by ``RLIMIT_`` name."""
    cpu, memory, disk = _cpu_rlimit(limits), limits.memory_mb * _MIB, limits.disk_mb * _MIB
    return {"CPU": (cpu, cpu + 1), "AS": (memory, memory), "FSIZE": (disk, disk), "CORE": (0, 0)}


_UNSHARE_PID = ("--pid", "--fork", "--kill-child", "--mount-proc")


@functools.cache
def _pid_namespaces() -> bool:
    """Can this process give ``subprocess`` runs a pid namespace (root, and ``unshare`` works:
    not in a container without ``CAP_SYS_ADMIN``)? Tried once."""
    unshare = _system_tool("unshare")
    if os.geteuid() != 0 or unshare is None:
        return False
    try:
        return subprocess.run([unshare, *_UNSHARE_PID, "--", "/bin/sh", "-c", _PID1, "sh", "--", "true"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={}, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _launcher(limits: Limits | None, cgroup: _Cgroup, uid: int | None, extra_processes: int,
              pid_namespace: bool = False) -> list[str]:
    """The argv prefix that puts the program in its cgroups, under its rlimits (none for
    ``limits=None``: the fork server, whose runs lower their own), as the guest; with
    ``pid_namespace`` (root only), in a pid namespace of its own under ``_PID1``.

    ``sh`` writes its pid into each cgroup, then execs util-linux's ``prlimit``, ``unshare``
    (its child is the namespace's init) and (as root) ``setpriv``, which exec the program: small
    execs in place of a ``preexec_fn``, which would make ``subprocess`` copy this whole process
    (a forked trainer with a model loaded costs tens of milliseconds; ``vfork`` cannot run
    Python code in the child).
    """
    tools = {name: _system_tool(name) for name in ("prlimit", "unshare", "setpriv")}
    needed = [name for name, used in (("prlimit", limits is not None), ("unshare", pid_namespace),
                                      ("setpriv", uid is not None)) if used]
    missing = [name for name in needed if tools[name] is None]
    if missing:
        names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
        raise FileNotFoundError(f"{names} not found (util-linux)")
    argv = ["/bin/sh", "-c", _JOIN_AND_EXEC, "sh"]
    argv += [str(d / "cgroup.procs") for d in cgroup.dirs.values()]
    if limits is not None:
        argv += ["--", tools["prlimit"]]
        argv += [f"--{name.lower()}={soft}:{hard}" for name, (soft, hard) in _rlimits(limits).items()]
    if limits is not None and "pids" not in cgroup.dirs:  # per user: counts the uid's other processes
        nproc = limits.processes + extra_processes + len(_processes_of(os.geteuid() if uid is None else uid))
        argv.append(f"--nproc={nproc}:{nproc}")
    if pid_namespace:  # unshare waits for its child, the init, which ends with the namespace
        argv += ["--", tools["unshare"], *_UNSHARE_PID, "--", "/bin/sh", "-c", _PID1, "sh"]
    if uid is not None:
        argv += ["--", tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return argv + ["--"]


# The guest's interpreter starts with this program (trusted) and waits: a ``g`` on stdin (the
# host then closes it, so the program's stdin is empty) means its program is in place. It then
# runs it as ``python3 -I -S PATH`` would: ``sys.argv`` [PATH], a fresh ``__main__`` namespace,
# the code compiled under its path (tracebacks name it). EOF first: the host gave up on it.
_BOOT = """\
import sys
def _boot():
    if sys.stdin.buffer.read(1) != b"g":
        raise SystemExit(0)
    path = sys.argv[1]
    sys.argv[:] = [path]
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    main = sys.modules["__main__"].__dict__
    builtins = main["__builtins__"]
    main.clear()
    main.update(__name__="__main__", __doc__=None, __package__=None, __loader__=None,
                __spec__=None, __file__=path, __cached__=None, __builtins__=builtins)
    exec(code, main)
_boot()
"""


class _LaunchFailed(Exception):
    """A process backend could not start its guest (a ``sandbox_error``, said in the message)."""


class _Process:
    """One run of a process backend (``subprocess``, ``bwrap``): ``__init__`` starts the guest
    (cgroups, rlimits and uid through ``_launcher``, then bwrap and/or the interpreter, which
    waits in ``_BOOT``), ``run`` gives it its program and files, times, watches and reaps it,
    ``close`` kills whatever is left and removes the work dir and cgroups. Starting costs most
    of a run's CPU (namespaces, the interpreter's start-up); once started, a guest runs only
    its program."""

    def __init__(self, backend: str, limits: Limits):
        self.backend, self.limits = backend, limits
        self.proc: subprocess.Popen | None = None
        self.cgroup: _Cgroup | None = None
        self.status_r = self.status_w = -1
        self.pumps: list[threading.Thread] = []
        self.watch = _Watch(limits, self.kill)
        uid = _guest_uid(backend)
        self.workdir = _WorkDir(uid)
        try:
            self._start(uid)
        except BaseException:
            self.close()
            raise

    def _start(self, uid: int | None) -> None:
        main = str(self.workdir.main)
        pid_namespace = self.backend == "subprocess" and uid is not None and _pid_namespaces()
        if self.backend == "bwrap":
            bwrap = _system_tool("bwrap")
            if bwrap is None:
                raise _LaunchFailed("bwrap not found (apt-get install bubblewrap)")
            self.status_r, self.status_w = os.pipe()
            # bwrap's outer process and the namespace's pid 1 count against the pids limit too
            argv, env, cwd, extra = (_bwrap_argv(bwrap, self.workdir, self.limits, self.status_w),
                                     {}, self.workdir.root, 2)
        else:
            if not os.path.exists(PYTHON):
                raise _LaunchFailed(f"{PYTHON} not found (the sandbox runs the system Python)")
            # in a pid namespace, unshare's two processes (it and the init) count too
            argv, env, cwd, extra = ([PYTHON, *_GUEST_ARGS, "-c", _BOOT, main],
                                     _guest_env(str(self.workdir.work)), self.workdir.work,
                                     2 if pid_namespace else 0)
        self.cgroup = _Cgroup(self.limits.processes + extra, self.limits.memory_mb * _MIB)
        try:
            launch = _launcher(self.limits, self.cgroup, uid, extra, pid_namespace=pid_namespace)
            self.proc = subprocess.Popen(
                launch + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=cwd, env=env, close_fds=True,
                pass_fds=() if self.status_w < 0 else (self.status_w,), start_new_session=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise _LaunchFailed(f"{self.backend} could not start: {exc}") from None
        if self.status_w >= 0:
            os.close(self.status_w)
            self.status_w = -1
        self.pumps = [self.watch.pump(self.proc.stdout.fileno(), self.watch.stdout),
                      self.watch.pump(self.proc.stderr.fileno(), self.watch.stderr)]

    def kill(self) -> None:
        """SIGKILL the run's processes and return once they have exited: the launched process,
        its session's process group and its children (the init of bwrap's or unshare's pid
        namespace, which exits last in it), then whatever is left in its cgroups."""
        if self.proc is not None:
            leader = self.proc.pid
            _end([leader, *_children(leader)], group=leader)
        if self.cgroup is not None:
            self.cgroup.kill()

    def run(self, code: str, files: dict[str, bytes]) -> SandboxResult:
        """Give the started guest ``code`` and ``files`` and wait for it (at most once)."""
        proc, limits = self.proc, self.limits
        self.workdir.fill(code, files)
        t0 = time.monotonic()
        try:
            proc.stdin.write(b"g")
            proc.stdin.close()
        except OSError:  # the guest is gone: reaped below, said as the sandbox's failure
            pass
        monitor = self.watch.monitor(t0 + limits.wall_s, self.workdir)
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        finally:  # on an interrupt too: nothing outlives the run
            wall_s = time.monotonic() - t0
            self.watch.finish()
            self.kill()  # the session's and the cgroup's leftovers, while the pgid is still ours
            _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        for thread in self.pumps:
            thread.join(timeout=5)
        monitor.join()
        oom, pids_hit = self.cgroup.events()
        code = proc.returncode
        stderr = self.watch.stderr.decode("utf-8", "replace")
        failure = ""
        if self.backend != "bwrap" and code in (125, 126, 127) and _LAUNCHER_FAILED.match(stderr):
            # bwrap's status report tells its launch failures apart; without one, the launcher's
            # own message does (a guest printing it only turns its own failure into this one)
            failure = f"{self.backend} could not start: {stderr.strip()[-2000:]}"
        outcome = _Outcome(
            exit_code=code if code >= 0 else 128 - code,
            stopped=self.watch.stopped,
            stderr=stderr,
            failure=failure,
            cpu_s=rusage.ru_utime + rusage.ru_stime,
            oom=oom, pids_hit=pids_hit,
            disk_used=self.workdir.usage(),
        )
        if self.backend == "bwrap":
            outcome = self._bwrap_failure(outcome)
        return _result(outcome, self.watch, wall_s, self.backend, self.workdir)

    def _bwrap_failure(self, outcome: _Outcome) -> _Outcome:
        with os.fdopen(self.status_r, "rb") as f:
            self.status_r = -1
            reports = f.read().decode("utf-8", "replace")
        if not outcome.failure and outcome.stopped is None and '"exit-code"' not in reports:
            # no exit report: bwrap died (killed from outside) or never started the program
            if outcome.exit_code is not None and outcome.exit_code > 128:
                why = f"bwrap was killed by {signal.Signals(outcome.exit_code - 128).name}"
            else:
                why = f"bwrap failed to start the program: {outcome.stderr.strip()[-2000:]}"
            outcome = dataclasses.replace(outcome, failure=why)
        return outcome

    def close(self) -> None:
        """Kill and reap the guest (if it never ran), remove its cgroups and work dir."""
        try:
            if self.proc is not None:
                self.watch.finish()
                self.kill()
                if self.proc.returncode is None:
                    self.proc.wait()
                for thread in self.pumps:  # their fds are closed next
                    thread.join(timeout=5)
                for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                    try:
                        stream.close()
                    except OSError:
                        pass
        finally:
            if self.cgroup is not None:
                self.cgroup.close()
            for fd in (self.status_r, self.status_w):
                if fd >= 0:
                    os.close(fd)
            self.status_r = self.status_w = -1
            self.workdir.cleanup()


def _guest_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"}


_WARNED_SUBPROCESS = False


def _warn_subprocess() -> None:
    global _WARNED_SUBPROCESS
    if not _WARNED_SUBPROCESS:
        _WARNED_SUBPROCESS = True
        warnings.warn("envs.sandbox: the 'subprocess' backend is not an isolation boundary (the "
                      "program sees this user's files and the network; only rlimits, cgroups and "
                      "a timeout apply); install bubblewrap or Docker for a sandbox",
                      RuntimeWarning, stacklevel=4)


def _bwrap_root(bwrap: str) -> list[str]:
    """bwrap's argv up to what differs between a run and the fork server: the namespaces, the
    environment, the read-only ``/usr`` and its links, ``/proc`` and ``/dev``."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv"]
    for key, value in _guest_env("/work").items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # usrmerge links or dirs
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    return argv + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
                   "--proc", "/proc", "--dev", "/dev"]


def _bwrap_argv(bwrap: str, workdir: _WorkDir, limits: Limits, status_fd: int) -> list[str]:
    argv = _bwrap_root(bwrap)
    argv += ["--size", str(limits.disk_mb * _MIB), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--ro-bind", str(workdir.prog), "/sandbox", "--bind", str(workdir.work), "/work",
             "--chdir", "/work", "--remount-ro", "/", "--json-status-fd", str(status_fd),
             PYTHON, *_GUEST_ARGS, "-c", _BOOT, "/sandbox/main.py"]
    return argv


def _probe_bwrap() -> bool:
    if _system_tool("bwrap") is None:
        _UNAVAILABLE_WHY["bwrap"] = "bwrap not found (apt-get install bubblewrap)"
        return False
    result = run("print('ok')", limits=Limits(wall_s=30), backend="bwrap")
    if result.status != "ok" or result.stdout != "ok\n":
        _UNAVAILABLE_WHY["bwrap"] = f"a trivial program failed in bwrap: {result.status}: " \
                                    f"{result.detail or result.stderr[-500:]}"
        return False
    return True


# --- bwrap through a fork server ------------------------------------------------------------

FORK_SERVER = True
"""bwrap runs are forks of one warm sandboxed interpreter per process (``envs/_fork_server.py``;
the module doc says what each run still gets of its own). False: every run starts its own bwrap
and interpreter. Read at each run; the server needs root, a pids cgroup and capabilities in
bwrap's user namespace, and without them every run starts its own sandbox (said once)."""

_FORK_SOURCE = Path(__file__).with_name("_fork_server.py")
_SERVER_PROCESSES = 1024  # its bwrap, pid 1, itself, and each run's A until it joins its own
_SERVER_MEMORY = 256 * _MIB
_SEND_TIMEOUT_S = 10.0


class _ServerGone(Exception):
    """The fork server died or cannot start (the message says why)."""


class _ForkServer:
    """One bwrap sandbox holding the fork server (``envs/_fork_server.py``), started through
    ``_launcher`` (its cgroups, the guest uid, no rlimits: each run sets its own), and the host
    side of its control socket: a run's request goes out with its three pipes' write ends, and
    everything about the run comes back on them, read on the caller's thread (no thread per
    run)."""

    def __init__(self):
        self.owner = os.getpid()
        _sweep_runs_dirs()
        self.runs_dir = Path(tempfile.mkdtemp(prefix=f"{_RUNS_PREFIX}{self.owner}-", dir=runs_root()))
        self.cgroup: _Cgroup | None = None
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.gone = ""
        self.stderr = bytearray()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        os.chmod(self.runs_dir, 0o711)
        parents = _cgroup_parents()
        if os.geteuid() != 0 or "pids" not in parents:
            raise _ServerGone("needs root and a writable pids cgroup")
        bwrap = _system_tool("bwrap")
        if bwrap is None:
            raise _ServerGone("bwrap not found (apt-get install bubblewrap)")
        for parent in parents.values():
            parent.mkdir(parents=True, exist_ok=True)
        self.cgroup = _Cgroup(_SERVER_PROCESSES, _SERVER_MEMORY)
        if set(self.cgroup.dirs) != set(parents):
            raise _ServerGone(f"could not make its cgroups under {', '.join(map(str, parents.values()))}")
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(_SEND_TIMEOUT_S)  # a server that stopped reading fails the run
        argv = _bwrap_root(bwrap) + ["--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                                     "--dir", "/work", "--dir", "/sandbox",
                                     "--bind", str(self.runs_dir), "/runs"]
        for controller, parent in parents.items():
            argv += ["--bind", str(parent), f"/cg/{controller}"]
        argv += ["--cap-add", "ALL", "--chdir", "/", "--remount-ro", "/",
                 PYTHON, *_GUEST_ARGS, "-c", _FORK_SOURCE.read_text(), str(theirs.fileno())]
        try:
            launch = _launcher(None, self.cgroup, GUEST_UID, 0)
            # on the launcher thread: bwrap's --die-with-parent follows the starting thread;
            # no environment: bwrap needs none, and every process of the server's (bwrap's two,
            # outside its --clearenv, included) runs as GUEST_UID, whose /proc/PID/environ
            # that uid's processes could read
            self.proc = _launcher_thread().submit(
                subprocess.Popen, launch + argv, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True, env={},
                pass_fds=(theirs.fileno(),), start_new_session=True).result()
        except (OSError, subprocess.SubprocessError) as exc:
            raise _ServerGone(f"bwrap could not start: {exc}") from None
        finally:
            theirs.close()
        threading.Thread(target=self._read_stderr, daemon=True, name="sandbox-forks").start()

    def _read_stderr(self) -> None:
        while data := self.proc.stderr.read1(1 << 16):
            self.stderr = (self.stderr + data)[-4000:]

    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def why_gone(self) -> str:
        """Why the server is gone, once it is (waiting a moment for its exit), else ``""``."""
        try:
            code = self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return ""
        self.gone = self.gone or (
            f"bwrap was killed by {signal.Signals(-code).name}" if code < 0 else
            f"the bwrap fork server exited with {code}: "
            f"{self.stderr.decode('utf-8', 'replace').strip()[-2000:]}")
        return self.gone

    def send(self, request: dict, fds: list[int]) -> None:
        """One run's request, with our pipes' far ends; ``_ServerGone`` when it cannot go."""
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        except OSError as exc:
            raise _ServerGone(self.why_gone() or f"the bwrap fork server is unreachable: {exc}") from None

    def preload(self, code: str) -> None:
        """Have the server compile ``code`` (``preload``); unanswered, like every message."""
        try:
            with self.lock:
                self.sock.send(json.dumps({"preload": code}).encode())
        except OSError:
            pass  # a server gone: its next run says so, and its successor gets every preload

    def prepare(self, limits: Limits) -> _ForkedRun:
        """A run set up now, its program to come (``Guest``, ``prepare``)."""
        return _ForkedRun(self, limits)

    def run(self, code: str, files: dict[str, bytes], limits: Limits) -> SandboxResult:
        return _ForkedRun(self, limits).run(code, files)

    def close(self) -> None:
        """End the server (its socket closes: it exits, bwrap with it) and remove its folders.
        Only in the process that started it."""
        if os.getpid() != self.owner:
            return
        self.gone = self.gone or "the bwrap fork server was closed"
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc.stderr.close()
        if self.cgroup is not None:
            self.cgroup.close()
        shutil.rmtree(self.runs_dir, ignore_errors=True)


_RUNS_PREFIX = "agent-rl-forks-"


def _sweep_runs_dirs() -> None:
    """Remove the runs folders of fork servers whose process is gone (one that left without
    ``atexit``, e.g. a forked child's ``os._exit``: its server died with it, its folder stayed)."""
    for root in {runs_root(), tempfile.gettempdir()}:
        for path in Path(root).glob(f"{_RUNS_PREFIX}*-*"):
            pid = path.name[len(_RUNS_PREFIX):].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(path, ignore_errors=True)


class _ForkedRun:
    """One run through the fork server. ``__init__`` makes its folder, cgroups and pipes and
    sends the request: the server's two processes set the run up and the second waits for a
    go. ``run`` writes the program and files in place, sends the go (``wall_s`` counts from
    there) and reads the run's pipes to their end on this thread; ``close`` (after ``run``, or
    instead of it: the waiting process sees its go pipe close and exits) removes what it made."""

    def __init__(self, server: _ForkServer, limits: Limits):
        self.server, self.limits = server, limits
        self.workdir: _WorkDir | None = None
        self.cgroup: _Cgroup | None = None
        self.ours: dict[str, int] = {}  # our ends: stdout, stderr, status (read), go (write)
        self.failure = ""
        if not server.alive():
            self.failure = server.gone or server.why_gone() or "the bwrap fork server is gone"
            return
        try:
            self.workdir = _WorkDir(GUEST_UID, parent=server.runs_dir)
            self.cgroup = _Cgroup(limits.processes + 2, limits.memory_mb * _MIB, owner=GUEST_UID)
            if "pids" not in self.cgroup.dirs:
                self.failure = "could not make the run's pids cgroup"
                return
            theirs = []
            for name in ("stdout", "stderr", "status", "go"):
                r, w = os.pipe()
                self.ours[name], far = (w, r) if name == "go" else (r, w)
                theirs.append(far)
            request = {"dir": self.workdir.root.name, "shm": limits.disk_mb * _MIB,
                       "rlimits": _rlimits(limits),
                       "cgroups": [f"/cg/{c}/{d.name}/cgroup.procs" for c, d in self.cgroup.dirs.items()]}
            try:
                server.send(request, theirs)
            except _ServerGone as exc:
                self.failure = str(exc)
            finally:
                for fd in theirs:
                    os.close(fd)
        except BaseException:
            self.close()
            raise

    def run(self, code: str, files: dict[str, bytes]) -> SandboxResult:
        try:
            if self.failure:
                return _failed("bwrap", self.failure)
            limits, cgroup, workdir = self.limits, self.cgroup, self.workdir
            workdir.fill(code, files)
            alive_at_stop: list[bool] = []
            watch = _Watch(limits, lambda: alive_at_stop.append(cgroup.kill()))
            status = bytearray()
            t0 = time.monotonic()
            try:
                os.write(self.ours["go"], b"g")
            except OSError:  # the run's process is gone: its report (or none) says why
                pass
            os.close(self.ours.pop("go"))
            _drain(watch, workdir, {self.ours["stdout"]: watch.stdout, self.ours["stderr"]: watch.stderr,
                                    self.ours["status"]: status}, t0 + limits.wall_s)
            wall_s = time.monotonic() - t0
            watch.finish()
            left = cgroup.kill()
            report = status.decode("utf-8", "replace")
            ended = _REPORT.search(report)
            # reported: the server reaped the run's init, so every process of the run is gone
            # and none can join its cgroups again
            cgroup.emptied = ended is not None and not left
            failure, why_gone = "", self.server.why_gone
            if ended is None and watch.stopped is None:
                failure = why_gone() or f"the run ended without a report: {report[-2000:]!r}"
            elif ended is None and not report.startswith("started"):
                failure = (why_gone() or "the bwrap fork server did not start the program "
                           f"within {limits.wall_s:g} s: {report[-2000:]!r}")
            elif ended is None and alive_at_stop == [False]:  # the program had ended unreported
                failure = (why_gone() or "the bwrap fork server did not report the end of the "
                           f"run (its processes had all ended by the {watch.stopped.value} stop)")
            elif ended is not None and not report.startswith("started\n"):
                failure = f"bwrap could not start the program: {report[:ended.start()][-2000:]}"
            oom, pids_hit = cgroup.events()
            outcome = _Outcome(exit_code=None if ended is None else int(ended[1]),
                               stopped=watch.stopped, stderr=watch.stderr.decode("utf-8", "replace"),
                               failure=failure, cpu_s=None if ended is None else float(ended[2]),
                               oom=oom, pids_hit=pids_hit, disk_used=workdir.usage())
            return _result(outcome, watch, wall_s, "bwrap", workdir)
        finally:
            self.close()

    def close(self) -> None:
        """End the run if it never went (its go pipe closes), kill what is left, remove its
        cgroups, pipes and folder. Idempotent."""
        ours, self.ours = self.ours, {}
        if "go" in ours:
            os.close(ours.pop("go"))
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None
        for fd in ours.values():
            os.close(fd)
        if self.workdir is not None:
            self.workdir.cleanup()


_REPORT = re.compile(r"\nexit (\d+) ([0-9.e+-]+)\n\Z")  # a fork server run's last words (the server's)
_STATUS_BYTES = 1 << 16
_DRAIN_AFTER_STOP_S = 5.0  # after a stop: for the output of a program that started
_UNSTARTED_AFTER_STOP_S = 0.5  # ... and for a run whose program never started


def _drain(watch: _Watch, workdir: _WorkDir, streams: dict[int, bytearray], deadline: float) -> None:
    """Read a fork server run's pipes until all end (every process holding them is gone), on
    this thread: output through ``watch`` (its cap), the status fd whole; stop the run at
    ``deadline`` or when the work dir outgrows ``disk_mb`` (polled every ``_DISK_POLL_S``)."""
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    status_fd = list(streams)[-1]
    left = set(streams)
    next_poll, stopped_at = time.monotonic() + _DISK_POLL_S, None
    while left:
        now = time.monotonic()
        if watch.stopped is None and now >= min(deadline, next_poll):
            next_poll = now + _DISK_POLL_S
            watch.check(deadline, workdir)
        grace = _DRAIN_AFTER_STOP_S if streams[status_fd].startswith(b"started") else _UNSTARTED_AFTER_STOP_S
        if watch.stopped is not None:
            stopped_at = stopped_at or now
            if now - stopped_at > grace:
                return
        wake = min(deadline, next_poll) if watch.stopped is None else stopped_at + grace
        for fd, _ in poller.poll(max(0.0, wake - now) * 1000):
            data = os.read(fd, 1 << 16)
            if not data:
                poller.unregister(fd)
                left.discard(fd)
            elif fd == status_fd:
                streams[fd] += data[:max(0, _STATUS_BYTES - len(streams[fd]))]
            else:
                watch.feed(streams[fd], data)


class _Forks:
    """This process's fork server: started at the first bwrap run (and checked with a trivial
    program), again after it died; off for the process, said once, when it cannot work here."""

    def __init__(self):
        self.lock = threading.Lock()
        self.server: _ForkServer | None = None
        self.off = ""

    def forget_in_child(self) -> None:
        """After ``os.fork``: the parent's server is not this process's (its socket closed
        here, the server left to the parent); a lock another thread held is free."""
        self.lock = threading.Lock()
        if self.server is not None and self.server.sock is not None:
            self.server.sock.close()
        self.server = None

    def get(self) -> _ForkServer | None:
        if not FORK_SERVER:
            return None
        with self.lock:
            server = self.server
            if server is not None and not server.alive():
                server.close()  # its cgroups and folders; a fresh one below
                self.server = server = None
            if server is None and not self.off:
                try:
                    server = _ForkServer()
                    for code in _PRELOADED:
                        server.preload(code)
                    probe = server.run("print('ok')", {}, Limits(wall_s=30))
                    if probe.status != "ok" or probe.stdout != "ok\n":
                        server.close()
                        raise _ServerGone(f"a trivial program failed: {probe.status}: "
                                          f"{probe.detail or probe.stderr[-500:]}")
                except _ServerGone as exc:
                    self.off = str(exc)
                    warnings.warn(f"envs.sandbox: the bwrap fork server is off ({self.off}); "
                                  "every bwrap run starts its own sandbox", RuntimeWarning,
                                  stacklevel=4)
                    return None
                self.server = server
                atexit.register(server.close)
            return server


_FORKS = _Forks()
os.register_at_fork(after_in_child=lambda: _FORKS.forget_in_child())
MAX_PRELOADED = 16
_PRELOAD_BYTES = 1 << 16
_PRELOADED: list[str] = []


def preload(code: str) -> None:
    """Let bwrap's fork server compile ``code``, a program run many times (a test harness), once,
    in the server: each later run of exactly this program executes that code instead of
    compiling it in its fork (~2 ms saved for a 4 KB program; the result is the same). Only
    for programs the caller wrote, never an agent's: the compiling happens outside any run.
    Other backends, and bwrap without the fork server, compile every run as before. At most
    ``MAX_PRELOADED`` programs (more are ignored) of at most 64 KiB as JSON; a program with a
    syntax error or a compile-time warning is left to compile in its runs."""
    if not isinstance(code, str):
        raise TypeError(f"preload takes the program's source as a str, got {type(code).__name__}")
    if len(json.dumps({"preload": code})) > _PRELOAD_BYTES:
        raise ValueError(f"a preloaded program is at most {_PRELOAD_BYTES} bytes as JSON")
    with _FORKS.lock:
        if code in _PRELOADED or len(_PRELOADED) >= MAX_PRELOADED:
            return
        _PRELOADED.append(code)
        if _FORKS.server is not None and _FORKS.server.alive():
            _FORKS.server.preload(code)


# --- docker ----------------------------------------------------------------------------------

_DOCKER_CLIENT = None
_DOCKER_LOCK = threading.Lock()


class _DockerUnavailable(Exception):
    pass


def _docker():
    """The Docker SDK client, made and pinged once per process."""
    global _DOCKER_CLIENT
    with _DOCKER_LOCK:
        if _DOCKER_CLIENT is None:
            try:
                import docker
            except ImportError as exc:
                raise _DockerUnavailable(f"the docker SDK is not installed (pip install "
                                         f"'agent-rl[docker]'): {exc}") from exc
            try:
                client = docker.from_env(version="auto", timeout=60)
                client.ping()
            except Exception as exc:  # any failure means no usable engine
                raise _DockerUnavailable(f"the Docker engine does not answer: {exc}") from exc
            _DOCKER_CLIENT = client
        return _DOCKER_CLIENT


def image_tag() -> str:
    """The sandbox image's tag, named after the host interpreter it copies (``py311``)."""
    version = re.fullmatch(r"python(\d)\.(\d+)", os.path.basename(os.path.realpath(PYTHON)))
    return f"{IMAGE_REPOSITORY}:py{version[1]}{version[2]}" if version else f"{IMAGE_REPOSITORY}:py3"


def build_image(client=None, force: bool = False) -> str:
    """Build the sandbox image from this host's ``/usr/bin/python3`` (no registry needed) and
    return its tag; a no-op when it exists (unless ``force``).

    The image holds the interpreter, its standard library, the shared libraries that ``ldd``
    lists for it and its extension modules, the usrmerge links, ``/etc/passwd``/``group`` with
    ``nobody`` (65534) and empty mount points ``/work``, ``/sandbox``, ``/tmp``.
    """
    client = _docker() if client is None else client
    tag = image_tag()
    if not force:
        try:
            client.images.get(tag)
            return tag
        except Exception:  # docker.errors.ImageNotFound: build it below
            pass
    with tempfile.TemporaryDirectory(prefix="agent-rl-sandbox-image-") as tmp:
        tar_path = Path(tmp) / "rootfs.tar"
        _write_rootfs(tar_path)
        repository, name = tag.split(":")
        client.api.import_image_from_file(
            str(tar_path), repository=repository, tag=name,
            changes=["USER 65534:65534", "WORKDIR /work", f'CMD ["{PYTHON}"]',
                     f"LABEL agent-rl-sandbox.python={_python_version()}"])
    client.images.get(tag)
    return tag


def _python_version() -> str:
    out = subprocess.run([PYTHON, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _write_rootfs(tar_path: Path) -> None:
    real_python = os.path.realpath(PYTHON)
    version = os.path.basename(real_python)  # python3.11
    stdlib = Path("/usr/lib") / version
    files = {real_python}
    for path in stdlib.rglob("*"):
        if path.is_file() and not path.is_symlink() and "site-packages" not in path.parts \
                and "dist-packages" not in path.parts:
            files.add(str(path))
    extensions = [real_python, *(str(p) for p in (stdlib / "lib-dynload").glob("*.so"))]
    ldd = subprocess.run(["ldd", *extensions], capture_output=True, text=True)
    libraries = set(re.findall(r"(/\S+\.so[.\d]*)\s", ldd.stdout))
    links: dict[str, str] = {PYTHON: os.path.basename(real_python)}
    for lib in libraries:  # keep each library's symlink chain, resolved through the usrmerge links
        path = os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib))
        while os.path.islink(path):
            target = os.readlink(path)
            links[path] = target
            path = os.path.join(os.path.dirname(path), target)
            path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        files.add(path)
    top_links = {f"/{n}": os.readlink(f"/{n}") for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
                 if os.path.islink(f"/{n}")}
    passwd = b"root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n"
    group = b"root:x:0:\nnogroup:x:65534:\n"

    def add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        tar.addfile(info)

    with tarfile.open(tar_path, "w") as tar:
        dirs = {"/etc", "/work", "/sandbox", "/proc", "/sys", "/dev"}
        for path in files | set(links):
            parent = os.path.dirname(path)
            while parent != "/" and parent not in top_links:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        for d in sorted(dirs):
            add_dir(tar, d)
        add_dir(tar, "/tmp", 0o1777)
        for name, target in {**top_links, **links}.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for path in sorted(files):
            tar.add(path, arcname=path.lstrip("/"), recursive=False)
        for name, data in (("etc/passwd", passwd), ("etc/group", group)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


def _probe_docker() -> bool:
    try:
        build_image(_docker())
    except Exception as exc:  # engine down, SDK missing, build failed
        _UNAVAILABLE_WHY["docker"] = str(exc)
        return False
    result = _run_docker("print('ok')", {}, Limits(wall_s=60))  # bind mounts need a local engine
    if result.status != "ok" or result.stdout != "ok\n":
        _UNAVAILABLE_WHY["docker"] = f"a trivial program failed in Docker: {result.status}: " \
                                     f"{result.detail or result.stderr[-500:]}"
        return False
    return True


def _docker_api_errors() -> tuple[type[BaseException], ...]:
    import docker.errors
    import requests.exceptions
    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def _run_docker(code: str, files: dict[str, bytes], limits: Limits) -> SandboxResult:
    try:
        client = _docker()
    except _DockerUnavailable as exc:
        return _failed("docker", str(exc))
    import docker.errors
    from docker.types import LogConfig, Ulimit
    from docker.utils.socket import frames_iter

    errors = _docker_api_errors()
    workdir = _WorkDir(GUEST_UID)
    container = None
    cpu, disk = _cpu_rlimit(limits), limits.disk_mb * _MIB
    try:
        workdir.fill(code, files)
        try:
            container = client.containers.create(
                image_tag(), [PYTHON, *_GUEST_ARGS, "/sandbox/main.py"],
                user=f"{GUEST_UID}:{GUEST_UID}", working_dir="/work", environment=_guest_env("/work"),
                network_mode="none", read_only=True, init=True, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], ipc_mode="private", shm_size=disk,
                mem_limit=limits.memory_mb * _MIB, memswap_limit=limits.memory_mb * _MIB,
                pids_limit=limits.processes + 1,  # the init process counts too
                nano_cpus=1_000_000_000,
                ulimits=[Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                         Ulimit(name="fsize", soft=disk, hard=disk), Ulimit(name="core", soft=0, hard=0)],
                volumes={str(workdir.prog): {"bind": "/sandbox", "mode": "ro"},
                         str(workdir.work): {"bind": "/work", "mode": "rw"}},
                log_config=LogConfig(type="none"), labels={IMAGE_REPOSITORY: "run"},
                stdin_open=False, tty=False)
            sock = container.attach_socket(params={"stdout": 1, "stderr": 1, "stream": 1})
        except docker.errors.ImageNotFound:
            return _failed("docker", f"image {image_tag()} missing: run envs.sandbox.build_image() "
                                     "or .ci/sandbox_image.sh")
        except errors as exc:
            return _failed("docker", f"could not create the container: {exc}")

        def kill() -> None:
            try:
                container.kill()
            except errors:
                pass

        watch = _Watch(limits, kill)

        def pump() -> None:
            try:
                for stream, data in frames_iter(sock, tty=False):
                    watch.feed(watch.stdout if stream == 1 else watch.stderr, data)
            except (OSError, ValueError):
                pass

        reader = threading.Thread(target=pump, daemon=True, name="sandbox-output")
        reader.start()
        since = time.time()
        t0 = time.monotonic()
        try:
            container.start()
            monitor = watch.monitor(t0 + limits.wall_s, workdir)
            exit_code = container.wait(timeout=limits.wall_s + 60)["StatusCode"]
            wall_s = time.monotonic() - t0
            watch.finish()
            reader.join(timeout=10)
            monitor.join()
            container.reload()
        except docker.errors.NotFound:
            return _failed("docker", "the container vanished mid-run", time.monotonic() - t0)
        except errors as exc:
            return _failed("docker", f"the engine failed mid-run: {exc}", time.monotonic() - t0)
        finally:
            watch.finish()
            try:
                sock.close()
            except OSError:
                pass
        state = container.attrs["State"]
        failure = ""
        if watch.stopped is None and exit_code > 128 and not state.get("OOMKilled"):
            try:  # a signal death: the guest's own, or a kill through the engine's API?
                kills = list(client.api.events(since=f"{since:.6f}", until=f"{time.time():.6f}",
                                               decode=True, filters={"container": container.id,
                                                                     "event": "kill"}))
            except errors as exc:
                kills, failure = [], f"the engine failed after the run: {exc}"
            if kills:
                failure = f"the container was killed from outside (exit code {exit_code})"
        outcome = _Outcome(exit_code=exit_code, stopped=watch.stopped,
                           stderr=watch.stderr.decode("utf-8", "replace"), failure=failure,
                           oom=bool(state.get("OOMKilled")), disk_used=workdir.usage())
        return _result(outcome, watch, wall_s, "docker", workdir)
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except errors:
                pass
        workdir.cleanup()


_PROBES: dict[str, Callable[[], bool]] = {
    "subprocess": lambda: os.path.exists(PYTHON), "bwrap": _probe_bwrap, "docker": _probe_docker}
_AVAILABLE: dict[str, bool] = {}
_UNAVAILABLE_WHY: dict[str, str] = {"subprocess": f"{PYTHON} not found"}
_AVAILABLE_LOCK = threading.RLock()
