"""The host side of bwrap's fork server: starting it, sending it runs, reading each run's end.

As root with a pids cgroup, the first bwrap run of a process starts one bwrap sandbox holding a
warm guest interpreter (``server.py``, run as ``python3 -I -S -c SOURCE``), and every bwrap run
is then two forks of it instead of a new bwrap and interpreter. A run's request goes out on the
control socket with its pipes' far ends (stdout, stderr, status, go); everything about the run
comes back on them, read on the caller's thread (no thread per run). ``docs/sandboxes.md`` says
what each run gets of its own and what it shares with the others.

A server that cannot start is said once (``RuntimeWarning``) and every run starts its own bwrap;
a server that dies fails the runs in flight (``sandbox_error``) and the next run starts a fresh
one; one that stops reading fails each run it does not start within its ``wall_s``
(``sandbox_error``, never the program's timeout). A process forked after the server started
starts its own.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

from envs.sandbox import settings
from envs.sandbox.cgroups import Cgroup, cgroup_parents
from envs.sandbox.limits import (
    DISK_POLL_S,
    GUEST_ARGS,
    GUEST_UID,
    MIB,
    PYTHON,
    Limits,
    RunFacts,
    SandboxResult,
    Watch,
    failed,
    rlimits,
    sandbox_result,
)
from envs.sandbox.process import bwrap_root, launcher, launcher_thread, system_tool
from envs.sandbox.workdir import WorkDir, runs_root

_FORK_SOURCE = Path(__file__).with_name("server.py")  # the program the server runs
_SERVER_PROCESSES = 1024  # its bwrap, pid 1, itself, and each run's A until it joins its own
_SERVER_MEMORY = 256 * MIB
_SEND_TIMEOUT_S = 10.0


class _ServerGone(Exception):
    """The fork server died or cannot start (the message says why)."""


class ForkServer:
    """One bwrap sandbox holding the fork server (``server.py``), started through
    ``launcher`` (its cgroups, the guest uid, no rlimits: each run sets its own), and the host
    side of its control socket: a run's request goes out with its three pipes' write ends, and
    everything about the run comes back on them, read on the caller's thread (no thread per
    run)."""

    def __init__(self):
        self.owner = os.getpid()
        _sweep_runs_dirs()
        self.runs_dir = Path(tempfile.mkdtemp(prefix=f"{_RUNS_PREFIX}{self.owner}-", dir=runs_root()))
        self.cgroup: Cgroup | None = None
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
        parents = cgroup_parents()
        if os.geteuid() != 0 or "pids" not in parents:
            raise _ServerGone("needs root and a writable pids cgroup")
        bwrap = system_tool("bwrap")
        if bwrap is None:
            raise _ServerGone("bwrap not found (apt-get install bubblewrap)")
        for parent in parents.values():
            parent.mkdir(parents=True, exist_ok=True)
        self.cgroup = Cgroup(_SERVER_PROCESSES, _SERVER_MEMORY)
        if set(self.cgroup.dirs) != set(parents):
            raise _ServerGone(f"could not make its cgroups under {', '.join(map(str, parents.values()))}")
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(_SEND_TIMEOUT_S)  # a server that stopped reading fails the run
        argv = bwrap_root(bwrap) + ["--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                                     "--dir", "/work", "--dir", "/sandbox",
                                     "--bind", str(self.runs_dir), "/runs"]
        for controller, parent in parents.items():
            argv += ["--bind", str(parent), f"/cg/{controller}"]
        argv += ["--cap-add", "ALL", "--chdir", "/", "--remount-ro", "/",
                 PYTHON, *GUEST_ARGS, "-c", _FORK_SOURCE.read_text(), str(theirs.fileno())]
        try:
            launch = launcher(None, self.cgroup, GUEST_UID, 0)
            # on the launcher thread: bwrap's --die-with-parent follows the starting thread;
            # no environment: bwrap needs none, and every process of the server's (bwrap's two,
            # outside its --clearenv, included) runs as GUEST_UID, whose /proc/PID/environ
            # that uid's processes could read
            self.proc = launcher_thread().submit(
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

    def prepare(self, limits: Limits) -> ForkedRun:
        """A run set up now, its program to come (``Guest``, ``prepare``)."""
        return ForkedRun(self, limits)

    def run(self, code: str, files: dict[str, bytes], limits: Limits) -> SandboxResult:
        return ForkedRun(self, limits).run(code, files)

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


class ForkedRun:
    """One run through the fork server. ``__init__`` makes its folder, cgroups and pipes and
    sends the request: the server's two processes set the run up and the second waits for a
    go. ``run`` writes the program and files in place, sends the go (``wall_s`` counts from
    there) and reads the run's pipes to their end on this thread; ``close`` (after ``run``, or
    instead of it: the waiting process sees its go pipe close and exits) removes what it made."""

    def __init__(self, server: ForkServer, limits: Limits):
        self.server, self.limits = server, limits
        self.workdir: WorkDir | None = None
        self.cgroup: Cgroup | None = None
        self.ours: dict[str, int] = {}  # our ends: stdout, stderr, status (read), go (write)
        self.failure = ""
        if not server.alive():
            self.failure = server.gone or server.why_gone() or "the bwrap fork server is gone"
            return
        try:
            self.workdir = WorkDir(GUEST_UID, parent=server.runs_dir)
            self.cgroup = Cgroup(limits.processes + 2, limits.memory_mb * MIB, owner=GUEST_UID)
            if "pids" not in self.cgroup.dirs:
                self.failure = "could not make the run's pids cgroup"
                return
            theirs = []
            for name in ("stdout", "stderr", "status", "go"):
                r, w = os.pipe()
                self.ours[name], far = (w, r) if name == "go" else (r, w)
                theirs.append(far)
            request = {"dir": self.workdir.root.name, "shm": limits.disk_mb * MIB,
                       "rlimits": rlimits(limits),
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
                return failed("bwrap", self.failure)
            limits, cgroup, workdir = self.limits, self.cgroup, self.workdir
            workdir.fill(code, files)
            alive_at_stop: list[bool] = []
            watch = Watch(limits, lambda: alive_at_stop.append(cgroup.kill()))
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
            outcome = RunFacts(exit_code=None if ended is None else int(ended[1]),
                               stopped=watch.stopped, stderr=watch.stderr.decode("utf-8", "replace"),
                               failure=failure, cpu_s=None if ended is None else float(ended[2]),
                               oom=oom, pids_hit=pids_hit, disk_used=workdir.usage())
            return sandbox_result(outcome, watch, wall_s, "bwrap", workdir)
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


def _drain(watch: Watch, workdir: WorkDir, streams: dict[int, bytearray], deadline: float) -> None:
    """Read a fork server run's pipes until all end (every process holding them is gone), on
    this thread: output through ``watch`` (its cap), the status fd whole; stop the run at
    ``deadline`` or when the work dir outgrows ``disk_mb`` (polled every ``DISK_POLL_S``)."""
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    status_fd = list(streams)[-1]
    left = set(streams)
    next_poll, stopped_at = time.monotonic() + DISK_POLL_S, None
    while left:
        now = time.monotonic()
        if watch.stopped is None and now >= min(deadline, next_poll):
            next_poll = now + DISK_POLL_S
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
        self.server: ForkServer | None = None
        self.off = ""

    def forget_in_child(self) -> None:
        """After ``os.fork``: the parent's server is not this process's (its socket closed
        here, the server left to the parent); a lock another thread held is free."""
        self.lock = threading.Lock()
        if self.server is not None and self.server.sock is not None:
            self.server.sock.close()
        self.server = None

    def get(self) -> ForkServer | None:
        if not settings.FORK_SERVER:
            return None
        with self.lock:
            server = self.server
            if server is not None and not server.alive():
                server.close()  # its cgroups and folders; a fresh one below
                self.server = server = None
            if server is None and not self.off:
                try:
                    server = ForkServer()
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
                                  stacklevel=5)  # run()'s caller, through fork_server()
                    return None
                self.server = server
                atexit.register(server.close)
            return server


_FORKS = _Forks()
os.register_at_fork(after_in_child=lambda: _FORKS.forget_in_child())


def fork_server() -> ForkServer | None:
    """This process's fork server, started at its first call (and again after it died); None
    when ``settings.FORK_SERVER`` is off or the server cannot run here (said once)."""
    return _FORKS.get()


_PRELOAD_BYTES = 1 << 16
_PRELOADED: list[str] = []


def preload(code: str) -> None:
    """Let bwrap's fork server compile ``code``, a program run many times (a test harness), once,
    in the server: each later run of exactly this program executes that code instead of
    compiling it in its fork (~2 ms saved for a 4 KB program; the result is the same). Only
    for programs the caller wrote, never an agent's: the compiling happens outside any run.
    Other backends, and bwrap without the fork server, compile every run as before. At most
    ``settings.MAX_PRELOADED`` programs (more are ignored) of at most 64 KiB as JSON; a program
    with a syntax error or a compile-time warning is left to compile in its runs."""
    if not isinstance(code, str):
        raise TypeError(f"preload takes the program's source as a str, got {type(code).__name__}")
    if len(json.dumps({"preload": code})) > _PRELOAD_BYTES:
        raise ValueError(f"a preloaded program is at most {_PRELOAD_BYTES} bytes as JSON")
    with _FORKS.lock:
        if code in _PRELOADED or len(_PRELOADED) >= settings.MAX_PRELOADED:
            return
        _PRELOADED.append(code)
        if _FORKS.server is not None and _FORKS.server.alive():
            _FORKS.server.preload(code)

