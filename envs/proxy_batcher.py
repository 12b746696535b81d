"""The policy server's batcher: one thread that sends the requests waiting for the policy to its
batched ``generate`` (``envs.agent_proxy``).

Requests that arrive within ``window_s`` of the first waiting one (up to ``max_batch``) go to
the policy as one ``generate`` call per distinct sampling setting. A job names its random
stream (``Sampling.streams``), or samples from its row of the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from envs.runner import Policy, Sampling


@dataclass
class _Job:
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: tuple[int, ...] | None = None  # the call's random stream; None: its batch row
    future: Future = field(default_factory=Future)


class Batcher:
    """One thread that sends waiting requests to the policy in batches (module docstring)."""

    def __init__(self, policy: Policy, window_s: float, max_batch: int):
        self.policy, self.window_s, self.max_batch = policy, window_s, max_batch
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
        jobs, deadline = [first], time.monotonic() + self.window_s
        while len(jobs) < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
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

