"""The GRPO training loop, top to bottom.

    contract -> run dir -> data (train / held-out splits from evals) -> model + optimizer
    -> [resume] -> evaluate before
    -> loop: rollout -> assign -> advantages -> loss -> optimizer step -> log -> guards
             -> maybe evaluate -> maybe checkpoint
    -> evaluate after -> report

The math lives in ``grpo.py`` (advantages, clipped loss, KL) and ``rollout.py`` (filtering,
credit, rendering); this file only wires it. Rollouts are synchronous (policy lag 0): each
batch is sampled by the current weights, so the first update on a batch has ratio 1, and
``updates_per_batch > 1`` reuses the batch with importance ratios against the rollout
policy's old log-probs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import envs
from agent_rl import checkpoint
from agent_rl.config import ExperimentContract
from agent_rl.grpo import policy_loss, token_entropy, token_logprobs
from agent_rl.guards import Guards, GuardTrip
from agent_rl.models import load_model
from agent_rl.policy import HFPolicy, scoring_temperature
from agent_rl.rollout import RolloutBatch, TrainSequence, rollout_batch
from envs.core import TaskSpec
from envs.runner import Sampling
from evals.run import evaluate, write_records
from evals.splits import default_splits
from evals.stats import paired_bootstrap, summarize, wilson
from trajectories import RolloutStore


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
    # --- 0. run directory: the contract and its hash, pinned before the first rollout ---------
    run_dir = contract.resolved_run_dir
    contract_hash = contract.contract_hash()
    prepare_run_dir(run_dir, contract, contract_hash, resume)
    seed_everything(contract.optim.seed)

    # --- 1. data: the train split and the held-out split come from evals ---------------------
    env = envs.make(contract.env.id, **contract.env.kwargs)
    splits = default_splits(env, contract.env.pool_size, contract.env.pool_seed,
                            iid_fraction=contract.env.iid_fraction)
    train_tasks = list(splits[contract.env.split])
    eval_tasks = list(splits[contract.eval.split])[: contract.eval.n]
    if not train_tasks or not eval_tasks:
        raise ValueError(f"{contract.env.id}: empty split (train {len(train_tasks)}, "
                         f"{contract.eval.split} {len(eval_tasks)}); enlarge env.pool_size")
    sampler = TaskSampler(train_tasks, seed=contract.optim.seed)
    verifier_id = f"{contract.env.id}@{env.unwrapped.version}"

    # --- 2. model, optional fixed reference, optimizer ------------------------------------
    model, tokenizer = load_model(contract.model.id, dtype=contract.model.dtype)
    if contract.model.adapter == "lora":
        model = add_lora(model, contract.model.lora_rank, contract.model.lora_alpha)
    reference = load_reference(contract, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=contract.optim.lr,
                                  weight_decay=contract.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy = HFPolicy(model, tokenizer)
    store = RolloutStore(run_dir / "rollouts.jsonl")
    tensorboard = tensorboard_writer(run_dir / "tensorboard")
    template_hash = hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()
    guards = Guards(**contract.guards.model_dump())
    eval_sampling = Sampling(temperature=contract.eval.temperature, top_p=1.0,
                             max_new_tokens=contract.rollout.max_response_tokens,
                             seed=contract.eval.seed)

    # --- 3. resume from the newest complete bundle ------------------------------------------
    start_step, counters, before = 0, Counter(), None
    latest = checkpoint.latest_complete(run_dir / "checkpoints") if resume else None
    if latest is not None:
        meta = checkpoint.load_bundle(latest, model, optimizer, scheduler)
        check_resumable(meta, contract_hash, template_hash, latest)
        start_step, counters = meta["step"], Counter(meta["counters"])
        sampler.position = meta["sampler_position"]
        before = meta.get("before")
        guards.load_state(meta.get("guards", {}))
    if resume:  # steps a killed run logged after its last checkpoint are redone: unlog them
        rewind_logs(run_dir, start_step if latest else -1, meta["store_cursor"] if latest else 0)

    def evaluate_policy(tag: str) -> dict[str, Any]:
        records = evaluate(policy, contract.env.id, eval_tasks, eval_sampling,
                           seed=contract.eval.seed, env_kwargs=contract.env.kwargs,
                           policy_name=tag)
        write_records(records, run_dir / "evals" / f"{tag}.jsonl")  # one record per episode
        return summarize_eval(records)

    def save(step: int, extra: dict[str, Any] | None = None) -> None:
        checkpoint.save_bundle(run_dir / "checkpoints", step, model=model, optimizer=optimizer,
                               scheduler=scheduler, meta={
                                   "step": step, "counters": dict(counters),
                                   "contract_hash": contract_hash, "template_hash": template_hash,
                                   "reference": contract.reference, "verifier": verifier_id,
                                   "sampler_position": sampler.position,
                                   "store_cursor": store.cursor, "before": before,
                                   "guards": guards.state(), **(extra or {})})
        checkpoint.apply_retention(run_dir / "checkpoints", contract.checkpoint.keep)

    # --- 4. evaluate the starting policy on the held-out tasks ------------------------------
    if before is None:
        before = evaluate_policy("before")
        log_json(run_dir / "eval.jsonl", {"step": start_step, "tag": "before", **before})

    # --- 5. the loop ------------------------------------------------------------------------
    result = RunResult(run_dir, start_step, before, None)
    with progress_bar(progress, contract.optim.max_steps, start_step) as advance:
        for step in range(start_step + 1, contract.optim.max_steps + 1):
            # rollout -> assign -> advantages (rollout.py does the three, recorded in the store)
            t0 = time.perf_counter()
            tasks = sampler.next(contract.rollout.tasks_per_step)
            batch = rollout_batch(
                policy, tokenizer, contract.env.id, tasks,
                group_size=contract.rollout.group_size,
                sampling=Sampling(temperature=contract.rollout.temperature,
                                  top_p=contract.rollout.top_p,
                                  max_new_tokens=contract.rollout.max_response_tokens,
                                  seed=contract.optim.seed * 100_003 + step),
                seed=contract.optim.seed * 100_003 + step, env_kwargs=contract.env.kwargs,
                truncation=contract.rollout.truncation,
                truncation_penalty=contract.rollout.truncation_penalty,
                dynamic_sampling=contract.rollout.dynamic_sampling,
                assigner=contract.credit.assigner, assigner_params=contract.credit.params,
                session_weighting=contract.credit.session_weighting,
                std=contract.advantage.std, scale=contract.advantage.scale,
                eps=contract.advantage.eps, store=store, group_prefix=f"step{step}/")
            rollout_s = time.perf_counter() - t0

            # loss -> optimizer step (updates_per_batch passes over the batch)
            t1 = time.perf_counter()
            update = {}
            for _ in range(contract.optim.updates_per_batch):
                update = policy_update(model, reference, optimizer, batch.sequences, contract,
                                       pad_id=tokenizer.pad_token_id or 0)
            if not update.get("optim/skipped"):
                scheduler.step()
            train_s = time.perf_counter() - t1

            # log
            counters["tokens_generated"] += batch.report["tokens_generated"]
            counters["tokens_trained"] += update.get("tokens", 0)
            counters["episodes"] += len(batch.episodes)
            metrics = step_metrics(step, batch, update, rollout_s, train_s, counters)
            result.losses.append(metrics["loss/policy"])

            # guards, evaluation, checkpoint
            trip = guards.after_step(metrics)
            if contract.eval.every and step % contract.eval.every == 0 and step < contract.optim.max_steps:
                held = evaluate_policy(f"step{step}")
                metrics["holdout/reward"] = held["reward_mean"]
                log_json(run_dir / "eval.jsonl", {"step": step, "tag": f"step{step}", **held})
                trip = trip or guards.after_eval(metrics["reward/mean"], held["reward_mean"])
            log_json(run_dir / "metrics.jsonl", metrics)
            log_tensorboard(tensorboard, metrics)
            result.steps = step
            advance(metrics)
            if trip is not None:
                record = json_safe(trip.__dict__)  # its evidence may be NaN (rule nonfinite)
                save(step, {"guard": record})
                (run_dir / "guard.json").write_text(json.dumps(record, indent=2, default=str))
                result.stopped = trip
                break
            if contract.checkpoint.every and step % contract.checkpoint.every == 0:
                save(step)

    # --- 6. evaluate the trained policy on the same held-out tasks, same seeds ---------------
    if result.stopped is None:
        if not (run_dir / "checkpoints" / f"step-{result.steps:06d}").exists():
            save(result.steps)
        result.after = evaluate_policy("after")
        log_json(run_dir / "eval.jsonl", {"step": result.steps, "tag": "after", **result.after})
        result.comparison = compare(before, result.after)
        (run_dir / "result.json").write_text(json.dumps(
            {"before": before, "after": result.after, "comparison": result.comparison},
            indent=2))
    return result


# --- the pieces the loop calls ----------------------------------------------------------------


def policy_update(model, reference, optimizer, sequences: list[TrainSequence],
                  contract: ExperimentContract, pad_id: int, micro_batch: int = 8) -> dict[str, float]:
    """One optimizer step over all sequences, in micro-batches whose losses add up exactly to
    the loss of the whole batch under the chosen aggregation."""
    if not sequences:
        return {"loss/policy": 0.0, "tokens": 0, "optim/grad_norm": 0.0, "optim/nonfinite": 0.0,
                "optim/skipped": 1.0}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(int(q.rendered.loss_mask.sum()) for q in sequences)
    temperature = scoring_temperature(contract.rollout.temperature)
    loss_sum, sums = 0.0, Counter()
    for start in range(0, len(sequences), micro_batch):
        chunk = sequences[start:start + micro_batch]
        batch = collate(chunk, pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
        logprobs = token_logprobs(logits, batch["input_ids"], temperature)  # [B, T]
        entropy = token_entropy(logits.detach(), temperature)  # [B, T]
        ref_logprobs = None
        if contract.loss.kl.beta > 0:
            with torch.no_grad():
                ref_logits = reference_logits(model, reference, batch)  # [B, T, V]
                ref_logprobs = token_logprobs(ref_logits, batch["input_ids"], temperature)
        loss, m = policy_loss(
            logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
            clip_low=contract.loss.clip_low, clip_high=contract.loss.clip_high,
            aggregation=contract.loss.aggregation, ref_logprobs=ref_logprobs,
            beta=contract.loss.kl.beta, kl=contract.loss.kl.estimator,
            max_len=contract.rollout.max_response_tokens, weights=batch["weights"],
            entropy=entropy)
        share = (m["tokens"] / max(total_tokens, 1) if contract.loss.aggregation == "token_mean"
                 else len(chunk) / len(sequences))
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
        for key, value in m.items():
            if key not in ("tokens", "ratio/min", "ratio/max"):
                sums[key] += value * share
        sums["ratio/min"] = min(sums.get("ratio/min", math.inf), m["ratio/min"])
        sums["ratio/max"] = max(sums.get("ratio/max", -math.inf), m["ratio/max"])
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, contract.optim.grad_clip))
    finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if finite:  # a non-finite step is skipped and counted; the guards decide when to stop
        optimizer.step()
        sums["kl/update"] = update_kl(model, sequences, pad_id, temperature, micro_batch)
    optimizer.zero_grad(set_to_none=True)
    return {**dict(sums), "loss/policy": loss_sum, "tokens": total_tokens,
            "optim/grad_norm": grad_norm, "optim/nonfinite": 0.0 if finite else 1.0,
            "optim/skipped": 0.0 if finite else 1.0}


@torch.no_grad()
def update_kl(model, sequences: list[TrainSequence], pad_id: int, temperature: float,
              micro_batch: int) -> float:
    """How far the step moved the policy on its own batch: the k3 estimate of
    KL(pi_new || pi_old) averaged over trained tokens, k3 = exp(d) - 1 - d, d = old - new.
    (``kl/approx`` is measured before the step, so it is ~0 whenever the batch is fresh.)"""
    total, count = 0.0, 0.0
    for start in range(0, len(sequences), micro_batch):
        batch = collate(sequences[start:start + micro_batch], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
        new = token_logprobs(logits, batch["input_ids"], temperature)  # [B, T]
        d = (batch["old_logprobs"] - new) * batch["loss_mask"]  # [B, T]
        total += float(((torch.exp(d) - 1 - d) * batch["loss_mask"]).sum())
        count += float(batch["loss_mask"].sum())
    return total / max(count, 1.0)


def collate(sequences: list[TrainSequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad sequences into a batch; padding is masked out of attention and loss."""
    length = max(len(q.rendered.input_ids) for q in sequences)
    n = len(sequences)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((n, length), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((n, length), dtype=torch.float32)  # [B, T]
    old = torch.zeros((n, length), dtype=torch.float32)  # [B, T]
    for i, q in enumerate(sequences):
        t = len(q.rendered.input_ids)
        input_ids[i, :t] = q.rendered.input_ids
        attention[i, :t] = 1
        loss_mask[i, :t] = q.rendered.loss_mask.float()
        old[i, :t] = q.rendered.old_logprobs.float()
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
            "old_logprobs": old,
            "advantages": torch.tensor([q.advantage for q in sequences], dtype=torch.float32),  # [B]
            "weights": torch.tensor([q.weight for q in sequences], dtype=torch.float32)}  # [B]


def step_metrics(step: int, batch: RolloutBatch, update: dict[str, float], rollout_s: float,
                 train_s: float, counters: Counter) -> dict[str, Any]:
    episodes = batch.episodes
    rewards = [e.reward.total for e in episodes]
    responses = [t for e in episodes for s in e.sessions for t in s.turns if t.token_ids]
    outcomes = Counter(e.reward.outcome.value for e in episodes)
    components = Counter()
    for e in episodes:
        for name, value in e.reward.components.items():
            components[name] += value / len(episodes)
    report = batch.report
    return {
        "step": step,
        "loss/policy": update.get("loss/policy", 0.0),
        "reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "reward/std": float(np.std(rewards)) if rewards else 0.0,
        **{f"reward/{k}": v for k, v in components.items()},
        **{f"outcome/{k}": v / len(episodes) for k, v in outcomes.items()},
        "reward/infra_error_rate": report["infrastructure_faults"] / max(len(episodes), 1),
        "groups/total": report["groups"],
        "groups/dropped": report["groups_dropped"],
        "groups/all_correct": report["drop_reasons"].get("all_correct", 0),
        "groups/all_wrong": report["drop_reasons"].get("all_wrong", 0),
        "groups/zero_contrast_other": report["drop_reasons"].get("zero_contrast", 0),
        "policy/entropy": update.get("entropy"),
        "kl/approx": update.get("kl/approx"),
        "kl/ref": update.get("kl/ref"),
        "kl/update": update.get("kl/update"),
        "ratio/min": update.get("ratio/min"),
        "ratio/mean": update.get("ratio/mean"),
        "ratio/max": update.get("ratio/max"),
        "clip/low_frac": update.get("clip/low_frac"),
        "clip/high_frac": update.get("clip/high_frac"),
        "optim/grad_norm": update.get("optim/grad_norm", 0.0),
        "optim/nonfinite": update.get("optim/nonfinite", 0.0),
        "optim/skipped": update.get("optim/skipped", 0.0),
        "response/length_mean": float(np.mean([len(t.token_ids) for t in responses])) if responses else 0.0,
        "response/truncated_frac": (sum(t.finish_reason == "length" for t in responses)
                                    / max(len(responses), 1)),
        "sessions/per_episode": float(np.mean([len(e.sessions) for e in episodes])),
        "sessions/compressions": sum(s.origin == "compression" for e in episodes for s in e.sessions),
        "sessions/branches": sum(s.origin == "branch" for e in episodes for s in e.sessions),
        "hint/used_frac": sum(e.hint is not None for e in episodes) / max(len(episodes), 1),
        "rollout/tokens_generated": report["tokens_generated"],
        "rollout/tokens_discarded": report["tokens_discarded"],
        "rollout/tokens_per_s": report["tokens_generated"] / max(rollout_s, 1e-9),
        "rollout/seconds": rollout_s,
        "rollout/policy_lag": 0,
        "rollout/data_wait_s": 0.0,
        "train/tokens": update.get("tokens", 0),
        "train/tokens_per_s": update.get("tokens", 0) / max(train_s, 1e-9),
        "train/seconds": train_s,
        "train/sequences": len(batch.sequences),
        "total/tokens_generated": counters["tokens_generated"],
        "total/episodes": counters["episodes"],
        "batch/task_ids": sorted({e.task_id for e in episodes}),
        "rollout/acceptance": report["acceptance"],
    }


def summarize_eval(records) -> dict[str, Any]:
    rewards = [r.reward for r in records]
    successes = sum(r.success for r in records)
    stats = summarize(rewards, n_boot=2000)
    lo, hi = wilson(successes, len(records))
    return {"reward_mean": stats["mean"], "reward_lo": stats["lo"], "reward_hi": stats["hi"],
            "success": successes / len(records), "success_lo": lo, "success_hi": hi,
            "n": len(records), "rewards": rewards, "task_ids": [r.task_id for r in records]}


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Paired bootstrap of after - before on the same tasks and sampling seeds."""
    diff, lo, hi = paired_bootstrap(after["rewards"], before["rewards"], n_boot=5000)
    return {"reward_diff": diff, "lo": lo, "hi": hi, "n": len(after["rewards"])}


class TaskSampler:
    """Cycles through the train tasks in a seeded order; ``position`` is saved in checkpoints."""

    def __init__(self, tasks: list[TaskSpec], seed: int):
        self.tasks = tasks
        self.seed = seed
        self.position = 0

    def next(self, n: int) -> list[TaskSpec]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.tasks))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
            out.append(self.tasks[int(order[index])])
            self.position += 1
        return out


def add_lora(model, rank: int, alpha: int):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("model.adapter: lora needs peft: pip install 'agent-rl[peft]'") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load_reference(contract: ExperimentContract, model):
    """The fixed KL reference: None without KL; the base weights (adapter off) for LoRA on the
    same model; otherwise a separately loaded, frozen model. Never the rollout policy."""
    if contract.loss.kl.beta <= 0:
        return None
    if contract.reference == contract.model.id and contract.model.adapter == "lora":
        return "adapter-disabled"
    reference, _ = load_model(contract.reference, dtype=contract.model.dtype)
    reference.eval().requires_grad_(False)
    return reference


def reference_logits(model, reference, batch) -> torch.Tensor:
    if reference == "adapter-disabled":
        with model.disable_adapter():
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def check_resumable(meta: dict[str, Any], contract_hash: str, template_hash: str, path: Path) -> None:
    if meta.get("contract_hash") != contract_hash:
        raise ValueError(f"cannot resume from {path}: it was written under contract "
                         f"{meta.get('contract_hash', '?')[:12]}, this run's contract is "
                         f"{contract_hash[:12]} (start a new run_dir or restore the old config)")
    if meta.get("template_hash") != template_hash:
        raise ValueError(f"cannot resume from {path}: the tokenizer's chat template changed")


def prepare_run_dir(run_dir: Path, contract: ExperimentContract, contract_hash: str,
                    resume: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    hash_file = run_dir / "contract.sha256"
    if hash_file.exists():
        old = hash_file.read_text().strip()
        if old != contract_hash:
            try:
                changed = contract.changes_from(
                    ExperimentContract.from_yaml(run_dir / "contract.yaml"))
            except ValueError:  # the old contract.yaml is missing or no longer validates
                changed = []
            raise ValueError(f"{run_dir} belongs to another contract ({old[:12]} != "
                             f"{contract_hash[:12]}; changed: {'; '.join(changed) or '?'}); "
                             "use a new run_dir or restore the old config")
        if not resume and any((run_dir / name).exists() for name in RUN_FILES):
            raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it "
                             "or choose a new run_dir")
    (run_dir / "contract.yaml").write_text(contract.to_yaml())
    hash_file.write_text(contract_hash + "\n")


RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl", "checkpoints")


def rewind_logs(run_dir: Path, step: int, store_cursor: int) -> None:
    """Cut the run's logs back to a checkpoint: the first ``store_cursor`` rollout records and
    the metrics/eval records of steps <= ``step`` stay; later records and a torn last line
    (work of a killed run after its last checkpoint, which the resumed run redoes) move to
    ``<file>.rewound``. So every step is logged once, and nothing is lost."""
    for name in ("rollouts.jsonl", "metrics.jsonl", "eval.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        *lines, torn = path.read_bytes().split(b"\n")  # torn: b"" when the file ends cleanly
        if name == "rollouts.jsonl":
            kept, cut = lines[:store_cursor], lines[store_cursor:]
        else:
            late = [json.loads(line)["step"] > step for line in lines]
            kept = [line for line, x in zip(lines, late, strict=True) if not x]
            cut = [line for line, x in zip(lines, late, strict=True) if x]
        if cut or torn:
            with open(path.with_name(name + ".rewound"), "ab") as fh:
                fh.write(b"".join(line + b"\n" for line in [*cut, torn] if line))
            tmp = path.with_name(name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def json_safe(obj: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"), for strict JSON (checkpoint meta)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(value) for value in obj]
    return obj


def tensorboard_writer(path: Path):
    """A TensorBoard SummaryWriter when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


def log_tensorboard(writer, metrics: dict[str, Any]) -> None:
    if writer is None:
        return
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            writer.add_scalar(key, value, metrics["step"])
    writer.flush()


def log_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")


class progress_bar:
    """A rich progress bar over steps showing the latest reward and loss (or nothing)."""

    def __init__(self, enabled: bool, total: int, completed: int):
        self.enabled, self.total, self.completed = enabled, total, completed

    def __enter__(self):
        if not self.enabled:
            return lambda metrics: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[status]}"))
        self.progress.start()
        task = self.progress.add_task("train", total=self.total, completed=self.completed, status="")

        def advance(m: dict[str, Any]) -> None:
            self.progress.update(task, advance=1, status=(
                f"reward {m['reward/mean']:.3f}  loss {m['loss/policy']:+.4f}  "
                f"kept {m['train/sequences']} seqs"))

        return advance

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()
