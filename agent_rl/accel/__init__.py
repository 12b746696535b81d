"""The optional CPU accelerator: everything that exists only for the CPU's speed.

    kernels.py    our compiled kernels (csrc/kernels.cpp, built at first use) and their
                  autograd functions
    attention.py  blocked attention over packed rows (transformers' attention registry)
    patches.py    the trainer's forward: RMSNorm, SwiGLU and rotary modules run as our kernels
    casts.py      bf16 casts of the trained weights once a step
    head.py       the output head's weight gradient once a step, its kept buffers, the tied
                  embedding's sparse gradient
    trainer.py    what one trainer step composes, and the handle ``step`` yields

Training enters it through one context manager per optimizer step, and through nothing else:

    with accel.step(backend, model, dtype) as fast:   # fast: a Step on the CPU, else None
        logits = trained_token_logits(model, batch, fast)                   # [N, V]
        logprobs, entropy = trained_logprobs(logits, targets, temperature, fast)  # [N], [N]

``step`` checks first where it runs: a model off the CPU (CUDA, ``meta``), another backend than
the one-process ``TorchBackend`` (DeepSpeed), or inside ``disabled()``, and it yields None
having touched nothing here (no kernel built, no module patched); the trainer's own tensor ops
then do the same work. On the CPU it applies the patches, casts and head buffers for the
duration of the step, puts the modules back on the way out, and yields a ``trainer.Step``: an
opaque handle to the trainer, whose three hooks and one number its token-scoring functions call
(documented on the class). The values are the plain path's to float rounding (tested: the
losses of whole updates with the accelerator on and off, float32 and bf16).

Rollouts use the kernels too (``decode``'s fused decode step, ``policy``'s sampling): they
import the names below from this package, never a module inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from agent_rl.accel import trainer
from agent_rl.accel.attention import allowed_pairs, plan_blocks
from agent_rl.accel.attention import blocked as blocked_attention
from agent_rl.accel.kernels import (
    PANEL,
    SILU,
    blocked_linear,
    decode_attention,
    fits_decode,
    rms_norm,
    rotary_write,
    silu_mul,
    to_panels,
)
from agent_rl.accel.kernels import load as load_kernels
from agent_rl.accel.kernels import sample as sample_tokens
from agent_rl.accel.trainer import Step
from agent_rl.run.distributed import Backend, TorchBackend

__all__ = [
    "PANEL", "SILU", "Step", "allowed_pairs", "blocked_attention", "blocked_linear",
    "decode_attention", "disabled", "fits_decode", "load_kernels", "plan_blocks", "rms_norm",
    "rotary_write", "sample_tokens", "silu_mul", "step", "to_panels",
]

_DISABLED = contextvars.ContextVar("agent_rl_accel_disabled", default=False)


@contextlib.contextmanager
def step(backend: Backend, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[Step | None]:
    """One optimizer step's passes (forward and backward, or a forward alone) inside: on the
    CPU under ``TorchBackend``, the accelerator applied and its ``Step`` handle yielded, the
    head's deferred gradient added into its weight's ``.grad`` on the way out (before the
    optimizer step); anywhere else, or inside ``disabled()``, None and nothing done.
    ``dtype`` is the step's compute dtype (``torch.bfloat16`` under bf16 autocast)."""
    if _DISABLED.get() or not runs_here(backend, model):
        yield None
        return
    handle = trainer.Step(backend, model, dtype)
    with trainer.step_contexts(backend, model, dtype):
        yield handle
    handle.flush()


def runs_here(backend: Backend, model: torch.nn.Module) -> bool:
    """Whether ``step`` applies: one process (``TorchBackend``: no hook waits for a gradient,
    no ZeRO partitions the weights) and the model's weights on the CPU. Reads the device only:
    builds nothing."""
    weight = next(model.parameters(), None)
    return isinstance(backend, TorchBackend) and weight is not None and weight.device.type == "cpu"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """While inside (this thread), ``step`` yields None on the CPU too: the trainer's plain
    path, to compare against or to rule the accelerator out."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)
