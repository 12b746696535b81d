"""Training throughput: achieved FLOP/s of the trainer's forward + backward against the matmul
peak measured in the same run (float32, and bf16 autocast), and the padding the trainer's
micro-batches carry, with and without packing, on a real multi-session batch.

The batch: one GRPO step of Relay-v0 (``--tasks`` tasks x 8 samples, two sessions per
episode) rolled out by the model itself, every group kept. One optimizer step of the trainer
(``agent_rl.training.update.policy_update``, full fine-tune, token-mean loss) is timed in each dtype,
best of ``--repeats`` after ``--warmup`` untimed ones, against the best of the matmul peaks
measured before every timed step and after the last (``matmul_peaks_gflop_s``: the
machine's speed drifts by half within minutes). FLOPs counted: 6 x (parameters outside the
embedding) x (tokens the decoder computes: each group's shared prompt once) + 6 x (head
parameters) x (trained tokens: the vocabulary projection runs only there); attention's own FLOPs are not counted, so that
fraction is a lower bound. Printed beside it: the fraction counting the attention
the masks need (12 x hidden size x layers FLOPs per allowed query x key pair, forward and
backward), and the fraction counting all the work done: attention's pairs as computed (the
trainer's blocked attention, ``accel.plan_blocks``: a few more than allowed; in bf16 the
pairs its kernel's tiles cover, ``kernel_pairs``) and the
forward work a row longer than ``optim.micro_batch_tokens`` recomputes in backward
(``update.recompute_layers``; its share of the layer work, ``train/recomputed_frac``, times
the forward's FLOPs). The pairs SDPA over whole rows would compute are printed too.

The step is ``policy_update`` whole: its micro-batches' forward and backward passes, the
optimizer step and ``update_kl``'s forward over one micro-batch (``kl/update``); the passes
alone (``train/forward_backward_seconds``) are set against the same FLOPs too
(``of_peak_forward_backward``).

Beside every timed step also the rate the machine sustains (``--sustain`` seconds of the same
products, before the step and after it), and each step's fraction of the mean of its two
(``of_sustained_paired``, their median ``of_sustained_median``): a step is seconds of work,
while each peak above is a tenth of a second that may catch the machine's best moment, and a
neighbour's load slows a step and the products beside it alike.

Padding, as fractions of the tokens computed, in micro-batches of at most 512 tokens
(``optim.micro_batch_tokens``' default) and of 2048: the trainer's packed micro-batches (each group's
shared prompt once, shared rows side by side, ``render.pack``) and, for comparison, the same
shared rows one per batch row, right-padded (what the trainer did before packing).

    python benchmarks/train_throughput.py                 # SmolLM2-135M-Instruct (GGUF)
    python benchmarks/train_throughput.py --model tiny    # a smoke run

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from limits import matmul_peak

import envs
from agent_rl.accel import allowed_pairs, plan_blocks
from agent_rl.policies.hf import HFPolicy
from agent_rl.policies.models import load_model
from agent_rl.policies.render import (
    ROW_TOKENS,
    bin_tokens,
    collate_shared,
    micro_batches,
    pack,
    padded_tokens,
    share_prefixes,
)
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.distributed import TorchBackend, adamw
from agent_rl.training.rollout import RolloutSettings, rollout_batch
from agent_rl.training.update import policy_update
from envs.runner import Sampling

ENV = "agent_rl/Relay-v0"
MICRO_TOKENS = (512, 2048)  # optim.micro_batch_tokens' default, and a larger one


def relay_batch(policy: HFPolicy, tasks: int, seed: int):
    specs = envs.make(ENV).unwrapped.task_pool(tasks, seed=seed)
    sampling = Sampling(temperature=0.7, max_new_tokens=32, seed=seed, max_prompt_tokens=1536)
    settings = RolloutSettings(ENV, group_size=8, sampling=sampling, dynamic_sampling=False,
                               truncation="keep")
    return rollout_batch(policy, policy.tokenizer, specs, settings, seed=seed)


def padding(rendered) -> dict[str, Any]:
    rows = share_prefixes(rendered)
    computed = sum(len(r) for r in rows)

    def padded(micro) -> int:
        return sum(map(padded_tokens, micro))

    out: dict[str, Any] = {"session_tokens": sum(len(r) for r in rendered), "shared_tokens": computed}
    for micro_tokens in MICRO_TOKENS:
        micro = micro_batches(pack(rows, min(micro_tokens, ROW_TOKENS)), micro_tokens)
        packed = padded(micro)
        # query x key pairs: those the masks allow (the work attention needs), those the
        # trainer's blocked attention computes (attention.plan_blocks; in float32), those its
        # bf16 kernel's products cover and those SDPA over whole rows would (each
        # micro-batch's rows padded to its longest, T^2 a row)
        masks = [collate_shared(m, rendered, 0, torch.bool)["attention_mask"] for m in micro]
        plans = [plan_blocks(m) for m in masks]
        out[f"attention_pairs_micro{micro_tokens}"] = {
            "allowed": sum(map(allowed_pairs, masks)),
            "blocked": sum(plan.pairs for plan in plans),
            "bf16_kernel": sum(map(kernel_pairs, plans)),
            "whole_rows": sum(len(m) * max(map(bin_tokens, m)) ** 2 for m in micro)}
        unpacked = padded(micro_batches([[r] for r in rows], micro_tokens))
        out[f"micro{micro_tokens}"] = {
            "packed_padded_tokens": packed, "packed_waste": round(1 - computed / packed, 4),
            "unpacked_padded_tokens": unpacked, "unpacked_waste": round(1 - computed / unpacked, 4)}
    return out


def kernel_pairs(plan) -> int:
    """About the query x key pairs the bf16 kernel's score products cover (``chunk_attention``
    in ``csrc/kernels.cpp``): a chunk's queries in tiles of 6, each tile's keys up to its
    longest extent (``BlockPlan.tables``) in whole vectors of 16."""
    chunks, _, _, extents = plan.tables
    total, at = 0, 0
    for _, _, queries, _, keys in chunks.tolist():
        ext = extents[at:at + queries].tolist()
        at += queries
        for i in range(0, queries, 6):
            total += len(ext[i:i + 6]) * min(-(-max(ext[i:i + 6]) // 16), -(-keys // 16)) * 16
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | a local HF folder")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first in each dtype (a process's first bf16 steps fault "
                         "~0.7 and ~0.2 million pages in, later ones ~0.02-0.03 million)")
    ap.add_argument("--sustain", type=float, default=5.0,
                    help="seconds of products for the sustained rate measured beside each step")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model)
    batch = relay_batch(HFPolicy(model, tokenizer), args.tasks, args.seed)
    rendered = [q.rendered for q in batch.sequences]
    result: dict[str, Any] = {"model": args.model, "sequences": len(rendered), **padding(rendered)}
    trained = sum(int(r.loss_mask.sum()) for r in rendered)
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    flops = 6 * body * result["shared_tokens"] + 6 * head * trained
    per_pair = 12 * model.config.hidden_size * model.config.num_hidden_layers  # forward + backward
    pairs = result["attention_pairs_micro512"]
    attention = per_pair * pairs["allowed"]
    computed = {"float32": per_pair * pairs["blocked"], "bfloat16": per_pair * pairs["bf16_kernel"]}
    result.update(trained_tokens=trained, flops_per_step=flops, attention_flops_per_step=attention,
                  attention_flops_computed_per_step=computed)

    for dtype in ("float32", "bfloat16"):
        contract = ExperimentContract.from_dict({"model": {"id": "tiny", "dtype": dtype}})
        backend = TorchBackend(model, adamw(list(model.parameters()), lr=1e-7, weight_decay=0.0))
        def step(backend=backend, contract=contract) -> dict[str, float]:  # a fresh prox each step
            return policy_update(backend, None, batch.sequences, contract,
                                 pad_id=tokenizer.pad_token_id or 0, prox={})

        steps, passes, peaks, sustained = [], [], [], []  # passes: forward + backward alone
        for _ in range(args.warmup):  # the first steps fault their memory in
            step()
        for k in range(args.repeats + 1):  # the last only measures
            # this machine's speed drifts within minutes: measured beside every step
            peaks.append(matmul_peak("cpu", getattr(torch, dtype)))
            sustained.append(matmul_peak("cpu", getattr(torch, dtype), seconds=args.sustain))
            if k == args.repeats:
                break
            start = time.perf_counter()
            update = step()
            steps.append(time.perf_counter() - start)
            passes.append(update["train/forward_backward_seconds"])
        seconds, fb_seconds = min(steps), min(passes)
        peak = max(peaks)  # the best the machine did during the run: the fractions err low
        # each step against the rate sustained just before and just after it
        paired = [flops / s / ((sustained[i] + sustained[i + 1]) / 2) for i, s in enumerate(steps)]
        median = statistics.median(paired)
        share = update["train/recomputed_frac"]
        recomputed = share * (2 * body * result["shared_tokens"] + computed[dtype] / 3)  # forward again
        work = flops + computed[dtype] + recomputed
        result[dtype] = {"step_s": round(seconds, 3), "achieved_gflop_s": round(flops / seconds / 1e9, 1),
                         "matmul_peak_gflop_s": round(peak / 1e9, 1),
                         "matmul_peaks_gflop_s": [round(p / 1e9, 1) for p in peaks],
                         "of_peak": round(flops / seconds / peak, 4),
                         "forward_backward_s": round(fb_seconds, 3),
                         "of_peak_forward_backward": round(flops / fb_seconds / peak, 4),
                         "steps_s": [round(x, 3) for x in steps],
                         "matmul_sustained_gflop_s": [round(p / 1e9, 1) for p in sustained],
                         "of_sustained_paired": [round(f, 4) for f in paired],
                         "of_sustained_median": round(median, 4),
                         "of_peak_with_attention": round((flops + attention) / seconds / peak, 4),
                         "recomputed_frac": round(share, 4),
                         "of_peak_all_work": round(work / seconds / peak, 4)}
        print(f"{dtype:<9} step {seconds:6.2f} s  {flops / seconds / 1e9:6.1f} GFLOP/s of "
              f"{peak / 1e9:6.1f} peak (best of {len(peaks)}, worst {min(peaks) / 1e9:.0f}) ({flops / seconds / peak:.0%}); counting attention "
              f"{(flops + attention) / seconds / peak:.0%}; {share:.0%} of the layer work "
              f"recomputed, counting that and attention as computed {work / seconds / peak:.0%}; "
              f"the forward and backward passes alone (without the optimizer step and update_kl's "
              f"forward) {fb_seconds:.2f} s, {flops / fb_seconds / peak:.0%}; "
              f"each step against the rate sustained beside it ({args.sustain:g} s of products before "
              f"and after): median {median:.0%} "
              f"({', '.join(f'{f:.0%}' for f in paired)})", flush=True)
    for micro_tokens in MICRO_TOKENS:
        p = result[f"micro{micro_tokens}"]
        print(f"padding, micro-batches of {micro_tokens}: {result['session_tokens']} session tokens, "
              f"{result['shared_tokens']} once prompts are shared; packed {p['packed_waste']:.1%} "
              f"({p['packed_padded_tokens']} computed), one shared row per batch row "
              f"{p['unpacked_waste']:.1%} ({p['unpacked_padded_tokens']})")
        a = result[f"attention_pairs_micro{micro_tokens}"]
        print(f"attention, micro-batches of {micro_tokens}: {a['allowed']} query x key pairs allowed, "
              f"{a['blocked']} computed blocked (float32), {a['bf16_kernel']} by the bf16 kernel, "
              f"{a['whole_rows']} over whole rows")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
