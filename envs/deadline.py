"""Calls under a wall-clock deadline, in worker processes that can be killed.

``call(fn, *args, timeout_s=10.0)`` returns ``fn(*args)`` computed in a worker process, raises
what ``fn`` raised, or ``DeadlineExceeded`` when no result came within ``timeout_s`` seconds:
the worker is then killed (with its process group), so a hung function (a catastrophic regex
backtrack, a sleep, an endless loop in a user's reward) is abandoned for real, which a thread
never can be. A worker that dies during a call (a crash, ``os._exit`` in the function) is
``WorkerDied``. ``fn`` and ``args`` must pickle (a module-level function, a ``functools.partial``
of one); so must the result.

Workers are plain ``python -c`` processes (not ``multiprocessing``, which would re-import the
caller's ``__main__``): each gets the caller's ``sys.path``, and every request carries the
caller's working directory and ``sys.path``, so the function runs as it would in the caller.
A worker is reused for the next call (one per concurrent caller, kept idle in between): a call
costs a pickle round trip over a socket pair, 0.07 to 0.2 ms, plus the function; starting
a worker (importing ``envs``) takes about 0.4 s, once per process and again after each kill.
The deadline counts from the request, so it covers a user module's first import in a worker.

Workers never outlive the caller: they read EOF and exit when the caller closes or exits, and
on Linux they are started from one long-lived thread with ``PR_SET_PDEATHSIG`` (SIGKILL), so
a caller killed with SIGKILL takes them along, even one stuck in a function.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, Pipe
from typing import Any

__all__ = ["DeadlineExceeded", "WorkerDied", "call"]

START_TIMEOUT_S = 120.0  # a worker that has not said "ready" by then did not start
MAX_IDLE = 4  # idle workers kept for reuse; more are closed

_BOOT = """\
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:] = conn.recv()
from envs.deadline import serve
serve(conn, int(sys.argv[2]))
"""


class DeadlineExceeded(TimeoutError):
    """The call did not return within its deadline; its worker was killed."""

    def __init__(self, timeout_s: float):
        super().__init__(f"no result within {timeout_s:g} s (the call was stopped)")
        self.timeout_s = timeout_s


class WorkerDied(RuntimeError):
    """The worker process ended during the call (a crash or an exit in the called function)."""


class _Worker:
    def __init__(self) -> None:
        parent, child = Pipe(duplex=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(child.fileno()), str(os.getpid())],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        child.close()
        self.conn = parent
        self.pid = os.getpid()  # the process that owns it (a fork must not share it)
        parent.send(list(sys.path))
        if not parent.poll(START_TIMEOUT_S):
            self.kill()
            raise WorkerDied(f"a deadline worker did not start within {START_TIMEOUT_S:g} s")
        try:
            parent.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise WorkerDied(f"a deadline worker exited while starting (exit code {code}); "
                             "its error is on stderr") from None

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def kill(self) -> int | None:
        """Kill the worker and whatever it started; its exit code."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.conn.close()
        return self.proc.wait()

    def close(self) -> None:
        self.conn.close()  # the worker reads EOF and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.kill()


_idle: list[_Worker] = []
_lock = threading.Lock()
_starter: ThreadPoolExecutor | None = None  # one long-lived thread starts every worker


def _start() -> _Worker:
    global _starter
    with _lock:
        if _starter is None:
            _starter = ThreadPoolExecutor(1, thread_name_prefix="deadline-worker-start")
        starter = _starter
    return starter.submit(_Worker).result()


def _acquire() -> _Worker:
    with _lock:
        while _idle:
            worker = _idle.pop()
            if worker.alive():
                return worker
    return _start()


def _release(worker: _Worker) -> None:
    with _lock:
        if len(_idle) < MAX_IDLE and worker.alive():
            _idle.append(worker)
            return
    worker.close()


def call(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in a worker process within ``timeout_s`` seconds (module docstring)."""
    worker = _acquire()
    try:
        worker.conn.send((os.getcwd(), list(sys.path), fn, args))
    except (OSError, EOFError) as exc:
        code = worker.kill()
        raise WorkerDied(f"the deadline worker is gone (exit code {code}): {exc}") from None
    if not worker.conn.poll(timeout_s):
        worker.kill()
        raise DeadlineExceeded(timeout_s)
    try:
        ok, value = worker.conn.recv()
    except (EOFError, OSError):
        code = worker.kill()
        raise WorkerDied(f"the worker process died during the call (exit code {code})") from None
    _release(worker)
    if not ok:
        raise value
    return value


def serve(conn: Connection, parent_pid: int) -> None:
    """The worker's loop: run each request, send back ``(True, result)`` or ``(False, error)``;
    return at EOF."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the caller died before the death signal was set
        return
    conn.send(True)
    while True:
        try:
            cwd, path, fn, args = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # a request that does not unpickle here
            conn.send((False, _portable(exc)))
            continue
        try:
            if cwd != os.getcwd():
                os.chdir(cwd)
            sys.path[:] = path
            reply = (True, fn(*args))
        except BaseException as exc:  # SystemExit and KeyboardInterrupt from the function too
            reply = (False, _portable(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send((False, TypeError(f"{_name(fn)} returned {type(reply[1]).__name__}, "
                                        f"which cannot be sent back: {exc}")))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when it is an ``Exception`` that pickles and unpickles, else a RuntimeError
    saying what it was (a ``SystemExit`` in the function must not end the caller)."""
    if not isinstance(exc, Exception):
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _name(fn: Any) -> str:
    fn = getattr(fn, "func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _forget_after_fork() -> None:
    """A forked child must not talk to its parent's workers, nor use its parent's thread."""
    global _starter, _lock
    _idle.clear()
    _lock = threading.Lock()
    _starter = None


@atexit.register
def _close_all() -> None:
    with _lock:
        workers = [w for w in _idle if w.pid == os.getpid()]
        _idle.clear()
    for worker in workers:
        worker.close()


os.register_at_fork(after_in_child=_forget_after_fork)
