"""Token log-probs and entropies of a policy's logits: the one rule the sampler, the rollout's
recorded log-probs and the trainer's ratio all use (``picked_logprobs``), so the old and new
log-probs of the PPO ratio come from one implementation.

A policy samples token x from ``softmax(logits / temperature)``; its log-prob is
``log_softmax(logits / temperature)[x]``, computed in at least float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of logits / temperature over the last dim, in at least float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:  # x / 1 is x: no [N, V] pass for nothing
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of ``targets[n]`` under ``softmax(logits[n] / temperature)``: logits ``[N, V]``,
    targets ``[N]`` -> ``[N]``. The one rule every log-prob here is computed with."""
    logp = scaled_log_softmax(logits, temperature)  # [N, V]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]


def picked_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits[n] / temperature)``: ``[N, V]`` -> ``[N]``."""
    logp = scaled_log_softmax(logits, temperature)  # [N, V]
    return -(logp.exp() * logp).sum(-1)  # [N]


def picked_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``picked_logprobs`` and ``picked_entropy`` (without gradient) from one log-softmax:
    ``[N]`` and ``[N]``. (The trainer's CPU accelerator computes the same with our kernel.)"""
    logp = scaled_log_softmax(logits, temperature)  # [N, V]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [N]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of input_ids[:, t] given input_ids[:, :t]: `[B, T]`, position 0 is 0.0.

    logits `[B, T, V]` as a causal LM returns them (logits[:, t] predicts token t + 1);
    input_ids `[B, T]`. Sampling at `temperature` means the policy is softmax(logits / T),
    so the same temperature must be used here for rollout and training.
    """
    B, T, V = logits.shape
    picked = picked_logprobs(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1),
                             temperature).view(B, T - 1)  # [B, T-1]
    return F.pad(picked, (1, 0))  # [B, T]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that sampled token t: `[B, T]`, position 0 is 0.0."""
    B, T, V = logits.shape
    ent = picked_entropy(logits[:, :-1].reshape(-1, V), temperature).view(B, T - 1)  # [B, T-1]
    return F.pad(ent, (1, 0))  # [B, T]
