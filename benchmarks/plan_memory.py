"""The resource plan (``agent-rl plan``) against a CPU training run's measured memory.

Each case runs in a fresh process: everything the run imports is imported, the process's
resident memory read (the baseline), ``train.run`` trains a few steps, and the peak resident
memory (VmHWM) less the baseline is what the run added; the plan's total per rank for the same
contract beside it, and the error (plan - measured) / measured. On the CPU the resident memory
also holds what the plan leaves out (the environment, tokenizers, Python objects, the allocator's
free pages), so small models are dominated by it: SmolLM2 is the case that tests the parts.

    python benchmarks/plan_memory.py                  # every case (about 10 minutes)
    python benchmarks/plan_memory.py --cases tiny     # one case

The last line printed is one JSON object: case -> {plan_bytes, measured_bytes, error}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
SMALL = ["rollout.group_size=2", "rollout.tasks_per_step=2", "rollout.max_response_tokens=16",
         "eval.n=2", "optim.max_steps=2", "checkpoint.every=0", "guards.min_entropy=0.0",
         "guards.max_truncated_frac=1.5", "rollout.dynamic_sampling=false"]
CASES = {
    "tiny": (TINY, []),
    "tiny-reference": (TINY, ["loss.kl.beta=0.01", "reference={reference}"]),
    "smollm2-full": (TINY, ["model.id=smollm2-135m", "model.adapter=none", "name=smollm2-full",
                            *SMALL]),
    # rows of a prompt and its 4 samples of 64 tokens (~330 tokens) fill a 256-token micro-batch
    "smollm2-full-micro": (TINY, ["model.id=smollm2-135m", "model.adapter=none",
                                  "name=smollm2-full-micro", *SMALL, "rollout.group_size=4",
                                  "rollout.max_response_tokens=64",
                                  "optim.micro_batch_tokens=256"]),
}


def rss(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(config: str, overrides: list[str]) -> dict:
    """In this process: the baseline after imports, a run, the peak; the plan beside them."""
    import gc

    from agent_rl.run.contract import ExperimentContract
    from agent_rl.training import train
    from agent_rl.training.setup import contract_plan

    contract = ExperimentContract.from_yaml(config, overrides)
    plan, _ = contract_plan(contract, 1)
    gc.collect()
    baseline = rss("VmRSS")
    train.run(contract, progress=False)
    measured = rss("VmHWM") - baseline
    return {"plan_bytes": plan.total, "measured_bytes": measured,
            "error": round((plan.total - measured) / measured, 3),
            "parts": {p.name: p.device for p in plan.parts if p.device}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)  # config, overrides...: a child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1:])))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        reference = Path(scratch) / "reference-model"
        from agent_rl.policies.models import tiny_model

        model, tokenizer = tiny_model(seed=1)  # a frozen model of the tiny shape, other weights
        model.save_pretrained(reference)
        tokenizer.save_pretrained(reference)
        for name in args.cases:
            config, overrides = CASES[name]
            overrides = [o.format(reference=reference) for o in overrides]
            overrides.append(f"run_dir={Path(scratch) / name}")
            done = subprocess.run([sys.executable, __file__, "--one", str(config), *overrides],
                                  capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            r = results[name]
            print(f"{name:<16} plan {r['plan_bytes'] / 2**20:9.1f} MiB  measured "
                  f"{r['measured_bytes'] / 2**20:9.1f} MiB  error {r['error']:+.1%}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
