"""The front: ``run`` and ``prepare`` (a ``Guest``: a sandbox started before its program is
known), and which backend runs (``choose_backend``, ``available``).

``guest = prepare(limits, backend)`` starts a sandbox (bwrap and subprocess: cgroups, rlimits,
namespaces and the interpreter, which then waits for a go on its stdin), and ``guest.run(code,
files)`` writes the program and files in place and lets it go: the same result, limits and
isolation as ``run``, one fresh sandbox per program, but the start-up (most of a short run's
cost) is paid while the caller does other work (CodeTests-v0 starts each episode's sandbox at
``reset``, while the policy writes the answer). ``run`` itself is a guest started and let go at
once. Docker containers are not started ahead. Through bwrap's fork server, ``prepare`` sets the
run up there: its folder, cgroups and processes, the program's own waiting for its go.

Nothing of a run outlives ``run``'s return (nor a ``Guest``'s ``close``): every process of the
run is killed (SIGKILL) and waited for until it has exited.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable, Mapping

from envs.sandbox import settings
from envs.sandbox.docker import build_image, docker_client, run_docker
from envs.sandbox.forkserver.client import ForkedRun, fork_server
from envs.sandbox.limits import BACKENDS, PYTHON, Limits, SandboxResult, failed
from envs.sandbox.process import (
    LaunchFailed,
    ProcessRun,
    launcher_thread,
    system_tool,
    warn_subprocess,
)
from envs.sandbox.workdir import check_files


def run(code: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None,
        backend: str = "auto") -> SandboxResult:
    """Run ``code`` as the main program with ``files`` in its work dir; ``docs/sandboxes.md`` says
    what each backend isolates.

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


_WAITING = 0
_WAITING_LOCK = threading.Lock()


class _WaitingSlot:
    """One of ``settings.MAX_WAITING``'s places, held by a guest started ahead from ``prepare``
    until its program comes, it closes or it is collected; ``give`` hands it back, once."""

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
        if _WAITING >= settings.MAX_WAITING:
            return None
        _WAITING += 1
        return _WaitingSlot()


def _close_unused(process: ProcessRun | ForkedRun, slot: _WaitingSlot | None) -> None:
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
    ran and removes its work dir and cgroups. Past ``settings.MAX_WAITING`` waiting guests, or
    where the process has no pids cgroup (``RLIMIT_NPROC`` counts the guest uid's processes,
    waiting ones too), the sandbox starts in ``run``. bwrap through the fork server
    (``settings.FORK_SERVER``): ``prepare`` sets the run up there (its folder, cgroups, and the
    forked processes up to the program's own, which waits for its go), a millisecond or so of
    this process's time."""

    def __init__(self, backend: str, limits: Limits, ahead: bool = True):
        self.backend, self.limits = backend, limits
        self._process: ProcessRun | ForkedRun | None = None
        self._finalizer: weakref.finalize | None = None
        self._starter: concurrent.futures.Future | None = None
        self._failure = ""
        self._used = False
        self._slot: _WaitingSlot | None = None
        if backend == "subprocess":
            warn_subprocess()
        server = fork_server() if backend == "bwrap" and ahead else None
        if ahead and backend != "docker":
            self._slot = _take_waiting_slot()
        if self._slot is not None and server is not None:  # set up at once: a few forks
            self._process = server.prepare(limits)
            self._finalizer = weakref.finalize(self, _close_unused, self._process, self._slot)
        elif self._slot is not None:
            # on the launcher thread: the caller (an env's reset) does not wait for the launch
            self._starter = launcher_thread().submit(self._start, True)

    def _start(self, ahead: bool = False) -> None:
        try:
            process = ProcessRun(self.backend, self.limits)
        except LaunchFailed as exc:
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
                return run_docker(code, files, self.limits)
            if self.backend == "bwrap" and self._process is None and not self._failure \
                    and (server := fork_server()) is not None:
                return server.run(code, files, self.limits)
            if self._process is None and not self._failure:
                self._start()
            if self._failure:
                return failed(self.backend, self._failure)
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
    return check_files(files)


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


def _probe_bwrap() -> bool:
    if system_tool("bwrap") is None:
        _UNAVAILABLE_WHY["bwrap"] = "bwrap not found (apt-get install bubblewrap)"
        return False
    result = run("print('ok')", limits=Limits(wall_s=30), backend="bwrap")
    if result.status != "ok" or result.stdout != "ok\n":
        _UNAVAILABLE_WHY["bwrap"] = f"a trivial program failed in bwrap: {result.status}: " \
                                    f"{result.detail or result.stderr[-500:]}"
        return False
    return True


def _probe_docker() -> bool:
    try:
        build_image(docker_client())
    except Exception as exc:  # engine down, SDK missing, build failed
        _UNAVAILABLE_WHY["docker"] = str(exc)
        return False
    result = run_docker("print('ok')", {}, Limits(wall_s=60))  # bind mounts need a local engine
    if result.status != "ok" or result.stdout != "ok\n":
        _UNAVAILABLE_WHY["docker"] = f"a trivial program failed in Docker: {result.status}: " \
                                     f"{result.detail or result.stderr[-500:]}"
        return False
    return True


_PROBES: dict[str, Callable[[], bool]] = {
    "subprocess": lambda: os.path.exists(PYTHON), "bwrap": _probe_bwrap, "docker": _probe_docker}
_AVAILABLE: dict[str, bool] = {}
_UNAVAILABLE_WHY: dict[str, str] = {"subprocess": f"{PYTHON} not found"}
_AVAILABLE_LOCK = threading.RLock()
