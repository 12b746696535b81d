"""Worker for test_distributed.py: trains the tiny Llama for a few optimizer steps through an
`agent_rl.run.distributed` backend and writes what it saw as JSON (plus the final weights).

    python _ds_worker.py SPEC.json OUT_DIR          # a world of one (or under torchrun)

SPEC is a list of runs, done in order in this process:
    {"name", "backend": "torch"|"deepspeed", "zero": 0-3, "offload": "none"|"cpu",
     "dtype": "float32"|"bfloat16", "steps": 3, "split": "whole"|"ranks"|"strided",
     "poison_step": null|k (that step's loss is inf),
     "save_after": null|k (write_bundle after step k into "bundle_root"),
     "resume_from": null|bundle path (load it, then run steps k+1..steps)}

The batch is 4 sequences of a fixed seeded draw. "whole": this process takes micro-batches
[0, 1] and [2, 3]; "ranks" (2 ranks): rank 0 takes [0] and [1], rank 1 takes [2, 3] and pads
with one zero-weight micro-batch; "strided" (any world size): rank r takes the sequences
k = r, r + world_size, ..., one micro-batch each. Losses are scaled for the GLOBAL token
count (the distributed module's rule), so every split computes the same gradient.
OUT_DIR/<name>.json: per-step loss, grad_norm, stepped (main rank); <name>.safetensors: the
final full state dict.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import safetensors.torch
import torch

from agent_rl.policies.models import tiny_model
from agent_rl.run import checkpoint, distributed
from agent_rl.training import update

LENGTHS = (9, 13, 6, 11)
ADVANTAGES = (1.0, -0.5, 0.7, -1.2)
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-2, 0.01, 1.0


def batch(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def micro_batches(split: str, rank: int, world_size: int) -> list[list[int]]:
    if split == "whole":
        return [[0, 1], [2, 3]]
    if split == "strided":
        return [[k] for k in range(rank, len(LENGTHS), world_size)]
    return [[[0], [1]], [[2, 3]]][rank]


def micro_loss(model, seqs: list[torch.Tensor], members: list[int]) -> tuple[torch.Tensor, int]:
    """The micro-batch's token mean of -advantage * log p(next token), and its token count."""
    T = max(len(seqs[k]) for k in members)
    ids = torch.zeros(len(members), T, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(members), T)  # [B, T]
    for i, k in enumerate(members):
        ids[i, : len(seqs[k])] = seqs[k]
        mask[i, : len(seqs[k])] = 1
    logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits  # [B, T, V]
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    trained = mask[:, 1:]  # [B, T-1]
    adv = torch.tensor([ADVANTAGES[k] for k in members])[:, None]  # [B, 1]
    tokens = int(trained.sum())
    return (-adv * logp * trained).sum() / tokens, tokens


def run(spec: dict, out_dir: Path) -> None:
    model, tokenizer = tiny_model(0)
    model.to(getattr(torch, spec.get("dtype", "float32"))).train()
    start = 0
    if spec.get("resume_from"):
        meta = checkpoint.load_bundle(spec["resume_from"], model)  # plain model, before wrapping
        start = meta["step"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    backend = distributed.make_backend(spec["backend"], spec.get("zero", 0),
                                       spec.get("offload", "none"), model, optimizer, GRAD_CLIP)
    if spec.get("resume_from"):
        backend.load_state(spec["resume_from"])
    seqs = batch(len(tokenizer))
    mine = micro_batches(spec.get("split", "whole"), backend.rank, backend.world_size)
    local_tokens = sum(len(seqs[k]) - 1 for members in mine for k in members)
    global_tokens = backend.all_reduce_sum(local_tokens)
    record = {"steps": [], "world_size": backend.world_size}
    for step in range(start + 1, spec["steps"] + 1):
        backend.zero_grad()
        n = backend.max_across(len(mine))
        loss_sum = 0.0
        for k in range(n):
            members, weight = (mine[k], 1.0) if k < len(mine) else (mine[0], 0.0)
            if spec.get("recompute"):  # every decoder layer recomputed in backward
                update.recompute_layers(backend.module, {"input_ids": seqs[members[0]]}, 1, every=True)
            loss, tokens = micro_loss(backend.model, seqs, members)
            if step == spec.get("poison_step"):
                loss = loss * float("inf")
            share = tokens / global_tokens * weight
            backend.backward(loss * share)
            loss_sum += float(loss.detach()) * share
        result = backend.step()
        record["steps"].append({"step": step, "loss": backend.all_reduce_sum(loss_sum),
                                "grad_norm": result.grad_norm, "stepped": result.stepped})
        if step == spec.get("save_after"):
            path = distributed.write_bundle(backend, spec["bundle_root"], step,
                                            meta={"step": step})
            if backend.is_main:
                record["bundle"] = str(path)
    state = backend.full_state_dict()
    if backend.is_main:
        safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()},
                                    out_dir / f"{spec['name']}.safetensors")
        (out_dir / f"{spec['name']}.json").write_text(json.dumps(record, indent=1))
    backend.barrier()


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        run(spec, out)
    if distributed.launched_world_size() > 1:
        distributed.end_launched_rank(0)  # as `agent-rl train` ends a launched rank
