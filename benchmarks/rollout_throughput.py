"""Rollout throughput: HFPolicy.generate vs plain ``model.generate``, same prompts, same model.

Both sample with the same temperature / top-p / max_new_tokens from the same left-padded
chat-template prompts, in the same batches. Tokens/s counts generated tokens up to and
including the end-of-turn token (what a rollout keeps). HFPolicy also returns each token's
log-prob; ``model.generate`` here returns only the ids.

    python benchmarks/rollout_throughput.py                 # SmolLM2-135M-Instruct (GGUF)
    python benchmarks/rollout_throughput.py --model tiny --prompts 64
"""

from __future__ import annotations

import argparse
import time

import torch

from agent_rl.models import load_model
from agent_rl.policy import HFPolicy
from agent_rl.render import chat_ids, stop_token_ids
from envs.runner import Sampling

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


def run_policy(policy: HFPolicy, convs, sampling: Sampling) -> tuple[int, float]:
    start = time.perf_counter()
    out = policy.generate(convs, sampling)
    return sum(len(c.token_ids) for c in out), time.perf_counter() - start


def run_hf_generate(model, tokenizer, convs, sampling: Sampling, batch_size: int) -> tuple[int, float]:
    stops = sorted(stop_token_ids(tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    torch.manual_seed(sampling.seed or 0)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(convs), batch_size):
        ids = [chat_ids(tokenizer, c, add_generation_prompt=True) for c in convs[i:i + batch_size]]
        L = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])  # [B, L]
        mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])  # [B, L]
        greedy = sampling.temperature == 0
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p, top_k=None,
                eos_token_id=stops, pad_token_id=pad,
            )[:, L:]  # [B, N]
        for row in out.tolist():
            n = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            tokens += n
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | a local HF folder")
    ap.add_argument("--prompts", type=int, default=16, help="number of conversations")
    ap.add_argument("--batch-size", type=int, default=8, help="conversations per forward batch")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs each (after one warm-up)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model)
    policy = HFPolicy(model, tokenizer, device=args.device, batch_size=args.batch_size)
    convs = prompts(args.prompts)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)

    def hf(convs_, sampling_):
        return run_hf_generate(policy.model, tokenizer, convs_, sampling_, args.batch_size)

    def ours(convs_, sampling_):
        return run_policy(policy, convs_, sampling_)

    runners = {"HFPolicy.generate": ours, "model.generate": hf}
    for run in runners.values():  # warm-up
        run(convs[: args.batch_size], Sampling(max_new_tokens=4, seed=0))
    results = {}
    for name, run in runners.items():
        tokens = seconds = 0.0
        for _ in range(args.repeats):
            n, s = run(convs, sampling)
            tokens, seconds = tokens + n, seconds + s
        results[name] = (tokens, seconds)

    print(f"model={args.model} device={args.device} prompts={args.prompts} "
          f"batch_size={args.batch_size} max_new_tokens={args.max_new_tokens} "
          f"temperature={args.temperature} top_p={args.top_p} threads={torch.get_num_threads()}")
    print(f"{'backend':<20}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for name, (tokens, seconds) in results.items():
        print(f"{name:<20}{int(tokens):>10}{seconds:>10.2f}{tokens / seconds:>12.1f}")
    ours_tps = results["HFPolicy.generate"][0] / results["HFPolicy.generate"][1]
    hf_tps = results["model.generate"][0] / results["model.generate"][1]
    print(f"HFPolicy / model.generate: {ours_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
