"""Supervised warm starts (``agent-rl sft``): train on episodes, write a bundle RL starts from.

    contract -> run dir -> data (the same splits as ``train``) -> model -> episodes (the env's
    scripted solver, or a RolloutStore filtered by reward) -> rendered sessions -> [resume]
    -> evaluate before -> loop: epochs x batches of sessions -> NLL -> optimizer step -> log
    -> maybe a resume bundle -> evaluate after -> bundle (full weights)

Sessions are rendered exactly as the trainer renders them (``render.render_session``): the
loss covers the tokens the policy generates, in every session of the episode (compression
summaries and branched sub-agents included), and nothing else. The solver's replies become
"generated" turns by tokenizing their text as the policy would have sampled it (the reply's
tokens, then the end-of-turn token): ``SolverPolicy``. The loss of one optimizer step is the
mean negative log-likelihood over all trained tokens of its sessions, computed in
micro-batches whose sums add up to it; sessions sharing a prefix (the system prompt with the
tool schemas) compute it once (``render.share_prefixes``, ``pack``), as the RL trainer does.

The bundle holds full weights (a LoRA adapter is merged first), so ``model.init: PATH`` in an
experiment contract loads it onto ``model.id`` before that run's own adapter. Its meta names
the base model's files (refused by ``load_init`` under another base), the contract hash, the
episodes trained on and the held-out result. One process, CPU or one GPU.

Resuming holds the trainer's guarantees, through the trainer's functions: the run directory is
held by one process (``runlock``) and checked as ``train`` checks its own (``check_run_dir``: a
changed contract or base model is refused, writing nothing); every ``checkpoint.every`` steps
and after the last one a resume bundle (``run_dir/resume/step-N``: the trained weights, the
optimizer and RNG states; ``write_bundle``) is written, and ``resume`` continues from the newest
complete one: step s trains the batch ``batch_of_step(s)`` (a pure function of s), so the
resumed run ends on the weights the uninterrupted one does. Logs a killed run wrote after that
bundle are set aside (``rewind_logs``); a finished run resumed again writes nothing.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import envs
from agent_rl import accel
from agent_rl.policies.hf import HFPolicy
from agent_rl.policies.models import model_fingerprint, rollout_copy
from agent_rl.policies.render import (
    ROW_TOKENS,
    Rendered,
    end_of_turn_id,
    micro_batches,
    pack,
    render_session,
    share_prefixes,
)
from agent_rl.run import checkpoint
from agent_rl.run.contract import SFTContract
from agent_rl.run.devices import prepare_device
from agent_rl.run.distributed import TorchBackend, adamw, launched_world_size, write_bundle
from agent_rl.run.loggers import open_loggers
from agent_rl.run.rundir import (
    check_run_dir,
    log_json,
    logged_eval,
    pin_run_dir,
    rewind_logs,
    write_file,
)
from agent_rl.run.runlock import hold_if_main
from agent_rl.run.sizing import resolve_sizes
from agent_rl.training.metrics import compare, peak_rss_mb, progress_bar
from agent_rl.training.rollout import prompt_too_long, task_total
from agent_rl.training.shared import (
    RunData,
    check_resumable,
    device_batch,
    eval_sampling,
    evaluate_held_out,
    load_data,
    seed_everything,
    template_hash,
    trainable_model,
)
from agent_rl.training.update import trained_logprobs, trained_token_logits
from envs.core import TaskSpec
from envs.runner import Completion, Sampling, run_episodes
from evals.run import write_episodes
from evals.splits import SPLIT_NAMES
from trajectories import Episode, RolloutStore, Session

RESUME_DIR = "resume"  # run_dir/resume/step-N: the bundles `agent-rl sft --resume` continues from


@dataclass
class SFTResult:
    run_dir: Path
    bundle: Path | None
    bundle_hash: str | None
    steps: int
    data: dict[str, Any]
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    comparison: dict[str, Any] | None = None
    losses: list[float] = field(default_factory=list)


def run(contract: SFTContract, resume: bool = False, progress: bool = True) -> SFTResult:
    """Train under ``contract`` (the module docstring), holding its run directory for the whole
    run (``runlock``); ``resume``: continue the run there from its newest resume bundle."""
    with hold_if_main(contract.check_run_dir(), resume):
        return _run(contract, resume, progress)


def _run(contract: SFTContract, resume: bool, progress: bool) -> SFTResult:
    # --- 0. data: the splits `train` would use, checked (empty splits, leakage, prompt limit)
    data = load_data(contract.env, contract.eval, contract.limits.max_prompt_tokens,
                     limit_key="limits.max_prompt_tokens")
    if launched_world_size() > 1:
        raise ValueError("agent-rl sft runs in one process (CPU or one GPU); run it without "
                         "torchrun / deepspeed")
    device = prepare_device(contract.model.device, contract.model.dtype, contract.model.tf32,
                            contract.run.deterministic)

    # --- 1. run directory: new, or (resume) a run of this contract and base model, continued
    # from its newest resume bundle; checked as the trainer checks its own, writing nothing
    run_dir = contract.check_run_dir()
    contract_hash = contract.contract_hash()
    base_model = {"model": model_fingerprint(contract.model.id)}
    latest = check_run_dir(run_dir, contract, contract_hash, base_model, resume,
                           checkpoints=run_dir / RESUME_DIR)
    seed_everything(contract.optim.seed)

    # --- 2. model (fp32 on the device, from model.init when set), optional LoRA, optimizer
    model, tokenizer = trainable_model(contract.model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    backend = TorchBackend(model, adamw(params, contract.optim.lr, contract.optim.weight_decay),
                           contract.optim.grad_clip)  # clip, skip a non-finite step, as train
    sizes = resolve_sizes(contract.optim.micro_batch_tokens, "auto", device, model,
                          contract.model.dtype,
                          contract.limits.max_prompt_tokens + contract.limits.max_response_tokens)
    policy = HFPolicy(model, tokenizer, device=device, compute_dtype=contract.model.dtype,
                      batch_size=sizes.decode_batch)

    # --- 3. episodes -> kept (reward filter, never a held-out task) -> rendered sessions ---
    kept, rendered, counts = training_sessions(contract, data, tokenizer)

    # --- 4. resume: weights, optimizer and RNG states of the newest resume bundle, the step
    # (the data cursor: ``batch_of_step``) and the held-out result before training; then the
    # run directory is pinned and its logs cut back to that bundle -------------------------
    pins = {"contract_hash": contract_hash, "template_hash": template_hash(tokenizer),
            "base_model": base_model}
    step, before = resume_point(latest, backend, pins)
    pin_run_dir(run_dir, contract, contract_hash, base_model)
    if resume:  # steps a killed run logged after its last resume bundle are redone
        rewind_logs(run_dir, step if latest else -1, 0)
    write_file(run_dir / "data.json", json.dumps(counts, indent=2, sort_keys=True) + "\n")
    write_episodes(kept, run_dir / "episodes.jsonl")  # what was trained on, for inspect
    sampling = eval_sampling(contract.eval, contract.limits.max_prompt_tokens,
                             contract.limits.max_response_tokens)

    def evaluate(tag: str, step: int) -> dict[str, Any]:  # hint-free, as `train` evaluates
        model.eval()
        summary = evaluate_held_out(policy, data, contract.env, contract.eval, sampling, tag,
                                    run_dir, backend, progress)
        log_json(run_dir / "eval.jsonl", {"step": step, "tag": tag, **summary})
        return summary

    # --- 5. evaluate the starting policy (once: a resumed run has it from its bundle) -------
    if before is None:
        before = evaluate("before", step)

    # --- 6. the loop: epochs over the sessions, each in a seeded order (``batch_of_step``),
    # a resume bundle every checkpoint.every steps and after the last ---------------------
    result = SFTResult(run_dir, None, None, step, counts, before, None)
    total_steps = contract.optim.epochs * -(-len(rendered) // contract.optim.batch_sessions)
    pad_id, every, done = tokenizer.pad_token_id or 0, contract.checkpoint.every, step
    loggers = open_loggers(contract, run_dir)  # metrics.jsonl and log.to's mirrors
    with progress_bar(progress, total_steps, done, label="sft", status=lambda m: (
            f"loss {m['loss/sft']:.4f}  token accuracy {m['token_accuracy']:.2f}")) as advance:
        for step in range(done + 1, total_steps + 1):
            metrics = sft_step(contract, backend, rendered, step, pad_id, device,
                               sizes.micro_batch_tokens)
            loggers.log(metrics, step)
            result.losses.append(metrics["loss/sft"])
            advance(metrics)
            if every and step % every == 0:
                save_resume(backend, run_dir, step, pins, before, contract.checkpoint.keep)
    loggers.close()
    result.steps = step = total_steps
    if not (run_dir / RESUME_DIR / f"step-{step:06d}" / checkpoint.COMPLETE_FILE).exists():
        save_resume(backend, run_dir, step, pins, before, contract.checkpoint.keep)

    # --- 7. evaluate the result (once: a finished run resumed re-reports what it logged),
    # then the bundle: full weights (a LoRA adapter merged) ---------------------------------
    result.after = logged_eval(run_dir, "after", step) or evaluate("after", step)
    result.comparison = compare(before, result.after)
    result.bundle, result.bundle_hash = write_sft_bundle(contract, model, run_dir, step, pins,
                                                         counts, before, result.after)
    write_file(run_dir / "result.json", json.dumps(
        {"before": before, "after": result.after, "comparison": result.comparison,
         "data": counts, "bundle": str(result.bundle), "bundle_hash": result.bundle_hash},
        indent=2, sort_keys=True))
    return result


# --- the pieces the loop calls ----------------------------------------------------------------


def batch_of_step(step: int, n: int, batch_sessions: int, seed: int) -> tuple[int, list[int]]:
    """The epoch (from 1) and the sessions (indices of the n rendered) that optimizer step
    ``step`` (from 1) trains: each epoch a seeded order of the n, cut into batches of
    ``batch_sessions`` (the last one of an epoch may be short). A pure function of the step,
    so a resumed run trains what the killed one would have."""
    per_epoch = -(-n // batch_sessions)
    epoch, k = divmod(step - 1, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return epoch + 1, [int(i) for i in order[k * batch_sessions:(k + 1) * batch_sessions]]


def resume_point(latest: Path | None, backend: TorchBackend, pins: dict[str, Any]
                 ) -> tuple[int, dict[str, Any] | None]:
    """``(step, before)`` of the newest resume bundle ``latest``, its weights, optimizer and
    RNG states loaded (a bundle of another contract or chat template refused); ``(0, None)``
    for a new run."""
    if latest is None:
        return 0, None
    meta = checkpoint.load_bundle(latest, backend.module)
    check_resumable(meta, pins["contract_hash"], pins["template_hash"], latest)
    backend.load_state(latest)
    return meta["step"], meta["before"]


def sft_step(contract: SFTContract, backend: TorchBackend, rendered: list[Rendered], step: int,
             pad_id: int, device: torch.device, micro_tokens: int) -> dict[str, Any]:
    """Optimizer step ``step``: its batch of sessions (``batch_of_step``) trained
    (``sft_update``, in micro-batches of ``micro_tokens``: ``optim.micro_batch_tokens``
    resolved), and its record for ``metrics.jsonl``."""
    t0 = time.perf_counter()
    epoch, picked = batch_of_step(step, len(rendered), contract.optim.batch_sessions,
                                  contract.optim.seed)
    metrics = sft_update(backend, [rendered[k] for k in picked], pad_id,
                         micro_tokens, device, contract.model.dtype)
    return metrics | {"step": step, "epoch": epoch, "step/seconds": time.perf_counter() - t0,
                      "memory/peak_rss_mb": peak_rss_mb()}


def training_sessions(contract: SFTContract, data: RunData, tokenizer
                      ) -> tuple[list[Episode], list[Rendered], dict[str, Any]]:
    """The episodes trained on (the scripted solver's, or a store's; never a held-out task;
    ``select_episodes``), their sessions rendered as the RL trainer renders them, and what was
    read, kept, dropped and skipped (``data.json``). No session left is an error saying why."""
    held_out = {t.task_id for name in SPLIT_NAMES if name != contract.env.split
                for t in data.splits[name]}
    if contract.data.source == "solver":
        episodes = solver_episodes(contract.env.id, data.train_tasks, tokenizer,
                                   contract.data.episodes_per_task, contract.env.kwargs,
                                   seed=contract.optim.seed)
    else:
        episodes = store_episodes(contract.data.store)
    kept, counts = select_episodes(episodes, contract.env.id, held_out, contract.data.min_reward,
                                   contract.data.max_episodes)
    rendered = render_sessions(tokenizer, kept, contract.limits.max_prompt_tokens
                               + contract.limits.max_response_tokens)
    counts |= {"sessions": len(rendered), "skipped_sessions": skipped_sessions(kept),
               "trained_tokens_per_epoch": sum(r.num_trained for r in rendered),
               "tokens_per_epoch": sum(map(len, rendered))}
    if not rendered:
        raise ValueError(no_session_message(counts))
    return kept, rendered, counts


def save_resume(backend: TorchBackend, run_dir: Path, step: int, pins: dict[str, Any],
                before: dict[str, Any] | None, keep: int | None) -> None:
    """A resume bundle (``run_dir/resume/step-N``): trained weights, optimizer and RNG states,
    the step (the data cursor), the run's pins (contract, template, base model) and the
    held-out result before training; the oldest beyond ``checkpoint.keep`` removed."""
    write_bundle(backend, run_dir / RESUME_DIR, step, meta={
        "kind": "sft-resume", "step": step, **pins, "before": before, "store_cursor": 0})
    checkpoint.apply_retention(run_dir / RESUME_DIR, keep)


def write_sft_bundle(contract: SFTContract, model, run_dir: Path, step: int,
                     pins: dict[str, Any], counts: dict[str, Any], before: dict[str, Any],
                     after: dict[str, Any]) -> tuple[Path, str]:
    """The warm start's bundle (``run_dir/checkpoints/step-N``: full weights, a LoRA adapter
    merged; once: a finished run resumed keeps it) and its hash."""
    bundle = run_dir / "checkpoints" / f"step-{step:06d}"
    if not (bundle / checkpoint.COMPLETE_FILE).exists():
        plain = rollout_copy(model, "float32") if contract.model.adapter == "lora" else model
        checkpoint.save_bundle(
            run_dir / "checkpoints", step, model=plain, trainable_only=False,
            meta={"kind": "sft", **pins, "init": contract.model.init, "data": counts,
                  "before": strip(before), "after": strip(after)})
    return bundle, checkpoint.bundle_hash(bundle)


class SolverPolicy:
    """The scripted solver of one environment (``reference_action``) as a policy: its next
    action, tokenized as the policy would have sampled it (the text's tokens, then the
    end-of-turn token), with no log-probs. Drives ``run_episodes`` over that one env."""

    def __init__(self, env, tokenizer):
        self.env = env
        self.tokenizer = tokenizer
        self.end = end_of_turn_id(tokenizer)

    def generate(self, batch, sampling) -> list[Completion]:
        if len(batch) != 1:
            raise ValueError("SolverPolicy drives one environment: give run_episodes one env")
        text = self.env.unwrapped.reference_action()
        if text is None:
            task = getattr(self.env.unwrapped, "task", None)
            raise ValueError(f"{self.env.spec.id if self.env.spec else type(self.env).__name__}: "
                             f"the scripted solver has no action for task "
                             f"{getattr(task, 'task_id', '?')} (reference_action() is None)")
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end]
        return [Completion(text=text, token_ids=ids, finish_reason="stop")]


def solver_episodes(env_id: str, tasks: list[TaskSpec], tokenizer, per_task: int,
                    env_kwargs: dict[str, Any], seed: int) -> list[Episode]:
    """``per_task`` episodes of every task played by the env's scripted solver."""
    env = envs.make(env_id, **env_kwargs)
    try:
        return run_episodes([env], tasks, SolverPolicy(env, tokenizer), Sampling(temperature=0.0),
                            samples_per_task=per_task, seed=seed, group_prefix="sft/",
                            hints=False)
    finally:
        env.close()


def store_episodes(path: str) -> list[Episode]:
    """Every episode of a RolloutStore file (verified: a corrupt line names its record)."""
    if not Path(path).is_file():
        raise ValueError(f"data.store: no file at {path}")
    return list(RolloutStore(path).read())


def select_episodes(episodes: list[Episode], env_id: str, held_out: set[str],
                    min_reward: float | None, max_episodes: int | None
                    ) -> tuple[list[Episode], dict[str, Any]]:
    """The episodes trained on, and the count of every one that is not, by reason: another
    environment, a held-out task (never trained on: it would leak into evaluation), a reward
    total below ``min_reward`` (the task's reward: length shaping left out), an infrastructure
    fault, beyond ``max_episodes``."""
    kept, dropped = [], Counter()
    for e in episodes:
        reason = ("other_env" if e.env_id != env_id else
                  "held_out_task" if e.task_id in held_out else
                  "infra_fault" if e.reward.is_infrastructure_fault else
                  "below_min_reward" if min_reward is not None and task_total(e.reward) < min_reward
                  else "over_max_episodes" if max_episodes is not None and len(kept) >= max_episodes
                  else None)
        if reason is None:
            kept.append(e)
        else:
            dropped[reason] += 1
    rewards = [task_total(e.reward) for e in kept]
    return kept, {"episodes_read": len(episodes), "episodes_kept": len(kept),
                  "dropped": dict(dropped), "tasks": len({e.task_id for e in kept}),
                  "reward_mean": float(np.mean(rewards)) if rewards else None}


def untrainable(episode: Episode, session: Session) -> str | None:
    """Why ``render_sessions`` skips a session, None where it has a generated turn to train:
    ``prompt_too_long`` (its episode ended before generating a token, the prompt over the limit
    of the run that recorded it), ``no_token_ids`` (assistant turns without sampled token ids),
    ``no_assistant_turn``."""
    if any(t.generated for t in session.turns):
        return None
    if prompt_too_long(episode):
        return "prompt_too_long"
    return "no_token_ids" if any(t.role == "assistant" for t in session.turns) else "no_assistant_turn"


def skipped_sessions(episodes: list[Episode]) -> dict[str, int]:
    """How many sessions of ``episodes`` ``render_sessions`` skips, by reason (``untrainable``)."""
    return dict(Counter(why for e in episodes for s in e.sessions
                        if (why := untrainable(e, s)) is not None))


def no_session_message(data: dict[str, Any]) -> str:
    """The error of an SFT run left with no session to train on: what was read, dropped and
    skipped, by reason."""
    def counts(by_reason: dict[str, int]) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in by_reason.items()) or "none"

    hint = (" (episodes that generated no token: their prompts were longer than the prompt "
            "limit of the run that recorded them)" if "prompt_too_long" in data["skipped_sessions"]
            else "")
    return (f"no session to train on: {data['episodes_read']} episodes read, "
            f"{data['episodes_kept']} kept (dropped: {counts(data['dropped'])}); their sessions "
            f"skipped: {counts(data['skipped_sessions'])}{hint}")


def render_sessions(tokenizer, episodes: list[Episode], max_tokens: int) -> list[Rendered]:
    """Every session that generated a token, rendered as the RL trainer renders it; a longer
    one than ``max_tokens`` is an error naming it (training on it would exceed what the policy
    is ever shown). The others are skipped (``untrainable``, counted by ``skipped_sessions``)."""
    out = []
    for e in episodes:
        for session in e.sessions:
            if untrainable(e, session) is not None:
                continue
            r = render_session(tokenizer, session, require_logprobs=False)
            if len(r) > max_tokens:
                raise ValueError(f"episode {e.episode_id}, session {session.session_id}: {len(r)} "
                                 f"tokens, more than limits.max_prompt_tokens + "
                                 f"limits.max_response_tokens ({max_tokens})")
            out.append(r)
    return out


def sft_update(backend: TorchBackend, batch: list[Rendered], pad_id: int, micro_tokens: int,
               device: torch.device, dtype: str) -> dict[str, float]:
    """One optimizer step: the mean negative log-likelihood of the batch's trained tokens,
    over micro-batches each weighted by its share of them; ``backend.step`` clips the
    gradients and skips a non-finite step (counted)."""
    from agent_rl.run.devices import as_dtype, autocast

    model = backend.module
    model.train()
    backend.zero_grad()
    total = sum(r.num_trained for r in batch)
    nll_sum, correct = 0.0, 0
    micro = micro_batches(pack(share_prefixes(batch), min(micro_tokens, ROW_TOKENS)), micro_tokens)
    with accel.step(backend, model, as_dtype(dtype)) as fast:  # the trainer's CPU accelerator
        for bins in micro:
            tensors = device_batch(bins, batch, pad_id, device)
            with autocast(device, dtype):
                logits = trained_token_logits(model, tensors, fast)  # [N, V]
            logprobs, _ = trained_logprobs(logits, tensors["target"], 1.0, fast)  # [N], as policy_update's
            backend.backward(-logprobs.sum() / max(total, 1))
            nll_sum += float(-logprobs.detach().sum())
            correct += int((logits.detach().argmax(-1) == tensors["target"]).sum())
    stepped = backend.step()
    finite = stepped.stepped and np.isfinite(nll_sum)
    return {"loss/sft": nll_sum / max(total, 1), "tokens": total, "sessions": len(batch),
            "token_accuracy": correct / max(total, 1), "optim/grad_norm": stepped.grad_norm,
            "optim/skipped": 0.0 if finite else 1.0, "micro_batches": len(micro)}


def strip(summary: dict[str, Any]) -> dict[str, Any]:
    """A held-out summary without its per-task lists (the bundle's meta keeps the headline)."""
    return {k: v for k, v in summary.items() if k not in ("rewards", "task_ids", "keys", "splits")}
