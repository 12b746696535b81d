"""Devices and compute dtypes: ``model.device`` specs (``auto | cpu | cuda | cuda:N``) and the
autocast context of a compute dtype (``model.dtype``)."""

from __future__ import annotations

import os

import torch


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or its name ``"bfloat16"`` -> ``torch.bfloat16``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown floating dtype {dtype!r}: use float32, bfloat16 or float16")
    return value



def check_device_spec(spec: str) -> str:
    """``auto | cpu | cuda | cuda:N``, checked for form only (``resolve_device`` checks that
    the device exists, on the machine that runs)."""
    head, _, index = str(spec).partition(":")
    if spec in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return spec
    raise ValueError(f"{spec!r} is not a device: use auto, cpu, cuda or cuda:N")



def resolve_device(spec: str) -> torch.device:
    """The torch device for a ``model.device`` spec: ``auto`` is ``cuda`` when torch sees a GPU,
    else ``cpu``. Under a launcher (``WORLD_SIZE`` > 1) ``cuda`` is this rank's own GPU,
    ``cuda:LOCAL_RANK``, made the current device before anything is allocated on a GPU.
    Asking for a GPU this machine does not have, or one GPU index for several ranks, is an
    error that says so."""
    check_device_spec(spec)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"model.device: {spec} asked for, but torch ({torch.__version__}, "
                         f"{build}) sees no GPU; use device: cpu or auto")
    count = torch.cuda.device_count()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if device.index is not None:
            raise ValueError(f"model.device: {spec} names one GPU for {world} ranks; use cuda "
                             "(or auto): each rank takes cuda:LOCAL_RANK")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.index is not None and device.index >= count:
        raise ValueError(f"model.device: {device} asked for, but this machine has {count} "
                         f"GPU(s): cuda:0..cuda:{count - 1}")
    if device.index is not None:
        torch.cuda.set_device(device)
    return device


def autocast(device: torch.device, dtype: torch.dtype | str):
    """The forward-pass context for a compute dtype: bf16/fp16 autocast (weights stay fp32,
    the master copy the optimizer updates), nothing for float32."""
    dtype = as_dtype(dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
