"""The policy server's batcher: one thread that sends the requests waiting for the policy to its
batched ``generate`` (``envs.agent_proxy``).

Requests that arrive within ``window_s`` of the one before (up to ``max_batch``, and at most
``COLLECT_MAX_S`` or ``window_s`` after the first) go to the policy as one ``generate`` call per
distinct sampling setting. Agents answered by one batch send their next calls over a spread that
grows with their number and the machine's load: a window counted from the first arrival split
such a round in two (two ``generate`` calls instead of one). Episodes opened together start
their agents over a spread too (each builds its client): while an episode opened less than
``FIRST_CALL_S`` ago has not called yet (``awaited``), a batch waits for it, at most
``FIRST_CALL_S`` after its own first request, so a rollout's first round is one batch too. A job names its random
stream (``Sampling.streams``), or samples from its row of the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from envs.runner import Policy, Sampling

COLLECT_MAX_S = 0.5  # a batch waits at most this (or window_s) after its first request
FIRST_CALL_S = 3.0  # ... or this, for episodes opened this recently that have not called yet


@dataclass
class _Job:
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: tuple[int, ...] | None = None  # the call's random stream; None: its batch row
    future: Future = field(default_factory=Future)


class Batcher:
    """One thread that sends waiting requests to the policy in batches (module docstring)."""

    def __init__(self, policy: Policy, window_s: float, max_batch: int,
                 awaited: Callable[[], int] = lambda: 0):
        self.policy, self.window_s, self.max_batch = policy, window_s, max_batch
        self.awaited = awaited  # episodes opened moments ago whose first call is still to come
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.batches: list[int] = []  # the size of every generate call, for tests and benchmarks
        self.thread = threading.Thread(target=self._run, name="agent-proxy-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict[str, Any]], sampling: Sampling,
               stream: tuple[int, ...] | None = None) -> Future:
        job = _Job(messages, sampling, stream)
        self.jobs.put(job)
        return job.future

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        start = time.monotonic()
        jobs, last = [first], start + max(self.window_s, COLLECT_MAX_S)
        deadline = min(start + self.window_s, last)
        while len(jobs) < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                now = time.monotonic()
                if now < start + FIRST_CALL_S and self.awaited():
                    deadline = min(now + max(self.window_s, 0.01), start + FIRST_CALL_S)
                    continue
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            deadline = min(time.monotonic() + self.window_s, last)
        return jobs, False

    def _run(self) -> None:
        while (first := self.jobs.get()) is not None:
            jobs, stopping = self._collect(first)
            groups: dict[Sampling, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.sampling, []).append(job)
            for sampling, group in groups.items():
                self._generate(sampling, group)
            if stopping:
                break
        while True:  # answer whatever still waits, so no handler hangs
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.future.set_exception(RuntimeError("the policy server is shutting down"))

    def _generate(self, sampling: Sampling, group: list[_Job]) -> None:
        self.batches.append(len(group))
        streams = tuple(job.stream if job.stream is not None else (row,)
                        for row, job in enumerate(group))
        try:
            completions = self.policy.generate([job.messages for job in group],
                                               replace(sampling, streams=streams))
            if len(completions) != len(group):
                raise RuntimeError(f"the policy returned {len(completions)} completions for "
                                   f"{len(group)} conversations")
        except Exception as exc:  # the handlers report it; the batcher keeps serving
            for job in group:
                job.future.set_exception(exc)
            return
        for job, completion in zip(group, completions, strict=True):
            job.future.set_result(completion)

