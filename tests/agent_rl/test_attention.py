"""agent_rl.accel.attention: chunk plans by hand, blocked attention equal to SDPA (values and
gradients), and the switch the trainer uses."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from agent_rl.accel import attention, trainer
from agent_rl.accel.attention import BLOCKED, blocked, blocked_attention_forward, plan_blocks
from agent_rl.policies.models import tiny_model
from agent_rl.policies.render import packed_attention_mask
from agent_rl.run.distributed import TorchBackend
from agent_rl.training import update


def shared_row_mask(dtype=torch.bool) -> torch.Tensor:
    """A shared prompt of 2 tokens, two rests of 3 (``render.share_prefixes``' layout)."""
    seq = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])  # [T]
    prefix = torch.zeros(8, dtype=torch.long)  # [T] every token sees sequence 0
    return packed_attention_mask(seq, dtype, prefix=prefix)  # [1, 1, 8, 8]


def chunks(plan, row=0):
    r = plan.rows[row]
    keys = r.keys.split(r.key_counts)
    return [(q, k.tolist()) for q, k in zip(r.query_counts, keys, strict=True)]


def test_plan_follows_the_sequences_of_a_shared_row():
    # the prompt [0, 2) and rest 1 [2, 5) grow causally as one segment (rest 1 sees the prompt
    # and itself); rest 2 [5, 8) starts a new one, seeing the prompt and itself
    plan = plan_blocks(shared_row_mask(), call_pairs=0)
    assert chunks(plan) == [(5, [0, 1, 2, 3, 4]), (3, [0, 1, 5, 6, 7])]
    assert plan.pairs == 5 * 5 + 3 * 5  # 40 of SDPA's 64
    assert attention.allowed_pairs(shared_row_mask()) == 1 + 2 + 3 + 4 + 5 + 3 + 4 + 5  # 27
    # merging both: 8 x 8 = 64 pairs for 25 + 15, +24: merged when a call is worth more
    assert chunks(plan_blocks(shared_row_mask(), call_pairs=24)) == chunks(plan)
    assert chunks(plan_blocks(shared_row_mask(), call_pairs=25)) == [(8, list(range(8)))]
    # the chunks' masks are the mask's own entries for their keys, additive stays additive
    additive = shared_row_mask(torch.float32)
    masks = plan_blocks(additive, call_pairs=0).rows[0].masks
    assert masks[1].dtype == torch.float32
    torch.testing.assert_close(masks[1], additive[0, 0, 5:8][:, [0, 1, 5, 6, 7]])


def test_a_long_sequence_is_split_so_later_pieces_see_more_keys():
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]  # [1, 1, 10, 10]
    plan = plan_blocks(causal, split=4, call_pairs=0)
    assert [(q, len(k)) for q, k in chunks(plan)] == [(4, 4), (4, 8), (2, 10)]
    assert plan.pairs == 16 + 32 + 20


def test_padding_and_several_rows():
    seq = torch.tensor([[0, 0, 0, -1, -1], [0, 0, 1, 1, 1]])  # [2, 5] row 0 padded at the end
    plan = plan_blocks(packed_attention_mask(seq, torch.bool), call_pairs=0)
    # padding sees only itself: one chunk per padding token
    assert chunks(plan, 0) == [(3, [0, 1, 2]), (1, [3]), (1, [4])]
    assert chunks(plan, 1) == [(2, [0, 1]), (3, [2, 3, 4])]


def test_bad_masks_are_refused():
    with pytest.raises(ValueError, match=r"\[R, 1, T, T\]"):
        plan_blocks(torch.ones(1, 4, 4, dtype=torch.bool))
    empty = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    empty[0, 0, 1] = False
    with pytest.raises(ValueError, match="allows no key"):
        plan_blocks(empty)
    with pytest.raises(ValueError, match="split"):
        plan_blocks(shared_row_mask(), split=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_blocked_attention_equals_sdpa_values_and_gradients(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    seq = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, -1],
                        [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])  # [2, 13]
    prefix = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1],
                           [-1] * 13])  # [2, 13] row 0: rests 1 and 2 share the prompt 0
    mask = packed_attention_mask(seq, torch.float32, prefix=prefix)  # [2, 1, 13, 13]

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    q, k, v = leaf(2, heads, 13, 8), leaf(2, kv_heads, 13, 8), leaf(2, kv_heads, 13, 8)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    plan = plan_blocks(mask, split=3, call_pairs=0)
    assert plan.pairs < 2 * 13 * 13
    out, _ = blocked_attention_forward(module, q, k, v, mask, scaling=0.3, attention_blocks=plan)
    expect = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                            v.repeat_interleave(heads // kv_heads, 1),
                                            attn_mask=mask, scale=0.3).transpose(1, 2)
    assert out.shape == (2, 13, heads, 8)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=gen)
    mine = torch.autograd.grad((out * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((expect * weights).sum(), (q, k, v))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # without a plan it is transformers' SDPA; a plan for another batch is refused
    plain, _ = blocked_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(plain, expect, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="plan the batch's own mask"):
        blocked_attention_forward(module, q[:1], k[:1], v[:1], mask[:1], attention_blocks=plan)


@pytest.mark.parametrize("autocast", [True, False])
def test_half_precision_chunks_run_in_float32_and_return_the_sdpa_dtype(autocast):
    """bf16 inputs, or any inputs under bf16 autocast (the trainer's q and k come out of the
    rotary embedding in float32, v in bf16): the chunks are computed in float32 from the
    inputs as given, the output is bf16 as SDPA's would be, gradients reach every input in
    its own dtype."""
    gen = torch.Generator().manual_seed(1)
    seq = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])  # [1, 10]
    prefix = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, 0, 0, 0]])  # rests 1 and 2 share prompt 0
    mask = packed_attention_mask(seq, torch.float32, prefix=prefix)  # [1, 1, 10, 10]
    q = torch.randn(1, 6, 10, 8, generator=gen)
    k = torch.randn(1, 2, 10, 8, generator=gen)
    v = torch.randn(1, 2, 10, 8, generator=gen).bfloat16()
    if not autocast:
        q, k = q.bfloat16(), k.bfloat16()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    plan = plan_blocks(mask, split=3, call_pairs=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = blocked_attention_forward(module, q, k, v, mask, scaling=0.3, attention_blocks=plan)
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == (1, 10, 6, 8)
    # float32 SDPA on the same values, rounded once at the end: exactly what was computed
    expect = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                            v.float().repeat_interleave(3, 1), attn_mask=mask,
                                            scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out.float(), expect.bfloat16().float(), rtol=0, atol=0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [q.dtype, k.dtype, v.dtype]
    theirs = torch.autograd.grad(expect.sum(), (q, k, v))
    for a, b in zip(grads, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_the_trainer_forward_runs_blocked_chunks_with_the_same_logits_and_gradients(monkeypatch):
    """trained_token_logits inside blocked(model), with the accelerator's handle (which plans
    the blocks): SDPA is called on chunks (queries shorter than the row), the logits and every
    gradient equal the dense forward's; outside, the model is SDPA again."""
    model, _ = tiny_model(0)
    assert model.config._attn_implementation == "sdpa"
    gen = torch.Generator().manual_seed(1)
    seq = torch.tensor([[0] * 6 + [1] * 5 + [2] * 7 + [3] * 4 + [-1] * 2])  # [1, 24]
    prefix = torch.tensor([[-1] * 6 + [0] * 12 + [-1] * 6])  # rests 1 and 2 share prompt 0
    position = torch.tensor([[*range(6), *range(6, 11), *range(6, 13), *range(4), 0, 0]])
    batch = {"input_ids": torch.randint(3, 60, (1, 24), generator=gen), "position_ids": position,
             "attention_mask": packed_attention_mask(seq, torch.float32, prefix=prefix),
             "row": torch.zeros(5, dtype=torch.long), "predictor": torch.tensor([5, 8, 12, 17, 20])}
    queries = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        queries.append(q.shape[-2])
        return real_sdpa(q, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    # a row this short is one chunk at the default call cost: chunk it at every segment
    monkeypatch.setattr(trainer, "plan_blocks", functools.partial(plan_blocks, call_pairs=0))

    def run(fast=None):
        model.zero_grad()
        logits = update.trained_token_logits(model, batch, fast)  # [5, V]
        logits.logsumexp(-1).sum().backward()
        if fast is not None:
            fast.flush()  # the head's deferred weight gradient
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    dense_logits, dense_grads = run()
    assert queries == [24] * model.config.num_hidden_layers  # transformers' SDPA: whole rows
    queries.clear()
    with blocked(model) as on:
        assert on and model.config._attn_implementation == BLOCKED
        backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))
        logits, grads = run(trainer.Step(backend, model, torch.float32))
    assert model.config._attn_implementation == "sdpa"
    assert queries and max(queries) < 24 and len(queries) % model.config.num_hidden_layers == 0
    torch.testing.assert_close(logits, dense_logits, rtol=1e-5, atol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def test_blocked_leaves_other_implementations_alone_and_restores_on_error():
    model, _ = tiny_model(0)
    model.set_attn_implementation("eager")
    with blocked(model) as on:
        assert not on and model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="boom"), blocked(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_plan_tables_by_hand():
    """The plan as the bf16 kernel reads it: (row, first query, queries, first key, keys) per
    chunk, the keys one chunk after another, the masks flattened (bool as 0 / -inf), and each
    query's extent (one past its last key not masked)."""
    plan = plan_blocks(shared_row_mask(), call_pairs=0)  # chunks (5, [0..4]), (3, [0, 1, 5, 6, 7])
    chunks, keys, mask, extents = plan.tables
    assert chunks.tolist() == [[0, 0, 5, 0, 5], [0, 5, 3, 5, 5]]
    assert keys.tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert mask.shape == (5 * 5 + 3 * 5,) and mask.dtype == torch.float32
    assert mask[:5].tolist() == [0.0] + [-math.inf] * 4  # query 0 sees key 0
    assert mask[25:30].tolist() == [0.0, 0.0, 0.0, -math.inf, -math.inf]  # query 5: prompt and itself
    # causal in each chunk: query i of the first sees keys 0..i; the second's see the prompt's
    # two keys and their own sample's (keys 5, 6, 7 at 2, 3, 4 of the chunk)
    assert extents.tolist() == [1, 2, 3, 4, 5, 3, 4, 5]
    assert plan.tables is plan.tables  # built once


def test_plan_extents_of_additive_masks():
    """An additive mask's -inf and float32's lowest rule a key out (a probability of exactly 0),
    a finite bias does not: the extent is one past the last key with anything else."""
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[0.0, low, -math.inf], [0.0, -5.0, low], [0.0, 0.0, 0.0]]).view(1, 1, 3, 3)
    plan = plan_blocks(mask, call_pairs=10**6)  # one chunk of all three queries and keys
    assert plan.tables[0].tolist() == [[0, 0, 3, 0, 3]]
    assert plan.tables[3].tolist() == [1, 2, 3]


@pytest.mark.parametrize("autocast", [True, False])
def test_bf16_chunks_run_in_our_kernel_where_it_fits(autocast, monkeypatch):
    """Heads of 32 in bf16 (or under bf16 autocast) on this CPU (AVX-512 BF16): one kernel
    call (``kernels.ChunkAttention``), values and gradients as float32 SDPA's within bf16
    rounding; where the kernel does not fit, the float32 chunks as before."""
    from agent_rl.accel import kernels

    if not kernels.fits_chunks(32):
        pytest.skip("this CPU has no AVX-512 BF16: the float32 chunks run (tested above)")
    gen = torch.Generator().manual_seed(2)
    seq = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13])  # [1, 40]
    prefix = torch.tensor([[-1] * 7 + [0] * 33])
    mask = packed_attention_mask(seq, torch.float32, prefix=prefix)  # [1, 1, 40, 40]
    q = torch.randn(1, 4, 40, 32, generator=gen)
    k = torch.randn(1, 2, 40, 32, generator=gen)
    v = torch.randn(1, 2, 40, 32, generator=gen).bfloat16()
    if not autocast:
        q, k = q.bfloat16(), k.bfloat16()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = plan_blocks(mask, split=8, call_pairs=0)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = blocked_attention_forward(torch.nn.Module(), q, k, v, mask, attention_blocks=plan)
        return out  # [1, 40, 4, 32]

    out = run()
    assert out.dtype == torch.bfloat16 and out.shape == (1, 40, 4, 32)
    assert "ChunkAttention" in out.grad_fn.name()  # bf16 as the kernel wrote it: no cast after it
    qf, kf, vf = q.bfloat16().float(), k.bfloat16().float(), v.float()
    expect = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert float((out.detach().float() - expect.detach()).norm() / expect.detach().norm()) < 5e-3
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [q.dtype, k.dtype, v.dtype]
    theirs = torch.autograd.grad(expect.square().sum(), (q, k, v))
    for a, b in zip(grads, theirs, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    # without the kernel: SDPA's float32 chunks on the inputs as given, rounded once at the end
    # (a value at a rounding boundary may land one bf16 step away: summation order)
    monkeypatch.setattr(kernels, "fits_chunks", lambda head_dim: False)
    plain = run()
    assert "ChunkAttention" not in plain.grad_fn.next_functions[0][0].name()
    expect = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                            enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(plain.float(), expect.bfloat16().float(), rtol=2**-7, atol=0)
