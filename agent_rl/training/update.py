"""One GRPO optimizer step over a batch of training sequences (``policy_update``), and the
pieces that score the trained tokens (``trained_token_logits``, ``trained_logprobs``), which
the SFT warm start shares.

    sequences [S] -> shared rows (``render.share_prefixes``) -> packed micro-batches
    (``render.pack``, ``micro_batches``) -> per micro-batch: forward over the rows, the
    vocabulary projection at the N predicting positions only ([N, V]), log-probs [N],
    behaviour correction, the clipped loss laid out per sequence ([B, G]: ``to_sequences``),
    backward scaled by the micro-batch's share of the global batch -> one optimizer step ->
    ``kl/update`` on one micro-batch (``update_kl``)

The loss and its math: ``grpo.py``. On the CPU (one process) the passes run inside the
accelerator (``agent_rl.accel``), entered through ``accel.step`` alone and a no-op anywhere
else; what it yields (``fast``) is passed, unopened, to the functions that score the tokens.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter

import torch
import torch.utils.checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from agent_rl import accel
from agent_rl.policies.hf import scoring_temperature
from agent_rl.policies.logprobs import picked_logprobs, picked_logprobs_and_entropy
from agent_rl.policies.render import (
    ROW_TOKENS,
    Rendered,
    SharedRow,
    micro_batches,
    pack,
    padded_tokens,
    share_prefixes,
)
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.devices import as_dtype, autocast, to_device
from agent_rl.run.distributed import Backend
from agent_rl.run.sizing import HALF_ACTIVATIONS, cpu_micro_batch_tokens
from agent_rl.training.grpo import KL_ESTIMATORS, behaviour_correction, policy_loss
from agent_rl.training.rollout import TrainSequence
from agent_rl.training.shared import device_batch

# how a decoder layer recomputes its activations in backward (``recompute_layers``)
RECOMPUTE = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def policy_update(backend: Backend, reference, sequences: list[TrainSequence],
                  contract: ExperimentContract, pad_id: int, prox: dict[int, torch.Tensor],
                  micro_tokens: int | None = None) -> dict[str, float]:
    """One optimizer step over all sequences, in micro-batches whose losses add up exactly to
    the loss of the whole batch under the chosen aggregation. Sequences that begin alike (a
    group's shared prompt) are computed once (``render.share_prefixes``), the shared rows are
    packed side by side (``render.pack``: almost no padding), and the vocabulary projection
    runs only where a trained token is predicted.

    Every rank holds the whole batch (``gather_batch``) and takes micro-batches rank,
    rank + world_size, ...; each is scaled by its share of the GLOBAL batch (trained tokens
    under ``token_mean``, sequences otherwise), so the backend's summed gradient is the
    one-process gradient. A rank with fewer micro-batches than the first one pads with a real
    one times 0.0 (every rank runs as many backward passes: ZeRO's collectives). The metrics
    are summed over the ranks.

    ``prox`` holds, per micro-batch, the trainer's log-probs before the first update on this
    batch: filled by the first pass, which also measures them against the rollout's
    (``rollout/logprob_diff_*``), reused by later passes (``grpo.behaviour_correction``)."""
    if not sequences:
        return {"loss/policy": 0.0, "tokens": 0, "optim/grad_norm": 0.0, "optim/nonfinite": 0.0,
                "optim/skipped": 1.0}
    started = time.perf_counter()  # the passes', the optimizer's and update_kl's seconds each
    backend.model.train()
    backend.zero_grad()
    rendered = [q.rendered for q in sequences]
    total_tokens = sum(int(r.loss_mask.sum()) for r in rendered)
    micro_tokens = micro_tokens or cpu_micro_batch_tokens(contract.optim.micro_batch_tokens)
    micro = micro_batches(pack(share_prefixes(rendered), min(micro_tokens, ROW_TOKENS)), micro_tokens)
    loss_sum, sums = forward_backward(backend, reference, sequences, micro, contract, pad_id,
                                      prox, micro_tokens, total_tokens)
    if backend.world_size > 1:
        loss_sum, sums = sum_over_ranks(backend.all_gather_object((loss_sum, dict(sums))))
    # clipped to optim.grad_clip; a non-finite loss or gradient skips the step (counted: the
    # guards decide when to stop) and leaves weights and optimizer state alone
    computed, recomputed = sums.pop("layer_tokens/computed", 0), sums.pop("layer_tokens/recomputed", 0)
    sums["train/recomputed_frac"] = recomputed / max(computed, 1)  # of decoder-layer work
    sums["train/forward_backward_seconds"] = time.perf_counter() - started  # this rank's
    started = time.perf_counter()
    stepped = backend.step()
    grad_norm, finite = stepped.grad_norm, stepped.stepped and math.isfinite(loss_sum)
    sums["train/optimizer_seconds"] = time.perf_counter() - started
    if finite:
        started = time.perf_counter()
        sums["kl/update"] = measured_kl(backend, micro, rendered, pad_id, contract, prox)
        sums["train/kl_seconds"] = time.perf_counter() - started
    return {**dict(sums), "loss/policy": loss_sum, "tokens": total_tokens,
            "optim/grad_norm": grad_norm, "optim/nonfinite": 0.0 if finite else 1.0,
            "optim/skipped": 0.0 if finite else 1.0}


def forward_backward(backend: Backend, reference, sequences: list[TrainSequence],
                     micro: list[list[list[SharedRow]]], contract: ExperimentContract,
                     pad_id: int, prox: dict[int, torch.Tensor], micro_tokens: int,
                     total_tokens: int) -> tuple[float, Counter]:
    """This rank's forward and backward passes over its micro-batches (``policy_update``),
    inside the CPU accelerator (``accel.step``; None off the CPU): the loss summed over them,
    each scaled by its share of the global batch, and the metrics summed the same way."""
    model, dtype = backend.module, contract.model.dtype
    device = next(model.parameters()).device
    rendered = [q.rendered for q in sequences]
    mine = list(range(backend.rank, len(micro), backend.world_size))  # this rank's share
    passes = -(-len(micro) // backend.world_size)  # every rank's count, padding included
    layers = len(checkpointing_layers(model))  # decoder layers, for train/recomputed_frac
    loss_sum, sums = 0.0, Counter()
    with accel.step(backend, model, as_dtype(dtype)) as fast:
        # what a bf16 token keeps for backward, of a float32 token's: less where its kernels run
        half = HALF_ACTIVATIONS if fast is None or fast.half_activations is None else fast.half_activations
        for k in range(passes):
            index = mine[k] if k < len(mine) else None  # None: padding, a zero-weight pass
            batch = device_batch(micro[0 if index is None else index], rendered, pad_id, device)
            # micro_tokens bounds the activations kept: a longer row (a shared prompt with its
            # samples is never split) recomputes a share of its layers in backward
            recomputed = recompute_layers(model, batch, micro_tokens,
                                          contract.optim.activation_checkpointing, dtype, half)
            if index is None:  # so every rank runs as many backward passes
                with autocast(device, dtype):
                    logits = trained_token_logits(model, batch, fast)  # [N, V]
                backend.backward(logits.sum() * 0.0)
                continue
            sums["layer_tokens/recomputed"] += recomputed * batch["input_ids"].numel()
            sums["layer_tokens/computed"] += layers * batch["input_ids"].numel()
            members = [k for rows in micro[index] for row in rows for k in row.members]
            loss, m = micro_batch_loss(model, reference, sequences, batch, members, index, prox,
                                       contract, fast)
            share = (m["tokens"] / max(total_tokens, 1) if contract.loss.aggregation == "token_mean"
                     else len(members) / len(sequences))
            backend.backward(loss * share)
            loss_sum += float(loss.detach()) * share
            add_metrics(sums, m, share)
    return loss_sum, sums


def micro_batch_loss(model, reference, sequences: list[TrainSequence],
                     batch: dict[str, torch.Tensor], members: list[int], index: int,
                     prox: dict[int, torch.Tensor], contract: ExperimentContract,
                     fast=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of micro-batch ``index`` (its sequences ``members``; ``batch`` its tensors)
    and its metrics: log-probs of the N trained tokens, the reference's under KL, the
    behaviour correction against the rollout's, and ``grpo.policy_loss`` over its B sequences
    laid out ``[B, G]``. Its first pass keeps its log-probs in ``prox``."""
    device, dtype = batch["input_ids"].device, contract.model.dtype
    temperature = scoring_temperature(contract.rollout.temperature)
    with autocast(device, dtype):
        logits = trained_token_logits(model, batch, fast)  # [N, V]
    logprobs, entropy = trained_logprobs(logits, batch["target"], temperature, fast)  # [N], [N]
    ref_logprobs = None
    if contract.loss.kl.beta > 0:
        with torch.no_grad(), autocast(device, dtype):
            ref_logprobs = picked_logprobs(reference_logits(model, reference, batch, fast),
                                           batch["target"], temperature)  # [N]
    first_pass = index not in prox
    if first_pass:
        prox[index] = logprobs.detach()  # [N] the trainer's numerics, before any update
    old, token_weights, mismatch = behaviour_correction(
        prox[index], batch["old_logprobs"], torch.ones_like(prox[index], dtype=torch.bool),
        contract.rollout.correction, contract.rollout.correction_cap)  # [N], [N] | None
    width = max(sequences[k].rendered.num_trained for k in members)  # G, from the host
    dense = to_sequences(batch, members, width)  # [N] -> [B, G]
    loss, m = policy_loss(
        dense(logprobs), dense(old),
        to_device(advantage_rows([sequences[k].advantage for k in members], width), device), dense(None),
        clip_low=contract.loss.clip_low, clip_high=contract.loss.clip_high,
        aggregation=contract.loss.aggregation,
        ratio=contract.loss.ratio, objective=contract.loss.objective,
        ref_logprobs=None if ref_logprobs is None else dense(ref_logprobs),
        beta=contract.loss.kl.beta, kl=contract.loss.kl.estimator,
        max_len=contract.rollout.max_response_tokens,
        weights=to_device(torch.tensor([sequences[k].weight for k in members]), device),
        entropy=dense(entropy),
        token_weights=None if token_weights is None else dense(token_weights))
    if first_pass:
        m.update(mismatch)
    else:
        m.update({k: v for k, v in mismatch.items() if k == "rollout/capped_frac"})
    return loss, m


def add_metrics(sums: Counter, m: dict[str, float], share: float) -> None:
    """One micro-batch's metrics ``m`` into the step's ``sums``: weighted by its ``share`` of
    the global batch; maxima and minima combine as such (the token count is the caller's)."""
    for key, value in m.items():
        if key == "rollout/logprob_diff_max":
            sums[key] = max(sums.get(key, 0.0), value)
        elif key not in ("tokens", "ratio/min", "ratio/max"):
            sums[key] += value * share
    sums["ratio/min"] = min(sums.get("ratio/min", math.inf), m["ratio/min"])
    sums["ratio/max"] = max(sums.get("ratio/max", -math.inf), m["ratio/max"])


def measured_kl(backend: Backend, micro: list[list[list[SharedRow]]], rendered: list[Rendered],
                pad_id: int, contract: ExperimentContract, prox: dict[int, torch.Tensor]) -> float:
    """``kl/update`` after a taken step: every rank runs the forward (ZeRO-3 gathers weights
    collectively) on a micro-batch rank 0 trained (``kl_micro_batch``), so rank 0 holds its
    pre-update log-probs, and its value is everyone's. Collective."""
    model, dtype = backend.module, contract.model.dtype
    index = kl_micro_batch(micro, rendered, backend.world_size)
    temperature = scoring_temperature(contract.rollout.temperature)
    with accel.step(backend, model, as_dtype(dtype)) as fast:  # prox's numerics
        kl = update_kl(model, micro[index], rendered, pad_id, temperature, prox.get(index), dtype, fast)
    return backend.all_gather_object(kl)[0]


def sum_over_ranks(parts: list[tuple[float, dict[str, float]]]) -> tuple[float, dict[str, float]]:
    """Every rank's (loss, metric sums) of one step as one: sums add (each rank's are already
    weighted by its global share); maxima and minima combine as such."""
    total, out = 0.0, {}
    for loss, sums in parts:
        total += loss
        for key, value in sums.items():
            if key in ("rollout/logprob_diff_max", "ratio/max"):
                out[key] = max(out.get(key, -math.inf), value)
            elif key == "ratio/min":
                out[key] = min(out.get(key, math.inf), value)
            else:
                out[key] = out.get(key, 0.0) + value
    return total, out


@torch.no_grad()
def update_kl(model, bins: list[list[SharedRow]], rendered: list[Rendered], pad_id: int,
              temperature: float, old: torch.Tensor | None, dtype: str = "float32", fast=None) -> float:
    """How far the update moved the policy on (a micro-batch of) its own batch: the k3
    estimate of KL(pi_old || pi_new) averaged over trained tokens, k3 = exp(d) - 1 - d,
    d = new - old (the tokens are the old policy's samples: ``grpo`` module docstring), where
    ``old`` are the trainer's own log-probs of these tokens before the first update on the
    batch (``prox``), not the rollout's: a rollout/trainer mismatch
    (``rollout/logprob_diff_*``) is no movement of the policy. One forward pass over one
    micro-batch (``kl_micro_batch``) keeps it cheap; its log-probs by prox's rule
    (``trained_logprobs`` with ``fast``, the accelerator's handle: our kernel on the CPU, where
    the tensor ops' float32 log-softmax took ~0.13 s a Relay-v0 step). (``kl/approx`` is measured before the
    step, so it is ~0 whenever the batch is fresh.) ``old`` None (a rank that did not train
    this micro-batch): the forward runs, for the collectives, and the result is NaN."""
    device = next(model.parameters()).device
    batch = device_batch(bins, rendered, pad_id, device)
    with autocast(device, dtype):
        logits = trained_token_logits(model, batch, fast)  # [N, V]
    if old is None:
        return math.nan
    new, _ = trained_logprobs(logits, batch["target"], temperature, fast)  # [N], as prox's
    return float(KL_ESTIMATORS["k3"](new - old).mean())


def kl_micro_batch(micro: list[list[list[SharedRow]]], rendered: list[Rendered], world_size: int) -> int:
    """Which micro-batch ``update_kl`` measures: of those rank 0 trains (0, world_size, ...),
    the one with the most trained tokens per token its forward computes (padding included),
    so the estimate averages the most tokens for the least work. (A Relay-v0 step's first
    micro-batch computed 1014 tokens for 55 trained ones; this picks one of 437 tokens with
    236 trained.) Ties go to the earliest."""
    def density(index: int) -> float:
        bins = micro[index]
        trained = sum(rendered[k].num_trained for rows in bins for row in rows for k in row.members)
        return trained / padded_tokens(bins)
    return max(range(0, len(micro), world_size), key=lambda i: (density(i), -i))



def trained_token_logits(model, batch: dict[str, torch.Tensor], fast=None) -> torch.Tensor:
    """The logits that predict every trained token of a shared batch: ``[N, V]``. The decoder
    runs over the rows; the vocabulary projection only at the predicting positions (the same
    hidden states and head as the model's own forward, whatever the transformers version).
    ``fast``: what ``accel.step`` yielded (None: the plain forward); its hooks add the decoder's
    keywords (blocked attention's plan) and project the head (its weight gradient deferred)."""
    R, T = batch["input_ids"].shape
    flat = batch["row"] * T + batch["predictor"]  # [N]
    extra = {} if fast is None else fast.decoder_kwargs(model, batch)
    hidden = model.get_decoder()(input_ids=batch["input_ids"],
                                 attention_mask=batch["attention_mask"],
                                 position_ids=batch["position_ids"],
                                 use_cache=False, **extra).last_hidden_state  # [R, T, H]
    picked = hidden.reshape(R * T, -1)[flat]  # [N, H]
    if fast is not None:
        return fast.head_logits(model, picked)  # [N, V]
    return model.get_output_embeddings()(picked)  # [N, V]


def trained_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     fast=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``policies.logprobs.picked_logprobs_and_entropy`` of the trained tokens' logits ``[N, V]``: ``[N]``
    log-probs and ``[N]`` entropies (without gradient); through ``fast`` (what ``accel.step``
    yielded) where its kernel takes them, the same values but for float summation order."""
    scored = None if fast is None else fast.token_logprobs(logits, targets, temperature)
    return scored if scored is not None else picked_logprobs_and_entropy(logits, targets, temperature)


def recompute_layers(model, batch: dict[str, torch.Tensor], micro_tokens: int,
                     every: bool = False, dtype: str = "float32", half: float = HALF_ACTIVATIONS) -> int:
    """Make the decoder layers of ``model`` recompute their activations in backward instead of
    keeping them (non-reentrant checkpointing through transformers' per-layer switch: the same
    values, so the same gradients), for all of them when ``every``, else for just enough that
    the activations kept are those of ``micro_tokens`` tokens in float32: for a micro-batch of
    T > B tokens (padding included), ceil(L (1 - B / T)) of its L layers, where B is
    ``micro_tokens`` in float32 and ``micro_tokens / half`` under half-precision autocast
    (``dtype``), whose tokens keep less (``half``: ``HALF_ACTIVATIONS``, or the share the CPU
    accelerator's handle reports where its kernels run). Returns how many."""
    layers = checkpointing_layers(model)
    tokens = batch["input_ids"].numel()
    budget = micro_tokens if as_dtype(dtype) == torch.float32 else micro_tokens / half
    count = len(layers) if every else math.ceil(len(layers) * max(0.0, 1.0 - budget / tokens))
    for i, layer in enumerate(layers):
        layer._gradient_checkpointing_func = RECOMPUTE
        layer.gradient_checkpointing = i < count
    return count


def checkpointing_layers(model) -> list[GradientCheckpointingLayer]:
    """The decoder layers of ``model`` that can recompute in backward (transformers')."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def to_sequences(batch: dict[str, torch.Tensor], members: list[int], width: int):
    """A function laying per-token values ``[N]`` out per sequence: ``[B, G]`` for the B
    ``members``, G = ``width`` (the most trained tokens of one: ``Rendered.num_trained``,
    known on the host); ``None`` gives the mask. Each token's place among the members is
    looked up on the device (``member_index``): nothing is read back to the host."""
    seq = to_device(member_index(members), batch["seq"].device)[batch["seq"]]  # [N]
    shape = (len(members), width)

    def dense(values: torch.Tensor | None) -> torch.Tensor:
        if values is None:
            values = torch.ones(len(seq), device=seq.device)
        return torch.zeros(shape, dtype=values.dtype, device=seq.device).index_put((seq, batch["rank"]), values)

    return dense


def advantage_rows(advantages: list[float | torch.Tensor], width: int) -> torch.Tensor:
    """The B sequences' advantages for ``grpo.policy_loss``: ``[B]`` when each is one float;
    ``[B, G]`` laid out as ``to_sequences`` lays tokens (G = ``width``, zero padding) when
    some carry one per trained token (``TrainSequence.advantage``, a turn-level credit)."""
    if not any(isinstance(a, torch.Tensor) for a in advantages):
        return torch.tensor(advantages)  # [B]
    rows = torch.zeros(len(advantages), width)  # [B, G]
    for row, a in zip(rows, advantages, strict=True):
        if isinstance(a, torch.Tensor):
            row[:len(a)] = a
        else:
            row.fill_(a)
    return rows


def member_index(members: list[int]) -> torch.Tensor:
    """The lookup from a sequence's index (into the step's batch) to its place in ``members``:
    ``[max(members) + 1]``, -1 where not a member."""
    lookup = torch.full((max(members) + 1,), -1, dtype=torch.long)
    lookup[members] = torch.arange(len(members))
    return lookup


def reference_logits(model, reference, batch, fast=None) -> torch.Tensor:
    """The fixed reference's logits at the trained tokens of a shared batch: ``[N, V]``."""
    if reference == "adapter-disabled":
        with model.disable_adapter():
            return trained_token_logits(model, batch, fast)
    return trained_token_logits(reference, batch, fast)
