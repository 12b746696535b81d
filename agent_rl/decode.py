"""Decoding with a preallocated KV cache: the per-token loop of ``HFPolicy`` for Llama-family
models, without transformers' per-step cache growth.

transformers' ``DynamicCache`` concatenates every layer's keys and values with the new token
on every decode step (a copy of the whole cache, per layer, per token), and its attention
repeats the keys and values of each KV head for its query heads. ``StaticDecoder`` takes the
prefill's cache once into buffers sized for the whole completion, ``[B, kv_heads, prompt +
max_new_tokens, head_dim]`` per layer, writes each new key and value in place, and runs the
decoder layers directly:

    x = embed(token)
    per layer:  h = input_norm(x);  q, k, v = q_proj(h), k_proj(h), v_proj(h)
                rotate q and k (the model's own rotary embedding at each row's position)
                cache[:, :, t] = k, v
                each KV head's group of queries: softmax(q K^T * scaling, padding masked) V,
                reading the cache slice in place
                x = x + o_proj(attention);  x = x + mlp(post_norm(x))
    logits = lm_head(norm(x))

Every module is the model's own (norms, projections, MLP, rotary embedding, head), so the
numbers are those of the model's forward up to float summation order (tested against it:
the same tokens, log-probs within 1e-5); the prefill stays the model's forward. It holds no
copy of any weight.

Supported (``supports``): ``model_type`` llama or qwen2 (SmolLM2 is llama) without
sliding-window attention, as a plain transformers model (not a peft wrapper: LoRA rollouts
run on a merged copy). Any other model decodes through its own forward, as before.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_TYPES = ("llama", "qwen2")


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
    U unique prompts (left-padded to length L); ``which`` [B]: each row's prompt; the buffers
    hold L + ``max_new_tokens`` positions."""

    def __init__(self, model: Any, cache: Any, which: torch.Tensor, max_new_tokens: int):
        inner = model.model
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.head = model.get_output_embeddings()
        first = cache.layers[0].keys  # [U, kv_heads, L, d]
        self.length = first.shape[2]  # positions filled
        size = self.length + max_new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers[: len(self.layers)]:
            for src, out in ((layer.keys, self.keys), (layer.values, self.values)):
                buf = src.new_empty((len(which), src.shape[1], size, src.shape[3]))  # [B, kvh, S, d]
                buf[:, :, : self.length] = src.index_select(0, which)
                out.append(buf)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch): finished rows leave."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[A, V]`` after feeding ``token`` [A] at ``position`` [A, 1]; ``mask``
        [A, t + 1] (1: attend) covers every filled position and this one."""
        t = self.length
        x = self.embed(token.unsqueeze(-1))  # [A, 1, H]
        cos, sin = self.rotary(x, position)  # [A, 1, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [A, 1, 1, d]
        attend = mask.bool()[:, None, None, :]  # [A, 1, 1, t + 1]
        A = x.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)  # [A, 1, H]
            d = attn.head_dim
            q = attn.q_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, nh, 1, d]
            k = attn.k_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
            v = attn.v_proj(h).view(A, 1, -1, d).transpose(1, 2)  # [A, kvh, 1, d]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, t] = k[:, :, 0]
            self.values[i][:, :, t] = v[:, :, 0]
            # one query per row: each KV head's query group attends as one matrix product,
            # reading the cache slice in place (no repeat of the keys, no contiguous copy)
            kvh = k.shape[1]
            qg = q.view(A, kvh, -1, d)  # [A, kvh, g, d]
            scores = torch.matmul(qg, self.keys[i][:, :, : t + 1].transpose(-1, -2)) * attn.scaling
            scores = scores.masked_fill(~attend, float("-inf"))  # [A, kvh, g, t + 1]
            o = torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype),
                             self.values[i][:, :, : t + 1])  # [A, kvh, g, d]
            x = x + attn.o_proj(o.reshape(A, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.length = t + 1
        return self.head(self.norm(x)[:, -1])  # [A, V]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
