"""Rollout throughput: HFPolicy against a plain ``model.generate`` loop, side by side in one run,
and steady-state decode against this machine's roofline, measured in the same run.

Workloads (every policy, same weights, same dtype, same sampling; alternated, best of
``--repeats`` each after a warm-up). HFPolicy runs on the model itself, as synchronous full
fine-tuning samples, and on a rollout copy with its projections and head packed into panels
for our kernel (``agent_rl.accel``, ``pack_weights``; what ``train.run`` samples with
whenever rollouts run on a copy: LoRA merged, ``max_policy_lag`` > 0, ``rollout.dtype``):

    grpo      4 prompts x 8 samples (a group shares its prompt), T = 1, completions of
              varied length ending at the end-of-turn token (at most --max-new-tokens)
    records   Records-v0 tool episodes (multi-turn: search / fetch calls, then an answer)
    relay     Relay-v0 episodes (two sessions: a note across a context compression)

The ``model.generate`` side is a Policy too (``GeneratePolicy``: left-padded chat-template
prompts, ``do_sample`` at the same temperature and top-p, stopping at the same tokens), so
the episode workloads run through the same ``envs.runner.run_episodes``. Tokens/s counts
every generated token up to and including the stop token. HFPolicy also returns each
token's log-prob; ``model.generate`` returns only ids.

Steady-state decode at batch 1, 8 and 32: HFPolicy with its stop tokens disabled (every row
decodes N tokens), the time per decode step from (t(N2) - t(N1)) / (N2 - N1), against

    roofline step = max(weight bytes / bandwidth, decode FLOPs / matmul peak)

(each for HFPolicy on the model and on a packed rollout copy), with the bandwidth measured
by copying a 512 MiB tensor into an already allocated one (read + write bytes / time) and the matmul peak by a 2048^3 matmul in the model's dtype;
decode FLOPs = 2 * batch * (parameters, the tied output head counted once more).

    python benchmarks/rollout_throughput.py                       # SmolLM2-135M, float32
    python benchmarks/rollout_throughput.py --dtype bfloat16      # both sides in bf16
    python benchmarks/rollout_throughput.py --model tiny --quick  # a smoke run

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from limits import copy_bandwidth, matmul_peak

import envs
from agent_rl.policies.hf import HFPolicy, chat_prompts
from agent_rl.policies.models import load_model, rollout_copy
from agent_rl.policies.render import stop_token_ids
from agent_rl.run.devices import as_dtype
from envs.runner import Completion, Sampling, run_episodes

QUESTIONS = [
    "What is 12 + 30?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "How many days are in a leap year?",
    "Explain what a tool call is in one sentence.",
    "What is the capital of France?",
    "Give me a synonym for 'quick'.",
    "Summarise: the search found record r-17 with value 3.25.",
]


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "system", "content": "You are a concise assistant."},
         {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for i in range(n)
    ]


class GeneratePolicy:
    """A plain ``model.generate`` loop as an ``envs.runner.Policy``: the baseline."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 32):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stops = sorted(stop_token_ids(tokenizer))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        self.prompt_memo: dict = {}  # for count_tokens (render.conversation_ids)

    count_tokens = HFPolicy.count_tokens  # context budgets counted as HFPolicy counts them

    @torch.inference_mode()
    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]:
        ids, rows, completions, base = chat_prompts(self.tokenizer, batch, sampling, 0)
        torch.manual_seed(base % 2**63)
        greedy = sampling.temperature == 0
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            L = max(len(ids[b]) for b in chunk)
            input_ids = torch.tensor([[self.pad] * (L - len(ids[b])) + ids[b] for b in chunk])  # [B, L]
            mask = torch.tensor([[0] * (L - len(ids[b])) + [1] * len(ids[b]) for b in chunk])  # [B, L]
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p, top_k=None,
                eos_token_id=self.stops, pad_token_id=self.pad)[:, L:]  # [B, N]
            for b, row in zip(chunk, out.tolist(), strict=True):
                n = next((k + 1 for k, t in enumerate(row) if t in self.stops), len(row))
                completions[b] = Completion(
                    self.tokenizer.decode(row[:n], skip_special_tokens=True), row[:n],
                    finish_reason="stop" if row[n - 1] in self.stops else "length",
                    prompt_tokens=len(ids[b]))
        return [completions[b] for b in range(len(batch))]


class Counting:
    """Wraps a policy and counts the tokens it generates."""

    def __init__(self, policy: Any):
        self.policy, self.tokens = policy, 0
        self.count_tokens = policy.count_tokens

    def generate(self, batch, sampling):
        out = self.policy.generate(batch, sampling)
        self.tokens += sum(len(c.token_ids) for c in out)
        return out


def workloads(args) -> dict[str, Callable[[Any], None]]:
    """name -> run(policy): one pass of the workload through ``policy``."""
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    group = [c for c in prompts(4) for _ in range(8)]

    def episodes(env_id: str, n_tasks: int, max_new: int, temperature: float):
        tasks = envs.make(env_id).unwrapped.task_pool(n_tasks, seed=args.seed)
        s = Sampling(temperature=temperature, max_new_tokens=max_new, seed=args.seed,
                     max_prompt_tokens=1536)
        return lambda policy: run_episodes(env_id, tasks, policy, s, samples_per_task=8,
                                           num_envs=len(tasks) * 8, seed=args.seed)

    tasks = 1 if args.quick else 4
    return {"grpo": lambda policy: policy.generate(group, sampling),
            "records": episodes("agent_rl/Records-v0", tasks, 48, 1.0),
            "relay": episodes("agent_rl/Relay-v0", tasks, 32, 0.7)}


def timed(run: Callable[[Any], None], policy: Any) -> tuple[int, float]:
    counting = Counting(policy)
    start = time.perf_counter()
    run(counting)
    return counting.tokens, time.perf_counter() - start


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_step_s(policy: HFPolicy, batch: int, n1: int, n2: int, repeats: int) -> float:
    """Seconds per steady-state decode step of ``batch`` rows (stops disabled), best of repeats."""
    convs = prompts(batch)
    stops, policy.stop_ids = policy.stop_ids, frozenset()  # every row decodes max_new_tokens
    try:
        def run(n: int) -> float:
            return min(_seconds(lambda: policy.generate(convs, Sampling(max_new_tokens=n, seed=1)))
                       for _ in range(repeats))
        run(2)
        return (run(n2) - run(n1)) / (n2 - n1)
    finally:
        policy.stop_ids = stops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | a local HF folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights both sides run in")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="grpo workload completions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="timed passes each (best is kept)")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    args = ap.parse_args()

    dtype = as_dtype(args.dtype)
    model, tokenizer = load_model(args.model)
    model = model.to(dtype).eval().requires_grad_(False)
    # HFPolicy on the model itself (synchronous full fine-tuning samples the trained model)
    # and on a packed rollout copy (what train.run samples with when rollouts run on a copy:
    # LoRA merged, max_policy_lag > 0, rollout.dtype)
    policies = {"HFPolicy": HFPolicy(model, tokenizer),
                "HFPolicy packed copy": HFPolicy(rollout_copy(model, dtype), tokenizer, pack_weights=True),
                "model.generate": GeneratePolicy(model, tokenizer)}
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype,
                              "threads": torch.get_num_threads(), "quick": args.quick,
                              "packed_layers": len(policies["HFPolicy packed copy"].packed)}

    for name, run in workloads(args).items():
        for policy in policies.values():  # warm-up
            run(policy)
        best = {label: (0, float("inf")) for label in policies}
        for _ in range(args.repeats):  # alternated
            for label, policy in policies.items():
                tokens, seconds = timed(run, policy)
                if seconds < best[label][1]:
                    best[label] = (tokens, seconds)
        if not all(tokens for tokens, _ in best.values()):
            raise SystemExit(f"{name}: a policy generated no tokens ({best}); prompts over "
                             "max_prompt_tokens are not generated for")
        tps = {label: tokens / seconds for label, (tokens, seconds) in best.items()}
        base = tps["model.generate"]
        result[name] = {"hfpolicy_tok_s": round(tps["HFPolicy"], 1),
                        "packed_tok_s": round(tps["HFPolicy packed copy"], 1),
                        "generate_tok_s": round(base, 1),
                        "hfpolicy_tokens": best["HFPolicy"][0],
                        "packed_tokens": best["HFPolicy packed copy"][0],
                        "generate_tokens": best["model.generate"][0],
                        "ratio": round(tps["HFPolicy"] / base, 3),
                        "packed_ratio": round(tps["HFPolicy packed copy"] / base, 3)}
        print(f"{name:<8} HFPolicy {tps['HFPolicy']:7.1f} tok/s ({result[name]['ratio']:.2f}x)   "
              f"packed copy {tps['HFPolicy packed copy']:7.1f} tok/s ({result[name]['packed_ratio']:.2f}x)   "
              f"model.generate {base:7.1f} tok/s", flush=True)

    bandwidth, peak = copy_bandwidth() / 1e9, matmul_peak("cpu", dtype) / 1e9
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flops_per_row = 2 * (params + (head.numel() if tied else 0))
    result["machine"] = {"bandwidth_gb_s": round(bandwidth, 1), "matmul_gflop_s": round(peak, 1),
                         "weight_mb": round(weight_bytes / 1e6, 1)}
    n1, n2 = (4, 24) if args.quick else (16, 48)
    for batch in (1, 8, 32):
        bound = max(weight_bytes / (bandwidth * 1e9), batch * flops_per_row / (peak * 1e9))
        for key, label in (("decode", "HFPolicy"), ("decode_packed", "HFPolicy packed copy")):
            step = decode_step_s(policies[label], batch, n1, n2, args.repeats)
            result[f"{key}_b{batch}"] = {"step_ms": round(step * 1e3, 4), "roofline_ms": round(bound * 1e3, 4),
                                         "of_roofline": round(bound / step, 4),
                                         "tok_s": round(batch / step, 1)}
            print(f"decode batch {batch:>2}, {label:<20}: {step * 1e3:7.2f} ms/step, roofline "
                  f"{bound * 1e3:6.2f} ms ({bound / step:.0%}), {batch / step:7.1f} tok/s", flush=True)
    print(f"machine: copy bandwidth {bandwidth:.1f} GB/s, {args.dtype} matmul {peak:.0f} GFLOP/s, "
          f"weights {weight_bytes / 1e6:.0f} MB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
