"""Attention over packed rows, computed only where the mask lets a token look.

A trainer batch (``render.collate_shared``) lays sequences side by side in a row: a group's
shared prompt once, then each sample's rest, and several such shared rows per bin. Its
additive mask ``[R, 1, T, T]`` lets a token see its own sequence's earlier tokens and its
shared prompt, nothing else. SDPA over the whole row computes all T^2 query x key pairs and
throws most of them away: on a Relay-v0 step 15% of them are allowed (rows of ~1000 tokens
holding eight samples of ~120 tokens after a 45-token prompt), and attention took a quarter of
the trainer's step.

``plan_blocks(mask)`` cuts each row's queries into chunks and gives each chunk the keys any of
its queries may see; attention then runs chunk by chunk on those keys only, under the mask's
own entries for them (``blocked_attention_forward``). The values are SDPA's (each query's
softmax runs over the same allowed keys; only the summation order differs, ~1e-7 in float32),
and so are the gradients. The chunks:

1. A new segment starts where a query's allowed keys are not the previous query's plus itself
   (a new sequence, a new shared prompt, padding): inside a segment the keys grow causally.
2. Segments longer than ``split`` queries are cut into pieces of ``split``: a later piece of
   a long prompt needs more keys than an earlier one, so pieces do ~T^2/2 work, not T^2.
3. Adjacent pieces merge while merging adds fewer than ``call_pairs`` query x key pairs
   (about what one more SDPA call costs, ~0.1 ms forward + backward on this machine's CPU,
   estimated from a profile; 1,000 and 10,000 timed alike on the Relay-v0 step).

All chunks' keys are gathered with one ``index_select`` and split (their gradient is one
``index_add``, one ``cat`` for the queries), so the extra work is linear in the row, not in
rows x chunks. Measured on the Relay-v0 step above (the trainer's micro-batches of 512
tokens): 0.91M pairs computed instead of 4.31M, attention forward + backward per layer 0.11 s
instead of 0.27 s.

bfloat16 (bf16 autocast, or a bf16 model) on a CPU with AVX-512 BF16 runs all of a batch's
chunks in one call of our kernel each way (``kernels.ChunkAttention``: bf16 products with float32
accumulation, float32 scores and softmax, probabilities rounded to bf16 for the product with V,
as flash attention does on a GPU). SDPA's own bf16 kernel there was slower than its float32 one
at these shapes (a layer's attention forward + backward on a Relay-v0 step, alternated: 0.136 s
against 0.103 s); ours took 6.4 ms against 16.0 ms for float32 SDPA chunks on a Relay-like row
of 1,000 tokens (9 heads; forward and backward, alternated), and a whole bf16 Relay-v0 step
2.1-2.4 s less (15.8-17.8 s against 17.9-20.3 s, three steps each way, alternated). Its
log-probs differ from float32's about as much as bf16 autocast's own: on that step's 1,126
trained tokens, mean |difference| 0.0165 against the float32 chunks' 0.0169 (max 0.235 and
0.189). The kernel skips each query's keys past its extent (``BlockPlan.tables``: a chunk's early
queries do not see its later keys), the same outputs and dQ to the bit (dK and dV to float32
rounding: chunks sharing keys add in whichever order the threads take them): on the Relay-v0 step's
micro-batches (one layer, captured plans, random inputs, alternated runs) forward 4.9-5.5 ->
4.2-4.4 ms, backward 11.2-12.4 -> 10.0-10.7 ms. Other half precision (float16), other head
sizes, or a CPU without AVX-512 BF16 runs the chunks in float32 through SDPA, rounding only the
output, once. The output is in the dtype SDPA would have returned.

transformers picks an attention function by ``config._attn_implementation``; ``blocked(model)``
switches an SDPA model on the CPU to ``BLOCKED`` (this module's function, registered with
transformers) for the duration of a training step: forward, backward and the layers it
recomputes in backward all see the same function. Rollouts use it too: ``decode.prefill``'s
token trees (each node attends to its ancestors only; 11% of a Relay-v0 rollout's pairs). The
plan travels as the ``attention_blocks`` keyword through the decoder's forward to every
layer; without it the function is transformers' SDPA, unchanged. Other implementations (eager, flash kernels) and
other devices are left as they are (CUDA's fused kernels were not measured here).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from agent_rl.accel import kernels

BLOCKED = "agent_rl_blocked"  # the attention implementation's name in transformers' registry
SPLIT = 128  # queries per piece of a long segment
CALL_PAIRS = 1000  # query x key pairs one more SDPA call is worth (forward + backward)
HALF = frozenset({torch.bfloat16, torch.float16})  # chunks in these dtypes run in float32 on the CPU


@dataclass
class RowBlocks:
    """One batch row's chunks: consecutive query counts, every chunk's keys (gathered at once,
    then split by ``key_counts``) and the mask's entries for them."""

    query_counts: list[int]  # queries per chunk, in order, summing to T
    keys: torch.Tensor  # [K] long: each chunk's key positions, chunk after chunk
    key_counts: list[int]  # keys per chunk, summing to K
    masks: list[torch.Tensor]  # [q_c, k_c] per chunk: the mask's own entries (additive or bool)

    @property
    def pairs(self) -> int:
        return sum(q * k for q, k in zip(self.query_counts, self.key_counts, strict=True))


@dataclass
class BlockPlan:
    """Chunks for every row of a batch (``plan_blocks``)."""

    rows: list[RowBlocks]

    @property
    def pairs(self) -> int:
        """Query x key pairs the plan computes (SDPA over the batch: R x T^2)."""
        return sum(r.pairs for r in self.rows)

    @functools.cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plan as ``kernels.chunk_attention`` reads it: chunks ``[C, 5]`` (row, first
        query, queries, first key in ``keys``, keys), every chunk's key positions ``[K]`` one
        after another, every chunk's ``[queries, keys]`` additive float32 mask, flattened, one
        after another, and every query's extent ``[R * T]``, chunk after chunk: one past its
        last key that the mask does not rule out (-inf, or float32's lowest, gives a
        probability of exactly 0), so the kernel skips the keys from there on (in a chunk cut
        from a causal segment, a query's later keys). Built once per plan (a trainer's
        micro-batch: every layer, forward and recompute)."""
        chunks, keys, masks, extents, key_at = [], [], [], [], 0
        lowest = torch.finfo(torch.float32).min
        for b, row in enumerate(self.rows):
            firsts = itertools.accumulate(row.query_counts, initial=0)
            key_firsts = itertools.accumulate(row.key_counts, initial=key_at)
            for first, count, key_first, key_count, m in zip(firsts, row.query_counts, key_firsts,
                                                             row.key_counts, row.masks, strict=False):
                chunks.append((b, first, count, key_first, key_count))
                m = m.float() if m.is_floating_point() else torch.zeros(m.shape).masked_fill(~m, -math.inf)
                masks.append(m.flatten())
                seen = torch.arange(1, key_count + 1) * (m > lowest)  # [q, k]: j + 1 where not ruled out
                extents.append(seen.amax(-1))
            keys.append(row.keys)
            key_at += len(row.keys)
        return (torch.tensor(chunks, dtype=torch.long), torch.cat(keys).long().contiguous(),
                torch.cat(masks).contiguous(), torch.cat(extents).long().contiguous())


def allowed_pairs(mask: torch.Tensor) -> int:
    """Query x key pairs a mask allows (``[R, 1, T, T]``, additive or bool)."""
    return int(_allowed(mask).sum())


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """``[R, T, T]`` bool from an ``[R, 1, T, T]`` mask: True where attention is allowed."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise ValueError(f"expected a [R, 1, T, T] attention mask, got {tuple(mask.shape)}")
    m = mask[:, 0]
    return m if m.dtype == torch.bool else m == 0


def plan_blocks(mask: torch.Tensor, split: int = SPLIT, call_pairs: int = CALL_PAIRS) -> BlockPlan:
    """The chunks (module docstring) of a ``[R, 1, T, T]`` mask, additive (0 where allowed)
    or bool (True where allowed). Every query row must allow at least one key."""
    if split < 1 or call_pairs < 0:
        raise ValueError(f"split must be >= 1 and call_pairs >= 0, got {split}, {call_pairs}")
    allowed = _allowed(mask)  # [R, T, T]
    if not bool(allowed.any(-1).all()):
        raise ValueError("a query of the attention mask allows no key (its softmax is empty)")
    rows = []
    for b, a in enumerate(allowed):  # [T, T]
        chunks = _chunks(a, split, call_pairs)  # [(start, end, [T] bool keys)]
        keys = [seen.nonzero().flatten() for _, _, seen in chunks]  # [k_c] each
        rows.append(RowBlocks(
            query_counts=[e - s for s, e, _ in chunks], keys=torch.cat(keys),
            key_counts=[len(k) for k in keys],
            masks=[mask[b, 0, s:e].index_select(-1, k) for (s, e, _), k in zip(chunks, keys, strict=True)]))
    return BlockPlan(rows)


def _chunks(allowed: torch.Tensor, split: int, call_pairs: int) -> list[tuple[int, int, torch.Tensor]]:
    """One row's chunks ``[start, end)`` of queries from its ``[T, T]`` allowed pairs, each with
    the keys any of its queries may see (``[T]`` bool): cut at every segment start and every
    ``split`` queries inside a segment, then merged while a merge adds fewer than
    ``call_pairs`` pairs (module docstring)."""
    T = allowed.shape[-1]
    grown = allowed[:-1].clone()  # [T-1, T] each query's keys plus the next query itself
    step = torch.arange(T - 1, device=allowed.device)
    grown[step, step + 1] = True
    starts = [0, *((allowed[1:] != grown).any(-1).nonzero().flatten() + 1).tolist(), T]
    pieces = [(p, min(p + split, e)) for s, e in itertools.pairwise(starts) for p in range(s, e, split)]
    chunks: list[tuple[int, int, torch.Tensor]] = []
    cost = 0  # pairs of the last chunk
    for s, e in pieces:
        seen = allowed[s:e].any(0)  # [T]
        alone = (e - s) * int(seen.sum())
        if chunks:
            start, _, before = chunks[-1]
            union = before | seen  # [T]
            merged = (e - start) * int(union.sum())
            if merged - cost - alone < call_pairs:
                chunks[-1], cost = (start, e, union), merged
                continue
        chunks.append((s, e, seen))
        cost = alone
    return chunks


def blocked_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              attention_blocks: BlockPlan | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[R, H, T, D]``, ``key`` and
    ``value`` ``[R, H_kv, T, D]``; returns ``[R, T, H, D]``. With ``attention_blocks`` (a
    ``plan_blocks`` of ``attention_mask``) attention runs chunk by chunk; without it, or
    with anything SDPA's own path handles beyond a mask (a position bias, sinks, soft-capping),
    this is transformers' SDPA."""
    special = any(kwargs.get(k) is not None for k in ("position_bias", "s_aux", "sinks", "softcap"))
    if attention_blocks is None or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    R, H, T, _ = query.shape
    if len(attention_blocks.rows) != R or sum(attention_blocks.rows[0].query_counts) != T:
        raise ValueError(f"attention_blocks plan {len(attention_blocks.rows)} rows for a batch of "
                         f"{R} x {T} tokens: plan the batch's own mask")
    gqa = key.shape[1] != H
    # the dtype SDPA would return; half-precision chunks on the CPU run in float32 (module
    # docstring: faster there than SDPA's half-precision kernel, and exact up to the inputs)
    out_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    dtypes = {query.dtype, key.dtype, value.dtype, out_dtype}
    widen = query.device.type == "cpu" and HALF & dtypes
    if widen and torch.float16 not in dtypes and dropout == 0.0 and kernels.fits_chunks(query.shape[-1]):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        chunks, keys, mask, extents = attention_blocks.tables
        out = kernels.ChunkAttention.apply(query.to(torch.bfloat16), key.to(torch.bfloat16),
                                           value.to(torch.bfloat16), chunks, keys, mask, extents, scale,
                                           torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
        return out.to(out_dtype), None  # [R, T, H, D]
    if widen:
        query, key, value = query.float(), key.float(), value.float()
    rows = []
    with torch.autocast("cpu", enabled=False) if widen else contextlib.nullcontext():
        for q, k, v, plan in zip(query, key, value, attention_blocks.rows, strict=True):  # [H, T, D]
            ks = k.index_select(1, plan.keys).split(plan.key_counts, 1)  # [H_kv, k_c, D] each
            vs = v.index_select(1, plan.keys).split(plan.key_counts, 1)  # [H_kv, k_c, D] each
            parts = [F.scaled_dot_product_attention(qc.unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0),
                                                    attn_mask=m.float() if widen and m.is_floating_point() else m,
                                                    dropout_p=dropout, scale=scaling,
                                                    enable_gqa=gqa)  # [1, H, q_c, D]
                     for qc, kc, vc, m in zip(q.split(plan.query_counts, 1), ks, vs, plan.masks, strict=True)]
            rows.append(torch.cat(parts, 2))  # [1, H, T, D]
    return torch.cat(rows, 0).transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), None  # [R, T, H, D]


AttentionInterface.register(BLOCKED, blocked_attention_forward)
AttentionMaskInterface.register(BLOCKED, sdpa_mask)


@contextlib.contextmanager
def blocked(model: torch.nn.Module) -> Iterator[bool]:
    """While inside, an SDPA ``model`` on the CPU runs ``BLOCKED`` attention (the plan passed
    as ``attention_blocks``, ``trained_token_logits``); yields whether it does. Any other
    implementation or device: nothing changes."""
    config = model.config
    device = next(model.parameters()).device
    if getattr(config, "_attn_implementation", None) != "sdpa" or device.type != "cpu":
        yield False
        return
    config._attn_implementation = BLOCKED
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
