"""Shared runs: identical code for the same tests runs once, and its result judges every copy.

The episodes of a GRPO group often write the same code for the same task; ``SHARED_RUNS`` (used
by every ``CodeTestsEnv`` with ``share_runs``, the default) runs such code once while the others
wait, and keeps the last finished results.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from envs import sandbox
from envs.codetests.verifier import TESTS_FILE, harness


class SharedRuns:
    """Test runs shared among identical programs: the episodes of a GRPO group often write the
    same code for the same task, and a run's result (with the nonce it was given) judges every
    one of them. A key (``key``) is the code, the function's name, the test inputs, the limits
    and the backend. ``run`` runs a key's program once while others wait for it, and keeps the
    last ``size`` finished results: those whose program ran to its end (``ok`` or
    ``runtime_error``) with at most ``max_output`` bytes of output. A timeout (the machine's
    load can cause one), a resource limit or a sandbox failure is not kept, and one that waiting
    callers would share (a sandbox failure, an exception) makes each run its own instead."""

    KEPT = ("ok", "runtime_error")

    def __init__(self, size: int = 256, max_output: int = 1 << 16):
        self.size, self.max_output = size, max_output
        self._lock = threading.Lock()
        self._done: OrderedDict[str, tuple[sandbox.SandboxResult, str]] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}

    @staticmethod
    def key(code: str, function: str, inputs: Sequence[Sequence[Any]], limits: sandbox.Limits,
            backend: str) -> str:
        tests = harness(function, inputs, nonce="")[1][TESTS_FILE]  # as the run reads them, but its nonce
        text = repr((code, tests, limits, backend)).encode("utf-8", "surrogatepass")
        return hashlib.sha256(text).hexdigest()

    def run(self, key: str, test_run: Callable[[], tuple[sandbox.SandboxResult, str]]
            ) -> tuple[sandbox.SandboxResult, str, bool]:
        """``(result, nonce, shared)``: a finished or running result for ``key`` (shared True),
        else ``test_run()``'s."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return *self._done[key], True
            leading = key not in self._running
            if leading:
                self._running[key] = concurrent.futures.Future()
            waiting = self._running[key]
        if not leading:
            got = waiting.result()
            return (*got, True) if got is not None else (*test_run(), False)
        got = None
        try:
            got = test_run()
            return *got, False
        finally:
            result = got[0] if got is not None else None
            share = result is not None and result.status != "sandbox_error"
            keep = (result is not None and result.status in self.KEPT
                    and len(result.stdout) + len(result.stderr) <= self.max_output)
            with self._lock:
                del self._running[key]
                if keep:
                    self._done[key] = got
                    while len(self._done) > self.size:
                        self._done.popitem(last=False)
            waiting.set_result(got if share else None)

    def clear(self) -> None:
        """Forget every finished result (runs in progress finish as they are)."""
        with self._lock:
            self._done.clear()

    def _forget_in_child(self) -> None:
        """After ``fork``: the runs in progress were the parent's threads' (none would ever
        finish here) and the lock may have been held by one."""
        self._lock = threading.Lock()
        self._running = {}


SHARED_RUNS = SharedRuns()
"""This process's shared runs, used by every ``CodeTestsEnv`` with ``share_runs`` (default)."""
os.register_at_fork(after_in_child=SHARED_RUNS._forget_in_child)
