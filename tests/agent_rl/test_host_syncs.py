"""Host reads in the hot loops, counted on the CPU: every read of a tensor's values into
Python (``.tolist()``, ``.item()``, ``int(t)``, ``nonzero``, ...) is a device synchronisation
on a GPU. The new code gives the old code's values exactly, with fewer reads."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from agent_rl.policies import decode
from agent_rl.policies.hf import HFPolicy, step_to_host
from agent_rl.policies.models import tiny_model
from agent_rl.training.update import member_index, to_sequences
from envs.runner import Sampling

READS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts the tensor operations that read values back to the host."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


def old_to_sequences(batch, members):
    """update.to_sequences as it was: one int() per trained token, one for the width."""
    local = {k: i for i, k in enumerate(members)}
    seq = torch.tensor([local[int(k)] for k in batch["seq"]])
    shape = (len(members), int(batch["rank"].max()) + 1)

    def dense(values):
        if values is None:
            values = torch.ones(len(seq))
        return torch.zeros(shape, dtype=values.dtype).index_put((seq, batch["rank"]), values)

    return dense


def test_to_sequences_gives_the_old_layout_without_reading_the_device():
    members, counts = [4, 1, 7], [3, 5, 2]  # sequences of the step's batch and trained tokens
    batch = {"seq": torch.tensor([k for k, n in zip(members, counts, strict=True) for _ in range(n)]),
             "rank": torch.cat([torch.arange(n) for n in counts])}
    values = torch.randn(sum(counts), generator=torch.Generator().manual_seed(0))
    with HostReads() as new_reads:
        dense = to_sequences(batch, members, max(counts))
        new = [dense(values), dense(None), dense(values.double())]
    with HostReads() as old_reads:
        old_dense = old_to_sequences(batch, members)
        old = [old_dense(values), old_dense(None), old_dense(values.double())]
    for a, b in zip(new, old, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert new[1].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert new_reads.count == 0 and old_reads.count == sum(counts) + 1


def test_member_index_by_hand():
    assert member_index([4, 1, 7]).tolist() == [-1, 1, -1, -1, 0, -1, -1, 2]


def test_step_to_host_is_exact_in_one_read():
    token = torch.tensor([3, 49151, 0, 2**40])
    for dtype in (torch.float32, torch.bfloat16):
        logp = torch.tensor([-0.1, -12.345678, -1e-8, -3.3], dtype=dtype)
        with HostReads() as reads:
            ids, lps = step_to_host(token, logp)
        assert reads.count == 1
        assert ids == token.tolist() and lps == logp.tolist()
        assert all(type(t) is int for t in ids)


def test_decoding_reads_the_host_once_a_step():
    """Rows that never stop: the reads grow by one per decode step (the old loop: 4: rows,
    tokens, log-probs, and the stopped rows' nonzero)."""
    model, tokenizer = tiny_model(0)
    policy = HFPolicy(model, tokenizer)
    policy.stop_ids = set()
    batch = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    counts = {}
    for steps in (4, 9):
        with HostReads() as reads:
            policy.generate(batch, Sampling(temperature=0.9, top_p=0.95, max_new_tokens=steps, seed=1))
        counts[steps] = reads.count
    assert (counts[9] - counts[4]) / 5 == 1


def test_the_kv_cache_takes_the_autocast_dtype_on_cuda_only():
    assert decode.kv_dtype(torch.float32, "cuda", torch.bfloat16) == torch.bfloat16
    assert decode.kv_dtype(torch.float32, "cuda", None) == torch.float32
    assert decode.kv_dtype(torch.float32, "cpu", torch.bfloat16) == torch.float32  # as before
    assert decode.kv_dtype(torch.bfloat16, "cpu", None) == torch.bfloat16
