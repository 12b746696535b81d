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


# cuBLAS's workspace sizes under which its products are deterministic (torch's reproducibility notes)
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def prepare_device(spec: str, dtype: str = "float32", tf32: bool = True,
                   deterministic: bool = False) -> torch.device:
    """``resolve_device`` with this process's numerics set around it: ``deterministic``
    (``run.deterministic``) before anything can start CUDA (``make_deterministic``), and
    TensorFloat-32 for float32 products once the device is CUDA (``model.tf32``:
    ``set_tf32``). A GPU without bf16 arithmetic (before Ampere) asked for ``dtype``
    bfloat16 is an error. On the CPU with the defaults nothing global changes."""
    if deterministic:
        make_deterministic()
    device = resolve_device(spec)
    if device.type != "cuda":
        return device
    if as_dtype(dtype) == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"model.dtype: bfloat16 on {torch.cuda.get_device_name(device)}, which "
                         "has no bf16 arithmetic (compute capability 8.0 and later has); use "
                         "model.dtype: float32")
    set_tf32(tf32)
    return device


def set_tf32(on: bool) -> None:
    """float32 matrix products and convolutions on CUDA in TensorFloat-32 (10 mantissa bits in,
    float32 accumulation) or full float32. The CUDA flags only: ``set_float32_matmul_precision``
    ("high" is the same switch for CUDA) would also move oneDNN's CPU products."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def make_deterministic() -> None:
    """Bit-exact reruns on a GPU: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (read when cuBLAS starts,
    so set before CUDA is), ``torch.use_deterministic_algorithms(True)`` (an op with no
    deterministic kernel raises, naming itself) and cuDNN deterministic without autotuning.
    A workspace setting that is not deterministic, or CUDA started before the setting could
    be made, is an error that says what to do."""
    held = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if held is not None and held not in DETERMINISTIC_CUBLAS:
        raise ValueError(f"run.deterministic: CUBLAS_WORKSPACE_CONFIG={held} leaves cuBLAS "
                         f"non-deterministic; unset it or use {DETERMINISTIC_CUBLAS[0]}")
    if held is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ValueError("run.deterministic: CUDA started in this process before the run could "
                         "set CUBLAS_WORKSPACE_CONFIG; export CUBLAS_WORKSPACE_CONFIG="
                         f"{DETERMINISTIC_CUBLAS[0]} before starting Python")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = held or DETERMINISTIC_CUBLAS[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host, on ``device``: as is on the CPU; on CUDA copied from pinned
    memory without the host waiting (queued on the current stream, so every kernel queued after
    it reads it; from pageable memory the host would first wait for the stream to drain)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def autocast(device: torch.device, dtype: torch.dtype | str):
    """The forward-pass context for a compute dtype: bf16/fp16 autocast (weights stay fp32,
    the master copy the optimizer updates), nothing for float32."""
    dtype = as_dtype(dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
