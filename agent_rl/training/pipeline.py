"""Rollouts ahead of training, with a bounded policy lag (``rollout.max_policy_lag: k``).

With k = 0 the trainer rolls out, then trains, on one set of weights (synchronous). With
k > 0 a background thread produces the batches of the next steps on a *rollout policy* that
holds its own weights (a copy of the trained model, or a vLLM engine), while the trainer
trains. After every optimizer step the trainer pushes its weights (``SyncedPolicy.push``);
the rollout policy takes them at its next ``generate`` call, so every generated turn carries
the revision of the weights that sampled it and a session records the oldest of its turns.

The schedule: batch m may start only once the trainer has taken batch m - k. Batch m then
starts on weights of revision >= m - k - 1 and is trained at revision m - 1: its lag is at
most k by construction. ``split_stale`` enforces the bound anyway, at the moment a batch is
trained: a session sampled more than k revisions ago is dropped and counted
(``rollout/dropped_stale``), never trained on.

Queue age (``rollout/queue_age_s``): how long the batch the trainer takes waited, from the
moment its rollout finished to the ``take``; 0 when the trainer was there first (it waited
for the batch instead: ``time/data_wait_s``) and always 0 when synchronous.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class SyncedPolicy:
    """A rollout policy that takes pushed weights between ``generate`` calls.

    ``push`` snapshots the tensors (the trainer goes on updating its own in place) and may be
    called from any thread; ``generate`` applies the newest snapshot first, through the wrapped
    policy's ``load_weights(named_tensors, revision)``. Everything else is the wrapped policy's.

    ``synchronous=True`` (rollouts and updates take turns on one thread, max_policy_lag 0):
    ``push`` loads the tensors at once, as they come, with no snapshot (for SmolLM2's merged
    LoRA weights a snapshot held 427 MB until the next rollout, on top of the copy itself).
    """

    def __init__(self, policy: Any, synchronous: bool = False):
        self.policy = policy
        self.synchronous = synchronous
        self._lock = threading.Lock()
        self._pending: tuple[list[tuple[str, torch.Tensor]], int] | None = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], revision: int) -> None:
        if self.synchronous:  # nothing is ever pending: every push loads at once
            self.policy.load_weights(named_tensors, revision)
            return
        snapshot = [(name, t.detach().clone()) for name, t in named_tensors]  # same device
        with self._lock:
            self._pending = (snapshot, revision)

    def release(self) -> int:
        """Free the wrapped policy's weights until the next push, where it can
        (``HFPolicy.release_weights``; ``VLLMPolicy.release_weights`` puts the engine to
        sleep; 0 bytes elsewhere): only a synchronous policy, which
        nothing samples from while the trainer trains. Returns the bytes freed."""
        if not self.synchronous:
            raise RuntimeError("SyncedPolicy.release: rollouts run beside training "
                               "(max_policy_lag > 0); their weights cannot be released")
        release = getattr(self.policy, "release_weights", None)
        return release() if release is not None else 0

    def apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self.policy.load_weights(*pending)

    def generate(self, batch, sampling):
        self.apply_pending()
        return self.policy.generate(batch, sampling)

    @property
    def revision(self) -> int:
        return self.policy.revision

    def close(self) -> None:
        """Shut the wrapped engine down (a vLLM engine holds its KV cache until then)."""
        close = getattr(self.policy, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:  # count_tokens, tokenizer, ... of the wrapped policy
        return getattr(self.policy, name)


def split_stale(sequences: Sequence[Any], revision: int, max_lag: int) -> tuple[list[Any], list[Any]]:
    """``(fresh, stale)``: a sequence is stale when ``revision - sequence.policy_revision`` is
    above ``max_lag`` (a sequence without a recorded revision counts as fresh: it was not
    sampled by a policy of ours)."""
    fresh, stale = [], []
    for q in sequences:
        old = q.policy_revision is not None and revision - q.policy_revision > max_lag
        (stale if old else fresh).append(q)
    return fresh, stale


class Synchronous(Generic[T]):
    """``RolloutPipeline``'s interface for max_policy_lag 0: ``take(step)`` produces the batch
    then and there, on the trainer's thread and weights (so no batch ever waits:
    ``queue_age_s`` 0)."""

    queue_age_s = 0.0

    def __init__(self, produce: Callable[[int], T]):
        self._produce = produce

    def take(self, step: int) -> T:
        return self._produce(step)

    def close(self) -> None:
        pass

    def __enter__(self) -> Synchronous[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class RolloutPipeline(Generic[T]):
    """``produce(step)`` for steps ``first..last`` on one background thread, batch m started
    only once batch m - ``max_lag`` was taken (module docstring). ``take(step)`` returns the
    batch of that step (re-raising what ``produce`` raised) and sets ``queue_age_s``: the
    seconds it waited between its rollout's end and this take (module docstring); ``close()``
    stops the thread after the batch in flight. Use it as a context manager."""

    queue_age_s = 0.0  # of the batch the last take returned

    def __init__(self, produce: Callable[[int], T], first: int, last: int, max_lag: int):
        if max_lag < 1:
            raise ValueError(f"RolloutPipeline needs max_lag >= 1, got {max_lag} (0 is synchronous)")
        self._produce = produce
        self._max_lag = max_lag
        # step -> (batch, error, when it was ready: time.perf_counter())
        self._ready: dict[int, tuple[T | None, BaseException | None, float]] = {}
        self._taken = first - 1  # the last step whose batch the trainer took
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(first, last), daemon=True,
                                        name="rollout-pipeline")
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            with self._cond:
                self._cond.wait_for(lambda s=step: self._stop or s - self._max_lag <= self._taken)
                if self._stop:
                    return
            try:
                item: tuple[T | None, BaseException | None] = (self._produce(step), None)
            except BaseException as exc:  # handed to the trainer's thread by take()
                item = (None, exc)
            with self._cond:
                self._ready[step] = (*item, time.perf_counter())
                self._cond.notify_all()
            if item[1] is not None:
                return

    def take(self, step: int) -> T:
        with self._cond:
            self._taken = step
            self._cond.notify_all()
            self._cond.wait_for(lambda: step in self._ready or not self._thread.is_alive())
            if step not in self._ready:
                raise RuntimeError(f"the rollout thread ended before producing step {step}")
            batch, error, ready = self._ready.pop(step)
        self.queue_age_s = time.perf_counter() - ready
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> RolloutPipeline[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
