"""What the GRPO loop (``training.train``) and the SFT warm start (``training.sft``) both
use, so that neither imports the other: the checks before a run starts, the resume check,
seeding, and a micro-batch on the model's device."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_rl.policies.render import Rendered, SharedRow, collate_shared
from agent_rl.run.contract import EnvSection
from envs.core import TaskSpec
from evals.splits import LeakageError, check_leakage


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



def device_batch(bins: list[list[SharedRow]], rendered: list[Rendered], pad_id: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """``render.collate_shared`` of a micro-batch, its tensors on the model's device."""
    return {k: v.to(device) for k, v in collate_shared(bins, rendered, pad_id).items()}



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
