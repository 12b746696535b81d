"""Batch sizes chosen from the device: the contract keys whose default is ``auto``
(``optim.micro_batch_tokens``, ``rollout.decode_batch``).

On the CPU ``auto`` is the value the CPU benchmarks were tuned at (``CPU_MICRO_BATCH_TOKENS``,
``CPU_DECODE_BATCH``), whatever the machine. On CUDA it is sized from the GPU memory free once
the run's model, reference and rollout copy are on the device (``free_cuda_bytes``) and from
the model's shape (``gpu_sizes``, a pure function):

    usable   = HEADROOM * free - OPTIMIZER_BYTES * trainable parameters
               (gradients and AdamW's two moments, float32, allocated at the first step)
    share    = usable / 2        the trainer's activations and the rollout's KV cache each get
                                 half: they run at once under rollout.max_policy_lag > 0
    micro    = share / trainer_token_bytes, down to a power of two,
               within [MIN_MICRO_BATCH_TOKENS, MAX_MICRO_BATCH_TOKENS]
    decode   = share / decode_row_bytes, within [1, MAX_DECODE_BATCH]

    trainer_token_bytes = layers * 4 (9 hidden + 4 intermediate + 3 kv_width)
                          (the tensors a decoder layer keeps for backward, float32;
                          x HALF_ACTIVATIONS under bf16 autocast)
                          + 3 * 4 * vocab   (a trained token's float32 logits, log-softmax and
                          their gradient)
    decode_row_bytes    = 2 * layers * kv_width * kv_bytes * (prompt + response tokens)
                          + 4 * 4 * vocab   (a row's logits and the sampler's float32 copies)

The per-layer count is the saved tensors of a Llama layer (norm inputs and outputs, q/k/v, the
attention output, gate, up, their product) and is within 10% of what was measured on
SmolLM2-135M (42.7 KB a layer and token in float32, ``training.update.HALF_ACTIVATIONS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

CPU_MICRO_BATCH_TOKENS = 512  # the CPU trainer's micro-batch (benchmarks/train_throughput.py)
CPU_DECODE_BATCH = 32  # conversations HFPolicy decodes at once on the CPU
HEADROOM = 0.8  # of the free GPU memory: the rest for the allocator's fragmentation, CUDA's own
OPTIMIZER_BYTES = 12  # per trainable parameter: float32 gradient and AdamW's two moments
MIN_MICRO_BATCH_TOKENS = 256
MAX_MICRO_BATCH_TOKENS = 16384  # 16 full rows (render.ROW_TOKENS): a forward fills an H100
MAX_DECODE_BATCH = 256  # a decode step's rows; more only lengthens the prefill's batch
# what a token keeps for backward under bf16 autocast, as a share of what it keeps in float32
# (``training.update.recompute_layers``): the products' inputs are kept in bf16, the residual
# stream and the norms' inputs in float32. Measured (saved-tensor bytes a token): 0.71 on
# SmolLM2-135M's Relay-v0 step (30.4 against 42.7 KB a layer), 0.69 on the tests' tiny Llama;
# where the CPU accelerator's kernels run, the share it reports (``accel.step``'s handle)
HALF_ACTIVATIONS = 0.72

Auto = int | Literal["auto"]


@dataclass(frozen=True)
class ModelShape:
    """What the sizes depend on: parameter counts and the decoder's widths."""

    trainable: int  # parameters the optimizer updates
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head dim
    vocab: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """Read from a transformers model (its config and parameters)."""
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   layers=config.num_hidden_layers, hidden=config.hidden_size,
                   intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
                   kv_width=kv_heads * head_dim, vocab=config.vocab_size)


@dataclass(frozen=True)
class Sizes:
    micro_batch_tokens: int  # optim.micro_batch_tokens
    decode_batch: int  # rollout.decode_batch: HFPolicy.batch_size


def layer_token_bytes(shape: ModelShape) -> int:
    """What one decoder layer keeps for backward per token, in float32 (the module docstring)."""
    return 4 * (9 * shape.hidden + 4 * shape.intermediate + 3 * shape.kv_width)


def trainer_token_bytes(shape: ModelShape, half: bool) -> float:
    """What one token of a micro-batch holds until its backward (the module docstring)."""
    return shape.layers * layer_token_bytes(shape) * (HALF_ACTIVATIONS if half else 1.0) \
        + 12 * shape.vocab


def decode_row_bytes(shape: ModelShape, kv_bytes: int, row_tokens: int) -> float:
    """What one decoding conversation holds: its KV cache and its logits (the docstring)."""
    return 2 * shape.layers * shape.kv_width * kv_bytes * row_tokens + 16 * shape.vocab


def gpu_sizes(free_bytes: int, shape: ModelShape, half: bool, kv_bytes: int,
              row_tokens: int) -> Sizes:
    """``auto``'s sizes on a GPU with ``free_bytes`` free once the weights are placed (the
    module docstring). ``half``: the trainer runs under bf16 autocast; ``kv_bytes``: bytes of
    one cached key or value element; ``row_tokens``: prompt + response tokens of a row."""
    usable = max(HEADROOM * free_bytes - OPTIMIZER_BYTES * shape.trainable, 0.0)
    share = usable / 2
    tokens = int(share // trainer_token_bytes(shape, half))
    micro = 1 << max(tokens, 1).bit_length() - 1  # a power of two, at most tokens
    rows = int(share // decode_row_bytes(shape, kv_bytes, max(row_tokens, 1)))
    return Sizes(micro_batch_tokens=min(max(micro, MIN_MICRO_BATCH_TOKENS), MAX_MICRO_BATCH_TOKENS),
                 decode_batch=min(max(rows, 1), MAX_DECODE_BATCH))


def free_cuda_bytes(device: torch.device) -> int:
    """GPU memory free for new tensors: the driver's free memory plus what torch's caching
    allocator holds without using."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resolve_sizes(micro_batch_tokens: Auto, decode_batch: Auto, device: torch.device,
                  model: Any, dtype: str, row_tokens: int) -> Sizes:
    """The two keys as a run uses them: a number as given; ``auto`` the CPU's value off CUDA,
    else ``gpu_sizes`` for this device's free memory now and ``model``'s shape (``dtype``
    bfloat16: bf16 activations, and a bf16 KV cache: ``decode.StaticDecoder``)."""
    if "auto" not in (micro_batch_tokens, decode_batch):
        return Sizes(micro_batch_tokens, decode_batch)
    if device.type != "cuda":
        auto = Sizes(CPU_MICRO_BATCH_TOKENS, CPU_DECODE_BATCH)
    else:
        half = dtype == "bfloat16"
        auto = gpu_sizes(free_cuda_bytes(device), ModelShape.of(model), half,
                         2 if half else 4, row_tokens)
    return Sizes(auto.micro_batch_tokens if micro_batch_tokens == "auto" else micro_batch_tokens,
                 auto.decode_batch if decode_batch == "auto" else decode_batch)


def cpu_micro_batch_tokens(setting: Auto) -> int:
    """A key's number, or ``auto``'s value on the CPU (``CPU_MICRO_BATCH_TOKENS``): for a
    caller outside a run (a benchmark calling ``policy_update``), where nothing was resolved."""
    return CPU_MICRO_BATCH_TOKENS if setting == "auto" else setting
