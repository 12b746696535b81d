"""Worker for test_vllm_ranks.py: a VLLMPolicy per rank, as the trainer starts one on each of
several ranks (one process without a launcher, or a rank of ``torch.distributed.run``, gloo).

    [python -m torch.distributed.run --nproc-per-node 2 ...] _vllm_ranks_worker.py OUT_DIR [zero3]

Rank r of n generates the rows [r * 6 / n, (r + 1) * 6 / n) of the six short conversations
(each row keeps its global random stream, as the trainer's jobs do), greedily and at T = 0.7,
on the start weights; then takes a push of other weights (revision 1) and generates again.
Writes OUT_DIR/rank{r}-of{n}.json: each row's token ids by phase, the engine's launch options,
its weights hash after the push and the hash of the weights pushed, and whether the trainer's
process group outlived the engine. ``zero3``: the pushed weights are those of a model that
DeepSpeed ZeRO-3 partitions over the ranks (made before the engine, as the trainer makes its
backend), pushed as the trainer pushes them (``Backend.layer_by_layer``, one layer gathered at a
time); the record is OUT_DIR/rank{r}-of{n}-zero3.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from agent_rl.policies.engine_weights import tensors_hash
from agent_rl.policies.models import named_weights_for_push
from agent_rl.policies.vllm_policy import VLLMPolicy, rank_launch_options
from envs.runner import Sampling
from tests.agent_rl.test_vllm_policy import conversations, perturbed, tiny_vllm_llama

ROWS = 6  # the short conversations


def sample(engine: VLLMPolicy, rows: range) -> dict[str, list[list[int]]]:
    batch = [conversations()[b] for b in rows]
    streams = tuple((b,) for b in rows)
    out = {}
    for name, temperature in (("greedy", 0.0), ("t0.7", 0.7)):
        sampling = Sampling(temperature=temperature, max_new_tokens=16, seed=5, streams=streams)
        out[name] = [c.token_ids for c in engine.generate(batch, sampling)]
    return out


def zero3_backend(model):
    """``model`` partitioned by DeepSpeed ZeRO-3 over the launcher's ranks (gloo)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from agent_rl.run.distributed import adamw, make_backend

    return make_backend("deepspeed", 3, "none", model, adamw(list(model.parameters()), 1e-4, 0.0),
                        1.0)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    zero3 = sys.argv[2:] == ["zero3"]
    model, tokenizer = tiny_vllm_llama()
    pushed = perturbed(model, seed=1)
    pushed_hash = tensors_hash(pushed.named_parameters())
    backend = zero3_backend(pushed) if zero3 else None  # partitions pushed's parameters
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # the trainer's group, there before the engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    suffix = "-zero3" if zero3 else ""
    engine = VLLMPolicy.from_model(model, tokenizer, out_dir / f"engine-{world}-{rank}{suffix}",
                                   max_model_len=512)
    rows = range(rank * ROWS // world, (rank + 1) * ROWS // world)
    record = {"rows": list(rows), "before": sample(engine, rows), "options": rank_launch_options()}
    if backend is None:
        engine.load_weights(named_weights_for_push(pushed), revision=1)
    else:
        engine.load_weights(backend.layer_by_layer(engine.weights_to_push), revision=1)
        record["partitioned"] = all(p.numel() == 0 for p in pushed.parameters())
    record.update(after=sample(engine, rows), engine_hash=engine.weights_hash(),
                  pushed_hash=pushed_hash, revision=engine.revision)
    engine.close()
    record["group_kept"] = dist.is_initialized()  # the trainer's group outlives the engine
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    (out_dir / f"rank{rank}-of{world}{suffix}.json").write_text(json.dumps(record))
