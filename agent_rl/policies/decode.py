"""Decoding with a preallocated KV cache: the per-token loop of ``HFPolicy`` for Llama-family
models, without transformers' per-step cache growth; and the prompts' forward before it
(``prefill``) with the prefixes they share computed once.

transformers' ``DynamicCache`` concatenates every layer's keys and values with the new token
on every decode step (a copy of the whole cache, per layer, per token), holds the prompt's
once per row, and its attention repeats the keys and values of each KV head for its query
heads. ``StaticDecoder`` keeps the prefill's prompt keys and values once per unique prompt,
writes each generated key and value in place into buffers sized for the whole completion,
and runs the decoder layers directly:

    x = embed(token)
    per layer:  h = input_norm(x);  q, k, v = q_proj(h), k_proj(h), v_proj(h)  (one product
                for the three on a packed copy: ``PackedGroup``; the same for gate and up)
                rotate q and k (the model's own rotary embedding at each row's position)
                generated[:, :, s] = k, v
                each KV head's group of queries: softmax(q K^T * scaling, padding masked) V
                over [the row's prompt, its generated positions so far], read in place (our
                kernel on the CPU, ``accel.decode_attention``; tensor ops elsewhere)
                x = x + o_proj(attention);  x = x + mlp(post_norm(x))
    logits = lm_head(norm(x))

Every module is the model's own (norms, projections, MLP, rotary embedding, head), so the
numbers are those of the model's forward up to float summation order (tested against it:
the same tokens, log-probs within 1e-5); the prefill is the model's forward (``prefill``:
over token trees, each distinct prefix once). It holds no copy of any weight.

A rollout copy (a model only sampled from, never trained) can also hold its larger
projections and head in panels of 32 output columns (``pack_linears``, ``PackedLinear``): the
model's forward (the prefill) and these steps then run our kernel (``agent_rl.accel``)
instead of MKL's matrix products, which at a decode step's few rows read a plain fp32 weight
far below the memory bandwidth. Same bytes, no second copy; the numbers move by float
summation order (1e-4).

Supported (``supports``): ``model_type`` llama or qwen2 (SmolLM2 is llama) without
sliding-window attention, as a plain transformers model (not a peft wrapper: LoRA rollouts
run on a merged copy). Any other model decodes through its own forward, as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from agent_rl import accel
from agent_rl.accel import blocked_attention, plan_blocks

SUPPORTED_TYPES = ("llama", "qwen2")
# A prompt's keys and values are held once for the rows sharing it when that spares more than
# this many bytes of reads per layer and step per prompt: each prompt costs a few small
# matrix products more per layer, about as long as reading 1 MB here (2 cores)
SHARED_MIN_BYTES = 1 << 20
# smaller weights stay plain: the kernel's per-call cost (~15 us) outweighs its gain below
# this (on 2 cores, at 8 / 32 rows, against F.linear: 256 x 128 0.8x / 0.8x, timed ad hoc;
# 192 x 576 1.45x / 1.19x, 576 x 576 1.47x / 1.21x, 1536 x 576 1.62x / 1.42x,
# benchmarks/linear_kernel.py)
PACK_MIN_ELEMENTS = 1 << 16


def kv_dtype(held: torch.dtype, device_type: str, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype ``StaticDecoder`` holds keys or values in, the prefill having left them in
    ``held``: on CUDA under autocast (``autocast``: its dtype, None when off) the autocast
    dtype, which the attention products take anyway (half the bytes a decode step reads and
    the cache holds: under bf16 autocast the rotated keys come out float32, since the rotary
    cos/sin are float32); elsewhere as held (the CPU's kernels read float32)."""
    return autocast if device_type == "cuda" and autocast is not None else held


def supports(model: Any) -> bool:
    """Can ``StaticDecoder`` run this model? (A Llama-style decoder it knows the layout of.)"""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return (getattr(config, "model_type", None) in SUPPORTED_TYPES
            and not hasattr(model, "get_base_model")
            and not getattr(config, "use_sliding_window", False)
            and inner is not None and hasattr(inner, "rotary_emb") and hasattr(inner, "layers"))


class StaticDecoder:
    """The decode steps after one prefill. ``cache``: the prefill's ``DynamicCache`` over the
    U unique prompts (left-padded to length L); ``which`` [B]: each row's prompt.

    The prompt's keys and values stay as the prefill left them, once per unique prompt, when
    rows share prompts (a GRPO group's samples) and that spares reading more than
    ``SHARED_MIN_BYTES`` per prompt, layer and step: the prompt is held (and copied) once
    instead of once per row (for 8 samples of a 400-token prompt, most of a step's memory
    traffic besides the weights; our attention kernel reads it once per row, the group's
    rows one after another; the tensor ops attend each group to it as one matrix product); the generated positions then have a buffer of their own, ``[B,
    kv_heads, max_new_tokens, head_dim]`` per layer. Otherwise (short prompts, one row per
    prompt) each row holds its prompt and its generated positions in one buffer, ``[B,
    kv_heads, L + max_new_tokens, head_dim]`` per layer, attended by our kernel or one
    ``F.scaled_dot_product_attention`` call. Generated keys and values are written in place."""

    def __init__(self, model: Any, cache: Any, which: torch.Tensor, max_new_tokens: int):
        inner = model.model
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.head = model.get_output_embeddings()
        prompt = cache.layers[: len(self.layers)]
        U, kvh, L, d = prompt[0].keys.shape
        device = prompt[0].keys.device
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        keys_dtype, values_dtype = (kv_dtype(held.dtype, device.type, autocast)
                                    for held in (prompt[0].keys, prompt[0].values))
        self.prompt_length, self.generated = L, 0
        saved = (len(which) - U) * L * kvh * d * keys_dtype.itemsize * 2  # per layer
        self.shared = saved > U * SHARED_MIN_BYTES
        self.which = which  # [A] each active row's prompt
        B = len(which)
        if self.shared:
            self.prompt_keys = [layer.keys.to(keys_dtype) for layer in prompt]  # [U, kvh, L, d]
            self.prompt_values = [layer.values.to(values_dtype) for layer in prompt]
            self.keys = [k.new_empty((B, kvh, max_new_tokens, d)) for k in self.prompt_keys]
            self.values = [v.new_empty((B, kvh, max_new_tokens, d)) for v in self.prompt_values]
        else:  # [B, kvh, L + max_new_tokens, d]: the row's prompt, then its generated positions
            self.keys, self.values = [], []
            for layer in prompt:
                for held, buffers, dtype in ((layer.keys, self.keys, keys_dtype),
                                             (layer.values, self.values, values_dtype)):
                    buffer = held.new_empty((B, kvh, L + max_new_tokens, d), dtype=dtype)
                    buffer[:, :, :L] = held.index_select(0, which)
                    buffers.append(buffer)
        if self.shared:
            self._groups()

    def _groups(self) -> None:
        """Each prompt's active rows, for the shared layout."""
        self.groups = [(u, (self.which == u).nonzero().flatten()) for u in self.which.unique().tolist()]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch, ascending): finished rows
        leave. The kept rows move to the front of the buffers they are in, in place, and only
        the generated positions written so far are moved (not the whole completion's room)."""
        used = self.generated if self.shared else self.prompt_length + self.generated
        self.keys = [_keep_rows(k, rows, used) for k in self.keys]
        self.values = [_keep_rows(v, rows, used) for v in self.values]
        self.which = self.which.index_select(0, rows)
        if self.shared:
            self._groups()

    def _prompt_matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a`` [A, kvh, g, m] times the shared prompt's ``b`` (its keys transposed, [U, kvh,
        d, L], or its values, [U, kvh, L, d]), each row by its own prompt's: ``[A, kvh, g, n]``."""
        A, kvh, g, m = a.shape
        out = None  # in the products' dtype: bf16 under autocast, whatever ``a``'s
        for u, rows in self.groups:  # the group's rows as one [kvh, rows * g, m] block
            block = a.index_select(0, rows).permute(1, 0, 2, 3).reshape(kvh, -1, m)
            product = torch.matmul(block, b[u])  # [kvh, rows * g, n]
            if out is None:
                out = product.new_empty((A, kvh, g, b.shape[-1]))
            out.index_copy_(0, rows, product.view(kvh, len(rows), g, -1).permute(1, 0, 2, 3))
        return out

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[A, V]`` after feeding ``token`` [A] at ``position`` [A, 1]; ``mask``
        [A, L + s + 1] (1: attend): the prompt's padding, then the s generated positions and
        this one."""
        L, s = self.prompt_length, self.generated
        x = self.embed(token.unsqueeze(-1))  # [A, 1, H]
        cos, sin = self.rotary(x, position)  # [A, 1, d]
        half = cos.shape[-1] // 2
        # rotate_half(t) * sin == roll(t, half) * (sin with its first half negated)
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # [A, 1, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [A, 1, 1, d]
        attend = mask.bool()  # [A, L + s + 1]
        A = x.shape[0]
        first = self.layers[0].self_attn
        d = first.head_dim
        kvh = self.keys[0].shape[1]
        # our kernels (accel.rotary_write, decode_attention, silu_mul) where they take the step
        fused = accel.fits_decode(x, d, first.config.num_attention_heads // kvh)
        slot = s if self.shared else L + s  # where this position's key and value go
        own = torch.arange(A)  # [A] each row reads its own buffer (the kernel, not shared)
        padding = ~attend[:, None, None, :L] if self.shared and not fused else None  # [A, 1, 1, L]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, x)  # [A, 1, H]
            q, k, v = (attn.packed_qkv(h) if hasattr(attn, "packed_qkv")
                       else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)))  # [A, 1, heads * d]
            if fused:  # rotated q; rotated k and v written at the slot, one pass
                q = accel.rotary_write(q.flatten(1), k.flatten(1), v.flatten(1), cos[:, 0, 0],
                                         sin[:, 0, 0], self.keys[i], self.values[i], slot)
                q = q.view(A, kvh, -1, d)  # [A, kvh, g, d]
            else:
                q = q.view(A, 1, -1, d).transpose(1, 2)  # [A, nh, 1, d]
                k = k.view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
                v = v.view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
                q = torch.addcmul(q * cos, q.roll(half, -1), sin)  # the model's rotary embedding
                k = torch.addcmul(k * cos, k.roll(half, -1), sin)
                # one query per row: each KV head's query group [A, kvh, g, d]
                q = q.reshape(A, kvh, -1, d)
                self.keys[i][:, :, slot] = k[:, :, 0]
                self.values[i][:, :, slot] = v[:, :, 0]
            # each KV head's query group attends to the prompt (shared or in the row's buffer)
            # and to the row's generated positions
            if fused and self.shared:  # our kernel: the prompt's keys held once, then the row's
                o = accel.decode_attention(
                    q, self.prompt_keys[i], self.prompt_values[i], self.which, self.keys[i][:, :, : s + 1],
                    self.values[i][:, :, : s + 1], attend, attn.scaling)  # [A, kvh, g, d]
            elif fused:  # our kernel over the row's own buffer, read in place
                keys, values = self.keys[i][:, :, : L + s + 1], self.values[i][:, :, : L + s + 1]
                o = accel.decode_attention(q, keys, values, own, keys[:, :, :0],
                                             values[:, :, :0], attend, attn.scaling)  # [A, kvh, g, d]
            elif self.shared:
                scores = torch.cat([
                    self._prompt_matmul(q, self.prompt_keys[i].transpose(-1, -2)).masked_fill(
                        padding, float("-inf")),
                    torch.matmul(q, self.keys[i][:, :, : s + 1].transpose(-1, -2))], -1) * attn.scaling
                p = scores.softmax(-1, dtype=torch.float32).to(q.dtype)  # [A, kvh, g, L + s + 1]
                o = (self._prompt_matmul(p[..., :L], self.prompt_values[i])
                     + torch.matmul(p[..., L:], self.values[i][:, :, : s + 1]))  # [A, kvh, g, d]
            else:
                o = torch.nn.functional.scaled_dot_product_attention(  # q in the cache's dtype
                    q.to(self.keys[i].dtype), self.keys[i][:, :, : L + s + 1], self.values[i][:, :, : L + s + 1],
                    attn_mask=attend[:, None, None, :], scale=attn.scaling)  # [A, kvh, g, d]
            x = x + attn.o_proj(o.reshape(A, 1, -1))
            h = _rms_norm(layer.post_attention_layernorm, x)  # [A, 1, H]
            mlp = layer.mlp
            if hasattr(mlp, "packed_gate_up"):  # the model's MLP: down(act(gate(h)) * up(h))
                gate, up = mlp.packed_gate_up(h)  # [A, 1, M] each
                if fused and type(mlp.act_fn).__name__ in accel.SILU:
                    x = x + mlp.down_proj(accel.silu_mul(gate.flatten(1), up.flatten(1)).unsqueeze(1))
                else:
                    x = x + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                x = x + mlp(h)
        self.generated = s + 1
        return self.head(_rms_norm(self.norm, x)[:, -1])  # [A, V]


def prefill(model: Any, prompts: list[list[int]], cache_arg: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The prompts' forward, each shared prefix computed once: the keys and values of every
    prompt and the logits after its last token, as the model's forward over each prompt alone
    gives them (up to float summation order). ``prompts``: U distinct token lists; ``cache_arg``:
    the name of the model's cache argument. Returns a ``DynamicCache`` over the prompts
    left-padded to the longest, L ([U, kv_heads, L, head_dim] per layer), the mask ``[U, L]``
    (1: a prompt token) and the logits ``[U, V]``.

    Prompts of one rollout share long prefixes: the chat template and system prompt, a
    task's instructions and examples, an episode's earlier turns (a Relay-v0 batch: 3,346
    prompt tokens, of which 1,385 distinct prefixes). Each row of the forward holds a *token
    tree* (``_tree``) of the prompts assigned to it: every distinct prefix once, a node at
    position = its depth attending to exactly its ancestors (a 4D mask), so each node's
    keys, values and output are those of the prompt's forward. One tree for all prompts
    computes each distinct prefix once, but its attention covers every pair of nodes in the
    row; a row per prompt is the plain padded batch. ``_rows`` picks, from the prompts sorted,
    the split into rows of adjacent prompts sharing at least t tokens that costs least
    (``_forward_cost``: projections per node, attention per pair of nodes in a row)."""
    config = model.config
    rows = _rows(prompts, _forward_cost(config))
    trees = [_tree([prompts[u] for u in row]) for row in rows]
    R, N = len(rows), max(len(tokens) for tokens, _, _ in trees)
    input_ids = torch.zeros((R, N), dtype=torch.long)  # [R, N] each tree right-aligned
    position_ids = torch.zeros((R, N), dtype=torch.long)
    attend = torch.eye(N, dtype=torch.bool).repeat(R, 1, 1, 1)  # [R, 1, N, N] padding sees itself
    L = max(len(p) for p in prompts)
    where = torch.zeros((len(prompts), L), dtype=torch.long)  # [U, L] each prompt's nodes, flat
    mask = torch.zeros((len(prompts), L), dtype=torch.long)  # [U, L]
    for r, (row, (tokens, depth, paths)) in enumerate(zip(rows, trees, strict=True)):
        start = N - len(tokens)
        input_ids[r, start:] = torch.tensor(tokens)
        position_ids[r, start:] = torch.tensor(depth)
        for u, path in zip(row, paths, strict=True):
            nodes = torch.tensor(path) + start  # [n] the prompt's nodes, root first
            n = len(path)
            attend[r, 0, nodes[:, None], nodes[None, :]] = torch.ones(n, n, dtype=torch.bool).tril()
            where[u, L - n:] = nodes + r * N
            mask[u, L - n:] = 1
    device = next(iter(model.parameters()), torch.empty(0)).device
    if config._attn_implementation != "sdpa":  # eager and the rest add the mask to the scores
        attend = torch.zeros(attend.shape, dtype=model.dtype).masked_fill(~attend, torch.finfo(model.dtype).min)
    cache = DynamicCache(config=config)
    with blocked_attention(model) as on:  # attention only over each node's ancestors (agent_rl.accel)
        blocks = {"attention_blocks": plan_blocks(attend)} if on else {}
        hidden = model.model(input_ids=input_ids.to(device), attention_mask=attend.to(device),
                             position_ids=position_ids.to(device), use_cache=True,
                             **{cache_arg: cache}, **blocks).last_hidden_state  # [R, N, H]
    where, mask = where.to(device), mask.to(device)
    last = where[:, -1]  # [U] each prompt's last node
    logits = model.get_output_embeddings()(hidden.flatten(0, 1).index_select(0, last))  # [U, V]
    out = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers[: config.num_hidden_layers]):
        kvh, d = layer.keys.shape[1], layer.keys.shape[3]
        out.update(*(t.transpose(1, 2).reshape(R * N, kvh, d).index_select(0, where.flatten())
                     .view(len(prompts), L, kvh, d).transpose(1, 2).contiguous()
                     for t in (layer.keys, layer.values)), i)
    return out, mask, logits


def _tree(prompts: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """The token tree of ``prompts``: each distinct prefix one node (parents first). Returns
    the nodes' tokens, their depths and each prompt's path of nodes."""
    node: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    depth: list[int] = []
    paths = []
    for prompt in prompts:
        path: list[int] = []
        for t in prompt:
            key = (path[-1] if path else -1, t)
            if key not in node:
                node[key] = len(tokens)
                tokens.append(t)
                depth.append(len(path))
            path.append(node[key])
        paths.append(path)
    return tokens, depth, paths


def _forward_cost(config: Any) -> tuple[float, float]:
    """FLOPs of a decoder forward (per token: the layers' products; per pair of tokens in a
    row: attention's scores and weighted sum), from the config."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * layers * (h * d * (2 * heads + 2 * kv) + 3 * h * config.intermediate_size)
    per_pair = 4 * layers * heads * d
    return per_token, per_pair


def _rows(prompts: list[list[int]], cost: tuple[float, float]) -> list[list[int]]:
    """The prompts (indices) of each row of the prefill: runs of the prompts in sorted order
    whose neighbours share at least t tokens, t chosen for the least cost: R rows of N nodes
    (the largest tree; the rest padded) cost R * (N * per_token + N^2 * per_pair)."""
    order = sorted(range(len(prompts)), key=lambda u: prompts[u])
    shared = [_common(prompts[a], prompts[b]) for a, b in zip(order, order[1:], strict=False)]
    per_token, per_pair = cost
    best: tuple[float, list[list[int]]] | None = None
    for t in sorted(set(shared)) + [float("inf")]:
        rows, nodes = [[order[0]]], [len(prompts[order[0]])]  # a tree's nodes: its prompts' distinct prefixes
        for u, s in zip(order[1:], shared, strict=True):
            if s >= t:
                rows[-1].append(u)
                nodes[-1] += len(prompts[u]) - s
            else:
                rows.append([u])
                nodes.append(len(prompts[u]))
        n = max(nodes)
        total = len(rows) * n * (per_token + n * per_pair)
        if best is None or total < best[0]:
            best = (total, rows)
    return best[1]


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` whose weight is held only in panels of 32 output columns
    (``accel.to_panels``: the same bytes as the plain weight, padded to a multiple of 32
    rows) and multiplied by our kernel (``accel.blocked_linear``).

    MKL's ``F.linear`` on a plain fp32 weight, and oneDNN's on its own reordered layout, run
    far below the memory bound at the few rows of a decode step (SmolLM2's 1536 x 576
    projection at 8 rows: ~320 and ~265 us where reading its 3.5 MB takes ~150); the kernel
    ~200 us (``benchmarks/linear_kernel.py``). Used by rollout copies (``pack_linears``), never by a trained
    model: there is no plain ``weight`` to train. ``load(weight)`` takes new weights (a push,
    written into the same panels); ``tied``: the plain parameter the weight is (a head tied
    to the embeddings), re-read by ``reload()`` after that parameter changed. ``release()``
    frees the panels' memory (a ``PackedGroup``'s: all its parts') until ``load`` or
    ``reload`` writes them again; ``stale`` says a part has not been written since."""

    def __init__(self, linear: torch.nn.Linear, tied: torch.nn.Parameter | None = None,
                 panels: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.tied = tied
        # [P, K, 32]; ``panels``: where to hold them (a PackedGroup's share)
        self.panels = accel.to_panels(linear.weight.detach(), out=panels)
        self._storage_bytes = self.panels.untyped_storage().nbytes()  # a group's: all parts'
        self.stale = False

    @torch.no_grad()
    def load(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"PackedLinear: a weight of shape {tuple(weight.shape)} for a "
                             f"{self.in_features} -> {self.out_features} layer")
        storage = self.panels.untyped_storage()
        if storage.nbytes() == 0:  # released: memory again (its views stay valid)
            storage.resize_(self._storage_bytes)
        accel.to_panels(weight.detach().to(self.panels.dtype), out=self.panels)
        self.stale = False

    def reload(self) -> None:
        if self.tied is not None:
            self.load(self.tied)

    def release(self) -> None:
        self.panels.untyped_storage().resize_(0)
        self.stale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stale:
            raise RuntimeError("PackedLinear: its weights were released and not loaded since")
        return accel.blocked_linear(x, self.panels, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedGroup(torch.nn.Module):
    """Linears of one input (a decoder layer's q, k and v projections; its MLP's gate and up)
    packed side by side in one panel tensor: each part is a ``PackedLinear`` on its own slice
    of the panels (what the model's forward, the prefill, calls), and ``forward`` runs one
    kernel call for all of them (what ``StaticDecoder`` calls): fewer, longer weight streams
    per decode step. Returns each part's output, a view of the one product (+ its bias)."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        counts = [-(-linear.out_features // accel.PANEL) for linear in linears]
        first = linears[0].weight
        self.panels = first.new_zeros((sum(counts), first.shape[1], accel.PANEL))  # [P, K, 32]
        starts = [sum(counts[:j]) for j in range(len(counts))]
        self.parts = [PackedLinear(linear, panels=self.panels[start:start + count])
                      for linear, start, count in zip(linears, starts, counts, strict=True)]
        self.columns = [(start * accel.PANEL, linear.out_features)
                        for start, linear in zip(starts, linears, strict=True)]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if any(part.stale for part in self.parts):
            raise RuntimeError("PackedGroup: its weights were released and not loaded since")
        y = accel.blocked_linear(x, self.panels, None, self.panels.shape[0] * accel.PANEL)
        return [y[..., c:c + n] if part.bias is None else y[..., c:c + n] + part.bias
                for part, (c, n) in zip(self.parts, self.columns, strict=True)]


# the linears of one input that pack_linears groups: {module attribute: (parts, group name)}
GROUPS = {"self_attn": (("q_proj", "k_proj", "v_proj"), "packed_qkv"),
          "mlp": (("gate_proj", "up_proj"), "packed_gate_up")}


def can_pack(model: Any) -> bool:
    """Would ``pack_linears`` take this model: a supported layout (``supports``) with float32
    or bfloat16 weights on the CPU, and our kernel built here (``accel.load_kernels``)."""
    if not supports(model):
        return False
    weights = {(p.device.type, p.dtype) for p in model.parameters()}
    return (weights <= {("cpu", torch.float32), ("cpu", torch.bfloat16)} and len(weights) == 1
            and accel.load_kernels())


@torch.no_grad()
def pack_linears(model: Any) -> dict[str, PackedLinear]:
    """Swap the decoder layers' projections and the head of a frozen rollout copy, those
    with at least ``PACK_MIN_ELEMENTS`` weights, for ``PackedLinear`` (in place; the plain
    weights are freed, a head tied to the embeddings keeps them as the embeddings'). A
    layer's q/k/v and gate/up projections, when all of them qualify, share one
    ``PackedGroup`` (``GROUPS``; set on the attention or MLP module as ``packed_qkv`` /
    ``packed_gate_up``). Returns {weight name, as in the unpacked model's
    ``named_parameters()``: the module now holding it}; {} when ``can_pack`` says no."""
    if not can_pack(model):
        return {}
    embed = model.get_input_embeddings().weight
    head_name = next(name for name, module in model.named_modules()
                     if module is model.get_output_embeddings())
    out: dict[str, PackedLinear] = {}
    for layer_name, layer in list(model.named_modules()):
        for attr, (names, group_name) in GROUPS.items():
            owner = getattr(layer, attr, None) if ".layers." in f".{layer_name}." else None
            linears = [getattr(owner, n, None) for n in names]
            if not all(isinstance(m, torch.nn.Linear) and m.weight.numel() >= PACK_MIN_ELEMENTS
                       for m in linears):
                continue
            group = PackedGroup(linears)
            setattr(owner, group_name, group)
            for n, part in zip(names, group.parts, strict=True):
                setattr(owner, n, part)
                out[f"{layer_name}.{attr}.{n}.weight"] = part
    for name, module in list(model.named_modules()):
        if (not isinstance(module, torch.nn.Linear) or module.weight.numel() < PACK_MIN_ELEMENTS
                or not (name == head_name or ".layers." in f".{name}")):
            continue
        tied = embed if module.weight is embed else None
        packed = PackedLinear(module, tied)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
        out[f"{name}.weight"] = packed
    return out


def _keep_rows(buffer: torch.Tensor, rows: torch.Tensor, used: int | None = None) -> torch.Tensor:
    """``buffer`` [B, kvh, S, d] with its rows ``rows`` moved to the front in place (of dim 2,
    only the first ``used`` positions, all when None): the view ``[len(rows), kvh, S, d]``."""
    part = buffer if used is None else buffer[:, :, :used]
    part[: len(rows)].copy_(part.index_select(0, rows))
    return buffer[: len(rows)]


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama/Qwen2 RMSNorm (x / sqrt(mean(x^2) + eps) * weight, the module's formula) as one
    op instead of its seven: our kernel's one pass on the CPU (``accel.rms_norm``),
    ``F.rms_norm`` elsewhere; any other norm module as itself."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
        return norm(x)
    if x.device.type == "cpu" and norm.weight.dtype == torch.float32 and accel.load_kernels():
        return accel.rms_norm(x, norm.weight, eps)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, eps)
