"""Compositional transfer on Records-v0 (He et al.: training on atomic skills does not reliably
transfer to their compositions; training on compositions transfers down to the atoms).

    1. warm start: ``agent-rl sft`` on the scripted solver's episodes of the training tasks
       (atomic and composed structures alike), from the base model;
    2. from that bundle (``model.init``), GRPO on (a) atomic tasks only, (b) composed tasks only;
    3. the warm start, (a) and (b) evaluated greedily on the same held-out tasks: unseen atomic
       tasks (``A``: named by id, never trained on by any stage) and tasks of composed
       structures no stage trains on (``C``: ``search>get>transform``, ``get>transform>update``,
       whose skills every arm has seen); paired bootstrap intervals over the tasks.

Every stage goes through the product (``sft.run``, ``train.run`` with ``env.holdout``, the
evaluation of ``agent-rl eval``), under contracts written to ``--out``. The base model's rewards
on A and C are the warm start's "before" evaluation (same tasks, same greedy sampling).

    python benchmarks/transfer.py                 # SmolLM2-135M at the CPU scale (~1.5-2.5 h)
    python benchmarks/transfer.py --scale tiny    # the tiny random Llama: a smoke run

``--out DIR`` of an earlier invocation reuses its warm start when that run finished (its
``result.json``, its bundle intact) under the same contract (its ``contract.yaml``), and each
GRPO arm continues from its newest checkpoint (every eighth of its steps) when it ran under the
same contract, so a scale longer than a machine's session is run by rerunning the same command
(``seconds`` then counts this invocation's part).

The scale that ran is printed with the table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

ENV = "agent_rl/Records-v0"
ATOMIC = ["search", "get", "transform", "update"]
HELD_COMPOSED = ["search>get>transform", "get>transform>update"]  # no stage trains on these
TRAIN_COMPOSED = ["search>get", "get>transform", "search>update", "search>transform>update",
                  "search>get>transform>update"]

SCALES: dict[str, dict[str, Any]] = {
    # model, pool, held-out tasks per kind, warm start (episodes, epochs, lr), GRPO (steps,
    # tasks x group per step, lr), limits
    "tiny": {"model": "tiny", "pool": 128, "n_eval": 4, "sft_episodes": 16, "sft_epochs": 1,
             "sft_lr": 1e-3, "steps": 1, "tasks": 2, "group": 2, "lr": 1e-4,
             "max_prompt": 2048, "max_response": 48, "adapter": "none"},
    "cpu": {"model": "smollm2-135m", "pool": 256, "n_eval": 16, "sft_episodes": 64,
            "sft_epochs": 3, "sft_lr": 1e-3, "steps": 8, "tasks": 2, "group": 4, "lr": 2e-4,
            "max_prompt": 1024, "max_response": 64, "adapter": "lora"},
    "full": {"model": "smollm2-135m", "pool": 512, "n_eval": 48, "sft_episodes": 256,
             "sft_epochs": 3, "sft_lr": 1e-3, "steps": 40, "tasks": 8, "group": 8, "lr": 2e-4,
             "max_prompt": 1024, "max_response": 64, "adapter": "lora"},
}


def env_section(scale: dict[str, Any], held_out_structures: list[str], ids_file: Path) -> dict:
    return {"id": ENV, "split": "train", "kwargs": {}, "pool_size": scale["pool"], "pool_seed": 0,
            "holdout": {"structures": held_out_structures, "task_ids_file": str(ids_file)}}


def held_out_atomic(scale: dict[str, Any]) -> list[str]:
    """The ids of ``A``: the first ``n_eval`` atomic tasks of the pool."""
    import envs

    pool = envs.make(ENV).unwrapped.task_pool(scale["pool"], seed=0)
    return [t.task_id for t in pool if t.meta.structure in ATOMIC][: scale["n_eval"]]


def sft_contract(scale: dict[str, Any], ids_file: Path, out: Path):
    from agent_rl.run.contract import SFTContract

    return SFTContract.from_dict({
        "name": "transfer-sft", "env": env_section(scale, HELD_COMPOSED, ids_file),
        "eval": {"split": ["holdout_iid", "holdout_structure"], "n": scale["n_eval"],
                 "seed": 1234, "temperature": 0.0},
        "model": {"id": scale["model"], "adapter": scale["adapter"]},
        "data": {"source": "solver", "episodes_per_task": 1, "min_reward": 1.0,
                 "max_episodes": scale["sft_episodes"]},
        "optim": {"lr": scale["sft_lr"], "epochs": scale["sft_epochs"], "batch_sessions": 8,
                  "micro_batch_tokens": 2048},
        "limits": {"max_prompt_tokens": scale["max_prompt"],
                   "max_response_tokens": scale["max_response"]},
        "run_dir": str(out / "sft")})


def grpo_contract(scale: dict[str, Any], arm: str, held_out: list[str], eval_split: str,
                  ids_file: Path, init: Path, out: Path):
    from agent_rl.run.contract import ExperimentContract

    return ExperimentContract.from_dict({
        "name": f"transfer-{arm}", "env": env_section(scale, held_out, ids_file),
        "eval": {"split": eval_split, "n": 1, "every": 0, "seed": 1234, "temperature": 0.0},
        "model": {"id": scale["model"], "adapter": scale["adapter"], "init": str(init)},
        "rollout": {"group_size": scale["group"], "tasks_per_step": scale["tasks"],
                    "temperature": 1.0, "max_prompt_tokens": scale["max_prompt"],
                    "max_response_tokens": scale["max_response"], "truncation": "keep",
                    "dynamic_sampling": False},
        "optim": {"lr": scale["lr"], "max_steps": scale["steps"], "seed": 0},
        "checkpoint": {"every": max(1, scale["steps"] // 8), "keep": 1},  # a rerun resumes
        # a warm-started policy is peaked (the solver's replies at ~0.01 nats a token): its
        # entropy is near 0 and a LoRA step at this lr moves it by up to ~1 nat, so the
        # entropy and KL bounds are loosened; every stop a guard still makes is reported
        "guards": {"max_truncated_frac": 1.5, "min_entropy": 0.0, "max_kl": 5.0},
        "run_dir": str(out / arm)})


def evaluate(path: Path, tasks: dict[str, list], scale: dict[str, Any]) -> dict[str, list[float]]:
    """Greedy, hint-free rewards of the policy in bundle/run ``path`` on each task list."""
    from agent_rl.policies.load import load_bundle_policy
    from envs.runner import Sampling
    from evals.run import run_eval

    loaded = load_bundle_policy(path, None, "cpu")
    sampling = Sampling(temperature=0.0, max_new_tokens=scale["max_response"], seed=1234,
                        max_prompt_tokens=scale["max_prompt"])
    out = {}
    for kind, kind_tasks in tasks.items():
        records = run_eval(loaded.policy, ENV, kind_tasks, sampling, seed=1234,
                           policy_name=str(path), split=kind).records
        out[kind] = [r.reward for r in records]
    return out


def finished_warm_start(contract):
    """The ``SFTResult`` of a warm start already in ``contract``'s run dir under this contract
    (read back from its ``result.json``), else None."""
    from agent_rl.run import checkpoint
    from agent_rl.run.contract import SFTContract
    from agent_rl.training.sft import SFTResult

    run_dir = contract.resolved_run_dir
    done = run_dir / "result.json"
    if not (done.is_file() and SFTContract.from_yaml(run_dir / "contract.yaml") == contract):
        return None
    r = json.loads(done.read_text())
    bundle = Path(r["bundle"])
    if checkpoint.verify_bundle(bundle) != r["bundle_hash"]:
        return None
    losses = [json.loads(line)["loss/sft"] for line in (run_dir / "metrics.jsonl").open()]
    print(f"reusing the warm start in {run_dir} (bundle {r['bundle_hash'][:12]})")
    return SFTResult(run_dir, bundle, r["bundle_hash"], len(losses), r["data"], r["before"],
                     r["after"], r["comparison"], losses)


def resumable(contract) -> bool:
    """Whether a GRPO arm continues the run in its folder: one an earlier invocation wrote
    under this same contract (from its newest checkpoint; a finished one re-reports its
    result). Any other folder there, from another contract or cut short before its contract
    was written, is this benchmark's own and starts over."""
    from agent_rl.run.rundir import pinned_to

    if pinned_to(contract.resolved_run_dir, contract.contract_hash()):
        return True
    shutil.rmtree(contract.resolved_run_dir, ignore_errors=True)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: "
                        "runs/transfer-<scale>-<time>)")
    args = parser.parse_args()
    scale = SCALES[args.scale]
    out = args.out or Path("runs") / f"transfer-{args.scale}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    import envs
    from agent_rl.training import sft, train
    from evals.stats import paired_bootstrap

    ids_file = out / "held_out_atomic.txt"
    ids_file.write_text("\n".join(held_out_atomic(scale)) + "\n")

    # 1. the warm start (its before/after evaluation: the base model and the bundle on A and C)
    warm = finished_warm_start(sft_contract(scale, ids_file, out)) or sft.run(
        sft_contract(scale, ids_file, out), progress=True)
    splits = sft_contract(scale, ids_file, out).env.splits(envs.make(ENV))
    tasks = {"atomic": list(splits["holdout_iid"])[: scale["n_eval"]],
             "composed": list(splits["holdout_structure"])[: scale["n_eval"]]}
    assert {t.meta.structure for t in tasks["atomic"]} <= set(ATOMIC)
    assert {t.meta.structure for t in tasks["composed"]} <= set(HELD_COMPOSED)
    rewards = {"base": {"atomic": warm.before["splits"]["holdout_iid"]["rewards"],
                        "composed": warm.before["splits"]["holdout_structure"]["rewards"]},
               "sft": evaluate(warm.bundle, tasks, scale)}

    # 2. GRPO from the warm start: atomic tasks only (every composed structure held out), and
    # composed tasks only (the atoms and the two evaluated compositions held out)
    arms = {"atomic": (TRAIN_COMPOSED + HELD_COMPOSED, "holdout_iid"),
            "composed": (ATOMIC + HELD_COMPOSED, "holdout_structure")}
    seconds, trained_steps = {"sft": time.perf_counter() - t0}, {}
    for arm, (held_out, eval_split) in arms.items():
        t1 = time.perf_counter()
        contract = grpo_contract(scale, arm, held_out, eval_split, ids_file, warm.bundle, out)
        trained = {t.meta.structure for t in contract.env.splits(envs.make(ENV))["train"]}
        assert trained <= set(ATOMIC if arm == "atomic" else TRAIN_COMPOSED), trained
        result = train.run(contract, resume=resumable(contract), progress=True)
        rewards[f"grpo_{arm}"] = evaluate(result.run_dir, tasks, scale)
        seconds[f"grpo_{arm}"] = time.perf_counter() - t1
        trained_steps[arm] = {"steps": result.steps, "stopped_by": result.stopped.rule
                              if result.stopped else None}

    # 3. the table: mean reward per policy and kind, paired differences with 95% intervals
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    rows = []
    for name, by_kind in rewards.items():
        rows.append({"policy": name, **{k: round(mean(v), 3) for k, v in by_kind.items()}})
    diffs = []
    for a, b in (("sft", "base"), ("grpo_atomic", "sft"), ("grpo_composed", "sft"),
                 ("grpo_composed", "grpo_atomic")):
        for kind in ("atomic", "composed"):
            d, lo, hi = paired_bootstrap(rewards[a][kind], rewards[b][kind], n_boot=5000)
            diffs.append({"diff": f"{a} - {b}", "kind": kind, "mean": round(d, 3),
                          "lo": round(lo, 3), "hi": round(hi, 3), "n": len(rewards[a][kind])})
    print(f"\nscale {args.scale}: {json.dumps(scale)}")
    print(f"GRPO steps trained: {json.dumps(trained_steps)}")
    print(f"{'policy':<15} {'held-out atomic':>16} {'held-out composed':>18}")
    for row in rows:
        print(f"{row['policy']:<15} {row['atomic']:>16.3f} {row['composed']:>18.3f}")
    print(f"\n{'paired difference':<30} {'kind':<9} {'mean':>7}  95% interval")
    for d in diffs:
        print(f"{d['diff']:<30} {d['kind']:<9} {d['mean']:>+7.3f}  [{d['lo']:+.3f}, {d['hi']:+.3f}]")
    print(json.dumps({"benchmark": "transfer", "scale": args.scale, "config": scale,
                      "sft_data": warm.data, "sft_loss": [warm.losses[0], warm.losses[-1]]
                      if warm.losses else None, "means": rows, "paired": diffs, "grpo": trained_steps,
                      "seconds": {k: round(v, 1) for k, v in seconds.items()},
                      "out": str(out)}))


if __name__ == "__main__":
    main()
