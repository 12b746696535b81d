"""Cgroups (v1) for the process backends, and ending a run's processes.

Each run gets a ``pids`` and a ``memory`` cgroup, made under this process's own cgroup of each
hierarchy (in a folder ``agent-rl-sandbox``) when that is writable, in practice as root; without
them the rlimits stand alone. ``kill_and_wait`` SIGKILLs processes and returns once each has
exited (a pidfd per process: neither a reused pid nor one reaped meanwhile is mistaken for it).
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import time
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_IDS = itertools.count()
_LIVE_CGROUPS: set[str] = set()  # this process's runs in progress


def cgroup_parents() -> dict[str, Path]:
    """Where this process's run cgroups go, per controller (``pids``, ``memory``) it is in."""
    pid = os.getpid()
    if pid not in _PARENTS:  # a forked child works out its own
        _PARENTS.clear()
        _PARENTS[pid] = {controller: _CGROUP_ROOT / controller / path.lstrip("/") / "agent-rl-sandbox"
                         for controller, path in _own_cgroups().items() if controller in ("pids", "memory")}
    return dict(_PARENTS[pid])


_PARENTS: dict[int, dict[str, Path]] = {}  # pid -> its run cgroups' parents


class Cgroup:
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
        for controller, parent in cgroup_parents().items():
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
            fields = dict(line.split() for line in read_lines(f"{self.dirs['memory']}/memory.oom_control"))
            oom = int(fields.get("oom_kill", "0")) > 0
        if "pids" in self.dirs:
            fields = dict(line.split() for line in read_lines(f"{self.dirs['pids']}/pids.events"))
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
                pids = [int(p) for p in read_lines(procs)]
                if not pids:
                    break
                found = True
                kill_and_wait(pids)
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


def kill_and_wait(pids: list[int], group: int | None = None) -> None:
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


def child_pids(pid: int) -> list[int]:
    """``pid``'s child processes (Linux's ``/proc/PID/task/PID/children``)."""
    return [int(child) for line in read_lines(f"/proc/{pid}/task/{pid}/children") for child in line.split()]


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


def read_lines(path: Path | str) -> list[str]:
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
    for line in read_lines(Path("/proc/self/cgroup")):
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller and (_CGROUP_ROOT / controller).is_dir():
                out[controller] = path
    return out


def processes_of(uid: int) -> list[int]:
    """Pids whose real uid is ``uid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            for line in read_lines(Path("/proc", entry, "status")):
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        out.append(int(entry))
                    break
    return out

