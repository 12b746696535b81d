"""Training backends: the one protocol the trainer calls for backward, optimizer step,
collectives and training state, with two implementations.

    TorchBackend      a world of one: backward, clip_grad_norm_, optimizer.step (CPU or GPU)
    DeepSpeedBackend  DeepSpeed ZeRO 0-3, optionally with the optimizer offloaded to the CPU;
                      one process or many under `torchrun` / `deepspeed` (gloo on CPU, nccl on
                      CUDA). Without a launcher it sets up a world of one itself.

One optimizer step, the same on every rank::

    backend.zero_grad()
    n = backend.max_across(len(micro))             # every rank runs n forward/backward passes
    for k in range(n):
        rows, weight = (micro[k], 1.0) if k < len(micro) else (micro[0], 0.0)  # padding
        loss = ...                                 # forward through backend.model
        backend.backward(loss * share * weight)
    result = backend.step()                        # StepResult(grad_norm, stepped)

Loss scaling. The losses passed to `backward` in one step, summed over micro-batches and over
ranks, must equal the loss of the whole global batch: under `token_mean` a micro-batch's loss
(its own token mean) times its trained tokens / the GLOBAL trained-token count (every rank's
count through `all_reduce_sum`); under the per-sequence aggregations times its sequences / the
global sequence count. The caller applies no factor of the world size: DeepSpeed averages
gradients over the data-parallel ranks, so `DeepSpeedBackend.backward` multiplies the loss by
`world_size` before `engine.backward`, which makes the gradient exactly that of the global
loss; in a world of one both backends pass the loss as is. The loss to log is `all_reduce_sum`
of each rank's sum of the losses it passed.

Why the same number of passes: ZeRO-3 all-gathers parameters in every forward, and ZeRO-2/3
reduce gradients in every backward, both collectives, so a rank that runs fewer passes leaves
the others waiting. Pad with a real micro-batch times 0.0, never an empty one (0 * nan is nan
and would skip the step). Every rank also runs the same no-grad forwards (``update_kl``).

Collective time: `collective_seconds` adds up the seconds spent inside the backend's own
collectives (`all_reduce_sum`, `all_gather_object`, `barrier`, `max_across`, the ZeRO-3 gather
of `gathered`), waiting for slower ranks included; the trainer logs each step's share
(`time/collective_s`). The gradient reductions and parameter gathers that DeepSpeed's engine
runs inside `backward` and `step` are not in it (they are in `train/forward_backward_seconds`
and `train/optimizer_seconds`). A world of one has none: 0.

Non-finite steps, one rule for both backends: a loss that is not finite poisons its gradient
(its gradient is multiplied by nan; a finite loss is passed unchanged), and the step is taken
only when the global gradient norm is finite. Otherwise `StepResult.stepped` is False, the
optimizer state and the weights are untouched and the gradients are dropped (DeepSpeed's own
overflow check under ZeRO 1-3 and bf16; under ZeRO 0 in fp32 DeepSpeed hands our optimizer
through unchanged, and the backend clips, and skips, in that optimizer's step pre-hook).
`grad_norm` is the global L2 norm before clipping; DeepSpeed reports inf for a skipped step.

Micro-batches per step may vary: DeepSpeed runs with `managed_gradient_accumulation: false`
(deepspeed 0.19.8): `backward` only accumulates (ZeRO-2/3 reduce into their partitions as they
go), `step` is the accumulation boundary, and `gradient_accumulation_steps` stays 1, so
DeepSpeed never divides the loss. `overlap_comm` is off (that mode needs it off for ZeRO-3).

Precision follows the model's parameters: fp32 parameters train in fp32 (the trainer's bf16
autocast works as with `torch`), bf16 parameters turn on DeepSpeed's bf16 mode, which keeps
fp32 master weights in the optimizer.

Training state and bundles. `save_state(folder)` / `load_state(folder)` are collective: every
rank passes the same folder (shared by every rank). They write / read plain files: the
backend's own optimizer state (`optimizer.pt` for torch; for DeepSpeed its module file and
every rank's optimizer partition, as `engine.save_checkpoint` names them) and `backend.json`
(backend, ZeRO stage, world size: a state resumes only under the same backend and stage; at
another world size see "Resume at another world size" below). `write_bundle` puts them into a
checkpoint bundle through `save_bundle`'s
`extra_writer`, next to model.safetensors written from the full parameters (`gathered`); a
full disk there is `checkpoint.DiskFullError`, naming the last complete bundle. To
resume: on every rank, `checkpoint.load_bundle(path, model, scheduler=..., rank=rank)` into
the plain model BEFORE `make_backend` (ZeRO-3 partitions what it wraps), then
`backend.load_state(path)`. The bundle's RNG files hold every rank's own states (gathered by
`write_bundle`), and each rank restores its own.

Resume at another world size. What defines the run's future is world-size independent: the
full weights (model.safetensors), and the fp32 master weights and Adam moments, which ZeRO 1-3
partition over the ranks that wrote them. DeepSpeed 0.19.8 refuses to load a ZeRO 1-3
optimizer state at another data-parallel size ("Automatic adjustment of ZeRO's optimizer
state partitioning with a new world size is not currently supported"); its supported way
across is the universal checkpoint: `deepspeed.checkpoint.ds_to_universal` merges the saved
partitions into one folder per parameter (fp32, exp_avg, exp_avg_sq, step), which any world
size loads (DeepSpeed's config `checkpoint: {load_universal: true}`). `load_state` does this
when the bundle's world size differs (`_reshard`): rank 0 converts the bundle's partitions into
a staging folder beside the bundle (named like save_bundle's temp folders: removed after the
load, or by `apply_retention` after a crash), then every rank loads its new partition from it.
ZeRO 0 in fp32 keeps the whole optimizer state on every rank (in the module file), so it loads
as is. Exact: the tensors are copied, not recomputed (tested: 2 -> 1, 1 -> 2 and 2 -> 4
ranks under ZeRO 0-3).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, NoReturn, Protocol

import torch
import torch.distributed as dist

from agent_rl.run import checkpoint

BACKEND_FILE = "backend.json"
OFFLOADS = ("none", "cpu")
Number = int | float


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm of the gradients before clipping (inf/nan: not finite)
    stepped: bool  # False: the update was skipped (non-finite loss or gradients)


class Backend(Protocol):
    """What the trainer calls. Every method is collective (all ranks call it, in the same
    order) except `zero_grad` and the attributes."""

    rank: int
    world_size: int
    collective_seconds: float  # so far, inside the collectives below (0 in a world of one)
    model: Any  # call it for forward passes (and .train() / .eval()): the DeepSpeed engine
    module: torch.nn.Module  # the wrapped nn.Module itself (under ZeRO-3 its parameters are
    # partitioned: read them inside `gathered()` or through `full_state_dict()`)

    @property
    def is_main(self) -> bool: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> StepResult: ...
    def zero_grad(self) -> None: ...
    def all_reduce_sum(self, x: Number | torch.Tensor) -> Number | torch.Tensor: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def barrier(self) -> None: ...
    def max_across(self, n: int) -> int: ...
    def gathered(self) -> contextlib.AbstractContextManager: ...
    def layer_by_layer(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]: ...
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]: ...
    def save_state(self, folder: str | os.PathLike) -> None: ...
    def load_state(self, folder: str | os.PathLike) -> None: ...


def _poisoned(loss: torch.Tensor) -> torch.Tensor:
    """`loss` unchanged when finite; otherwise with a nan gradient, so the norm shows it."""
    finite = torch.isfinite(loss.detach())
    return loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)


def _read_backend_file(folder: Path) -> dict[str, Any] | None:
    path = folder / BACKEND_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


def _check_saved_by(folder: Path, expected: dict[str, Any]) -> int:
    """The world size that wrote the training state in ``folder``; a state of another backend
    or ZeRO stage is refused with the fix (another world size is not: ``load_state``)."""
    saved = _read_backend_file(folder)
    if saved is None and expected["backend"] == "torch":
        return 1  # bundles from before backend.json: optimizer.pt alone
    if saved is None or {**saved, "world_size": None} != {**expected, "world_size": None}:
        raise checkpoint.BundleError(
            f"{folder / BACKEND_FILE}: the training state was saved by {saved}, this run is "
            f"{expected}; resume with the same backend and ZeRO stage, or start a new run "
            "from the bundle's model.safetensors (model.init)")
    return saved["world_size"]


# ---------------------------------------------------------------------------------------------
# A world of one
# ---------------------------------------------------------------------------------------------


class TorchBackend:
    """Single process: `loss.backward()`, `clip_grad_norm_` over the trainable parameters,
    `optimizer.step()` when the norm is finite. Collectives are identities."""

    rank = 0
    world_size = 1
    is_main = True
    collective_seconds = 0.0  # a world of one communicates with no one

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 grad_clip: float = 1.0):
        self.model = self.module = model
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]

    def backward(self, loss: torch.Tensor) -> None:
        _poisoned(loss).backward()

    def step(self) -> StepResult:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        stepped = math.isfinite(grad_norm)
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm, stepped)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, x):
        return x

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def max_across(self, n: int) -> int:
        return n

    def gathered(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def layer_by_layer(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(weights(self.module, None))

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        return _state_dict(self.module, trainable_only)

    def save_state(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint.save_torch(self.optimizer.state_dict(), folder / checkpoint.OPTIMIZER_FILE)
        _write_json(folder / BACKEND_FILE, self._identity())

    def load_state(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        _check_saved_by(folder, self._identity())
        path = folder / checkpoint.OPTIMIZER_FILE
        if not path.is_file():
            raise checkpoint.BundleError(f"{path} is missing: the bundle holds no optimizer state")
        self.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    @staticmethod
    def _identity() -> dict[str, Any]:
        return {"backend": "torch", "world_size": 1}


def _state_dict(module: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Every state-dict entry (tied names each get their copy), or only trainable parameters,
    as CPU copies."""
    if trainable_only:
        return {n: p.detach().to("cpu", copy=True)
                for n, p in module.named_parameters() if p.requires_grad}
    return {n: t.detach().to("cpu", copy=True) for n, t in module.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# DeepSpeed
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str | torch.device = "cpu") -> None:
    """Join the process group a launcher described (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or, when none did, make a world of one on 127.0.0.1 and a
    free port. gloo on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK). Idempotent."""
    import deepspeed
    import deepspeed.ops

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # DeepSpeed's CPU accelerator would compile its shared-memory all-reduce (used only by
        # inference_all_reduce; ~1 min on first use) when its comm backend starts; training
        # collectives go through gloo, so mark the op unavailable instead.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    atexit.register(leave_process_group)


def leave_process_group() -> None:
    """Destroy the process group (registered at exit by ``init_distributed``, so a world of one
    set up inside a Python session leaves it before the interpreter's teardown). A launched
    rank ends through ``end_launched_rank``, which calls this first."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_launched_rank(code: int) -> NoReturn:
    """End a process that a launcher started as one of several ranks (``WORLD_SIZE`` > 1),
    once its work is written: flush the standard streams and logging, leave the process group
    and exit with ``code`` through ``os._exit``, without the interpreter's teardown.

    Why: ZeRO-3 keeps its partitioned parameters, each holding its process group, in reference
    cycles through autograd hooks that Python's collector cannot see, so gloo's process groups
    outlive ``destroy_process_group`` (measured on the two-rank ZeRO-3 run: their four worker
    and two transport threads still run after it and a ``gc.collect()``) and are torn down only
    while the interpreter finalizes. A rank then aborted there, after a run that had succeeded
    ("terminate called without an active exception", SIGABRT, from a thread that is not
    Python's, the main thread already past the script), and torchrun failed the whole job:
    twice, on first runs in a fresh environment."""
    try:
        leave_process_group()
    except Exception:  # said, and the rank fails, but it still ends here
        traceback.print_exc()
        code = code or 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def deepspeed_config(zero_stage: int, offload: str, grad_clip: float,
                     bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config the backend runs with (see the module docstring for why)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if offload != "none" and zero_stage == 0:
        raise ValueError("offload: cpu needs ZeRO stage 1, 2 or 3 (zero_stage >= 1)")
    zero: dict[str, Any] = {"stage": zero_stage, "overlap_comm": False}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the trainer's own torch.optim.AdamW
        "zero_force_ds_cpu_optimizer": False,  # offload runs it too: no compiled CPU Adam
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend:
    """`deepspeed.initialize(model, optimizer, config)`; forward through `backend.model` (the
    engine). The caller's optimizer is a plain torch optimizer (no compiled op is needed)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 zero_stage: int = 1, offload: Literal["none", "cpu"] = "none",
                 grad_clip: float = 1.0):
        import deepspeed

        dtypes = {p.dtype for p in model.parameters()}
        if not dtypes <= {torch.float32, torch.bfloat16} or len(dtypes) != 1:
            raise ValueError(f"DeepSpeedBackend trains fp32 or bf16 parameters, got {dtypes}")
        bf16 = dtypes == {torch.bfloat16}
        init_distributed(next(model.parameters()).device)
        self.zero_stage, self.offload, self.grad_clip = zero_stage, offload, grad_clip
        # DeepSpeed splits the optimizer state over the ranks (ZeRO 1-3; bf16's optimizer too)
        self.partitioned = zero_stage > 0 or bf16
        # ZeRO 0 in fp32 gives our optimizer to the engine as is (no norm, no overflow check):
        # we clip in its step pre-hook, after DeepSpeed's all-reduce, and skip from there.
        self._own_clip = zero_stage == 0 and not bf16
        config = deepspeed_config(zero_stage, offload, 0.0 if self._own_clip else grad_clip, bf16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._own_norm = math.nan
        if self._own_clip:
            optimizer.register_step_pre_hook(self._clip_or_drop)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config)
        self.model, self.module = self.engine, self.engine.module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.collective_seconds = 0.0
        self._device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- one step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over ranks; the caller's losses add up to the global
        # loss, so the sum is restored here (module docstring, "Loss scaling").
        self.engine.backward(_poisoned(loss) * self.world_size)

    def step(self) -> StepResult:
        self.engine.step()
        if self._own_clip:
            grad_norm = self._own_norm
            stepped = math.isfinite(grad_norm)
        else:
            stepped = self.engine.was_step_applied()
            grad_norm = float(self.engine.get_global_grad_norm()) if stepped else math.inf
            stepped = stepped and math.isfinite(grad_norm)
        self.engine.zero_grad()
        return StepResult(grad_norm, stepped)

    def _clip_or_drop(self, optimizer, args, kwargs) -> None:
        self._own_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        if not math.isfinite(self._own_norm):
            for p in self.params:  # torch optimizers skip parameters without a gradient
                p.grad = None

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # --- collectives: each timed into collective_seconds (``_timed``) ---------------------------

    @contextlib.contextmanager
    def _timed(self):
        """Adds the seconds spent inside to ``collective_seconds``: the trainer's own collectives
        (not those DeepSpeed's engine runs inside ``backward`` and ``step``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.collective_seconds += time.perf_counter() - started

    def all_reduce_sum(self, x):
        with self._timed():
            if isinstance(x, torch.Tensor):
                out = x.detach().to(self._device, copy=True)
                dist.all_reduce(out, op=dist.ReduceOp.SUM)
                return out.to(x.device)
            out = torch.tensor(x, dtype=torch.int64 if isinstance(x, int) else torch.float64,
                               device=self._device)
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            return type(x)(out.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with self._timed():
            dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        with self._timed():
            dist.barrier()

    def max_across(self, n: int) -> int:
        with self._timed():
            out = torch.tensor(int(n), dtype=torch.int64, device=self._device)
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
            return int(out.item())

    # --- weights and state ---------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self):
        """Inside, every parameter of `module` holds its full value (ZeRO-3 all-gathers them
        on every rank, read-only; the gather timed into ``collective_seconds``); a no-op for
        ZeRO 0-2. Collective."""
        if self.zero_stage != 3:
            yield
            return
        import deepspeed

        with contextlib.ExitStack() as stack:
            with self._timed():
                stack.enter_context(deepspeed.zero.GatheredParameters(
                    list(self.module.parameters()), modifier_rank=None))
            yield

    def layer_by_layer(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights(module, None)`` (a policy's ``weights_to_push``) as a push streams it:
        under ZeRO-3 read one ``push_units`` piece at a time inside a gather of its parameters
        alone (``by_unit``), never the whole model gathered at once; as it is for ZeRO 0-2.
        Collective under ZeRO-3: every rank consumes the stream to its end."""
        if self.zero_stage != 3:
            return iter(weights(self.module, None))
        import deepspeed

        @contextlib.contextmanager
        def gather(params: list[torch.nn.Parameter]):
            with contextlib.ExitStack() as stack:
                with self._timed():
                    stack.enter_context(deepspeed.zero.GatheredParameters(params, modifier_rank=None))
                yield

        return by_unit(self.module, weights, gather)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """CPU copies of the full weights (the module's dtype) on every rank: for a rollout
        copy or model.safetensors. Collective."""
        with self.gathered():
            return _state_dict(self.module, trainable_only)

    def save_state(self, folder: str | os.PathLike) -> None:
        """`engine.save_checkpoint` into `folder` itself (tag "."): the module file and every
        rank's optimizer partition, plus backend.json; DeepSpeed's recovery scripts are
        removed. Collective; the same folder on every rank."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(folder), tag=".", client_state={}, save_latest=False)
        self.barrier()
        if self.is_main:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (folder / script).unlink(missing_ok=True)
            _write_json(folder / BACKEND_FILE, self._identity())
        self.barrier()

    def load_state(self, folder: str | os.PathLike) -> None:
        """Module weights, fp32 master weights and optimizer states as `save_state` wrote
        them, on any number of ranks (another world size: `_reshard`, the module docstring).
        Collective; on a fresh backend (ZeRO-3 cannot reload an engine it trained)."""
        folder = Path(folder)
        saved_world = _check_saved_by(folder, self._identity())
        if saved_world != self.world_size and self.partitioned:
            self._reshard(folder)
            return
        self._load(folder, ".")

    def _reshard(self, folder: Path) -> None:
        """Load a ZeRO 1-3 state that another world size wrote in ``folder``: rank 0 merges its
        partitions into a universal checkpoint (``universal_checkpoint``) in a staging folder
        beside ``folder``, every rank loads its own partition of it. Collective."""
        stage = Path(self.all_gather_object(str(
            folder.parent / f".tmp-universal-{folder.name}-{checkpoint._host()}-{os.getpid()}"))[0])
        try:
            failed = None  # rank 0's conversion error, said on every rank (none waits for it)
            if self.is_main:
                shutil.rmtree(stage, ignore_errors=True)
                try:
                    universal_checkpoint(folder, stage / "universal")
                except checkpoint.BundleError as exc:
                    failed = str(exc)
            failed = self.all_gather_object(failed)[0]
            if failed is not None:
                raise checkpoint.BundleError(failed)
            self.engine._config.load_universal_checkpoint = True  # read by load_checkpoint only
            try:
                self._load(stage, "universal")
            finally:
                self.engine._config.load_universal_checkpoint = False
            self.barrier()
        finally:
            if self.is_main:
                shutil.rmtree(stage, ignore_errors=True)

    def _load(self, folder: Path, tag: str) -> None:
        load_path, _ = self.engine.load_checkpoint(
            str(folder), tag=tag, load_module_strict=True, load_optimizer_states=True,
            load_lr_scheduler_states=False)
        if load_path is None:
            raise checkpoint.BundleError(f"{folder}: DeepSpeed found no checkpoint to load")

    def _identity(self) -> dict[str, Any]:
        return {"backend": "deepspeed", "zero_stage": self.zero_stage,
                "world_size": self.world_size}


def universal_checkpoint(folder: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal``: the ZeRO 1-3 partitions ``save_state`` wrote in
    ``folder`` (any world size) as a universal checkpoint in ``out`` (one folder per parameter:
    fp32 master, exp_avg, exp_avg_sq, step), which any world size loads
    (``DeepSpeedBackend._reshard``); ``out.parent`` gets its ``latest_universal`` file. Serial,
    in this process; its progress output is kept and shown only when it fails."""
    from deepspeed.checkpoint import ds_to_universal

    args = SimpleNamespace(input_folder=str(folder), output_folder=str(out),
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                           strict=True, inject_missing_state=True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except Exception as exc:
        raise checkpoint.BundleError(
            f"{folder}: DeepSpeed could not merge its ZeRO partitions for another world size "
            f"({type(exc).__name__}: {exc}); resume with the world size in "
            f"{folder / BACKEND_FILE}. Its output ended:\n{said.getvalue()[-2000:]}") from exc


# ---------------------------------------------------------------------------------------------
# Factory and bundles
# ---------------------------------------------------------------------------------------------


def launched_rank() -> int:
    """This process's rank as a launcher set it (RANK): 0 without one. Readable before the
    process group exists (a resume loads its bundle before the backend is made)."""
    return int(os.environ.get("RANK", "0"))


def launched_world_size() -> int:
    """The world size a launcher (torchrun, deepspeed) set for this process: 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_size(name: str, world_size: int) -> None:
    """Several ranks (WORLD_SIZE from a launcher) need backend deepspeed."""
    if name == "torch" and world_size > 1:
        raise ValueError(f"WORLD_SIZE={world_size}: several ranks train through backend.name: "
                         "deepspeed (backend torch is a world of one)")


# devices whose parameters torch's AdamW updates with its fused kernel (``adamw``)
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda"})


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The trainers' optimizer: torch's AdamW, as its fused kernel (one pass over each tensor
    instead of a chain of tensor ops: on this machine's CPU 0.04 against 0.24 s a step for
    SmolLM2-135M's 135M parameters) where every parameter is a float tensor on a device that
    has it, else the default implementation. The same update but for float rounding (tested)."""
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point()
                                 for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


# A policy's ``weights_to_push(model, within)``: HF-named tensors of the parameters whose names
# ``within`` accepts (every one when None), computed from those alone.
Weights = Callable[[Any, Callable[[str], bool] | None], Iterator[tuple[str, torch.Tensor]]]
PEFT_PREFIX = "base_model.model."  # a peft model's names for its base model's parameters


@dataclass(frozen=True)
class PushUnit:
    """A piece of the model a ZeRO-3 push gathers at once: a block of a ``ModuleList`` (a
    transformer layer) or a module outside them (embeddings, final norm, head) with all its
    parameters (``whole``), or a module's own parameters alone where its children hold
    blocks (``whole`` False). ``name``: the module's, in the base model (a peft model's)."""

    name: str
    params: tuple[torch.nn.Parameter, ...]
    whole: bool

    def holds(self, name: str) -> bool:
        """Whether the parameter (or a pushed tensor) called ``name`` is this unit's: named
        in the base model or in its peft model (``base_model.model.`` first), a LoRA layer's
        ``base_layer`` and adapters included."""
        name = name.removeprefix(PEFT_PREFIX)
        if self.whole:
            return name.startswith(f"{self.name}.")
        return name.rpartition(".")[0] == self.name


def push_units(model: torch.nn.Module) -> list[PushUnit]:
    """``model`` (its base model under peft) cut into the pieces a ZeRO-3 push gathers one at
    a time, in parameter order; together they hold every parameter once. Largest: the larger
    of a transformer block and the embeddings (or an untied head)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    units: list[PushUnit] = []
    seen: set[int] = set()  # a tied parameter (a head tied to the embeddings) is gathered once

    def add(name: str, params: Iterable[torch.nn.Parameter], whole: bool) -> None:
        fresh = tuple(p for p in params if id(p) not in seen)
        seen.update(id(p) for p in fresh)
        if fresh:
            units.append(PushUnit(name, fresh, whole))

    def has_blocks(module: torch.nn.Module) -> bool:
        return any(isinstance(m, torch.nn.ModuleList) for m in module.modules())

    def walk(module: torch.nn.Module, prefix: str) -> None:
        add(prefix.rstrip("."), module.parameters(recurse=False), whole=False)
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList):
                for i, block in enumerate(child):
                    add(f"{prefix}{name}.{i}", block.parameters(), whole=True)
            elif has_blocks(child):
                walk(child, f"{prefix}{name}.")
            else:
                add(f"{prefix}{name}", child.parameters(), whole=True)

    walk(base, "")
    return units


def by_unit(model: torch.nn.Module, weights: Weights,
            gather: Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager],
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights(model, within)`` one ``push_units`` piece at a time: inside ``gather`` of
    that piece's parameters, ``within`` accepting its names alone; each tensor cloned (a
    consumer may keep it after the gather ends: vLLM buffers a layer's tensors until the
    layer is complete). At most one piece is gathered, and one piece's tensors copied, at
    a time."""
    for unit in push_units(model):
        with gather(list(unit.params)):
            for name, tensor in weights(model, unit.holds):
                yield name, tensor.clone()


def make_backend(name: Literal["torch", "deepspeed"], zero_stage: int, offload: str,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 grad_clip: float) -> TorchBackend | DeepSpeedBackend:
    """The backend `backend.name` names (the contract's flat fields)."""
    if name == "torch":
        if zero_stage != 0 or offload != "none":
            raise ValueError(f"backend torch has no ZeRO stage {zero_stage} or offload "
                             f"{offload!r}; use backend.name: deepspeed")
        check_world_size(name, launched_world_size())
        return TorchBackend(model, optimizer, grad_clip)
    if name == "deepspeed":
        return DeepSpeedBackend(model, optimizer, zero_stage, offload, grad_clip)
    raise ValueError(f"backend {name!r} is not one of torch, deepspeed")


def write_bundle(backend: Backend, root: str | os.PathLike, step: int, *,
                 meta: dict[str, Any], scheduler: Any | None = None,
                 trainable_only: bool = True) -> Path | None:
    """`checkpoint.save_bundle` for any backend and world size. Collective: call it on every
    rank. Every rank writes its training state into one staging folder under `root`
    (`save_state`); the main rank writes the bundle from the full parameters, with the staged
    files moved in through `extra_writer`, and every rank's RNG states (`checkpoint.rng_states`,
    gathered here) in its RNG files. Returns the bundle on the main rank, else None.

    The staging folder is named like save_bundle's temp folders (`.tmp-...-<host>-<pid>`), so
    `apply_retention` removes one a crash left behind."""
    root = Path(root)
    rngs = backend.all_gather_object(checkpoint.rng_states())  # every rank's own, in rank order
    stage = Path(backend.all_gather_object(
        str(root / f".tmp-state-{step:06d}-{checkpoint._host()}-{os.getpid()}"))[0])
    if backend.is_main:
        shutil.rmtree(stage, ignore_errors=True)
    backend.barrier()
    path = None
    try:  # the staging folder goes whatever happens (an interrupt mid-write included)
        try:
            backend.save_state(stage)
        except Exception as exc:  # a full disk says so, and names the last complete bundle
            if checkpoint.is_disk_full(exc):
                raise checkpoint.no_space(root / f"step-{step:06d}", root, exc) from exc
            raise
        with backend.gathered():
            if backend.is_main:
                path = checkpoint.save_bundle(
                    root, step, model=backend.module, scheduler=scheduler, meta=meta,
                    trainable_only=trainable_only, extra_writer=_move_files_from(stage),
                    rank_rngs=rngs)
    finally:
        if backend.is_main:
            shutil.rmtree(stage, ignore_errors=True)
    backend.barrier()
    return path


def _move_files_from(src: Path) -> Callable[[Path], None]:
    def move(dst: Path) -> None:
        for entry in sorted(os.listdir(src)):
            if (dst / entry).exists():
                raise checkpoint.BundleError(f"{src / entry}: the bundle already has {entry}")
            os.replace(src / entry, dst / entry)

    return move
