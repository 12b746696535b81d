"""Worker for test_checkpoint.py's two-rank RNG test (run under torch.distributed.run, gloo):
each rank seeds its torch generator differently, writes one bundle through
``distributed.write_bundle`` (every rank's RNG states gathered), draws, loads the bundle with
its own rank and draws again. Writes OUT/rank-R.json: the state it saved, what it drew after
saving and after restoring.

    python -m torch.distributed.run --nproc-per-node 2 _rng_worker.py OUT
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from agent_rl.run import checkpoint, distributed


class GlooBackend:
    """The parts of ``distributed.Backend`` that ``write_bundle`` calls, over a gloo group."""

    def __init__(self, module: torch.nn.Module):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = self.module = module

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def save_state(self, folder) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.barrier()

    def gathered(self):
        return contextlib.nullcontext()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert distributed.launched_rank() == rank
    backend = GlooBackend(torch.nn.Linear(2, 2))
    torch.manual_seed(100 + rank)  # each rank its own stream
    torch.rand(3)
    saved = torch.get_rng_state()
    path = distributed.write_bundle(backend, out / "checkpoints", 1, meta={})
    path = Path(backend.all_gather_object(str(path))[0])
    after_save = torch.rand(4).tolist()
    torch.manual_seed(999)  # moved on
    checkpoint.load_bundle(path, backend.module, rank=rank)
    after_load = torch.rand(4).tolist()
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "saved": saved.tolist(), "after_save": after_save, "after_load": after_load,
        "bundle": str(path)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
