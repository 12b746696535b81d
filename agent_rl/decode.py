"""Decoding with a preallocated KV cache: the per-token loop of ``HFPolicy`` for Llama-family
models, without transformers' per-step cache growth.

transformers' ``DynamicCache`` concatenates every layer's keys and values with the new token
on every decode step (a copy of the whole cache, per layer, per token), holds the prompt's
once per row, and its attention repeats the keys and values of each KV head for its query
heads. ``StaticDecoder`` keeps the prefill's prompt keys and values once per unique prompt,
writes each generated key and value in place into buffers sized for the whole completion,
and runs the decoder layers directly:

    x = embed(token)
    per layer:  h = input_norm(x);  q, k, v = q_proj(h), k_proj(h), v_proj(h)
                rotate q and k (the model's own rotary embedding at each row's position)
                generated[:, :, s] = k, v
                each KV head's group of queries: softmax(q K^T * scaling, padding masked) V
                over [the row's prompt, its generated positions so far], read in place
                x = x + o_proj(attention);  x = x + mlp(post_norm(x))
    logits = lm_head(norm(x))

Every module is the model's own (norms, projections, MLP, rotary embedding, head), so the
numbers are those of the model's forward up to float summation order (tested against it:
the same tokens, log-probs within 1e-5); the prefill stays the model's forward. It holds no
copy of any weight.

A rollout copy (a model only sampled from, never trained) can also hold its larger
projections and head in oneDNN's weight layout (``pack_linears``, ``PackedLinear``): the
model's forward (the prefill) and these steps then run oneDNN's matrix products instead of
MKL's, which at a decode step's few rows read a plain fp32 weight far below the memory
bandwidth. Same bytes, no second copy; the numbers move by float summation order (1e-4).

Supported (``supports``): ``model_type`` llama or qwen2 (SmolLM2 is llama) without
sliding-window attention, as a plain transformers model (not a peft wrapper: LoRA rollouts
run on a merged copy). Any other model decodes through its own forward, as before.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_TYPES = ("llama", "qwen2")
# A prompt's keys and values are held once for the rows sharing it when that spares more than
# this many bytes of reads per layer and step per prompt: each prompt costs a few small
# matrix products more per layer, about as long as reading 1 MB here (2 cores)
SHARED_MIN_BYTES = 1 << 20
# the row count oneDNN's weight layout is chosen for (any count runs): a GRPO group's samples
PACK_ROWS = 8
# smaller weights stay plain: oneDNN's per-call cost outweighs its gain below ~1 MB of fp32
# (on 2 cores: 64 x 640 1.7x slower at 8 rows, 192 x 576 1.3x faster at 8 rows but 1.2x
# slower at 32; 576 x 576 1.6x and the 49152 x 576 head 3.4x faster at 8 rows)
PACK_MIN_ELEMENTS = 1 << 18


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
    ``SHARED_MIN_BYTES`` per prompt, layer and step: every group's queries attend to their
    prompt as one matrix product, so a step reads each prompt once instead of once per row
    (for 8 samples of a 400-token prompt that is most of a step's memory traffic besides the
    weights). Otherwise (short prompts, one row per prompt) they are laid out per row. The generated positions have a
    buffer of their own, ``[B, kv_heads, max_new_tokens, head_dim]`` per layer, written in
    place."""

    def __init__(self, model: Any, cache: Any, which: torch.Tensor, max_new_tokens: int):
        inner = model.model
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.head = model.get_output_embeddings()
        prompt = cache.layers[: len(self.layers)]
        U, kvh, L, d = prompt[0].keys.shape
        self.prompt_length, self.generated = L, 0
        saved = (len(which) - U) * L * kvh * d * prompt[0].keys.element_size() * 2  # per layer
        self.shared = saved > U * SHARED_MIN_BYTES
        self.which = which  # [A] each active row's prompt
        if self.shared:
            self.prompt_keys = [layer.keys for layer in prompt]  # [U, kvh, L, d]
            self.prompt_values = [layer.values for layer in prompt]
        else:
            self.prompt_keys = [layer.keys.index_select(0, which) for layer in prompt]  # [B, kvh, L, d]
            self.prompt_values = [layer.values.index_select(0, which) for layer in prompt]
        self.keys = [k.new_empty((len(which), kvh, max_new_tokens, d)) for k in self.prompt_keys]
        self.values = [v.new_empty((len(which), kvh, max_new_tokens, d)) for v in self.prompt_values]
        self._groups()

    def _groups(self) -> None:
        """Each prompt's active rows, for the shared layout."""
        self.groups = [(u, (self.which == u).nonzero().flatten()) for u in self.which.unique().tolist()]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch): finished rows leave."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.which = self.which.index_select(0, rows)
        if self.shared:
            self._groups()
        else:
            self.prompt_keys = [k.index_select(0, rows) for k in self.prompt_keys]
            self.prompt_values = [v.index_select(0, rows) for v in self.prompt_values]

    def _prompt_matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a`` [A, kvh, g, m] times the prompt's ``b`` (its keys transposed, [., kvh, d, L],
        or its values, [., kvh, L, d]; one per prompt when shared, else per row):
        ``[A, kvh, g, n]``."""
        if not self.shared:
            return torch.matmul(a, b)
        A, kvh, g, m = a.shape
        out = a.new_empty((A, kvh, g, b.shape[-1]))
        for u, rows in self.groups:  # the group's rows as one [kvh, rows * g, m] block
            block = a.index_select(0, rows).permute(1, 0, 2, 3).reshape(kvh, -1, m)
            product = torch.matmul(block, b[u])  # [kvh, rows * g, n]
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
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [A, 1, 1, d]
        padding = ~mask[:, :L].bool()[:, None, None, :]  # [A, 1, 1, L]
        A = x.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)  # [A, 1, H]
            d = attn.head_dim
            q = attn.q_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, nh, 1, d]
            k = attn.k_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
            v = attn.v_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, s] = k[:, :, 0]
            self.values[i][:, :, s] = v[:, :, 0]
            # one query per row; each KV head's query group [A, kvh, g, d] attends to the
            # prompt (shared or per row) and to the row's generated positions
            q = q.reshape(A, k.shape[1], -1, d)
            scores = torch.cat([
                self._prompt_matmul(q, self.prompt_keys[i].transpose(-1, -2)).masked_fill(
                    padding, float("-inf")),
                torch.matmul(q, self.keys[i][:, :, : s + 1].transpose(-1, -2))], -1) * attn.scaling
            p = scores.softmax(-1, dtype=torch.float32).to(q.dtype)  # [A, kvh, g, L + s + 1]
            o = (self._prompt_matmul(p[..., :L], self.prompt_values[i])
                 + torch.matmul(p[..., L:], self.values[i][:, :, : s + 1]))  # [A, kvh, g, d]
            x = x + attn.o_proj(o.reshape(A, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.generated = s + 1
        return self.head(self.norm(x)[:, -1])  # [A, V]


class PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` whose weight is held only in oneDNN's blocked layout, reordered
    once (``torch.ops.mkldnn._reorder_linear_weight``; the same bytes as the plain weight).

    MKL's ``F.linear`` on a plain fp32 weight runs far below the memory bound at the few rows
    of a decode step (SmolLM2's 49152 x 576 head: ~16 ms for 8 rows where reading its 113 MB
    takes ~4); on the reordered weight oneDNN streams it (4.8 ms). Used by rollout copies
    (``pack_linears``), never by a trained model: there is no plain ``weight`` to train.
    ``load(weight)`` takes new weights (a push); ``tied``: the plain parameter the weight is
    (a head tied to the embeddings), re-read by ``reload()`` after that parameter changed."""

    def __init__(self, linear: torch.nn.Linear, tied: torch.nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.tied = tied
        self.load(linear.weight)

    @torch.no_grad()
    def load(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"PackedLinear: a weight of shape {tuple(weight.shape)} for a "
                             f"{self.in_features} -> {self.out_features} layer")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)

    def reload(self) -> None:
        if self.tied is not None:
            self.load(self.tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(model: Any) -> bool:
    """Would ``pack_linears`` take this model: a supported layout (``supports``) with float32
    or bfloat16 weights on the CPU, and oneDNN in this torch."""
    if not (supports(model) and torch.backends.mkldnn.is_available()):
        return False
    weights = {(p.device.type, p.dtype) for p in model.parameters()}
    return weights <= {("cpu", torch.float32), ("cpu", torch.bfloat16)} and len(weights) == 1


@torch.no_grad()
def pack_linears(model: Any) -> dict[str, PackedLinear]:
    """Swap the decoder layers' projections and the head of a frozen rollout copy, those
    with at least ``PACK_MIN_ELEMENTS`` weights, for ``PackedLinear`` (in place; the plain
    weights are freed, a head tied to the embeddings keeps them as the embeddings'). Returns
    {weight name, as in the unpacked model's ``named_parameters()``: the module now holding
    it}; {} when ``can_pack`` says no."""
    if not can_pack(model):
        return {}
    embed = model.get_input_embeddings().weight
    head_name = next(name for name, module in model.named_modules()
                     if module is model.get_output_embeddings())
    out: dict[str, PackedLinear] = {}
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
