"""Our trainer against TRL's ``GRPOTrainer`` at identical configuration, runs alternating in one
invocation: ours/TRL for the rollout, the training and the whole step, and tokens per second.

The workload, the same on both sides: the same weights (the model saved once to a folder both
sides load), Arithmetic-v0's one-operation training tasks (its system and user messages through
the tokenizer's chat template), 4 prompts x 8 samples per step, at most 32 new tokens at T = 1.0
(top-p 1, no top-k), token-mean loss (TRL's ``dapo``: one process, one accumulation step),
clip 0.2 / 0.28, no KL term and no reference model, the environment's reward, advantages
normalised per group, AdamW at lr 1e-5, every group trained (our ``dynamic_sampling`` off: TRL
keeps zero-contrast groups), a full fine-tune or LoRA (rank 16, alpha 32, every linear layer).

Every run is a fresh process: TRL in ``.venv-trl`` (built by this script when missing: the CPU
torch wheel, ``trl==1.16.0``, this venv's transformers and peft, then this project, whose
environment scores TRL's completions), ours in this venv through ``agent_rl.training.train.run``. A run
takes one warm-up step, then ``--steps`` timed steps; runs alternate TRL, ours, TRL, ours, ...
(``--repeats`` pairs) and each side's figure is the median over its timed steps.

What is timed: TRL's rollout is ``_generate_and_score_completions`` (generation, reward,
advantages), its step from a callback's step begin to step end, its training the difference.
Ours are ``train.run``'s ``rollout/seconds``, ``train/seconds`` and ``step/seconds`` (the step
from waiting for its batch to its metrics, the store append and weight sync included). Tokens:
the completion tokens generated (TRL: its completion mask; ours: ``rollout/tokens_generated``).

    python benchmarks/vs_trl.py                      # SmolLM2-135M and the tiny Llama, full and LoRA
    python benchmarks/vs_trl.py --models tiny --steps 1 --repeats 1   # a smoke run

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".venv-trl"
TRL_VERSION = "1.16.0"
ENV = "agent_rl/Arithmetic-v0"
ENV_KWARGS = {"max_ops": 2, "max_operand": 12}  # ours trains on the one-operation split
PROMPTS, GROUP, MAX_NEW, TEMPERATURE, LR = 4, 8, 32, 1.0, 1e-5
LORA_RANK, LORA_ALPHA = 16, 32


def tasks(n: int, seed: int = 0) -> list:
    """``n`` one-operation tasks (the tasks our side's ``train`` split holds)."""
    import envs

    pool = envs.make(ENV, **ENV_KWARGS).unwrapped.task_pool(4 * n, seed=seed)
    return [t for t in pool if t.meta.length == 1][:n]


# ----------------------------------------------------------------------------- TRL's side


def trl_worker(model_dir: str, adapter: str, steps: int, seed: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import envs

    env = envs.make(ENV, **ENV_KWARGS).unwrapped
    pool = tasks(PROMPTS * (steps + 1), seed)
    by_id = {t.task_id: t for t in pool}
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": env.instructions},
                                          {"role": "user", "content": t.prompt}],
                               "task_id": t.task_id} for t in pool])

    def reward(completions, task_id, **_) -> list[float]:
        return [env.score(by_id[k], c[-1]["content"], None).total
                for c, k in zip(completions, task_id, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft_config = None
    if adapter == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    out = tempfile.mkdtemp(prefix="vs-trl-")
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=MAX_NEW, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=steps + 1, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=seed, shuffle_dataset=False,
        dataloader_pin_memory=False, disable_dropout=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, peft_config=peft_config)
    records: list[dict[str, float]] = []
    current: dict[str, float] = {}
    generate = trainer._generate_and_score_completions

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        current["rollout_s"] = current.get("rollout_s", 0.0) + time.perf_counter() - start
        current["tokens"] = current.get("tokens", 0) + int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - current.pop("start")
            records.append({"step_s": step_s, "rollout_s": current["rollout_s"],
                            "train_s": step_s - current["rollout_s"], "tokens": current["tokens"]})

    trainer.add_callback(StepTimer())
    trainer.train()
    return {"steps": records[1:]}  # the first is the warm-up


# ----------------------------------------------------------------------------- our side


def ours_worker(model_dir: str, adapter: str, steps: int, seed: int) -> dict[str, Any]:
    from agent_rl.run.contract import ExperimentContract
    from agent_rl.training.train import run

    run_dir = tempfile.mkdtemp(prefix="vs-ours-")
    contract = ExperimentContract.from_dict({
        "name": "vs-trl",
        "env": {"id": ENV, "split": "train", "kwargs": ENV_KWARGS, "pool_size": 256, "pool_seed": seed,
                "iid_fraction": 0.25},
        "eval": {"split": "holdout_iid", "n": 1, "every": 0, "seed": seed, "temperature": 0.0},
        "model": {"id": model_dir, "dtype": "float32", "device": "cpu", "adapter": adapter,
                  "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA},
        "rollout": {"backend": "hf", "group_size": GROUP, "tasks_per_step": PROMPTS,
                    "temperature": TEMPERATURE, "top_p": 1.0, "max_prompt_tokens": 256,
                    "max_response_tokens": MAX_NEW, "truncation": "keep", "dynamic_sampling": False},
        "advantage": {"std": "population", "scale": "group"},
        "loss": {"aggregation": "token_mean", "clip_low": 0.2, "clip_high": 0.28, "kl": {"beta": 0.0}},
        "optim": {"lr": LR, "weight_decay": 0.0, "grad_clip": 1.0, "updates_per_batch": 1,
                  "max_steps": steps + 1, "seed": seed},
        "checkpoint": {"every": 0, "keep": 1},
        "guards": {"min_entropy": 0.0, "max_truncated_frac": 1.5, "max_kl": 1e9},
        "run_dir": run_dir,
    })
    run(contract, progress=False)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step/seconds" in r]
    return {"steps": [{"step_s": r["step/seconds"], "rollout_s": r["rollout/seconds"],
                       "train_s": r["train/seconds"], "tokens": r["rollout/tokens_generated"]}
                      for r in rows[1:]]}  # the first is the warm-up


# ----------------------------------------------------------------------------- the driver


def trl_python() -> Path:
    """``.venv-trl``'s python, building the venv first when missing."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".agent-rl-installed"
    if stamp.is_file():
        return python
    import peft
    import transformers

    print(f"building {TRL_VENV} (trl=={TRL_VERSION}, transformers=={transformers.__version__})",
          flush=True)
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel first: no CUDA build
    subprocess.run([*pip, f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}",
                    f"peft=={peft.__version__}"], check=True)
    subprocess.run([*pip, "-e", str(ROOT)], check=True)
    stamp.touch()
    return python


def save_model(name: str, folder: Path) -> str:
    from agent_rl.policies.models import load_model

    model, tokenizer = load_model(name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_side(python: str, side: str, model_dir: str, adapter: str, steps: int, seed: int) -> list[dict]:
    spec = json.dumps({"side": side, "model_dir": model_dir, "adapter": adapter, "steps": steps,
                       "seed": seed})
    # a run is one process of its own: never a rank of a world the caller's environment names
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([python, __file__, "--worker", spec], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{side} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["steps"]


def summary(steps: list[dict]) -> dict[str, float]:
    med = {k: statistics.median(s[k] for s in steps) for k in ("step_s", "rollout_s", "train_s")}
    tokens = statistics.median(s["tokens"] for s in steps)
    return {**{k: round(v, 3) for k, v in med.items()}, "tokens": tokens,
            "rollout_tok_s": round(tokens / med["rollout_s"], 1),
            "step_tok_s": round(tokens / med["step_s"], 1), "n_steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,tiny", help="comma-separated: smollm2-135m, tiny")
    ap.add_argument("--adapters", default="none,lora", help="comma-separated: none (full fine-tune), lora")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating (TRL, ours) pairs of runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        worker = trl_worker if spec.pop("side") == "trl" else ours_worker
        print(json.dumps(worker(**spec)))
        return

    trl = str(trl_python())
    result: dict[str, Any] = {"trl": TRL_VERSION, "steps": args.steps, "repeats": args.repeats,
                              "workload": {"prompts": PROMPTS, "group": GROUP, "max_new_tokens": MAX_NEW,
                                           "temperature": TEMPERATURE}}
    with tempfile.TemporaryDirectory(prefix="vs-trl-models-") as tmp:
        for name in args.models.split(","):
            model_dir = save_model(name, Path(tmp) / name)
            for adapter in args.adapters.split(","):
                runs: dict[str, list[dict]] = {"trl": [], "ours": []}
                for k in range(args.repeats):
                    for side, python in (("trl", trl), ("ours", sys.executable)):
                        runs[side] += run_side(python, side, model_dir, adapter, args.steps, args.seed + k)
                        print(f"{name} {adapter:<4} {side:<4} run {k + 1}/{args.repeats}: "
                              f"{statistics.median(s['step_s'] for s in runs[side][-args.steps:]):.2f} s/step",
                              flush=True)
                trl_s, ours_s = summary(runs["trl"]), summary(runs["ours"])
                ratios = {f"{part}_ratio": round(ours_s[f"{part}_s"] / trl_s[f"{part}_s"], 3)
                          for part in ("rollout", "train", "step")}
                result[f"{name}/{adapter}"] = {"trl": trl_s, "ours": ours_s, **ratios}
    print(f"{'model/adapter':<20} {'rollout':>8} {'train':>8} {'step':>8}   (ours / TRL, lower is faster)")
    for key, row in result.items():
        if isinstance(row, dict) and "step_ratio" in row:
            print(f"{key:<20} {row['rollout_ratio']:>7.2f}x {row['train_ratio']:>7.2f}x "
                  f"{row['step_ratio']:>7.2f}x   TRL {row['trl']['step_s']:.2f} s/step, "
                  f"ours {row['ours']['step_s']:.2f} s/step")
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
