"""envs.deadline: a call in a worker process returns, raises as the function did, or is stopped
at its deadline (the worker killed, a fresh one for the next call); a worker never outlives
the caller, even one killed with SIGKILL while a call hangs."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envs import deadline

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_call_returns_what_the_function_returns_and_raises_what_it_raised():
    assert deadline.call(sum, [1, 2, 3], timeout_s=30) == 6
    assert deadline.call(functools.partial(max, 4), 9, timeout_s=30) == 9
    assert deadline.call(os.getpid, timeout_s=30) != os.getpid()  # not in this process
    with pytest.raises(ValueError, match="invalid literal"):
        deadline.call(int, "x", timeout_s=30)


def test_an_exit_in_the_function_is_an_error_not_an_exit_of_the_caller():
    with pytest.raises(RuntimeError, match="SystemExit: 3"):
        # sys.exit looked up in the worker: a library in this process (wandb) may have
        # replaced it with a hook that does not pickle by reference
        deadline.call(exec, "import sys; sys.exit(3)", timeout_s=30)
    with pytest.raises(deadline.WorkerDied, match="exit code 4"):
        deadline.call(os._exit, 4, timeout_s=30)
    assert deadline.call(len, "abc", timeout_s=30) == 3


def test_a_hung_call_is_stopped_at_its_deadline_and_its_worker_killed():
    worker = deadline.call(os.getpid, timeout_s=30)
    started = time.monotonic()
    with pytest.raises(deadline.DeadlineExceeded, match=r"no result within 0.5 s") as info:
        deadline.call(re.search, r"^(a+)+$", "a" * 40 + "!", timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 10 and info.value.timeout_s == 0.5
    assert not alive(worker)
    assert deadline.call(os.getpid, timeout_s=30) != worker  # a fresh worker
    assert deadline.call(abs, -2, timeout_s=30) == 2


def test_the_function_sees_the_callers_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert deadline.call(os.getcwd, timeout_s=30) == str(tmp_path)


def test_a_call_costs_well_under_a_millisecond_once_a_worker_runs():
    deadline.call(len, "", timeout_s=60)
    started = time.perf_counter()
    for _ in range(200):
        deadline.call(len, "abc", timeout_s=30)
    assert (time.perf_counter() - started) / 200 < 0.005  # measured: about 0.07 ms


CALLER = textwrap.dedent("""
    import os, sys, time
    from envs import deadline
    print(deadline.call(os.getpid, timeout_s=60), flush=True)
    deadline.call(time.sleep, 3600, timeout_s=3600)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_a_caller_killed_during_a_hung_call():
    caller = subprocess.Popen([sys.executable, "-c", CALLER], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = int(caller.stdout.readline())
    time.sleep(0.5)  # the worker is now in time.sleep(3600)
    assert alive(worker)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    give_up = time.monotonic() + 10
    while alive(worker) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not alive(worker)
