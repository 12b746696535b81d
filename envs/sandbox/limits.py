"""What a run may use and how it ends: ``Limits``, ``SandboxResult`` and its statuses, who the
guest is, and the host-side watch that stops a run and turns what it saw into one status.

One status per run:

* ``ok``: exit code 0 within every limit;
* ``runtime_error``: a nonzero exit, or death by a signal that none of our limits sent;
* ``timeout``: ``wall_s`` (from the host) or ``cpu_s`` (``RLIMIT_CPU``: per process, rounded up
  to whole seconds) ran out;
* ``resource_limit``: memory, processes, output bytes (per stream) or disk ran out;
* ``sandbox_error``: the sandbox itself failed, never the guest's fault.

A memory limit hit inside one process surfaces as Python's ``MemoryError``; a run whose stderr
ends with it counts as ``resource_limit`` (a guest can only make its own failure look like
that, never like ``ok``). A limit-bound failure counts as ``resource_limit`` only when the run
failed (a program that meets ``EAGAIN`` from ``fork`` and still exits 0 is ``ok``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from envs.sandbox.workdir import WorkDir

SandboxStatus = Literal["ok", "runtime_error", "timeout", "resource_limit", "sandbox_error"]
BACKENDS = ("docker", "bwrap", "subprocess")
PYTHON = "/usr/bin/python3"  # the Debian interpreter, never the venv's
GUEST_ARGS = ("-I", "-S")  # isolated: no site, no PYTHON* variables, no script dir on sys.path
GUEST_UID = 65534  # nobody/nogroup: the guest's uid and gid whenever we can choose
SUBPROCESS_UID = 65533
"""The ``subprocess`` backend's guest uid and gid as root. Not ``GUEST_UID``: such a guest sees the
host's files (bwrap runs' work dirs, that uid's, among them), and the uid that owns the bwrap fork
server's user namespace may trace the server whatever its dumpability. 65533 is outside systemd's
dynamic users (61184-65519), in Debian's reserved, never allocated 65000-65533."""
MIB = 1 << 20
DISK_POLL_S = 0.05  # how often the work dir's usage is checked during a run


def guest_env(home: str) -> dict[str, str]:
    """The guest's whole environment."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"}


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


class Stop(enum.Enum):
    """Why the host stopped a run."""

    WALL = "wall time"
    OUTPUT = "output"
    DISK = "disk"


class Watch:
    """Stops a run once (the first reason wins) and captures its two output streams."""

    def __init__(self, limits: Limits, kill: Callable[[], None]):
        self.limits, self._kill = limits, kill
        self.stopped: Stop | None = None
        self._killer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.done = threading.Event()

    def stop(self, why: Stop) -> None:
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
        self.stop(Stop.OUTPUT)

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

    def check(self, deadline: float, workdir: WorkDir) -> bool:
        """Stop the run if ``deadline`` passed or the work dir outgrew ``disk_mb``; whether the
        run is stopped (for any reason)."""
        if time.monotonic() >= deadline:
            self.stop(Stop.WALL)
        elif workdir.usage() > self.limits.disk_mb * MIB:
            self.stop(Stop.DISK)
        return self.stopped is not None

    def monitor(self, deadline: float, workdir: WorkDir) -> threading.Thread:
        """``check`` every ``DISK_POLL_S`` (and at ``deadline``) on a thread of its own."""
        def loop() -> None:
            while not self.done.wait(max(0.0, min(DISK_POLL_S, deadline - time.monotonic()))):
                if self.check(deadline, workdir):
                    return

        thread = threading.Thread(target=loop, daemon=True, name="sandbox-monitor")
        thread.start()
        return thread


@dataclass
class RunFacts:
    """The facts a backend gathered; ``classify`` turns them into one status."""

    exit_code: int | None
    stopped: Stop | None
    stderr: str
    failure: str = ""  # the sandbox itself failed
    cpu_s: float | None = None  # the run's CPU seconds, where the backend can tell
    oom: bool = False  # a memory cgroup OOM kill / Docker's OOMKilled
    pids_hit: bool = False  # the pids cgroup refused a fork
    disk_used: int = 0  # bytes in the work dir at the end


_MEMORY_ERROR = re.compile(r"^MemoryError\b")


def cpu_rlimit(limits: Limits) -> int:
    """``cpu_s`` as ``RLIMIT_CPU`` takes it: whole seconds, rounded up."""
    return max(1, math.ceil(limits.cpu_s))


def rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    """A run's rlimits, (soft, hard) by ``RLIMIT_`` name."""
    cpu, memory, disk = cpu_rlimit(limits), limits.memory_mb * MIB, limits.disk_mb * MIB
    return {"CPU": (cpu, cpu + 1), "AS": (memory, memory), "FSIZE": (disk, disk), "CORE": (0, 0)}


def classify(o: RunFacts, limits: Limits) -> tuple[SandboxStatus, str]:
    """One status and its detail; the first that applies, in the order below."""
    if o.failure:
        return "sandbox_error", o.failure
    if o.stopped is Stop.WALL:
        return "timeout", f"wall time over {limits.wall_s:g} s"
    if o.stopped is Stop.OUTPUT:
        return "resource_limit", f"output over {limits.output_bytes} bytes on stdout or stderr"
    if o.stopped is Stop.DISK or o.disk_used > limits.disk_mb * MIB:  # more than the poll saw
        return "resource_limit", f"work dir over {limits.disk_mb} MiB"
    if o.exit_code == 0:
        return "ok", ""
    lines = o.stderr.rstrip().splitlines()
    if o.oom or (o.exit_code == 1 and lines and _MEMORY_ERROR.match(lines[-1])):
        return "resource_limit", f"memory over {limits.memory_mb} MiB"
    killed_by_cpu = o.exit_code == 128 + signal.SIGKILL and o.cpu_s is not None \
        and o.cpu_s >= cpu_rlimit(limits) - 0.05
    if o.exit_code == 128 + signal.SIGXCPU or killed_by_cpu:
        return "timeout", f"CPU time over {cpu_rlimit(limits)} s"
    if o.pids_hit:
        return "resource_limit", f"more than {limits.processes} processes"
    if o.disk_used >= limits.disk_mb * MIB:  # a write met RLIMIT_FSIZE
        return "resource_limit", f"work dir reached {limits.disk_mb} MiB"
    if o.exit_code is not None and o.exit_code > 128:
        try:
            return "runtime_error", f"killed by {signal.Signals(o.exit_code - 128).name}"
        except ValueError:
            pass
    return "runtime_error", f"exit code {o.exit_code}"


def sandbox_result(o: RunFacts, watch: Watch, wall_s: float, backend: str,
                   workdir: WorkDir | None) -> SandboxResult:
    """The run's ``SandboxResult``: its status from ``classify``, its output from ``watch``."""
    status, detail = classify(o, watch.limits)
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


def failed(backend: str, detail: str, wall_s: float = 0.0) -> SandboxResult:
    """A ``sandbox_error``: the sandbox itself failed, for ``detail``."""
    return SandboxResult(status="sandbox_error", stdout="", stderr="", exit_code=None,
                         wall_s=wall_s, backend=backend, detail=detail)

