"""Asynchronous rollouts (agent_rl.training.pipeline): batches run ahead of training on their own
thread, and no sample older than ``max_policy_lag`` updates is ever trained on.

The property test drives the real RolloutPipeline over random schedules: a producer whose
rounds take random times and read the rollout policy's revision at each round (a session is
as old as its oldest round), and a trainer whose steps take random times, sometimes skip
their update (no revision bump), and push weights after each step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_rl.training.pipeline import RolloutPipeline, SyncedPolicy, Synchronous, split_stale


@dataclass
class Sample:
    step: int
    policy_revision: int | None


class Counter:
    """A rollout policy stand-in that only has a revision (set by pushes, as a real one)."""

    def __init__(self):
        self.revision = 0

    def load_weights(self, named_tensors, revision):
        self.revision = revision

    def generate(self, batch, sampling):
        return [self.revision for _ in batch]


def test_split_stale_by_hand():
    qs = [Sample(1, 5), Sample(1, 3), Sample(1, 2), Sample(1, None)]
    fresh, stale = split_stale(qs, revision=5, max_lag=2)
    assert [q.policy_revision for q in fresh] == [5, 3, None]
    assert [q.policy_revision for q in stale] == [2]


def test_synced_policy_takes_pushed_weights_at_its_next_generate():
    policy = SyncedPolicy(Counter())
    w = torch.ones(2)
    policy.push([("w", w)], revision=3)
    w.add_(1.0)  # the trainer goes on updating in place; the push was a snapshot
    assert policy.revision == 0  # not yet: weights change only between generate calls
    assert policy.generate(["a"], None) == [3]
    assert policy.revision == 3


def test_synchronous_push_loads_at_once_as_the_tensors_come():
    loaded = []

    class Recorder(Counter):
        def load_weights(self, named_tensors, revision):
            for name, t in named_tensors:  # a consumer that loads as it goes
                loaded.append((name, t.data_ptr(), len(made)))
            self.revision = revision

    made = []

    def weights():  # a producer of fresh tensors, like merged LoRA weights
        for name in ("a", "b"):
            made.append(torch.full((2,), float(len(made))))
            yield name, made[-1]

    policy = SyncedPolicy(Recorder(), synchronous=True)
    policy.push(weights(), revision=4)
    assert policy.revision == 4  # applied in push, not at the next generate
    # each tensor loaded before the next was made, and as given (no snapshot copy)
    assert loaded == [("a", made[0].data_ptr(), 1), ("b", made[1].data_ptr(), 2)]
    assert policy.generate(["x"], None) == [4]


def test_only_a_synchronous_policy_releases_its_weights():
    released = []

    class Releasing(Counter):
        def release_weights(self):
            released.append(True)
            return 123

    assert SyncedPolicy(Releasing(), synchronous=True).release() == 123 and released == [True]
    assert SyncedPolicy(Counter(), synchronous=True).release() == 0  # nothing it can free
    with pytest.raises(RuntimeError, match="max_policy_lag > 0"):
        SyncedPolicy(Releasing()).release()
    assert released == [True]


def test_synchronous_produces_on_take():
    calls = []
    with Synchronous(lambda step: calls.append(step) or step * 10) as rollouts:
        assert rollouts.take(1) == 10 and rollouts.take(2) == 20
    assert calls == [1, 2]


def test_pipeline_hands_over_producer_errors():
    def produce(step):
        if step == 2:
            raise ValueError("env broke at step 2")
        return step

    with RolloutPipeline(produce, 1, 3, max_lag=1) as rollouts:
        assert rollouts.take(1) == 1
        with pytest.raises(ValueError, match="step 2"):
            rollouts.take(2)


def test_pipeline_refuses_lag_zero():
    with pytest.raises(ValueError, match="synchronous"):
        RolloutPipeline(lambda s: s, 1, 2, max_lag=0)


@settings(max_examples=25, deadline=None)
@given(max_lag=st.integers(1, 3), steps=st.integers(1, 7),
       rounds=st.lists(st.integers(1, 3), min_size=7, max_size=7),
       produce_ms=st.lists(st.integers(0, 3), min_size=21, max_size=21),
       train_ms=st.lists(st.integers(0, 4), min_size=7, max_size=7),
       skipped=st.lists(st.booleans(), min_size=7, max_size=7))
def test_no_trained_sample_is_older_than_max_policy_lag(max_lag, steps, rounds, produce_ms,
                                                        train_ms, skipped):
    policy = SyncedPolicy(Counter())
    produced = []
    lock = threading.Lock()

    def produce(step):  # a batch of 2 sessions, each as old as its oldest round
        revisions = []
        for r in range(rounds[step - 1]):
            time.sleep(produce_ms[(step - 1) * 3 + r] / 1000)
            revisions.append(policy.generate([None], None)[0])
        batch = [Sample(step, min(revisions)), Sample(step, revisions[-1])]
        with lock:
            produced.extend(batch)
        return batch

    revision, trained, dropped = 0, [], 0
    with RolloutPipeline(produce, 1, steps, max_lag) as rollouts:
        for step in range(1, steps + 1):
            batch = rollouts.take(step)
            fresh, stale = split_stale(batch, revision, max_lag)
            trained += [(revision, q) for q in fresh]
            dropped += len(stale)
            time.sleep(train_ms[step - 1] / 1000)
            revision += not skipped[step - 1]
            policy.push([], revision)
    assert all(rev - q.policy_revision <= max_lag for rev, q in trained)
    assert len(trained) + dropped == len(produced) == 2 * steps  # every sample counted
    assert dropped == 0  # the schedule meets the bound by itself; the filter is the guarantee
    assert sorted({q.step for _, q in trained}) == list(range(1, steps + 1))


def test_the_filter_drops_what_a_late_push_left_stale():
    """Without pushes the rollout weights stay at revision 0: by step k + 2 they are stale."""
    with RolloutPipeline(lambda s: [Sample(s, 0)], 1, 4, max_lag=1) as rollouts:
        dropped = [len(split_stale(rollouts.take(step), step - 1, 1)[1]) for step in range(1, 5)]
    assert dropped == [0, 0, 1, 1]
