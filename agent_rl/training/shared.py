"""What the GRPO loop (``training.train``) and the SFT warm start (``training.sft``) both
use, so that neither imports the other: the run's data (splits, held-out tasks, the checks
before a run starts: ``load_data``), the trained model, held-out evaluation, the resume check,
seeding, and a micro-batch on the model's device."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import envs
from agent_rl.policies.models import add_lora, initial_model
from agent_rl.policies.render import Rendered, SharedRow, collate_shared
from agent_rl.run.contract import EnvSection, EvalSection, ModelSection
from agent_rl.run.devices import to_device
from agent_rl.training.metrics import episode_progress, held_out_tasks, summarize_eval
from envs.core import TaskSpec
from envs.runner import Sampling
from evals.run import run_eval, write_episodes, write_records
from evals.splits import LeakageError, Splits, check_leakage


@dataclass(frozen=True)
class RunData:
    """The tasks a run trains and evaluates on (``load_data``)."""

    env: Any  # the environment the splits were drawn from (its version names the verifier)
    splits: Splits
    train_tasks: list[TaskSpec]  # env.split
    eval_sets: dict[str, list[TaskSpec]]  # the first eval.n tasks of each eval.split


def load_data(section: EnvSection, evaluation: EvalSection, max_prompt_tokens: int,
              limit_key: str = "rollout.max_prompt_tokens") -> RunData:
    """The environment, its splits (``evals``: the train split and the held-out ones), the
    train tasks and the held-out tasks, checked (``check_data``) before anything is written."""
    env = envs.make(section.id, **section.kwargs)
    splits = section.splits(env, require=[section.split, *evaluation.splits])
    train_tasks = list(splits[section.split])
    eval_sets = held_out_tasks(splits, evaluation.splits, evaluation.n)
    check_data(section, env, train_tasks, eval_sets, max_prompt_tokens, limit_key)
    return RunData(env, splits, train_tasks, eval_sets)


def check_data(section: EnvSection, env, train_tasks: list[TaskSpec],
               eval_sets: dict[str, list[TaskSpec]], max_prompt_tokens: int,
               limit_key: str = "rollout.max_prompt_tokens") -> None:
    """What must hold before a run starts: non-empty splits, no evaluation task that is also a
    training task (``evals.splits.check_leakage``: same id, same normalised prompt or a near
    duplicate), and a context budget below the prompt limit (``limit_key`` names it)."""
    empty = [name for name, tasks in {section.split: train_tasks, **eval_sets}.items()
             if not tasks]
    if empty:
        raise ValueError(f"{section.id}: empty split {empty} of a pool of "
                         f"{section.pool_size} tasks; enlarge env.pool_size")
    for name, tasks in eval_sets.items():
        try:
            check_leakage(train_tasks, tasks)
        except LeakageError as exc:
            raise ValueError(f"eval.split {name!r} overlaps env.split {section.split!r}: "
                             f"{exc}") from None
    budget = getattr(env.unwrapped, "context_budget", None)
    if budget is not None and budget >= max_prompt_tokens:
        raise ValueError(
            f"{section.id} compresses at context_budget {budget} tokens, but "
            f"{limit_key} is {max_prompt_tokens}: raise {limit_key} or lower "
            "env.kwargs.context_budget")



def trainable_model(section: ModelSection, device: torch.device):
    """``(model, tokenizer)``: the model section's model (fp32 master weights, from
    ``model.init``'s bundle when set), a LoRA adapter added under ``adapter: lora``, on
    ``device``."""
    model, tokenizer = initial_model(section)
    if section.adapter == "lora":
        model = add_lora(model, section.lora_rank, section.lora_alpha)
    return model.to(device), tokenizer


def template_hash(tokenizer) -> str:
    """The chat template's sha256: a resumed run must render as the run it continues."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def eval_sampling(evaluation: EvalSection, max_prompt_tokens: int, max_response_tokens: int) -> Sampling:
    """How held-out evaluation samples: eval.temperature (top_p 1), eval.seed, the run's limits."""
    return Sampling(temperature=evaluation.temperature, top_p=1.0,
                    max_new_tokens=max_response_tokens, seed=evaluation.seed,
                    max_prompt_tokens=max_prompt_tokens)


def evaluate_held_out(policy, data: RunData, section: EnvSection, evaluation: EvalSection,
                      sampling: Sampling, tag: str, run_dir: Path, backend,
                      progress: bool = False) -> dict[str, Any]:
    """The held-out summary of ``policy`` (``summarize_eval``), hint-free whatever env.kwargs
    say; its records and episodes written under ``run_dir/evals`` (``agent-rl inspect`` shows
    them) by the main rank. Each of ``backend``'s ranks evaluates its slice of every split,
    seeded as one process seeds the whole (``shard``); ``progress`` shows the main rank's
    episodes done per split. Collective."""
    records, episodes = [], []
    for name, tasks in data.eval_sets.items():
        lo, hi = shard(len(tasks), backend.rank, backend.world_size)
        with episode_progress(progress and backend.is_main, hi - lo,
                              f"eval {tag} {name}") as on_round:
            mine = run_eval(policy, section.id, tasks[lo:hi], sampling,
                            seed=evaluation.seed + lo, env_kwargs=section.kwargs,
                            policy_name=tag, split=name, on_round=on_round)
        for part in backend.all_gather_object(mine):
            records += part.records
            episodes += part.episodes
    if backend.is_main:
        write_records(records, run_dir / "evals" / f"{tag}.jsonl")
        write_episodes(episodes, run_dir / "evals" / "episodes" / f"{tag}.jsonl")
    return summarize_eval(records, evaluation.n) | {"temperature": evaluation.temperature}


def shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous slice ``[lo, hi)`` of n items; the first n % world_size ranks
    take one more. Seeding jobs by their global index (``seed + lo * samples``) makes the
    shards sample what one process would."""
    per, extra = divmod(n, world_size)
    lo = rank * per + min(rank, extra)
    return lo, lo + per + (rank < extra)


def device_batch(bins: list[list[SharedRow]], rendered: list[Rendered], pad_id: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """``render.collate_shared`` of a micro-batch, its tensors on the model's device (on CUDA
    from pinned memory, the host not waiting: ``devices.to_device``)."""
    return {k: to_device(v, device) for k, v in collate_shared(bins, rendered, pad_id).items()}



def check_resumable(meta: dict[str, Any], contract_hash: str, template_hash: str, path: Path) -> None:
    if meta.get("contract_hash") != contract_hash:
        raise ValueError(f"cannot resume from {path}: it was written under contract "
                         f"{meta.get('contract_hash', '?')[:12]}, this run's contract is "
                         f"{contract_hash[:12]} (start a new run_dir or restore the old config)")
    if meta.get("template_hash") != template_hash:
        raise ValueError(f"cannot resume from {path}: the tokenizer's chat template changed")



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
