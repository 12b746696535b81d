"""Policy backends. ``HFPolicy``: transformers on CPU or one GPU, sampling with its own loop.

Why our own loop rather than ``model.generate``: the rollout must report, for every sampled
token, the log-prob the trainer will later recompute for the same token, with the same
function (``agent_rl.policies.logprobs.token_logprobs``) and the same temperature, so that the PPO ratio
is exactly 1 (up to float noise, ~1e-6 in float32) on the first update after a rollout.

The loop, per batch of up to ``batch_size`` conversations:

    prompt_b   = chat template(messages_b, add_generation_prompt=True)   left-padded to [U, L]
                 (U unique prompts: identical ones are prefilled once, the cache then
                 copied to each of their rows)
    positions  = cumsum(attention_mask) - 1  (padding does not shift positions)
    step s:    logits_s = model(last token, KV cache)[:, -1]                         [B, V]
               logp_s   = log_softmax(logits_s / T')      T' = scoring_temperature(T)  [B, V]
               x_s      = first token with cumsum(exp(logp_s), top-p truncated) > u_bs * total
                          (inverse-CDF sampling, u_bs uniform); argmax when T == 0
               the row's log-prob: logp_s[x_s], the trainer's rule (``logprobs.picked_logprobs``)
    stop:      a row stops after sampling EOS / ``<|im_end|>`` (kept in its token ids) or
               after ``max_new_tokens`` tokens (finish_reason "length"); a stopped row leaves
               the batch (and the KV cache), so the last long reply does not drag the rest

Random streams: row b of a ``generate`` call draws its uniforms u_b (one per step, on the
CPU) from a generator seeded with ``envs.runner.stream_seed(sampling.seed,
*sampling.stream(b))`` (its index b unless ``sampling.streams`` names it; the runner names
each job's call), so rows never share random numbers, and a row's draws depend neither on
the other rows, nor on how the batch is cut into chunks, nor on the device. A prompt longer
than ``sampling.max_prompt_tokens`` is not generated for: its completion is empty with finish
reason ``prompt_too_long`` (the env ends the episode truncated). Every completion carries ``policy_revision``: the trainer bumps ``revision``
after each optimizer step.

What transfers between rollout and trainer is one rule, ``scoring_temperature``: the policy
being optimised is softmax(logits / T) for the sampling temperature T; greedy decoding
(T == 0) has no such distribution, so its tokens are scored at T' = 1.0 (the model's own
distribution). Reported log-probs ignore top-p truncation (they are log-probs under the full
softmax(logits / T'), as the trainer computes them), as vLLM's are.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from agent_rl import accel
from agent_rl.policies import decode
from agent_rl.policies.logprobs import scaled_log_softmax, token_logprobs
from agent_rl.policies.models import named_weights_for_push
from agent_rl.policies.render import conversation_ids, stop_token_ids
from agent_rl.run.devices import as_dtype, autocast
from envs.core import PROMPT_TOO_LONG
from envs.runner import Completion, Sampling, stream_seed


def scoring_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at, for a given sampling temperature.

    Rollout and trainer both call this: T for T > 0, 1.0 for greedy (T == 0).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return float(temperature) if temperature > 0 else 1.0


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left- or right-padded ``[B, T]`` mask: 0 at each row's first token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]


def sequence_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob of every token given the ones before it, one forward pass: ``[B, T]``.

    input_ids ``[B, T]``; attention_mask ``[B, T]`` (padding) or ``[B, 1, T, T]`` (packed
    rows, see ``agent_rl.policies.render.packed_attention_mask``); ``temperature`` is the *sampling*
    temperature (mapped by ``scoring_temperature``). Position 0 of each row is 0.0. Runs with
    gradients unless the caller disables them: the trainer uses this for the new log-probs.
    """
    if position_ids is None and attention_mask is not None and attention_mask.dim() == 2:
        position_ids = positions_from_mask(attention_mask)  # [B, T]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits  # [B, T, V]
    return token_logprobs(logits, input_ids, scoring_temperature(temperature))  # [B, T]


def _sample_step(logits: torch.Tensor, sampling: Sampling,
                 uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits ``[B, V]`` and its log-prob: ``([B], [B])``.

    One log-softmax serves both: log-probs under softmax(logits / T') (``grpo``'s rule, T' =
    ``scoring_temperature(T)``), and, for T > 0 (where T' = T), the sampling distribution
    ``exp`` of it, top-p truncated. Row b takes the first token whose cumulative probability
    exceeds ``uniforms[b]`` times the total (inverse-CDF sampling: one uniform per row and
    step, no per-row kernel); T == 0 takes the argmax. On the CPU without top-p, our kernel
    does the same in one pass per row (``accel.sample_tokens``)."""
    if (sampling.temperature > 0 and sampling.top_p >= 1.0 and logits.device.type == "cpu"
            and accel.load_kernels()):
        return accel.sample_tokens(logits, uniforms, sampling.temperature)
    logp = scaled_log_softmax(logits, scoring_temperature(sampling.temperature))  # [B, V]
    if sampling.temperature == 0:
        token = logits.argmax(-1)  # [B]
    else:
        probs = logp.exp()  # [B, V]
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
            before = sorted_probs.cumsum(-1) - sorted_probs  # [B, V] mass of the better tokens
            sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # [B, V]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # [B, V]
        cdf = probs.cumsum(-1)  # [B, V]
        target = (uniforms * cdf[:, -1]).unsqueeze(-1)  # [B, 1] in [0, total)
        # right=True: the first entry strictly above the target, so a zero-probability token
        # (equal to its predecessor's cdf) is never taken
        token = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)  # [B], [B]


def step_to_host(token: torch.Tensor, logp: torch.Tensor) -> tuple[list[int], list[float]]:
    """A decode step's sampled tokens ``[A]`` and their log-probs ``[A]`` as Python numbers,
    read in one device-to-host copy (on a GPU, the step's one synchronisation: which rows stop
    is then decided on the host). Exact: token ids and float32 / bf16 log-probs are float64
    numbers, so the values equal ``token.tolist()`` and ``logp.tolist()``."""
    ids, lps = torch.stack([token.to(torch.float64), logp.to(torch.float64)]).tolist()
    return [int(t) for t in ids], lps


def row_uniforms(sampling: Sampling, base: int, rows: Sequence[int]) -> torch.Tensor | None:
    """The uniforms rows ``rows`` of a batch sample with: ``[R, max_new_tokens]`` on the CPU,
    row b's drawn from ``stream_seed(base, *sampling.stream(b))`` (so the same on any device
    and whatever else shares the batch); None for greedy decoding."""
    if sampling.temperature == 0:
        return None
    return torch.stack([
        torch.rand(max(sampling.max_new_tokens, 1),
                   generator=torch.Generator().manual_seed(stream_seed(base, *sampling.stream(b))))
        for b in rows])  # [R, S]


def chat_prompts(tokenizer: Any, batch: Sequence[list[dict[str, Any]]], sampling: Sampling,
                 revision: int, max_len: int | None = None, memo: dict | None = None
                 ) -> tuple[list[list[int]], list[int], dict[int, Completion], int]:
    """What every policy backend does first: check ``sampling``, render each conversation with
    the chat template (generation header included; earlier sampled turns as the token ids
    sampled: ``render.conversation_ids``), and split off the prompts over
    ``sampling.max_prompt_tokens`` (or ``max_len``, an engine's own limit), which get an empty
    ``PROMPT_TOO_LONG`` completion. Returns (prompts, rows to generate for, those completions,
    the base seed: ``sampling.seed``, or a fresh random one when unseeded)."""
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise ValueError(f"invalid sampling {sampling}: need temperature >= 0, 0 < top_p <= 1")
    sampling.check_batch(len(batch))
    base = sampling.seed if sampling.seed is not None else secrets.randbits(62)
    prompts = [conversation_ids(tokenizer, messages, memo) for messages in batch]
    limit = sampling.max_prompt_tokens
    fits = [(limit is None or len(p) <= limit) and (max_len is None or len(p) < max_len)
            for p in prompts]
    too_long = {b: Completion("", finish_reason=PROMPT_TOO_LONG, prompt_tokens=len(prompts[b]),
                              policy_revision=revision, prompt_ids=list(prompts[b]))
                for b, ok in enumerate(fits) if not ok}
    return prompts, [b for b, ok in enumerate(fits) if ok], too_long, base


class HFPolicy:
    """A transformers causal LM as a ``envs.runner.Policy``. The model is moved to ``device``;
    ``compute_dtype`` bfloat16 runs its forward passes under autocast (weights stay as they are)."""

    def __init__(self, model: Any, tokenizer: Any, device: str | torch.device = "cpu",
                 batch_size: int = 32, compute_dtype: str | torch.dtype = "float32",
                 pack_weights: bool = False):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer)
        # transformers >= 5.x names the KV-cache argument `cache`; older versions `past_key_values`
        # (a peft wrapper's forward takes **kwargs: look at the wrapped model's signature)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.revision = 0  # optimizer steps applied to these weights; the trainer bumps it
        self.prompt_memo: dict = {}  # render.conversation_ids' layouts of generated turns
        # decode steps on a preallocated KV cache (agent_rl.policies.decode) where the model allows
        self.static_cache = decode.supports(model)
        # pack_weights: the model is a frozen rollout copy (never trained through this policy);
        # its projections and head are held in panels for our kernel (agent_rl.accel) where
        # they can, float32 compute only (autocast does not reach the packed products)
        self.packed = (decode.pack_linears(self.model)
                       if pack_weights and as_dtype(compute_dtype) == torch.float32 else {})
        self.pushed: set[str] = set()  # packed weights load_weights has written

    def count_tokens(self, messages: Sequence[dict[str, Any]]) -> int:
        """Prompt tokens of a conversation as this policy sees it (chat template, generation
        header included): what env context budgets are counted in."""
        return len(conversation_ids(self.tokenizer, messages, self.prompt_memo))

    # --- rollout -------------------------------------------------------------------------
    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]:
        """One completion per conversation, in order. Reproducible for a given ``sampling.seed``."""
        stale = [name for name, packed in self.packed.items() if packed.stale]
        if stale:
            raise RuntimeError(f"HFPolicy: {len(stale)} packed weights were released and not "
                               f"pushed since ({stale[0]}, ...): load_weights before sampling")
        prompts, rows, completions, base = chat_prompts(self.tokenizer, batch, sampling, self.revision,
                                                        memo=self.prompt_memo)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                uniforms = row_uniforms(sampling, base, chunk)  # [B, S] | None
                with autocast(self.device, self.compute_dtype):
                    outs = self._generate_chunk([prompts[b] for b in chunk], sampling, uniforms)
                completions.update(zip(chunk, outs, strict=True))
            return [completions[b] for b in range(len(batch))]
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def _generate_chunk(
        self, prompts: list[list[int]], sampling: Sampling, uniforms: torch.Tensor | None
    ) -> list[Completion]:
        # identical prompts (the G samples of one task) are prefilled once, then every row
        # continues from its prompt's keys and values
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        index = {p: u for u, p in enumerate(unique)}
        which = torch.tensor([index[tuple(p)] for p in prompts], device=self.device)  # [B]
        B, U, L = len(prompts), len(unique), max(len(p) for p in unique)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        if self.static_cache:  # prefixes the prompts share computed once (decode.prefill)
            cache, attention_mask, logits = decode.prefill(self.model, [list(p) for p in unique],
                                                           self._cache_arg)  # [U, L], [U, V]
        else:
            input_ids = torch.full((U, L), self.pad_id, dtype=torch.long)  # [U, L] left-padded
            attention_mask = torch.zeros(U, L, dtype=torch.long)  # [U, L]
            for u, p in enumerate(unique):
                input_ids[u, L - len(p):] = torch.tensor(p)
                attention_mask[u, L - len(p):] = 1
            attention_mask = attention_mask.to(self.device)
            cache = DynamicCache(config=self.model.config)
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask,
                                position_ids=positions_from_mask(attention_mask), use_cache=True,
                                logits_to_keep=1, **{self._cache_arg: cache}).logits[:, -1]  # [U, V]
        logits = logits.index_select(0, which)  # [B, V]
        static = decode.StaticDecoder(self.model, cache, which, sampling.max_new_tokens) if self.static_cache else None
        if static is None:
            cache.reorder_cache(which)  # [U, ...] -> [B, ...] in place
        attention_mask = attention_mask.index_select(0, which)  # [B, L]
        next_pos = positions_from_mask(attention_mask)[:, -1:]  # [B, 1]
        if uniforms is not None:
            uniforms = uniforms.to(self.device)  # [B, S]
        rows = list(range(B))  # rows still generating; finished ones leave
        index = torch.arange(B, device=self.device)  # [A] the same, on the device
        for step in range(sampling.max_new_tokens):
            token, logp = _sample_step(logits, sampling,
                                       None if uniforms is None else uniforms[index, step])  # [A], [A]
            ids, lps = step_to_host(token, logp)  # the step's one device -> host copy
            for b, t, lp in zip(rows, ids, lps, strict=True):
                tokens[b].append(t)
                logprobs[b].append(lp)
            going = [i for i, t in enumerate(ids) if t not in self.stop_ids]  # rows that go on
            if not going or step == sampling.max_new_tokens - 1:
                break
            if len(going) < len(rows):  # drop finished rows from the cache and the inputs
                keep = torch.tensor(going, device=self.device)  # [A']
                if static is None:
                    cache.batch_select_indices(keep)
                else:
                    static.select(keep)
                token, attention_mask, next_pos = token[keep], attention_mask[keep], next_pos[keep]
                rows, index = [rows[i] for i in going], index[keep]
            next_pos = next_pos + 1  # [A, 1]
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], -1)
            if static is not None:
                logits = static.step(token, next_pos, attention_mask)  # [A, V]
            else:
                logits = self.model(
                    input_ids=token.unsqueeze(-1), attention_mask=attention_mask, position_ids=next_pos,
                    use_cache=True, logits_to_keep=1, **{self._cache_arg: cache},
                ).logits[:, -1]  # [A, V]; the cache is updated in place

        return [
            Completion(
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                token_ids=ids,
                logprobs=lps,
                finish_reason="stop" if ids and ids[-1] in self.stop_ids else "length",
                prompt_tokens=len(prompt),
                policy_revision=self.revision,
                prompt_ids=list(prompt),
            )
            for ids, lps, prompt in zip(tokens, logprobs, prompts, strict=True)
        ]

    def weights_to_push(self, model: Any, within: Callable[[str], bool] | None = None,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """What this policy's weight copy of ``model`` is sent after an update, one tensor at a
        time (a consumer that loads as it goes never holds them all): the trainable tensors
        (the frozen ones never change); for a copy with a LoRA model's adapters merged in
        (``models.rollout_copy``), the merged weights of the layers the adapters change.
        ``within``: of the parameters whose names it accepts only (``named_weights_for_push``)."""
        if hasattr(model, "get_base_model") and not hasattr(self.model, "get_base_model"):
            changed = {name.partition(".lora_")[0] if ".lora_" in name else name.rpartition(".")[0]
                       for name, p in model.get_base_model().named_parameters() if p.requires_grad}
            return ((name, t) for name, t in named_weights_for_push(model, within=within)
                    if name.rpartition(".")[0] in changed)
        return ((name, p) for name, p in model.named_parameters()
                if p.requires_grad and (within is None or within(name)))

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], revision: int) -> None:
        """Copy pushed weights (names as in ``model.named_parameters()``) into this policy's
        model and take their revision. Every name must exist; shapes must match."""
        params = dict(self.model.named_parameters())
        tied = {id(p.tied): p for p in self.packed.values() if p.tied is not None}  # packed heads
        for name, tensor in named_tensors:
            if name in self.packed:  # a packed projection: reordered from the new weight
                self.packed[name].load(tensor)
                self.pushed.add(name)
                continue
            if name not in params:
                raise KeyError(f"load_weights: the rollout model has no parameter {name!r}")
            params[name].copy_(tensor)
            if id(params[name]) in tied:  # a packed head tied to these embeddings re-reads them
                tied[id(params[name])].reload()
        for packed in self.packed.values():
            if packed.stale and packed.tied is not None:  # released: re-read (nothing pushed)
                packed.reload()
        self.revision = revision

    def release_weights(self) -> int:
        """Free this rollout copy's packed weights that the next ``load_weights`` writes again
        (``decode.PackedLinear.release``): the memory a synchronous trainer needs while the
        copy is not sampling (538 MB of SmolLM2's merged LoRA copy). Those are the ones a push
        has written before (a push carries every weight that changes: one never pushed is
        frozen, and kept) and heads tied to a parameter (re-read at the next push); a panel
        tensor shared by several projections (``decode.PackedGroup``) only when all of them
        are. Sampling before the next push raises. Returns the bytes freed."""
        shared: dict[int, list[decode.PackedLinear]] = {}
        for packed in self.packed.values():
            if not packed.stale:
                shared.setdefault(packed.panels.untyped_storage().data_ptr(), []).append(packed)
        releasable = {id(p) for name, p in self.packed.items() if name in self.pushed or p.tied is not None}
        freed = 0
        for parts in shared.values():
            if all(id(p) in releasable for p in parts):
                freed += parts[0].panels.untyped_storage().nbytes()
                for p in parts:
                    p.release()
        return freed

    # --- training ------------------------------------------------------------------------
    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """``sequence_logprobs`` with this policy's model (inputs moved to its device): ``[B, T]``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        return sequence_logprobs(
            self.model, move(input_ids), move(attention_mask), move(position_ids), temperature
        )
