"""What one optimizer step of the trainer runs on the CPU (``accel.step``): the contexts
around its passes (``step_contexts``) and the handle its token scoring calls (``Step``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from agent_rl.accel import kernels
from agent_rl.accel.attention import BLOCKED, plan_blocks
from agent_rl.accel.casts import linear_casts, step_cast_cache
from agent_rl.accel.head import DeferredHead, HeadGrads, sparse_tied_lookup
from agent_rl.accel.patches import trainer_forward
from agent_rl.run.distributed import Backend

# what a token keeps for backward under bf16 autocast, as a share of what it keeps in float32,
# where the trainer's kernels run (``half_activations``): the norms write the projections'
# bf16 input once (autocast kept a cast per projection) and blocked attention's kernel its
# bf16 output (float32 before, and its cast). Measured: 0.53 on SmolLM2-135M's Relay-v0 step
# (18.9 against 35.4 KB a layer); autocast's own share is the trainer's HALF_ACTIVATIONS
HALF_ACTIVATIONS_KERNELS = 0.56


@contextlib.contextmanager
def step_contexts(backend: Backend, model, dtype: torch.dtype):
    """One optimizer step's micro-batches, forward and backward, inside: the tied embedding's
    sparse gradient (``sparse_tied_lookup``), each weight cast once a step (``step_cast_cache``,
    ``linear_casts``), the trainer's forward (``patches.trainer_forward``)."""
    with (sparse_tied_lookup(backend, model), step_cast_cache(backend, dtype),
          trainer_forward(backend, model), linear_casts(backend, model, dtype)):
        yield


class Step:
    """The handle ``accel.step`` yields on the CPU. The trainer passes it, unopened, to its
    token-scoring functions, which call these and nothing else:

    - ``decoder_kwargs(model, batch) -> dict``: keywords for the decoder's forward over a shared
      batch (blocked attention's plan, where the model runs it);
    - ``head_logits(model, hidden [N, H]) -> [N, V]``: the output head at the picked positions
      (with gradients, on the step's model: its weight gradient deferred to the step's end,
      ``HeadGrads``);
    - ``token_logprobs(logits [N, V], targets [N], temperature) -> ([N], [N]) | None``: the
      picked log-probs and entropies (``policies.logprobs.picked_logprobs_and_entropy``'s values) as our
      kernel, writing the logits' gradient into the head's kept rows; None where the kernel
      does not take these logits (the caller's tensor ops then);
    - ``half_activations``: what a bf16 token keeps for backward, as a share of a float32
      token's, where these kernels change it (``HALF_ACTIVATIONS_KERNELS``); None where they
      leave it as autocast keeps it."""

    def __init__(self, backend: Backend, model, dtype: torch.dtype):
        self.model = model
        self.half_activations = half_activations(model)
        self._backend, self._dtype = backend, dtype

    @functools.cached_property
    def head(self) -> HeadGrads | None:
        """The step's deferred head gradient (None where it does not apply), made at the first
        forward pass with gradients: a step whose passes take none (``update_kl``) makes no
        buffers and no gradient."""
        return HeadGrads.of(self._backend, self.model, self._dtype)

    def decoder_kwargs(self, model, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        if getattr(model.config, "_attn_implementation", None) != BLOCKED:
            return {}
        return {"attention_blocks": plan_blocks(batch["attention_mask"])}

    def head_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head if model is self.model and torch.is_grad_enabled() else None
        if head is None:
            return model.get_output_embeddings()(hidden)  # [N, V]
        return DeferredHead.apply(hidden, head.weight, head)  # [N, V]

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not kernels.fits_logprobs(logits):
            return None
        head = vars(self).get("head")  # made by this step's forward with gradients, if any
        return token_logprobs(logits, targets, temperature, None if head is None else head.grad_rows)

    def flush(self) -> None:
        """Add the head's held gradient parts into its weight's gradient (before the optimizer
        step)."""
        head = vars(self).get("head")
        if head is not None:
            head.flush()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   grad_into=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``policies.logprobs.picked_logprobs_and_entropy`` as our kernel (``kernels.TokenLogprobs``): logits
    ``[N, V]`` (float32 or bf16 on the CPU), targets ``[N]`` -> ``[N]`` log-probs and ``[N]``
    entropies without gradient. The same values but for float summation order, one pass over
    the logits for both and one back (measured ad hoc, 125 x 49152 logits forward and
    backward: 3-4 against 11-40 ms); the logits' gradient goes where ``grad_into(N)`` says."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return kernels.TokenLogprobs.apply(logits.contiguous(), targets.contiguous(), float(temperature),
                                       grad_into)


def half_activations(model) -> float | None:
    """``HALF_ACTIVATIONS_KERNELS`` where the trainer's kernels take ``model`` (an SDPA model, so
    blocked attention, whose bf16 kernel takes its heads: ``kernels.fits_chunks``), else None."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fits = (getattr(config, "_attn_implementation", None) in (BLOCKED, "sdpa")
            and kernels.fits_chunks(head_dim))
    return HALF_ACTIVATIONS_KERNELS if fits else None
