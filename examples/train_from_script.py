"""Train from a script: an ExperimentContract built in code, run by ``agent_rl.train``.

The tiny random Llama (``model.id: tiny``) on Records-v0 for three steps: it runs in seconds on
a CPU and shows the whole loop (rollout -> credit -> advantages -> loss -> step -> held-out
evaluation before and after). Swap in ``smollm2-135m`` and more steps for a real run.

    python examples/train_from_script.py [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile

import agent_rl
from agent_rl import ExperimentContract


def contract(run_dir: str) -> ExperimentContract:
    return ExperimentContract.from_dict({
        "name": "records-tiny",
        "env": {"id": "agent_rl/Records-v0", "pool_size": 64},
        "eval": {"split": "holdout", "n": 4, "every": 0},
        "model": {"id": "tiny", "adapter": "none"},
        # Records-v0's first prompt (instructions, tool schemas, task) is 1009-1092 tokens
        "rollout": {"group_size": 2, "tasks_per_step": 2, "max_prompt_tokens": 1536,
                    "max_response_tokens": 16, "truncation": "keep", "dynamic_sampling": False},
        "optim": {"lr": 1e-4, "max_steps": 3},
        "checkpoint": {"every": 0, "keep": 1},
        # a random model always hits the length limit; > 1 turns that guard off
        "guards": {"max_truncated_frac": 1.5},
        "run_dir": run_dir,
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    c = contract(args.run_dir or tempfile.mkdtemp(prefix="agent-rl-records-"))
    print(f"contract {c.contract_hash()[:12]}: {c.env.id}, model {c.model.id}, "
          f"{c.optim.max_steps} steps")
    result = agent_rl.train(c, progress=False)
    for step, loss in enumerate(result.losses, start=1):
        print(f"step {step}: loss/policy {loss:+.4f}")
    if result.stopped is not None:
        raise SystemExit(f"stopped by guard {result.stopped.rule}: {result.stopped.message}")
    print(f"held-out reward before {result.before['reward_mean']:.3f} "
          f"after {result.after['reward_mean']:.3f} "
          f"(paired diff {result.comparison['reward_diff']:+.3f} "
          f"[{result.comparison['lo']:+.3f}, {result.comparison['hi']:+.3f}], "
          f"n={result.comparison['n']})")
    print(f"trained {result.steps} steps; run dir {result.run_dir}")


if __name__ == "__main__":
    main()
