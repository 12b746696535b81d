"""The trainer's forward pass on the CPU: attention only where the packed mask allows
(``attention.blocked``), and the Hugging Face modules' RMSNorms, SwiGLU middles and rotary
embedding run as our kernels, forward and backward, by patching the model's module instances
(``instance_forwards``) or the modeling module's ``apply_rotary_pos_emb`` for the duration of a
step, and putting them back afterwards. The same values to float rounding (tested)."""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from agent_rl.accel import kernels
from agent_rl.accel.attention import blocked
from agent_rl.run.distributed import Backend, TorchBackend


@contextlib.contextmanager
def trainer_forward(backend: Backend, model):
    """The trainer's forward pass: attention only where the packed mask allows
    (``attention.blocked``), RMSNorms, SwiGLU's middle and the rotary embedding as our kernels
    on the CPU. ``accel.step`` runs it: the trainer's passes and its ``update_kl``'s alike."""
    with blocked(model), kernel_norms(backend, model), kernel_mlps(backend, model), kernel_rotary(backend, model):
        yield


@contextlib.contextmanager
def kernel_norms(backend: Backend, model):
    """While inside, the Llama-style RMSNorms of ``model`` (a ``variance_epsilon`` and a
    ``[H]`` weight: Llama, Qwen2 and their kin; ``decode`` runs the same ones as its kernel)
    compute float32 rows on the CPU as our kernel, forward and backward one pass each
    (``kernels.RMSNorm``; ~0.6 against ~3.1 ms for 1000 x 576 rows, forward + backward); any
    other input (bf16 rows, another device) goes through the module's own forward. The same
    values but for float summation order (tested). Under bf16 autocast the result is bf16,
    rounded once: the value autocast's cast before each projection would give, written and
    kept once instead of once per projection (q, k and v: three casts, three bf16 copies kept);
    the projections' input gradients then add up in bf16, as the model's own bf16 tensors'
    would, where autocast's casts added them in float32. Not on another device, without the
    kernel, or under another backend than ``TorchBackend`` (DeepSpeed's ZeRO-3 manages the
    weights inside forward): nothing changes. A norm whose forward something else already
    wrapped (accelerate's hooks set their own on the instance) keeps it."""
    norms = [m for m in model.modules() if getattr(m, "variance_epsilon", None) is not None
             and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() == 1
             and m.weight.device.type == "cpu" and "forward" not in vars(m)]
    if not norms or not isinstance(backend, TorchBackend) or not kernels.load():
        yield
        return
    with instance_forwards(norms, _kernel_norm_forward):
        yield


@contextlib.contextmanager
def kernel_mlps(backend: Backend, model):
    """While inside, the SwiGLU MLPs of ``model`` (``down(silu(gate(x)) * up(x))``: Llama,
    Qwen2 and their kin) run their middle as our kernel, forward and backward one pass each
    (``kernels.SiluMul``: float32 or bf16 rows on the CPU; anything else as the module's
    act_fn and product). The same values to float rounding (float32; bf16: rounded once
    instead of twice). Measured (profile, SmolLM2's bf16 Relay-v0 step): silu, its backward
    and their products took ~0.35 s. Without the kernel, or under another backend than
    ``TorchBackend``: nothing changes; a module whose forward something else wrapped keeps it."""
    mlps = [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in kernels.SILU and "forward" not in vars(m)]
    if not mlps or not isinstance(backend, TorchBackend) or not kernels.load():
        yield
        return
    with instance_forwards(mlps, _kernel_mlp_forward):
        yield


def _kernel_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``kernel_mlps``' forward of one MLP: its projections, the middle as our kernel where it
    fits."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if not kernels.fits_silu_mul(gate, up):
        return mlp.down_proj(mlp.act_fn(gate) * up)
    middle = kernels.SiluMul.apply(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
    return mlp.down_proj(middle.view(gate.shape))


@contextlib.contextmanager
def kernel_rotary(backend: Backend, model):
    """While inside, the rotary embedding of ``model``'s attention (the ``apply_rotary_pos_emb``
    of the modules that define its attention classes: Llama, Qwen2 and their kin) runs as our
    kernel where it fits (``kernels.Rotary``: q and k ``[R, H, T, D]``, float32 angles), one
    pass each way; anything else goes to the model's own function. Under bf16 autocast, where
    blocked attention's kernel takes q and k (``kernels.fits_chunks``; it would round them to
    bf16 itself), they come out in bf16, rounded once as that cast would; otherwise in the
    dtype the tensor ops give. The same values to float rounding (tested). Measured ad hoc
    (956 positions x 9 heads, forward and backward): 0.33 against 1.17 ms. Without the kernel,
    or under another backend than ``TorchBackend``: nothing changes."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if hasattr(m, "q_proj") and hasattr(m, "k_proj")}
    modules = [mod for mod in modules if callable(getattr(mod, "apply_rotary_pos_emb", None))]
    if not modules or not isinstance(backend, TorchBackend) or not kernels.load():
        yield
        return
    originals = {mod: mod.apply_rotary_pos_emb for mod in modules}
    for mod, original in originals.items():
        mod.apply_rotary_pos_emb = functools.partial(_kernel_rotary, original)
    try:
        yield
    finally:
        for mod, original in originals.items():
            mod.apply_rotary_pos_emb = original


def _kernel_rotary(original, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel_rotary``'s ``apply_rotary_pos_emb``: q and k through our kernel where it fits,
    else ``original``."""
    if (args or kwargs.get("unsqueeze_dim", 1) != 1 or set(kwargs) - {"unsqueeze_dim"}
            or sin.dtype != cos.dtype or sin.shape != cos.shape
            or not kernels.fits_rotary(q, cos) or not kernels.fits_rotary(k, cos)):
        return original(q, k, cos, sin, *args, **kwargs)
    dtype = torch.promote_types(q.dtype, cos.dtype)
    if (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and kernels.fits_chunks(q.shape[-1])):
        dtype = torch.bfloat16
    cos, sin = cos.contiguous(), sin.contiguous()
    return kernels.Rotary.apply(q, cos, sin, dtype), kernels.Rotary.apply(k, cos, sin, dtype)


@contextlib.contextmanager
def instance_forwards(modules: list[torch.nn.Module], forward):
    """While inside, each of ``modules`` runs ``forward(module, *args)`` instead of its
    class's forward; afterwards they are as they were."""
    for m in modules:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def _kernel_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``kernel_norms``' forward of one norm module: float32 rows and weight as our kernel
    (its result in bf16 under bf16 autocast: what the projections after it read), anything
    else as the module's own forward."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        half = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return kernels.RMSNorm.apply(x, norm.weight, norm.variance_epsilon,
                                     torch.bfloat16 if half else torch.float32)
    return type(norm).forward(norm, x)


