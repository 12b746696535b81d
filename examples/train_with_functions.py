"""Train from a script with your own Python objects, no ``module:function`` strings: a reward
function, rows as a list of dicts, a credit assigner function and a ``peft.LoraConfig``.

    python examples/train_with_functions.py [--run-dir DIR] [--steps N]

The tiny random Llama (``model.id: tiny``) trains for two steps on 24 arithmetic rows: it runs
in seconds on a CPU. Swap in ``smollm2-135m`` (or a local Hugging Face folder) and more steps
for a real run. What the run directory records for each object (``agent_rl.train``):

    reward     env.kwargs.reward: __main__:near_miss   (its source is pinned in the hash)
    dataset    env.kwargs.path:   RUN/inputs/<sha256>.jsonl  (the rows, written once)
    assigner   credit.assigner:   __main__:final_full_others_half
    LoraConfig model.adapter: lora, model.lora_rank: 4, model.lora_alpha: 8

Functions defined in a script are not importable by name, so resuming this run means
passing them again: ``agent_rl.train(RUN/"contract.yaml", resume=True, reward=near_miss,
assigner=final_full_others_half)``. Put them in a module and they are plain
``module:function`` names that ``agent-rl train --resume`` finds by itself.
"""

from __future__ import annotations

import argparse
import re
import tempfile

from peft import LoraConfig

import agent_rl

ROWS = [{"prompt": f"What is {a} plus {b}? Reply with the number only.", "answer": str(a + b)}
        for a in range(1, 7) for b in range(1, 5)]


def near_miss(reply: str, task) -> float:
    """1 for the answer, 0.5 for one off, else 0 (``task.target`` is the row's answer)."""
    numbers = re.findall(r"-?\d+", reply)
    if not numbers:
        return 0.0
    miss = abs(int(numbers[-1]) - int(task.target))
    return 1.0 if miss == 0 else 0.5 if miss == 1 else 0.0


def final_full_others_half(episode) -> dict[str, float]:
    """The session that answered gets the episode's reward, every other session half of it."""
    final = episode.final_session.session_id
    reward = episode.reward.total
    return {s.session_id: reward if s.session_id == final else reward / 2
            for s in episode.sessions}


CONTRACT = {
    "name": "functions-tiny",
    # rows without composition metadata: hold out a quarter of them as unseen tasks
    "env": {"iid_fraction": 0.25, "pool_size": 24},
    "eval": {"split": "holdout_iid", "n": 4, "every": 0},
    "model": {"id": "tiny"},
    "rollout": {"group_size": 2, "tasks_per_step": 2, "max_response_tokens": 8,
                "truncation": "keep", "dynamic_sampling": False},
    "optim": {"lr": 1e-4},
    "checkpoint": {"every": 0, "keep": 1},
    "guards": {"max_truncated_frac": 1.5},  # a random model always hits the length limit
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="default: a new temporary folder")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="agent-rl-functions-")
    result = agent_rl.train(
        CONTRACT, reward=near_miss, dataset=ROWS, assigner=final_full_others_half,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                               task_type="CAUSAL_LM"),
        optim__max_steps=args.steps, run_dir=run_dir, progress=False)
    contract = agent_rl.read_contract(result.run_dir / "contract.yaml")
    print(f"reward {contract.env.kwargs['reward']}, assigner {contract.credit.assigner}, "
          f"lora r={contract.model.lora_rank} alpha={contract.model.lora_alpha}")
    print(f"rows {contract.env.kwargs['path']}")
    for step, loss in enumerate(result.losses, start=1):
        print(f"step {step}: loss/policy {loss:+.4f}")
    if result.stopped is not None:
        raise SystemExit(f"stopped by guard {result.stopped.rule}: {result.stopped.message}")
    print(f"held-out reward before {result.before['reward_mean']:.3f} "
          f"after {result.after['reward_mean']:.3f}")
    print(f"trained {result.steps} steps; run dir {result.run_dir}")


if __name__ == "__main__":
    main()
