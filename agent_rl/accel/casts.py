"""Casts of the trained weights under bf16 autocast on the CPU, once a step: autocast's own
cache held open for the step (``step_cast_cache``), and each ``nn.Linear``'s weight cast by
``StepCast``, whose backward adds its bf16 gradient straight into the float32 ``.grad``
(``linear_casts``). The same casts and sums: the same gradients (tested)."""

from __future__ import annotations

import contextlib

import torch

from agent_rl.accel import kernels
from agent_rl.accel.patches import instance_forwards
from agent_rl.run.distributed import Backend, TorchBackend


@contextlib.contextmanager
def step_cast_cache(backend: Backend, dtype: torch.dtype):
    """While inside, bf16 autocast keeps its cast of each trainable fp32 weight from the first
    forward pass on, for every micro-batch of the step and the layers recomputed in backward,
    instead of casting it again in each (autocast drops its cache when the outermost autocast
    context exits: a nesting level held open here keeps it, autocast itself stays off between
    the forward passes, so backward runs as before). The weights do not change until the
    optimizer step, which comes after; the cache is dropped on the way out. The same casts,
    so the same gradients (a cached cast passes its gradient back through the same node in
    every backward). Measured on SmolLM2's Relay step (profile, bf16): the [V, H] head's cast
    alone took 32 ms a micro-batch. float32, or several processes (ZeRO gathers and releases
    parameters between passes): nothing changes."""
    if dtype == torch.float32 or not isinstance(backend, TorchBackend):
        yield
        return
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


@contextlib.contextmanager
def linear_casts(backend: Backend, model, dtype: torch.dtype):
    """While inside, under bf16 the trainable float32 weight of each ``nn.Linear`` (but the
    output head: ``HeadGrads``) is cast once a step (``StepCast``), and each backward adds its
    bf16 gradient straight into the weight's float32 ``.grad`` (one pass) instead of casting
    it to a float32 temporary and adding that. The same sums in the same order: the same
    gradient, to the bit (tested). Measured (profile, SmolLM2's bf16 Relay-v0 step, 11
    micro-batches): the casts back took 0.39 s. Only in one process (``TorchBackend``, world
    of one: no hook waits for a gradient) and for modules whose forward nothing else wrapped;
    float32: nothing changes."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
               and m.weight.requires_grad and m.weight.dtype == torch.float32
               and "forward" not in vars(m)]
    if (dtype == torch.float32 or not isinstance(backend, TorchBackend)
            or backend.world_size != 1 or not linears):
        yield
        return
    try:
        with instance_forwards(linears, _cast_once_forward):
            yield
    finally:
        for m in linears:
            m.__dict__.pop("_step_cast", None)


def _cast_once_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear_casts``' forward: under autocast, with gradients, the step's one cast of the
    weight; otherwise the module's own forward."""
    dtype = torch.get_autocast_dtype(x.device.type)
    if not torch.is_autocast_enabled(x.device.type) or dtype == torch.float32 or not torch.is_grad_enabled():
        return type(linear).forward(linear, x)
    cast = linear.__dict__.get("_step_cast")
    if cast is None or cast.dtype != dtype:
        cast = linear.__dict__["_step_cast"] = StepCast.apply(linear.weight, dtype)
    return torch.nn.functional.linear(x, cast, linear.bias)


class StepCast(torch.autograd.Function):
    """``weight.to(dtype)`` whose backward adds the gradient into ``weight.grad`` in place
    (float32 += bf16, one pass) and passes nothing on (``linear_casts``)."""

    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.weight = weight
        return weight.detach().to(dtype)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = grad.to(weight.dtype)
        else:
            kernels.add_into(weight.grad, grad)
        return None, None


