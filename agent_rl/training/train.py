"""The GRPO training loop, top to bottom.

    contract -> data (train / held-out splits from evals, checked) -> run dir, model,
    optimizer, policies, [resume] (setup.py) -> [difficulty band: curriculum.py]
    -> evaluate before
    -> loop: collect episodes -> assign credit -> compute advantages -> build the loss batch
             -> update -> log -> guards -> maybe evaluate -> maybe checkpoint
    -> evaluate after -> report

The math lives in ``grpo.py`` (advantages, clipped loss, KL) and ``rollout.py`` (filtering,
credit, rendering), one optimizer step in ``update.py``, what a run is made of in
``setup.py``, what the run directory holds in ``run/rundir.py``, what a step reports in
``metrics.py``; this file only wires it.

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

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent_rl.policies.hf import HFPolicy
from agent_rl.run import checkpoint
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.devices import prepare_device
from agent_rl.run.distributed import Backend, launched_world_size, write_bundle
from agent_rl.run.guards import GuardTrip, holdout_train_reward
from agent_rl.run.rundir import json_safe, logged_eval, rewind_logs, unpin_run_dir, write_file
from agent_rl.run.runlock import hold_if_main
from agent_rl.training import curriculum
from agent_rl.training.metrics import (
    TrainStatus,
    compare,
    held_out_task,
    note_untrained,
    progress_bar,
    scale_metrics,
    step_metrics,
)
from agent_rl.training.pipeline import RolloutPipeline, Synchronous, split_stale
from agent_rl.training.rollout import (
    RolloutBatch,
    RolloutSettings,
    TrainSequence,
    hint_share,
    hinted_jobs,
    merge_batches,
    rollout_batch,
)
from agent_rl.training.setup import (
    Run,
    State,
    TaskSampler,
    check_engines,
    check_hints,
    check_plan,
    check_world,
    start,
)
from agent_rl.training.shared import evaluate_held_out, load_data, shard
from agent_rl.training.update import policy_update
from envs.core import TaskSpec


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    comparison: dict[str, Any] | None = None
    stopped: GuardTrip | None = None
    losses: list[float] = field(default_factory=list)


def run(contract: ExperimentContract, resume: bool = False, progress: bool = True,
        before: dict[str, Any] | None = None) -> RunResult:
    """Train under ``contract`` (the module docstring), holding its run directory for the whole
    run (``runlock``): a second process there is refused at once naming this one, a folder
    that cannot be written before anything else is done; a resource plan that cannot fit the
    device (``setup.check_plan``) before that. ``before``: the held-out summary of the same
    starting policy from another run of the same model, env and eval sections (runs that
    differ only in credit or seed, as an ablation's, share it), used instead of evaluating
    again; one that does not cover this run's held-out tasks at its temperature is refused."""
    check_plan(contract, launched_world_size())
    with hold_if_main(contract.check_run_dir(), resume):
        return _run(contract, resume, progress, before)


def _run(contract: ExperimentContract, resume: bool, progress: bool,
         before: dict[str, Any] | None = None) -> RunResult:
    # --- 0. data: the train split and the held-out splits come from evals; checked (empty
    # splits, leakage between train and evaluation, context budget vs. prompt limit) before
    # anything is written ----------------------------------------------------------------------
    data = load_data(contract.env, contract.eval, contract.rollout.max_prompt_tokens)
    check_hints(contract.env, contract.hints is not None, data.train_tasks)
    device = prepare_device(contract.model.device, contract.model.dtype, contract.model.tf32,
                            contract.run.deterministic)  # a GPU asked for and missing fails here
    check_world(contract, launched_world_size())
    check_engines(contract)

    # --- 1. run directory (checked: empty, or a run of this contract and base model), model,
    # fixed reference, optimizer, [resume from the newest complete bundle], backend, the
    # policies that evaluate and roll out; then the run directory is pinned by rank 0
    run, state = start(contract, data, device, resume)

    # --- 2. the difficulty band (curriculum.py) in force: the checkpoint's round, else
    # estimated now (a band keeping no task fails, a new run's pins taken back)
    band = band_in_force(run, state)
    if resume and run.main:  # steps a killed run logged after its last checkpoint are redone
        rewind_logs(run.run_dir, state.step if state.resumed else -1, state.store_cursor)
    if band is not None:
        adopt(run, state, band)

    # --- 3. evaluate the starting policy on the held-out tasks -------------------------------
    if state.before is None:
        state.before = (evaluate(run, "before", progress) if before is None else
                        same_held_out(before, run.data.eval_sets, contract.eval.temperature))
        run.log("eval.jsonl", {"step": state.step, "tag": "before", **state.before})

    # --- 4. the loop -------------------------------------------------------------------------
    result = train_loop(run, state, progress)

    # --- 5. evaluate the trained policy on the same held-out tasks, same seeds (once: a
    # finished run resumed again re-reports what it logged) ----------------------------------
    if result.stopped is None:
        finish(run, state, result, progress)
    return result


def train_loop(run: Run, state: State, progress: bool) -> RunResult:
    """Steps ``state.step + 1 .. optim.max_steps``, or until a guard stops the run. Rollouts
    come from this thread (max_policy_lag 0) or run ahead on a background thread, at most
    max_policy_lag updates behind (``pipeline.py``)."""
    contract, backend, policy = run.contract, run.backend, run.policy
    last, lag_bound = contract.optim.max_steps, contract.rollout.max_policy_lag
    result = RunResult(run.run_dir, state.step, state.before, None)
    settings = RolloutSettings.from_contract(contract)
    produce = functools.partial(rollout_step, run, state, settings)  # step -> (batch, seconds)
    rollouts = (RolloutPipeline(produce, state.step + 1, last, lag_bound) if lag_bound
                else Synchronous(produce))
    with rollouts, progress_bar(progress and run.main, last, state.step,
                                status=TrainStatus(state.before)) as advance:
        for step in range(state.step + 1, last + 1):
            if state.selection is not None and curriculum.due(state.selection, step,
                                                              contract.curriculum.every):
                adopt(run, state, estimate_band(contract, run.rollout_policy, backend,
                                                run.data.train_tasks, step, state.selection))
            # collect episodes -> assign credit -> compute advantages -> build the loss batch:
            # rollout_batch over this rank's share of the step's tasks (``rollout_step``), then
            # the whole batch on every rank, recorded in the store
            t0, collective0 = time.perf_counter(), backend.collective_seconds
            batch, rollout_s = gather_batch(backend, *rollouts.take(step))
            # batch.episodes: [tasks_per_step * G], each with its filter decision
            # batch.sequences: [S] kept sessions, each [T_s] tokens with advantage and weight
            wait_s = time.perf_counter() - t0
            if run.main:
                run.store.append(batch.episodes)
            # sessions sampled more than max_policy_lag updates ago: dropped (counted)
            fresh, stale = split_stale(batch.sequences, policy.revision, lag_bound)  # [S'], [S - S']
            lag = policy_lag(fresh, policy.revision)

            # update: loss -> optimizer step, updates_per_batch times over the fresh sequences
            t1 = time.perf_counter()
            update = update_policy(run, fresh)
            train_s = time.perf_counter() - t1
            update["rollout/dropped_stale"] = len(stale)

            # log
            metrics = step_record(run, state, step, batch, fresh, update, lag,
                                  {"rollout": rollout_s, "train": train_s, "wait": wait_s, "t0": t0,
                                   "queue_age": rollouts.queue_age_s, "collective0": collective0})
            result.losses.append(metrics["loss/policy"])

            # guards, evaluation
            trip = run.guards.after_step(metrics, last=step == last)
            if contract.eval.every and step % contract.eval.every == 0 and step < last:
                held = evaluate(run, f"step{step}")
                metrics["holdout/reward"] = held["reward_mean"]
                run.log("eval.jsonl", {"step": step, "tag": f"step{step}", **held})
                trip = trip or run.guards.after_eval(  # the unhinted reward under annealed hints
                    holdout_train_reward(metrics, contract.hints is not None), held["reward_mean"])
            trip = backend.all_gather_object(trip)[0]  # rank 0's decision, on every rank
            if run.main:  # rank 0 writes the run directory
                run.loggers.log(metrics, step)
            result.steps = step
            advance(metrics)

            # checkpoint
            if trip is not None:
                result.stopped = stop(run, state, step, trip)
                break
            if contract.checkpoint.every and step % contract.checkpoint.every == 0:
                save(run, state, step)
    if run.rollout_policy is not policy:
        run.rollout_policy.close()
    run.loggers.close()
    return result


# --- the pieces the loop calls ----------------------------------------------------------------


def rollout_step(run: Run, state: State, settings: RolloutSettings,
                 step: int) -> tuple[RolloutBatch, float]:
    """Step ``step``'s batch from this rank (``rollout.py`` steps 0-8: collect -> filter ->
    credit -> advantages -> rendered sequences) and its seconds: the rank's contiguous share
    of the step's tasks, its jobs seeded and hinted as one process would (``shard``). Runs on
    the pipeline's thread when rollouts are asynchronous."""
    t0 = time.perf_counter()
    contract = run.contract
    tasks = state.sampler.for_step(step, contract.rollout.tasks_per_step)
    lo, hi = shard(len(tasks), run.backend.rank, run.backend.world_size)
    seed = contract.optim.seed * 100_003 + step
    group, share, shown, note = contract.rollout.group_size, scheduled_hints(contract, step), None, None
    if share is not None:  # annealed hints, chosen over the step's jobs as a whole
        shown = hinted_jobs(share, len(tasks) * group, contract.optim.seed, step)
        shown = shown[lo * group:hi * group]
        note = {"schedule": contract.hints.schedule, "step": step, "share": share}
    batch = rollout_batch(run.rollout_policy, run.rollout_policy.tokenizer, tasks[lo:hi],
                          settings.seeded(seed), seed=seed + lo * group,
                          group_prefix=f"step{step}/", hints=shown, hint_note=note)
    return batch, time.perf_counter() - t0


def scheduled_hints(contract: ExperimentContract, step: int) -> float | None:
    """The share of step ``step``'s episodes the contract's ``hints`` schedule (None: no hints)."""
    return hint_share(step, **contract.hints.model_dump()) if contract.hints else None


def update_policy(run: Run, sequences: list[TrainSequence]) -> dict[str, float]:
    """``optim.updates_per_batch`` optimizer steps over ``sequences`` (``update.policy_update``;
    later passes reuse the first one's log-probs, ``prox``). Every step taken bumps the policy
    revision that later samples record, and the policies holding their own weights (a copy, a
    vLLM engine) get the new ones (``sync_weights``)."""
    contract, policy = run.contract, run.policy
    if not contract.rollout.max_policy_lag and run.rollout_policy is not policy:
        run.rollout_policy.release()  # the copy's weights: unread until the push below
    update, prox = {}, {}
    for _ in range(contract.optim.updates_per_batch):
        update = {**update, **policy_update(run.backend, run.reference, sequences, contract,
                                            pad_id=run.tokenizer.pad_token_id or 0, prox=prox,
                                            micro_tokens=run.micro_batch_tokens)}
        policy.revision += not update.get("optim/skipped")
    if not update.get("optim/skipped"):
        run.scheduler.step()
    sync_weights(run.backend, policy, run.rollout_policy)
    return update


def step_record(run: Run, state: State, step: int, batch: RolloutBatch,
                trained: list[TrainSequence], update: dict[str, float], lag: dict[str, float],
                seconds: dict[str, float]) -> dict[str, Any]:
    """The step's ``metrics.jsonl`` record (``metrics.step_metrics`` and ``scale_metrics``:
    collective), the run's counters advanced. ``trained``: the sequences in the loss;
    ``seconds``: rollout, train, wait (for the batch), queue_age (of the batch), t0 (when the
    wait began) and collective0 (``backend.collective_seconds`` then)."""
    contract, counters = run.contract, state.counters
    counters["tokens_generated"] += batch.report["tokens_generated"]
    counters["tokens_trained"] += update.get("tokens", 0)
    counters["episodes"] += len(batch.episodes)
    metrics = step_metrics(step, batch, update, seconds["rollout"], seconds["train"], counters,
                           lag, hint_share=scheduled_hints(contract, step))
    # prompts over the limit, a step that trained no token, no reward contrast: counted,
    # warned (the guard nothing_trained stops a run whose limits let nothing train)
    metrics |= note_untrained(metrics, batch, counters, contract.rollout.max_prompt_tokens,
                              contract.rollout.max_response_tokens, warn=run.main)
    metrics["step/seconds"] = time.perf_counter() - seconds["t0"]  # waiting for the batch to here
    metrics |= scale_metrics(
        run.backend, flops=run.flops_per_token * update.get("tokens", 0) * contract.optim.updates_per_batch,
        peak=run.peak, step_s=metrics["step/seconds"], train_s=seconds["train"],
        wait_s=seconds["wait"], queue_age_s=seconds["queue_age"], trained=trained,
        collective_s=run.backend.collective_seconds - seconds["collective0"])
    if state.selection is not None:  # the band in force and what estimating it cost
        metrics |= {**state.selection.metrics(step), "total/curriculum_tokens_generated":
                    counters["curriculum_tokens_generated"]}
    return metrics


def evaluate(run: Run, tag: str, progress: bool = False) -> dict[str, Any]:
    """The held-out summary of the policy now (``shared.evaluate_held_out``), hint-free."""
    return evaluate_held_out(run.policy, run.data, run.contract.env, run.contract.eval,
                             run.eval_sampling, tag, run.run_dir, run.backend, progress)


def same_held_out(before: dict[str, Any], eval_sets: dict[str, list], temperature: float
                  ) -> dict[str, Any]:
    """``before`` (a held-out summary from another run) when it evaluated exactly this run's
    held-out tasks, split by split (its scored tasks among them, the rest infrastructure
    faults), at ``temperature``; else a ValueError naming what differs."""
    evaluated = {split: len(tasks) for split, tasks in eval_sets.items()}
    mine = {(split, task.task_id) for split, tasks in eval_sets.items() for task in tasks}
    keys = before.get("keys", [])
    scored = {held_out_task(key) for key in keys}
    if (before.get("n_evaluated") != evaluated or not scored <= mine
            or len(keys) + before.get("infra_faults", 0) != sum(evaluated.values())):
        raise ValueError(f"train.run(before=...): the summary evaluated "
                         f"{before.get('n_evaluated')} held-out tasks ({len(scored)} scored, "
                         f"{len(scored - mine)} not held out here), this run holds out "
                         f"{evaluated}: it is another eval section or env, so it cannot stand "
                         "for this run's evaluation before training")
    if before.get("temperature") != temperature:
        raise ValueError(f"train.run(before=...): the summary was sampled at temperature "
                         f"{before.get('temperature')}, this run evaluates at {temperature}")
    return before


def save(run: Run, state: State, step: int, extra: dict[str, Any] | None = None) -> None:
    """A checkpoint after step ``step`` (every rank: ``write_bundle``), what resumes the run
    in its meta; the oldest beyond ``checkpoint.keep`` removed."""
    write_bundle(run.backend, run.run_dir / "checkpoints", step, scheduler=run.scheduler, meta={
        "step": step, "counters": dict(state.counters), **run.pins,
        "sampler_position": step * run.contract.rollout.tasks_per_step,  # TaskSampler.for_step
        "store_cursor": run.store.cursor if run.main else None, "before": state.before,
        "policy_revision": run.policy.revision, "guards": run.guards.state(),
        "curriculum": state.selection.state() if state.selection else None, **(extra or {})})
    if run.main:
        checkpoint.apply_retention(run.run_dir / "checkpoints", run.contract.checkpoint.keep)


def stop(run: Run, state: State, step: int, trip: GuardTrip) -> GuardTrip:
    """A guard stopped the run after step ``step``: a checkpoint with its record, and
    ``guard.json``."""
    record = json_safe(trip.__dict__)  # its evidence may be NaN (rule nonfinite)
    save(run, state, step, {"guard": record})
    if run.main:
        write_file(run.run_dir / "guard.json", json.dumps(record, indent=2, default=str))
    return trip


def finish(run: Run, state: State, result: RunResult, progress: bool = False) -> None:
    """After the last step: its checkpoint, the held-out result of the trained policy (the
    logged one when a finished run is resumed again), the comparison, ``result.json``."""
    if not (run.run_dir / "checkpoints" / f"step-{result.steps:06d}").exists():
        save(run, state, result.steps)
    result.after = run.backend.all_gather_object(logged_eval(run.run_dir, "after", result.steps))[0]
    if result.after is None:
        result.after = evaluate(run, "after", progress)
        run.log("eval.jsonl", {"step": result.steps, "tag": "after", **result.after})
    result.comparison = compare(state.before, result.after)
    if run.main:
        write_file(run.run_dir / "result.json", json.dumps(
            {"before": state.before, "after": result.after, "comparison": result.comparison},
            indent=2, sort_keys=True))


def band_in_force(run: Run, state: State) -> curriculum.Selection | None:
    """The difficulty band at the start: the checkpoint's round (the sampler set to its kept
    tasks; None returned), or a new one estimated now when a round is due (returned, to
    ``adopt``). A band keeping no task fails with a new run's pins taken back."""
    contract = run.contract
    if contract.curriculum is None:
        return None
    first = state.step + 1
    if state.step < contract.optim.max_steps and curriculum.due(state.selection, first,
                                                                 contract.curriculum.every):
        try:
            return estimate_band(contract, run.rollout_policy, run.backend, run.data.train_tasks,
                                 first, state.selection)
        except curriculum.CurriculumError:
            if state.fresh:
                unpin_run_dir(run.run_dir)
            raise
    if state.selection is not None:  # the sampler draws from the band's kept tasks only
        state.sampler = TaskSampler(state.selection.tasks(run.data.train_tasks),
                                    seed=contract.optim.seed)
    return None


def adopt(run: Run, state: State, band: curriculum.Selection) -> None:
    """A new band in force: its cost counted, its record logged, the sampler drawing from its
    kept tasks only."""
    state.counters["tokens_generated"] += band.tokens
    state.counters["curriculum_tokens_generated"] += band.tokens
    run.log("curriculum.jsonl", band.record())
    state.selection = band
    state.sampler = TaskSampler(band.tasks(run.data.train_tasks), seed=run.contract.optim.seed)


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


def gather_batch(backend: Backend, batch: RolloutBatch, rollout_s: float) -> tuple[RolloutBatch, float]:
    """The whole step's batch on every rank (``merge_batches`` of the ranks' shards, in rank
    order) and the slowest rank's rollout time. A world of one returns its own."""
    if backend.world_size == 1:
        return batch, rollout_s
    shards = backend.all_gather_object((batch, rollout_s))
    return merge_batches([b for b, _ in shards]), max(s for _, s in shards)


def sync_weights(backend: Backend, policy: HFPolicy, rollout_policy) -> None:
    """After an update, the policies holding their own weights take the trained ones, streamed
    by ``backend.layer_by_layer`` (under ZeRO-3 gathered one layer at a time, never the whole
    model): the evaluation policy's full copy under ZeRO-3, and the rollout copy or vLLM
    engine (pushed, applied at its next generate) when rollouts are asynchronous or on vLLM.
    Collective."""
    if policy.model is not backend.module:
        policy.load_weights(backend.layer_by_layer(policy.weights_to_push), policy.revision)
    if rollout_policy is not policy:
        rollout_policy.push(backend.layer_by_layer(rollout_policy.weights_to_push), policy.revision)
