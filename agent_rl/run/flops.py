"""Model FLOPs utilisation (MFU): the training work a step did over what the device could have
done in the same time.

    FLOPs per trained token = 6 N_trained + 4 N_frozen
    model FLOPs of a step   = FLOPs per token x trained tokens x optim.updates_per_batch
    MFU                     = model FLOPs / (seconds x peak FLOP/s)

A dense decoder spends 2 FLOPs per parameter per token in the forward pass, 2 in the backward
pass for the gradient of its input and 2 for the gradient of the weight (Kaplan et al. 2020;
PaLM's MFU). A frozen parameter (the base weights under LoRA, a frozen embedding) still runs
forward and passes the gradient back to the adapters below it, but computes no weight gradient:
4 per token. N counts the matrices a token is multiplied by: every parameter but the input
embedding table, which is a lookup (a head tied to it multiplies, and counts once). Not counted,
as "model" FLOPs leave them out: attention's score and value products (small at these
lengths), the layers recomputed in backward (``train/recomputed_frac``), the prompt tokens the
decoder reads but the loss does not train, and the no-grad forwards (``kl/update``, a KL
reference). So MFU is a lower bound of the hardware's busy share.

The peak: ``run.peak_flops`` when the contract sets it (any device: e.g. what
``python benchmarks/limits.py`` measures on a CPU); otherwise, on CUDA under
``model.dtype: bfloat16``, NVIDIA's spec-sheet dense bf16 figure for the device's name
(``PEAK_BF16_TFLOPS``); otherwise none, and MFU is not reported (null), while the FLOPs are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dense bf16 tensor-core peak, TFLOP/s, from NVIDIA's spec sheets (the figures "with sparsity"
# halved), matched in order against torch.cuda.get_device_name(): the more specific names first
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
                    ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))


@dataclass(frozen=True)
class Peak:
    """A device's peak, in FLOP/s, and where that figure came from."""

    flops: float
    source: str  # "run.peak_flops" | "spec sheet (H100)"


def spec_sheet_peak(device_name: str) -> Peak | None:
    """The dense bf16 peak of the GPU named ``device_name`` (``PEAK_BF16_TFLOPS``), or None
    for a device the table does not list."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return Peak(tflops * 1e12, f"spec sheet ({key})")
    return None


def device_peak(device: torch.device, dtype: str, configured: float | None) -> Peak | None:
    """The peak MFU is taken against (the module docstring): ``configured`` (``run.peak_flops``),
    else the spec sheet's for a bf16 run on a listed GPU, else None (not reported)."""
    if configured is not None:
        return Peak(float(configured), "run.peak_flops")
    if device.type == "cuda" and dtype == "bfloat16":
        return spec_sheet_peak(torch.cuda.get_device_name(device))
    return None


def flops_per_token(model: torch.nn.Module) -> float:
    """6 N_trained + 4 N_frozen (the module docstring) of ``model``, the input embedding table
    left out unless it is also the output head. Counted on the full parameters: under ZeRO-3
    a partitioned parameter's full size (``ds_numel``)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    trained = frozen = 0
    for p in model.parameters():
        if p is embedding and (head is None or head.weight is not embedding):
            continue
        n = getattr(p, "ds_numel", p.numel())
        if p.requires_grad:
            trained += n
        else:
            frozen += n
    return 6.0 * trained + 4.0 * frozen


def mfu(flops: float, seconds: float, peak: Peak | None) -> float | None:
    """``flops`` done in ``seconds`` as a share of ``peak`` (None without a peak, or without
    time to divide by)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak.flops
