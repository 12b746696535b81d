"""Our compiled CPU kernels (``agent_rl/accel/csrc/kernels.cpp``): ``blocked_linear``, ``y = x W^T +
b`` for a frozen weight held in panels of 32 output columns, ``[P, K, 32]``; ``rms_norm``, a
decode step's RMSNorm as one pass (``F.rms_norm`` runs as five ops on the CPU), and
``RMSNorm``, the trainer's, forward and backward one pass each; ``sample``, a
decode step's inverse-CDF draw over the vocabulary without the four ``[B, V]`` tensors the
tensor ops write; ``decode_attention``, a decode step's attention reading each row's keys and
values once, in place, from a prompt held once per group or the row's own buffer
(``F.scaled_dot_product_attention`` at those shapes took ~1.4x its time in a decode step:
~550 against ~400 us a layer at batch 32, ~195 against ~135 at batch 8, calls alternated);
``rotary_write``, a decode step's rotary embedding of q and k with k and v written into the
cache (~8 tensor ops a layer); ``silu_mul``, a SwiGLU MLP's silu(gate) * up (``SiluMul``: the
trainer's, forward and backward); ``Rotary``, the trainer's rotary embedding. The three
decode-step kernels together against the tensor ops, steps alternated in one run: 11-15%
less time a step at batch 32, ~10% at 8 and 1.
``ChunkAttention``, the trainer's blocked attention (``attention.py``) in bfloat16, all of a
batch's chunks forward in one call and backward in another (AVX-512 BF16's pair dot product,
float32 accumulation; ``fits_chunks`` says where it runs). ``TokenLogprobs``, the trainer's
log-probs and entropies of its trained tokens from their logits, one pass each way.
``add_into``, a float32 gradient plus a bfloat16 one in one pass (``torch.Tensor.add_``
first writes the bfloat16 operand out as a fresh float32 temporary).

Why: at a decode step's few rows, MKL's ``F.linear`` on a plain float32 weight and oneDNN's
on its own reordered layout both read the weight well below the memory bandwidth (2 cores,
~23 GB/s: SmolLM2's 1536 x 576 projection at 8 rows in ~320 and ~265 us, 11-13 GB/s); this
kernel keeps 12 rows x 32 columns in registers and prefetches the panel stream ahead (~200
us, ~18 GB/s; ``benchmarks/linear_kernel.py``).
It is what ``decode.PackedLinear`` runs (rollout copies only: nothing trains through it).

Built at first use with ``torch.utils.cpp_extension`` (the compiler on PATH, ninja, OpenMP
through torch's own runtime; ``-O3 -march=native``), once per machine: the build folder is
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, named by a hash of the source, the
CPU's instruction-set flags and the torch version, so a cached build never runs on a CPU it
was not compiled for. ``load()`` returns False (and warns once, naming why) where it cannot
be built; callers then keep plain weights.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import platform
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
PANEL = 32  # output columns per panel (the kernel's kPanel)
FLAGS = ["-O3", "-march=native", "-fopenmp"]
# activation modules that are SiLU (``silu_mul`` runs them with their product), by class name
SILU = ("SiLU", "SiLUActivation")


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name() -> str:
    """The extension's name: a hash of what its binary depends on."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), _cpu_flags().encode(), torch.__version__.encode(),
                 " ".join(FLAGS).encode()):
        key.update(part)
    return f"agent_rl_kernels_{key.hexdigest()[:16]}"


@contextlib.contextmanager
def build_lock(name: str):
    """Hold an ``flock`` on the build folder while torch builds or loads there. torch's own
    lock is a file that a killed build leaves behind, after which every later process waits
    for it forever; the kernel drops an ``flock`` with its process, so a process holding ours
    knows no other is building and removes torch's left-over file first."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with open(folder / "agent_rl.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds
        try:
            if (folder / "lock").exists():
                warnings.warn(f"agent_rl.accel: removed {folder / 'lock'}, left by a build "
                              "that was killed", RuntimeWarning, stacklevel=3)
                (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the kernel into ``torch.ops.agent_rl_kernels``; False,
    with one warning saying why, where it cannot be built here."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        warnings.warn(f"agent_rl.accel: no build for {sys.platform}/{platform.machine()}; "
                      "rollout copies keep plain weights", RuntimeWarning, stacklevel=2)
        return False
    from torch.utils.cpp_extension import load as build

    try:
        print("agent_rl.accel: loading our CPU kernels (built once per machine, a few seconds)",
              file=sys.stderr, flush=True)
        with build_lock(build_name()):
            build(build_name(), [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                  is_python_module=False, verbose=False)
    except Exception as exc:  # a missing compiler or ninja, a failed build: plain weights
        warnings.warn(f"agent_rl.accel: could not build {SOURCE.name} ({type(exc).__name__}: "
                      f"{_first_error(str(exc))}); rollout copies keep plain weights",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _first_error(output: str) -> str:
    """The line of a failed build's output that says why: the compiler's first ``error:``,
    else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "no output")


def to_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` [N, K] as panels ``[P, K, 32]`` (P = ceil(N / 32), rows past N zero), written
    into ``out`` when given (a push: no new allocation)."""
    N, K = weight.shape
    P = -(-N // PANEL)
    if out is None:
        out = weight.new_zeros((P, K, PANEL))
    full = N // PANEL
    with torch.no_grad():
        out[:full].transpose(1, 2).copy_(weight[: full * PANEL].view(full, PANEL, K))
        if full < P:  # the last, partial panel
            out[full].zero_()
            out[full].t()[: N - full * PANEL].copy_(weight[full * PANEL:])
    return out


def blocked_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """``x`` [..., K] times the panelled weight (``to_panels``) plus ``bias`` [out_features]
    or None: ``[..., out_features]`` in ``x``'s dtype (float32 inside). At many rows (a
    prefill, compute-bound) this is 0.56-1.08x MKL's speed on a plain weight (400 rows,
    ``benchmarks/linear_kernel.py``); rebuilding the plain weight for such a call costs as
    much as it gains."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.to(torch.float32)  # [N]
    y = torch.ops.agent_rl_kernels.blocked_linear(rows, panels, bias)  # [M, P * 32]
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    y = y.reshape(*x.shape[:-1], out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` [..., H], float32: ``weight * (x / sqrt(mean(x^2) + eps))``."""
    y = torch.ops.agent_rl_kernels.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)
    return y.view(x.shape)


class RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm for training, float32 rows on the CPU: ``RMSNorm.apply(x, weight, eps,
    dtype)``, the forward as ``rms_norm`` keeping each row's reciprocal root, its result in
    ``dtype`` (float32, or bfloat16 rounded once: what a projection reads under bf16 autocast,
    which would otherwise cast the rows once per projection and keep each cast), the backward
    as one pass over the rows (``dx = r (dn - n mean(dn n))`` with ``n = x r``, ``dn = grad *
    weight``; the weight's gradient summed over the rows; a float32 or bfloat16 gradient,
    widened). Saves ``x`` and ``[M]`` roots, where the tensor ops keep ``x`` and the
    normalized rows. ``accel.patches.kernel_norms`` switches a model's norms to it for a step."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, H]
        y, rstd = torch.ops.agent_rl_kernels.rms_norm_forward(rows, weight, eps, dtype)  # [M, H], [M]
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        flat = grad.reshape(rows.shape)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        dx, dweight = torch.ops.agent_rl_kernels.rms_norm_backward(flat.contiguous(), rows, weight, rstd)  # [M, H], [H]
        return (dx.view(grad.shape) if ctx.needs_input_grad[0] else None,
                dweight if ctx.needs_input_grad[1] else None, None, None)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] under softmax(logits / temperature), T > 0, by
    inverse CDF with the row's uniform (``uniforms`` [B]: the first token whose cumulative
    probability exceeds it), and its log-prob: ``([B] int64, [B] float32)``."""
    return torch.ops.agent_rl_kernels.sample(logits.float().contiguous(), uniforms.float().contiguous(),
                                             float(temperature))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                     generated_keys: torch.Tensor, generated_values: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step's attention: ``q`` [A, kv_heads, g, d] (each KV head's query group)
    over the keys and values of [``keys``[rows[a]], ``generated_keys``[a]] (``[U, kv_heads,
    S1, d]`` and ``[A, kv_heads, S2, d]``, read in place: slices of larger buffers are fine),
    ``mask`` [A, S1 + S2] (true: attend). Returns ``[A, kv_heads, g, d]``. float32, d 64 or
    128, g at most 8 (``fits_decode``)."""
    return torch.ops.agent_rl_kernels.decode_attention(
        q.contiguous(), keys, values, rows.contiguous(), generated_keys, generated_values,
        mask.contiguous(), scale)


def rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin_signed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int) -> torch.Tensor:
    """A decode step's rotary embedding and cache write in one pass: ``q`` [A, heads * d] and
    ``k`` rotated by ``cos`` and ``sin_signed`` [A, d] (sin with its first half negated:
    x cos + roll(x, d / 2) sin_signed is Llama's rotation), the rotated ``k`` and ``v`` [A,
    kv_heads * d] written into ``keys``/``values``[a, :, slot] ([>= A, kv_heads, S, d]).
    Returns the rotated q ``[A, heads * d]``. float32; rows of q, k, v may be strided."""
    return torch.ops.agent_rl_kernels.rotary_write(q, k, v, cos.contiguous(), sin_signed.contiguous(),
                                                   keys, values, slot)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ([M, N] float32 or bfloat16 each, rows may be strided) in one pass:
    ``[M, N]``."""
    return torch.ops.agent_rl_kernels.silu_mul(gate, up)


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` for a float32 ``dst`` and a float32 or bfloat16 ``src`` of its shape: one
    pass as our kernel where both are contiguous on the CPU (``add_`` first writes a bfloat16
    ``src`` out as a float32 temporary, a fresh allocation whose pages fault in: ~0.8 ms of a
    ~1 ms ``[1536, 576]`` add in a training step), else ``add_``. The same sums to the bit."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == torch.float32
            and src.dtype in (torch.float32, torch.bfloat16) and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and load()):
        torch.ops.agent_rl_kernels.add_into(dst, src)
    else:
        dst.add_(src)


class SiluMul(torch.autograd.Function):
    """The trainer's SwiGLU middle, ``silu(gate) * up``, one pass each way: ``apply(gate, up)``
    with ``[M, N]`` float32 or bfloat16 (both alike, columns contiguous) returns ``[M, N]``
    in their dtype (float32 inside, rounded once), where the tensor ops take two passes
    forward (silu, the product) and three back."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.ops.agent_rl_kernels.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.agent_rl_kernels.silu_mul_backward(grad.to(gate.dtype).contiguous(), gate, up)


class Rotary(torch.autograd.Function):
    """The trainer's rotary embedding, Llama's ``x cos + rotate_half(x) sin``, one pass each
    way: ``apply(x, cos, sin, dtype)`` with ``x`` ``[R, H, T, D]`` float32 or bfloat16 (the
    last dimension contiguous) and ``cos``, ``sin`` ``[R, T, D]`` float32 returns a contiguous
    ``[R, H, T, D]`` in ``dtype`` (float32 inside, rounded once); the gradient comes back in
    ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, cos, sin, dtype):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return torch.ops.agent_rl_kernels.rotary(x, cos, sin, dtype, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return torch.ops.agent_rl_kernels.rotary(grad, cos, sin, ctx.x_dtype, True), None, None, None


def fits_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``Rotary`` takes ``x`` [R, H, T, D] with ``cos`` (and sin) [R, T, D]: on the CPU,
    float32 or bfloat16 ``x`` with its last dimension contiguous, float32 angles of its rows,
    positions and even head size, and the kernel built."""
    return (x.device.type == "cpu" and x.dim() == 4 and cos.dim() == 3 and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0
            and tuple(cos.shape) == (x.shape[0], x.shape[2], x.shape[3]) and load())


def fits_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``SiluMul`` takes these: on the CPU, one shape and dtype (float32 or
    bfloat16), the last dimension contiguous, and the kernel built."""
    return (gate.device.type == "cpu" and up.device == gate.device and gate.shape == up.shape
            and gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16)
            and gate.dim() >= 1 and gate.stride(-1) == 1 and up.stride(-1) == 1 and load())


def fits_decode(x: torch.Tensor, head_dim: int, group: int) -> bool:
    """Do the decode-step kernels (``decode_attention``, ``rotary_write``, ``silu_mul``) take
    this step: float32 on the CPU and no autocast there (which would hand them bf16
    projections), heads of 64 or 128, at most 8 query heads per KV head, and the kernels
    built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and head_dim in (64, 128) and group <= 8 and load())


class ChunkAttention(torch.autograd.Function):
    """A plan's chunks in bfloat16, forward and backward one kernel call each
    (``chunk_attention`` in ``csrc/kernels.cpp``): ``apply(q, k, v, chunks, keys, mask, extents,
    scale, dtype)`` with ``q`` ``[R, H, T, D]``, ``k``, ``v`` ``[R, H_kv, T, D]`` bfloat16 and a
    plan's ``tables``; returns ``[R, T, H, D]`` in ``dtype``, float32 or bfloat16 (float32 sums
    rounded once: what the next projection reads under bf16 autocast, kept once for both). The
    gradient may come back in either. A query's keys past its extent are masked, so the
    products skip them (a chunk's later queries see more of its keys than its earlier ones)."""

    @staticmethod
    def forward(ctx, q, k, v, chunks, keys, mask, extents, scale, dtype):
        out, lse = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, mask, extents, scale, dtype)
        ctx.save_for_backward(q, k, v, out, lse, chunks, keys, mask, extents)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, chunks, keys, mask, extents = ctx.saved_tensors
        if grad.dtype not in (torch.float32, torch.bfloat16):
            grad = grad.float()
        dq, dk, dv = torch.ops.agent_rl_kernels.chunk_attention_backward(
            grad.contiguous(), q, k, v, out, lse, chunks, keys, mask, extents, ctx.scale)  # [R, T, H(_kv), D]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None, None


class TokenLogprobs(torch.autograd.Function):
    """The trainer's log-probs and entropies of its trained tokens from their logits, one
    kernel call each way (``token_logprobs`` in ``csrc/kernels.cpp``):
    ``apply(logits, targets, temperature, grad_into)`` with ``logits`` ``[N, V]`` float32 or
    bfloat16 (contiguous) and ``targets`` ``[N]`` int64 returns the ``[N]`` float32 log-probs
    of ``targets`` under ``softmax(logits / temperature)`` and their rows' entropies (no
    gradient). The gradient comes back in the logits' dtype, written where
    ``grad_into(N)`` says when it gives a contiguous ``[N, V]`` tensor of that dtype (memory
    the caller keeps: ``accel.head.HeadGrads.grad_rows``), else into a new tensor; ``grad_into``
    None: a new tensor. Two reads of the logits forward and one backward, where log-softmax,
    the entropy's exp, product and sum write three ``[N, V]`` float32 tensors (and a bf16 row
    is cast to float32 first)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, grad_into=None):
        logp, entropy, lse = torch.ops.agent_rl_kernels.token_logprobs(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.grad_into = temperature, grad_into
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _):
        logits, targets, lse = ctx.saved_tensors
        grad = grad.float().contiguous()
        out = None if ctx.grad_into is None else ctx.grad_into(logits.shape[0])
        if (out is None or out.shape != logits.shape or out.dtype != logits.dtype
                or out.device != logits.device or not out.is_contiguous()):
            return torch.ops.agent_rl_kernels.token_logprobs_backward(
                grad, logits, targets, lse, ctx.temperature), None, None, None
        torch.ops.agent_rl_kernels.token_logprobs_backward_into(grad, logits, targets, lse, ctx.temperature, out)
        return out, None, None, None


def fits_logprobs(logits: torch.Tensor) -> bool:
    """Whether ``TokenLogprobs`` takes these logits: ``[N, V]`` float32 or bfloat16 on the
    CPU, and the kernel built."""
    return (logits.device.type == "cpu" and logits.dim() == 2
            and logits.dtype in (torch.float32, torch.bfloat16) and load())


def fits_chunks(head_dim: int) -> bool:
    """Whether ``ChunkAttention`` runs here: the kernel is built, the CPU has AVX-512 BF16's
    dot product (without it the kernel's products are scalar loops, slower than SDPA's float32
    chunks) and the head size is a multiple of 32."""
    return head_dim % 32 == 0 and "avx512_bf16" in _cpu_flags().split() and load()
