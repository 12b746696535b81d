"""The process backends, ``subprocess`` and a fresh ``bwrap`` per run: how a guest is launched.

The guest starts through ``/bin/sh`` (it joins the run's cgroups), util-linux's ``prlimit`` (the
rlimits) and, as root, ``setpriv`` (the guest uid), not a ``preexec_fn``: the child never runs
Python, so starting a run costs the same in a process holding gigabytes (a forked trainer would
copy its page tables). As root, ``subprocess`` runs also go through util-linux's ``unshare`` into
a pid namespace of their own, with a new ``/proc`` and ``/bin/sh`` as its init, where the kernel
allows it (checked once). The interpreter then waits in a trusted boot (``_BOOT``) for its go, so
that a sandbox can be started before its program is known (``envs.sandbox.prepare``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import warnings

from envs.sandbox.cgroups import Cgroup, child_pids, kill_and_wait, processes_of
from envs.sandbox.limits import (
    GUEST_ARGS,
    GUEST_UID,
    MIB,
    PYTHON,
    SUBPROCESS_UID,
    Limits,
    RunFacts,
    SandboxResult,
    Watch,
    guest_env,
    rlimits,
    sandbox_result,
)
from envs.sandbox.workdir import WorkDir


def _guest_uid(backend: str) -> int | None:
    """The uid a process backend's guest runs as; None (this process's own) unless root."""
    if os.geteuid() != 0:
        return None
    return SUBPROCESS_UID if backend == "subprocess" else GUEST_UID


@functools.cache
def system_tool(name: str) -> str | None:
    """Where a system tool (util-linux's, bwrap) is, on the system's own path only."""
    return shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin")


_JOIN_AND_EXEC = ('while [ "$1" != -- ]; do { echo $$ > "$1"; } 2>/dev/null || '
                  '{ echo "agent-rl-sandbox: cannot join the cgroup $1" >&2; exit 125; }; '
                  'shift; done; shift; exec "$@"')
# the init of a subprocess run's pid namespace: runs the rest (after ``--``) as its child, with its
# own stderr on /dev/null (sh says "Segmentation fault" when its child dies so), and exits with
# the child's status, 128 + N after signal N; reaps orphans meanwhile
_PID1 = 'exec 3>&2 2>/dev/null; shift; (exec "$@" 2>&3 3>&-); exit $?'
_LAUNCHER_FAILED = re.compile(r"^(?:agent-rl-sandbox|\S*prlimit|\S*unshare|\S*setpriv): ")
_UNSHARE_PID = ("--pid", "--fork", "--kill-child", "--mount-proc")


@functools.cache
def _pid_namespaces() -> bool:
    """Can this process give ``subprocess`` runs a pid namespace (root, and ``unshare`` works:
    not in a container without ``CAP_SYS_ADMIN``)? Tried once."""
    unshare = system_tool("unshare")
    if os.geteuid() != 0 or unshare is None:
        return False
    try:
        return subprocess.run([unshare, *_UNSHARE_PID, "--", "/bin/sh", "-c", _PID1, "sh", "--", "true"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={}, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def launcher(limits: Limits | None, cgroup: Cgroup, uid: int | None, extra_processes: int,
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
    tools = {name: system_tool(name) for name in ("prlimit", "unshare", "setpriv")}
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
        argv += [f"--{name.lower()}={soft}:{hard}" for name, (soft, hard) in rlimits(limits).items()]
    if limits is not None and "pids" not in cgroup.dirs:  # per user: counts the uid's other processes
        nproc = limits.processes + extra_processes + len(processes_of(os.geteuid() if uid is None else uid))
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


class LaunchFailed(Exception):
    """A process backend could not start its guest (a ``sandbox_error``, said in the message)."""


class ProcessRun:
    """One run of a process backend (``subprocess``, ``bwrap``): ``__init__`` starts the guest
    (cgroups, rlimits and uid through ``launcher``, then bwrap and/or the interpreter, which
    waits in ``_BOOT``), ``run`` gives it its program and files, times, watches and reaps it,
    ``close`` kills whatever is left and removes the work dir and cgroups. Starting costs most
    of a run's CPU (namespaces, the interpreter's start-up); once started, a guest runs only
    its program."""

    def __init__(self, backend: str, limits: Limits):
        self.backend, self.limits = backend, limits
        self.proc: subprocess.Popen | None = None
        self.cgroup: Cgroup | None = None
        self.status_r = self.status_w = -1
        self.pumps: list[threading.Thread] = []
        self.watch = Watch(limits, self.kill)
        uid = _guest_uid(backend)
        self.workdir = WorkDir(uid)
        try:
            self._start(uid)
        except BaseException:
            self.close()
            raise

    def _start(self, uid: int | None) -> None:
        main = str(self.workdir.main)
        pid_namespace = self.backend == "subprocess" and uid is not None and _pid_namespaces()
        if self.backend == "bwrap":
            bwrap = system_tool("bwrap")
            if bwrap is None:
                raise LaunchFailed("bwrap not found (apt-get install bubblewrap)")
            self.status_r, self.status_w = os.pipe()
            # bwrap's outer process and the namespace's pid 1 count against the pids limit too
            argv, env, cwd, extra = (_bwrap_argv(bwrap, self.workdir, self.limits, self.status_w),
                                     {}, self.workdir.root, 2)
        else:
            if not os.path.exists(PYTHON):
                raise LaunchFailed(f"{PYTHON} not found (the sandbox runs the system Python)")
            # in a pid namespace, unshare's two processes (it and the init) count too
            argv, env, cwd, extra = ([PYTHON, *GUEST_ARGS, "-c", _BOOT, main],
                                     guest_env(str(self.workdir.work)), self.workdir.work,
                                     2 if pid_namespace else 0)
        self.cgroup = Cgroup(self.limits.processes + extra, self.limits.memory_mb * MIB)
        try:
            launch = launcher(self.limits, self.cgroup, uid, extra, pid_namespace=pid_namespace)
            self.proc = subprocess.Popen(
                launch + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=cwd, env=env, close_fds=True,
                pass_fds=() if self.status_w < 0 else (self.status_w,), start_new_session=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LaunchFailed(f"{self.backend} could not start: {exc}") from None
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
            kill_and_wait([leader, *child_pids(leader)], group=leader)
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
        outcome = RunFacts(
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
        return sandbox_result(outcome, self.watch, wall_s, self.backend, self.workdir)

    def _bwrap_failure(self, outcome: RunFacts) -> RunFacts:
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


_WARNED_SUBPROCESS = False


def warn_subprocess() -> None:
    """Say once per process that ``subprocess`` isolates nothing (at the caller of ``run``)."""
    global _WARNED_SUBPROCESS
    if not _WARNED_SUBPROCESS:
        _WARNED_SUBPROCESS = True
        warnings.warn("envs.sandbox: the 'subprocess' backend is not an isolation boundary (the "
                      "program sees this user's files and the network; only rlimits, cgroups and "
                      "a timeout apply); install bubblewrap or Docker for a sandbox",
                      RuntimeWarning, stacklevel=4)


def bwrap_root(bwrap: str) -> list[str]:
    """bwrap's argv up to what differs between a run and the fork server: the namespaces, the
    environment, the read-only ``/usr`` and its links, ``/proc`` and ``/dev``."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv"]
    for key, value in guest_env("/work").items():
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


def _bwrap_argv(bwrap: str, workdir: WorkDir, limits: Limits, status_fd: int) -> list[str]:
    argv = bwrap_root(bwrap)
    argv += ["--size", str(limits.disk_mb * MIB), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--ro-bind", str(workdir.prog), "/sandbox", "--bind", str(workdir.work), "/work",
             "--chdir", "/work", "--remount-ro", "/", "--json-status-fd", str(status_fd),
             PYTHON, *GUEST_ARGS, "-c", _BOOT, "/sandbox/main.py"]
    return argv


_LAUNCHER_LOCK = threading.Lock()
_LAUNCHER: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def launcher_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One thread, kept for the process's life, that starts the guests of ``prepare`` and the
    fork server: bwrap's ``--die-with-parent`` is the kernel's parent-death signal, sent when
    the *thread* that started it exits, so a short-lived starter thread would kill its guest.
    (Made again in a forked child, where the parent's thread does not exist.)"""
    global _LAUNCHER
    with _LAUNCHER_LOCK:
        if _LAUNCHER is None or _LAUNCHER[0] != os.getpid():
            _LAUNCHER = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sandbox-launcher"))
        return _LAUNCHER[1]

