"""The resource plan: what one rank of a run holds in memory, part by part, from the contract
and the model's architecture alone (no weight is loaded), before the first rollout
(``agent-rl plan CONFIG``; ``agent-rl train`` refuses a plan that cannot fit its device).

P: the model's parameters; T: those the optimizer trains (P under full fine-tuning; under
``model.adapter: lora`` the adapters', r (in + out) summed over every linear layer but the head,
which peft's ``all-linear`` targets, and P grows by T); W: the world size; Z: the ZeRO stage
(``backend.name: deepspeed``; none under ``torch``). Bytes per rank on the device:

    parameters     4 P                   float32 master weights whatever model.dtype (bfloat16
                                         runs forward passes under autocast); / W under Z 3
    gradients      4 T                   / W under Z 2-3; on the host with Z 2-3 and offload
    optimizer      8 T (AdamW's 2 moments, float32) + 4 T under Z 1-2 (DeepSpeed's float32
                   master partition); / W under Z >= 1; on the host under backend.offload cpu
    reference      4 P_ref               the fixed KL reference (loss.kl.beta > 0), unless it is
                                         the base model under LoRA (the adapter turned off)
    rollout copy   a separate set of weights that samples (training.setup.make_rollout_policy):
                   ZeRO-3's full copy for evaluation and rollouts, 4 P; an HF copy (LoRA merged,
                   rollout.dtype, max_policy_lag > 0): 2 P_base in bfloat16, else the float32
                   weights it cannot share (the adapted layers' under LoRA, all under full
                   fine-tuning, none from ZeRO-3's frozen copy); a vLLM engine's weights in
                   rollout.dtype or model.dtype (or its whole gpu_memory_utilization share)
    KV cache       rows x sizing.decode_row_bytes(prompt + response tokens): keys and values of
                   every layer (2 x layers x kv heads x head_dim x bytes a token, 2 bytes where
                   the decoder holds them in bf16) and a row's logits; rows = the conversations
                   decoded at once, min(rollout.decode_batch, the most a rank has in flight:
                   tasks_per_step / W x group_size rollouts, eval.n / W evaluations)
    activations    micro_batch_tokens x sizing.trainer_token_bytes (what a token keeps for
                   backward); with optim.activation_checkpointing each layer keeps its float32
                   input and one layer is recomputed at a time
    bf16 casts     2 T under model.dtype bfloat16: autocast's cast of every trained weight, kept
                   for the step (/ W under Z 3)
    collectives    DeepSpeed's buffers: Z 1-3 allocate a reduce bucket of 5e8 float32 elements
                   (on the CPU only the pages gradients touch are committed: 4 T at most);
                   Z 0 with W > 1 all-reduces through a bucket of up to 4 T; Z 3 also gathers a
                   layer's parameters at a time, plus a prefetch bucket of 5e7 elements

``auto`` batch sizes resolve as the run resolves them (``run.sizing``): the CPU's values, or, when
the device memory is known and the device is not the CPU, ``gpu_sizes`` of the memory left once
the weights (parameters, reference, rollout copy, collective buffers) are placed. Not counted:
CUDA's context and the allocator's fragmentation (keep ~1 GiB), the prefill's transient
activations, a checkpoint's gathered state dict, sandboxes and verifiers (host processes).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent_rl.run.sizing import (
    CPU_DECODE_BATCH,
    CPU_MICRO_BATCH_TOKENS,
    HALF_ACTIVATIONS,
    ModelShape,
    decode_row_bytes,
    gpu_sizes,
    layer_token_bytes,
    trainer_token_bytes,
)

if TYPE_CHECKING:
    from agent_rl.run.contract import ExperimentContract, ModelSection

GIB = 2**30
FLOAT32 = 4
BF16 = 2
ADAM_MOMENTS = 2
REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size, elements (its default)
ALLREDUCE_BUCKET = 500_000_000  # ZeRO 0's allreduce_bucket_size, elements
PREFETCH_BUCKET = 50_000_000  # ZeRO 3's stage3_prefetch_bucket_size, elements


class PlanError(ValueError):
    """A plan that cannot fit the device's memory: the message names its biggest parts and
    what to change."""


@dataclass(frozen=True)
class Architecture:
    """What the plan reads from a model: counts and widths, no weights."""

    params: int  # every parameter, a tied head counted once
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head dim
    vocab: int
    lora_dims: int  # in + out features summed over the linear layers LoRA adapts (not the head)
    lora_weights: int  # elements of those layers' weights
    largest_module: int  # parameters of the largest decoder layer or embedding

    @classmethod
    def of(cls, model: Any) -> Architecture:
        """Read from a transformers causal LM (on the meta device will do)."""
        import torch
        from transformers.modeling_layers import GradientCheckpointingLayer

        shape = ModelShape.of(model)
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        blocks = [model.get_input_embeddings(),
                  *(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))]
        return cls(params=sum(p.numel() for p in model.parameters()), layers=shape.layers,
                   hidden=shape.hidden, intermediate=shape.intermediate,
                   kv_width=shape.kv_width, vocab=shape.vocab,
                   lora_dims=sum(m.in_features + m.out_features for m in linears),
                   lora_weights=sum(m.weight.numel() for m in linears),
                   largest_module=max(sum(p.numel() for p in b.parameters()) for b in blocks))

    def lora_params(self, rank: int) -> int:
        """The parameters of a rank-``rank`` LoRA adapter on every linear layer but the head."""
        return rank * self.lora_dims

    def shape(self, trainable: int) -> ModelShape:
        return ModelShape(trainable=trainable, layers=self.layers, hidden=self.hidden,
                          intermediate=self.intermediate, kv_width=self.kv_width,
                          vocab=self.vocab)


@dataclass(frozen=True)
class Part:
    name: str
    device: int  # bytes on this rank's device
    note: str
    host: int = 0  # bytes moved to host memory (backend.offload: cpu)


@dataclass(frozen=True)
class Plan:
    """One rank's memory, by part (the module docstring), and what fits the device."""

    parts: tuple[Part, ...]
    world_size: int
    device_memory: int | None  # bytes; None: not known (the CPU without a stated limit)
    params: int  # the model's (P, with any adapter)
    trainable: int  # T
    micro_batch_tokens: int  # as the run resolves it
    micro_auto: bool
    decode_rows: int  # conversations decoded at once
    decode_batch: int  # rollout.decode_batch as the run resolves it
    decode_auto: bool
    token_bytes: float  # activations per micro-batch token
    row_bytes: float  # KV cache and logits per decoded row
    tasks_per_rank: int

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def total(self) -> int:
        return sum(p.device for p in self.parts)

    @property
    def host(self) -> int:
        return sum(p.host for p in self.parts)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    @property
    def max_micro_batch_tokens(self) -> int | None:
        """The largest ``optim.micro_batch_tokens`` that fits, the rest unchanged."""
        return self._most("activations", self.token_bytes)

    @property
    def max_decode_rows(self) -> int | None:
        """The most conversations decoded at once that fit (``rollout.decode_batch``)."""
        return self._most("KV cache", self.row_bytes)

    @property
    def max_group_size(self) -> int | None:
        """The largest ``rollout.group_size`` whose rows a rank decodes in one pass."""
        rows = self.max_decode_rows
        return None if rows is None else rows // max(self.tasks_per_rank, 1)

    def _most(self, name: str, unit: float) -> int | None:
        if self.device_memory is None:
            return None
        room = self.device_memory - (self.total - self.part(name).device)
        return max(int(room // unit), 0)

    def biggest(self, n: int = 3) -> list[Part]:
        return sorted((p for p in self.parts if p.device), key=lambda p: -p.device)[:n]

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size,
                "parts": {p.name: p.device for p in self.parts},
                "host": {p.name: p.host for p in self.parts if p.host},
                "total_bytes": self.total, "total_gib": round(self.total / GIB, 3),
                "host_bytes": self.host,
                "device_memory_gib": (None if self.device_memory is None
                                      else round(self.device_memory / GIB, 3)),
                "fits": self.fits, "params": self.params, "trainable": self.trainable,
                "micro_batch_tokens": self.micro_batch_tokens, "decode_rows": self.decode_rows,
                "max_micro_batch_tokens": self.max_micro_batch_tokens,
                "max_decode_rows": self.max_decode_rows, "max_group_size": self.max_group_size}


def reference_loaded(contract: ExperimentContract) -> bool:
    """Whether a run loads a separate reference model (``training.setup.load_reference``):
    under KL, unless the reference is the base model under LoRA (the adapter turned off)."""
    return contract.loss.kl.beta > 0 and not (contract.reference == contract.model.id
                                              and contract.model.adapter == "lora")


def resource_plan(contract: ExperimentContract, model: Architecture,
                  reference: Architecture | None = None, world_size: int = 1,
                  device_memory: int | None = None, gpu: bool = False) -> Plan:
    """The plan of one rank of ``world_size`` (the module docstring); ``reference``: the
    reference's architecture, needed when ``reference_loaded``; ``device_memory``: bytes;
    ``gpu``: the run's device is a CUDA GPU (``Device``)."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if reference_loaded(contract) and reference is None:
        raise ValueError(f"the plan needs the architecture of the reference {contract.reference!r}")
    m, rollout, b = contract.model, contract.rollout, contract.backend
    W = world_size
    stage = b.zero_stage if b.name == "deepspeed" else None
    offload = b.offload == "cpu"
    lora = m.adapter == "lora"
    trainable = model.lora_params(m.lora_rank) if lora else model.params
    params = model.params + (trainable if lora else 0)
    half = m.dtype == "bfloat16"
    sharded = W if stage == 3 else 1
    parts = [Part("parameters", FLOAT32 * params // sharded,
                  f"{params:,} float32" + (", / W (ZeRO-3)" if stage == 3 else ""))]

    grads = FLOAT32 * trainable // (W if stage in (2, 3) else 1)
    to_host = offload and stage in (2, 3)
    parts.append(Part("gradients", 0 if to_host else grads,
                      f"{trainable:,} trained, float32" + (", / W" if stage in (2, 3) else "")
                      + (", on the host (offload)" if to_host else ""),
                      host=grads if to_host else 0))

    master = stage in (1, 2)
    optimizer = (ADAM_MOMENTS + master) * FLOAT32 * trainable // (W if stage else 1)
    parts.append(Part("optimizer", 0 if offload else optimizer,
                      "AdamW 2 moments" + (" + master partition" if master else "")
                      + (", / W" if stage else "") + (", on the host" if offload else ""),
                      host=optimizer if offload else 0))

    loaded = reference_loaded(contract)
    parts.append(Part("reference", FLOAT32 * reference.params if loaded else 0,
                      f"{contract.reference}, float32" if loaded else
                      "none (loss.kl.beta 0)" if contract.loss.kl.beta <= 0 else
                      "the base model, adapter off: no copy"))

    engine, engine_share = rollout_copy_bytes(contract, model, params, stage, device_memory)
    parts.append(Part("rollout copy", engine, engine_note(contract, stage, engine_share)))

    collectives = collective_bytes(stage, W, params, trainable, model.largest_module, gpu)
    casts = BF16 * trainable // sharded if half else 0

    # what a decoded row holds: the sampling weights' KV dtype (run.sizing, policies.decode)
    sample_dtype = rollout.dtype or ("float32" if rollout.backend == "hf" else m.dtype)
    compute = "float32" if rollout.dtype else m.dtype
    kv_bytes = BF16 if sample_dtype == "bfloat16" or (gpu and compute == "bfloat16") else FLOAT32
    row_tokens = rollout.max_prompt_tokens + rollout.max_response_tokens
    shape = model.shape(trainable)
    row_bytes = decode_row_bytes(shape, kv_bytes, row_tokens)
    token_bytes = (checkpointed_token_bytes(shape, half) if contract.optim.activation_checkpointing
                   else trainer_token_bytes(shape, half))

    # placed before the batch sizes are chosen (training.setup.size_batches): the weights
    placed = sum(p.device for p in parts if p.name in ("parameters", "reference",
                                                       "rollout copy")) + collectives
    micro, decode = resolved_sizes(contract, shape, gpu, device_memory, placed, half, kv_bytes,
                                   row_tokens)
    tasks = max(rollout.tasks_per_step // W, 1)
    rows = min(decode, max(tasks * rollout.group_size, math.ceil(contract.eval.n / W)))
    kv = 0 if engine_share else int(rows * row_bytes)
    parts += [
        Part("KV cache", kv, "inside the engine's share" if engine_share else
             f"{rows} rows x {row_tokens} tokens, {'bf16' if kv_bytes == BF16 else 'float32'}"),
        Part("activations", int(micro * token_bytes),
             f"{micro} tokens" + (", checkpointed" if contract.optim.activation_checkpointing
                                  else "") + (", bf16 autocast" if half else "")),
        Part("bf16 casts", casts, "trained weights, bf16" if half else "none (float32)"),
        Part("collectives", collectives, collective_note(stage, W, gpu)),
    ]
    return Plan(tuple(parts), W, device_memory, params, trainable, micro,
                contract.optim.micro_batch_tokens == "auto", rows, decode,
                rollout.decode_batch == "auto", token_bytes, row_bytes, tasks)


def rollout_copy_bytes(contract: ExperimentContract, model: Architecture, params: int,
                       stage: int | None, device_memory: int | None) -> tuple[int, bool]:
    """``(bytes, engine_share)``: the weights that sample beside the trained ones
    (``training.setup.start`` and ``make_rollout_policy``); ``engine_share``: a vLLM engine's
    whole ``gpu_memory_utilization`` share (its KV cache inside)."""
    m, rollout = contract.model, contract.rollout
    lora = m.adapter == "lora"
    full = FLOAT32 * params if stage == 3 else 0  # ZeRO-3: a full copy evaluates and rolls out
    if rollout.backend == "vllm":
        if rollout.gpu_memory_utilization is not None and device_memory is not None:
            return full + int(rollout.gpu_memory_utilization * device_memory), True
        width = BF16 if (rollout.dtype or m.dtype) == "bfloat16" else FLOAT32
        return full + width * model.params, False
    if not (rollout.max_policy_lag or rollout.dtype is not None or lora):
        return full, False  # the trained weights (or ZeRO-3's copy) sample
    if rollout.dtype == "bfloat16":
        return full + BF16 * model.params, False
    # float32: what the copy cannot share is copied (models.rollout_copy): the merged layers
    # under LoRA; every trained weight under full fine-tuning, none of ZeRO-3's frozen copy
    return full + FLOAT32 * (model.lora_weights if lora else 0 if stage == 3 else model.params), False


def engine_note(contract: ExperimentContract, stage: int | None, engine_share: bool) -> str:
    rollout = contract.rollout
    copies = ["ZeRO-3 full copy"] if stage == 3 else []
    if rollout.backend == "vllm":
        copies.append("vLLM engine's share" if engine_share else
                      f"vLLM weights, {rollout.dtype or contract.model.dtype}")
    elif rollout.max_policy_lag or rollout.dtype is not None or contract.model.adapter == "lora":
        copies.append(f"HF copy, {rollout.dtype or 'float32'}"
                      + (", LoRA merged" if contract.model.adapter == "lora" else ""))
    return " + ".join(copies) or "none: the trained weights sample"


def collective_bytes(stage: int | None, world_size: int, params: int, trainable: int,
                     largest_module: int, gpu: bool) -> int:
    """DeepSpeed's communication buffers on one rank (the module docstring)."""
    if stage is None:
        return 0
    if stage == 0:
        return FLOAT32 * min(ALLREDUCE_BUCKET, trainable) if world_size > 1 else 0
    bucket = FLOAT32 * (REDUCE_BUCKET if gpu else min(REDUCE_BUCKET, trainable))
    gathered = FLOAT32 * min(params, PREFETCH_BUCKET + largest_module) if stage == 3 else 0
    return bucket + gathered


def collective_note(stage: int | None, world_size: int, gpu: bool) -> str:
    if stage is None:
        return "none (backend torch, one process)"
    if stage == 0:
        return "all-reduce bucket" if world_size > 1 else "none (ZeRO 0, one rank)"
    bucket = "reduce bucket 5e8 float32" if gpu else "reduce bucket (pages used)"
    return bucket + (" + layer gather, prefetch" if stage == 3 else "")


def checkpointed_token_bytes(shape: ModelShape, half: bool) -> float:
    """A micro-batch token's activations under ``optim.activation_checkpointing``: each
    layer's float32 input, one layer's activations while it is recomputed, the logits."""
    recomputed = layer_token_bytes(shape) * (HALF_ACTIVATIONS if half else 1.0)
    return shape.layers * FLOAT32 * shape.hidden + recomputed + 12 * shape.vocab


def resolved_sizes(contract: ExperimentContract, shape: ModelShape, gpu: bool,
                   device_memory: int | None, placed: int, half: bool, kv_bytes: int,
                   row_tokens: int) -> tuple[int, int]:
    """``(micro_batch_tokens, decode_batch)`` as the run resolves them (``run.sizing``):
    numbers as given; ``auto`` the CPU's values, or on a GPU of known memory ``gpu_sizes`` of
    what is free once ``placed`` bytes of weights are."""
    micro, decode = contract.optim.micro_batch_tokens, contract.rollout.decode_batch
    if gpu and device_memory is not None and "auto" in (micro, decode):
        auto = gpu_sizes(max(device_memory - placed, 0), shape, half, kv_bytes, row_tokens)
        auto_micro, auto_decode = auto.micro_batch_tokens, auto.decode_batch
    else:
        auto_micro, auto_decode = CPU_MICRO_BATCH_TOKENS, CPU_DECODE_BATCH
    return (auto_micro if micro == "auto" else micro, auto_decode if decode == "auto" else decode)


# what to change, by the part that is too big
FIXES = {
    "parameters": "train a LoRA adapter (model.adapter: lora), or partition the weights over "
                  "more ranks (backend.zero_stage: 3)",
    "gradients": "train a LoRA adapter (model.adapter: lora), or partition them over more "
                 "ranks (backend.zero_stage: 2)",
    "optimizer": "train a LoRA adapter (model.adapter: lora), partition it over more ranks "
                 "(backend.zero_stage >= 1) or move it to the host (backend.offload: cpu)",
    "reference": "use the base model with the adapter off (reference: model.id with "
                 "model.adapter: lora), or no KL (loss.kl.beta: 0)",
    "rollout copy": "sample with the trained weights (rollout.max_policy_lag: 0, rollout.dtype: "
                    "null, model.adapter: none), a bfloat16 copy (rollout.dtype: bfloat16), or "
                    "ZeRO 2 instead of 3 (no full copy)",
    "KV cache": "decode fewer rows at once (rollout.decode_batch: {rows}) or shorten "
                "rollout.max_prompt_tokens / rollout.max_response_tokens",
    "activations": "a smaller optim.micro_batch_tokens ({tokens} fit) or "
                   "optim.activation_checkpointing: true",
    "bf16 casts": "train in float32 (model.dtype: float32) or a LoRA adapter",
    "collectives": "one process with backend.name: torch (no DeepSpeed buckets)",
}


def unfit_message(plan: Plan, where: str) -> str:
    """Why ``plan`` does not fit (its three biggest parts) and what to change, for a device
    ``where`` names."""
    parts = plan.biggest(3)
    rows, tokens = plan.max_decode_rows or 0, plan.max_micro_batch_tokens or 0
    fixes = "; ".join(f"{p.name}: " + FIXES[p.name].format(rows=max(rows, 1), tokens=tokens)
                      for p in parts)
    return (f"the resource plan needs {gib(plan.total)} per rank, the device ({where}) has "
            f"{gib(plan.device_memory)}: biggest parts "
            + ", ".join(f"{p.name} {gib(p.device)}" for p in parts)
            + f". To fit: {fixes}. `agent-rl plan CONFIG` shows every part")


def check_fits(plan: Plan, where: str) -> None:
    """``PlanError`` (``unfit_message``) when the plan does not fit; nothing when it fits or
    the device's memory is not known."""
    if plan.fits is False:
        raise PlanError(unfit_message(plan, where))


@dataclass(frozen=True)
class Device:
    """The device a rank of the run uses, as far as the plan needs it."""

    memory: int | None  # bytes; None: not known (the CPU without a stated limit)
    where: str  # where the number comes from: --device-memory, model.device_memory, cuda:N
    gpu: bool  # a CUDA GPU: auto sizes from its memory, bf16 KV caches, DeepSpeed's buckets


def device_memory(section: ModelSection, given_gib: float | None = None) -> Device:
    """The device a run of ``section`` uses: a GPU for ``model.device`` cuda or cuda:N, and for
    auto where torch sees one; its memory ``given_gib`` (``--device-memory``), else
    ``model.device_memory``, else a CUDA device's total (under a launcher the rank's
    LOCAL_RANK); unknown for the CPU without a stated limit."""
    import torch

    spec = section.device
    gpu = spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available())
    for gib_value, where in ((given_gib, "--device-memory"),
                             (section.device_memory, "model.device_memory")):
        if gib_value is not None:
            return Device(int(gib_value * GIB), where, gpu)
    if not (gpu and torch.cuda.is_available()):
        return Device(None, "the CPU" if not gpu else f"{spec}, not on this machine", gpu)
    _, _, index = spec.partition(":")
    n = int(index) if index else int(os.environ.get("LOCAL_RANK", "0"))
    return Device(torch.cuda.get_device_properties(n).total_memory, f"cuda:{n}", True)


def gib(n: int | float | None) -> str:
    """Bytes, readable: ``1.50 GiB``, ``12.3 MiB``, ``4.0 KiB``, ``512 B``."""
    if n is None:
        return "unknown"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
