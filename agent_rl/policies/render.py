"""Render sessions into training sequences: token ids, loss mask, old log-probs, turn spans.

``render_session(tokenizer, session)`` walks the session's turns, keeping two token lists: the
template's own rendering of the messages so far (``template``) and the sequence we train on
(``ids``), which differs from it only inside policy-generated turns.

* A non-generated turn (system, user, tool, hand-written assistant): the template renders the
  messages up to and including it; the new rendering must start with the previous one (the
  template round-trips), and the extra tokens are appended as prompt (mask 0).
* A generated assistant turn (``token_ids`` set): the template renders the messages before it
  with ``add_generation_prompt=True``; the extra tokens (``<|im_start|>assistant\\n``) are
  prompt. Then the sampled ``token_ids`` are appended exactly as generated, never
  re-tokenized, with mask 1 and the turn's old log-probs. Then the end of turn: the template
  renders the turn itself, and its tokens from the last end-of-turn token (``<|im_end|>``) on
  are the closing (``<|im_end|>\\n`` in ChatML). If the policy sampled the end-of-turn token
  (finish_reason "stop") it is already in ``token_ids`` and trained; only the rest of the
  closing (the newline) is appended, as prompt. If the turn was cut by length, the whole
  closing is appended as prompt: nothing after the last sampled token is trained.

Checking against the template's own rendering rather than against ``ids`` keeps rendering
correct when the sampled tokens are not what the template would produce from the text: a
non-canonical tokenization ("4" + "2" for "42"), or a reply starting with whitespace, which
re-tokenized merges with the header's newline ("\n" + "  The" becomes "\n  " + "The").
We keep the sampled ids after the header exactly as the policy saw them. They must still
decode to the turn's text (ignoring special tokens and whitespace, or up to a difflib ratio
of 0.9), or the record is inconsistent and rendering fails.

Templates without tool support (SmolLM2's ChatML) render a ``tool`` turn like any role:
``<|im_start|>tool\\n{result}<|im_end|>\\n``; the tool schemas live in the system message.

``share_prefixes(rendered)`` lays sequences that begin with the same tokens out once:
``prefix + rest_1 + rest_2 + ...`` in one row, every rest attending to the shared prefix and to
itself, its position ids continuing from the prefix. The G samples of one task share their
whole prompt, so a group's root sessions cost one prompt instead of G. The prefix stops before
the first trained token of any member, so every trained token belongs to exactly one rest; its
log-prob is read from the hidden state before it (the prefix's last token for a rest's first
token). Exact: the same attention, positions and parameters as unpacked, and the gradient
through the shared prefix is the sum over its members.

``pack(rows)`` then puts shared rows side by side into bins (first-fit decreasing, at most
``ROW_TOKENS`` each), so a micro-batch carries almost no padding; ``collate_shared`` batches
bins, one per batch row, with ``packed_attention_mask`` blocking attention between the rows of
a bin (position ids restart with each row), and lists every trained token as (row,
predicting position, target, sequence); ``micro_batches`` groups consecutive bins into
micro-batches of at most so many tokens, padding included.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trajectories import Episode, Session, Turn

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")
ROW_TOKENS = 1024  # attention over a row costs its length squared: rows stay within this
TEXT_MATCH_RATIO = 0.9
MEMO_ENTRIES = 4096  # conversation_ids: generated-turn layouts a policy keeps

# Span kinds: "system" | "user" | "tool" | "assistant" (hand-written, untrained)
# | "prompt" (the generation header before a generated turn) | "generated" (sampled, trained)
# | "end" (template tokens closing a generated turn that the policy did not sample).


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the rendered sequence, from turn ``turn`` of the session."""

    kind: str
    start: int
    end: int
    turn: int


@dataclass
class Rendered:
    """One session as a training sequence."""

    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool, True exactly on policy-sampled tokens
    old_logprobs: torch.Tensor  # [T] float32, the rollout log-probs; 0.0 where the mask is 0
    spans: list[Span]
    session_id: str
    episode_id: str

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.loss_mask.sum())


# ---------------------------------------------------------------------------------------------
# Chat-template helpers (shared with the policy)
# ---------------------------------------------------------------------------------------------


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
    """The tokenizer's chat template applied to ``messages``, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template. Fix: set "
            "`tokenizer.chat_template` (e.g. agent_rl.policies.models.CHATML_TEMPLATE) or load an "
            "instruct/chat model whose tokenizer ships one"
        )
    if not messages:
        if add_generation_prompt:
            raise ValueError("a reply needs at least one message before it (chat templates "
                             "cannot render an empty conversation)")
        return []
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(i) for i in out]


def _template_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                  memo: dict[tuple[str, bool], list[int]] | None) -> list[int]:
    """``chat_ids`` through ``memo``: a dict one caller keeps over the sessions it renders (a
    group's samples share their prompt's messages, each rendered once; ~0.4 ms a template
    rendering with SmolLM2's tokenizer). The ids returned are shared: not to be mutated."""
    if memo is None:
        return chat_ids(tokenizer, messages, add_generation_prompt)
    key = (json.dumps(list(messages), sort_keys=True, default=str), add_generation_prompt)
    if key not in memo:
        memo[key] = chat_ids(tokenizer, messages, add_generation_prompt)
    return memo[key]


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn: ``<|im_end|>`` (ChatML) or the like, else EOS."""
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in END_OF_TURN_TOKENS:  # one lookup each (get_vocab() copies the vocabulary)
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != unk:
            return int(tid)
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither an end-of-turn token nor an EOS token")
    return int(tokenizer.eos_token_id)


def stop_token_ids(tokenizer: Any) -> frozenset[int]:
    """Sampled tokens that end a turn: the end-of-turn token and EOS."""
    ids = {end_of_turn_id(tokenizer)}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("\ufffd", ""))


def _check_text(tokenizer: Any, turn: Turn, where: str) -> None:
    decoded = _normalise(tokenizer.decode(turn.token_ids, skip_special_tokens=True))
    content = _normalise(turn.content)
    if decoded == content:
        return
    matcher = difflib.SequenceMatcher(None, decoded, content, autojunk=False)
    if matcher.real_quick_ratio() >= TEXT_MATCH_RATIO and matcher.ratio() >= TEXT_MATCH_RATIO:
        return
    raise ValueError(
        f"{where}: token_ids decode to {decoded[:80]!r} but the turn's content is "
        f"{content[:80]!r} (whitespace and special tokens ignored): the record's tokens and "
        "text disagree"
    )


def _check_extends(before: list[int], after: list[int], where: str, tokenizer: Any) -> None:
    if after[: len(before)] != before:
        at = next((k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))
        raise ValueError(
            f"{where}: the chat template does not round-trip: rendering one more message changed "
            f"earlier tokens (first difference at token {at}: "
            f"{tokenizer.decode(before[at:at + 8])!r} became {tokenizer.decode(after[at:at + 8])!r}). "
            "Training needs a template whose rendering of a conversation is a prefix of its "
            "rendering of any continuation"
        )


def render_session(tokenizer: Any, session: Session, require_logprobs: bool = True,
                   memo: dict[tuple[str, bool], list[int]] | None = None) -> Rendered:
    """One session as input ids, loss mask, old log-probs and spans (see the module docstring).

    ``require_logprobs=False`` accepts generated turns without log-probs (their old log-probs
    are 0.0; the caller must recompute them). ``memo``: a dict kept over the sessions of one
    batch, so that the template renders each message list once (``_template_ids``); the same
    result without it.
    """
    eot = end_of_turn_id(tokenizer)
    stops = stop_token_ids(tokenizer)
    vocab_size = len(tokenizer)
    ids: list[int] = []
    mask: list[bool] = []
    old: list[float] = []
    spans: list[Span] = []
    template: list[int] = []  # the template's rendering of the messages so far
    messages: list[dict[str, Any]] = []

    def add(kind: str, tokens: Sequence[int], turn: int, logprobs: Sequence[float] | None = None) -> None:
        if not tokens:
            return
        spans.append(Span(kind, len(ids), len(ids) + len(tokens), turn))
        ids.extend(tokens)
        mask.extend([logprobs is not None] * len(tokens))
        old.extend(logprobs if logprobs is not None else [0.0] * len(tokens))

    for i, turn in enumerate(session.turns):
        where = f"episode {session.episode_id}, session {session.session_id}, turn {i} ({turn.role})"
        message = turn.message()
        if not turn.generated:
            rendered = _template_ids(tokenizer, messages + [message], False, memo)
            _check_extends(template, rendered, where, tokenizer)
            add(turn.role, rendered[len(template):], i)
            template = rendered
            messages.append(message)
            continue

        sampled = list(turn.token_ids)
        if not sampled:
            raise ValueError(f"{where}: a generated turn with no token_ids")
        bad = [t for t in sampled if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} are outside the vocabulary ({vocab_size})")
        if turn.logprobs is None and require_logprobs:
            raise ValueError(f"{where}: a generated turn without logprobs cannot be trained on")
        _check_text(tokenizer, turn, where)

        header, closing, rendered = _generated_turn(tokenizer, template, messages, message,
                                                    sampled, where, eot, stops, memo)
        add("prompt", header, i)
        add("generated", sampled, i, turn.logprobs if turn.logprobs is not None else [0.0] * len(sampled))
        add("end", closing, i)
        template = rendered
        messages.append(message)

    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:2] == [bos, bos]:
        raise ValueError(
            f"session {session.session_id}: the rendering starts with two BOS tokens (the "
            "template writes one and the tokenizer adds another)"
        )
    return Rendered(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        old_logprobs=torch.tensor(old, dtype=torch.float32),
        spans=spans,
        session_id=session.session_id,
        episode_id=session.episode_id,
    )


def _generated_turn(tokenizer: Any, template: list[int], messages: list[dict[str, Any]],
                    message: dict[str, Any], sampled: list[int], where: str, eot: int,
                    stops: frozenset[int], memo: dict[tuple[str, bool], list[int]] | None = None,
                    ) -> tuple[list[int], list[int], list[int]]:
    """A generated assistant turn after ``messages`` (whose template rendering is
    ``template``): ``(header, closing, rendering)``. header: the template's tokens from
    ``template`` up to the generation header included (the messages in between and
    ``<|im_start|>assistant\\n``); closing: its tokens from the turn's last end-of-turn token
    on, without the end-of-turn token when the policy sampled it (it ends ``sampled``);
    rendering: the template's own rendering of ``messages + [message]`` (module docstring)."""
    prompt = _template_ids(tokenizer, messages, True, memo)
    _check_extends(template, prompt, where, tokenizer)
    rendered = _template_ids(tokenizer, messages + [message], False, memo)
    _check_extends(template, rendered, where, tokenizer)
    # The template's own tokens for this turn. Not compared with prompt + sampled: text
    # starting with whitespace can merge with the header's newline when re-tokenized.
    own = rendered[len(template):]
    if eot not in own:
        raise ValueError(
            f"{where}: the chat template closes an assistant turn without the end-of-turn "
            f"token {tokenizer.convert_ids_to_tokens(eot)!r}; cannot tell where it ends"
        )
    closing = own[len(own) - 1 - own[::-1].index(eot):]  # from the last end-of-turn token on
    if sampled and sampled[-1] in stops:  # the policy sampled its end of turn: trained above
        closing = closing[1:]
    return prompt[len(template):], closing, rendered


def conversation_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                     memo: dict[str, tuple[list[int], list[int]]] | None = None) -> list[int]:
    """The prompt a policy is shown for ``messages``, generation header included: the chat
    template's rendering, except that an assistant message carrying ``token_ids`` (what the
    policy sampled for it; environments' observations carry them) is laid out as
    ``render_session`` lays out a generated turn: header, exactly those ids, closing. Every
    later turn is then sampled in the very context the trainer scores it in. Re-rendering the
    text instead re-tokenizes it, and a non-canonical sampled tokenization ("4" + "2" for
    "42") shifts every later token's context (measured on warm-started Records-v0 rollouts
    at T=1: 7 of 177 generated turns saw another context than the trainer's, their log-probs
    up to 6 nats off).

    ``memo`` (a policy's own dict) keeps the layout through each generated turn, keyed by a
    hash of the messages up to it: a conversation that grows by a turn renders only what is
    new (at most ``MEMO_ENTRIES`` kept, the oldest dropped)."""
    plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in messages]
    sampled = [list(m.get("token_ids") or []) if m.get("role") == "assistant" else []
               for m in messages]
    if not any(sampled):
        return chat_ids(tokenizer, plain, add_generation_prompt=True)
    eot, stops = end_of_turn_id(tokenizer), stop_token_ids(tokenizer)
    ids: list[int] = []
    template: list[int] = []  # the template's rendering through the last generated turn
    digest, keys = hashlib.sha256(), {}
    for i, message in enumerate(messages):  # the key of every prefix ending in a generated turn
        digest.update(json.dumps(message, sort_keys=True, default=str).encode())
        if sampled[i]:
            keys[i] = digest.copy().hexdigest()
    done = max((i for i, key in keys.items() if memo is not None and key in memo), default=-1)
    if done >= 0:
        ids, template = (list(x) for x in memo[keys[done]])
    for i in keys:
        if i > done:
            header, closing, template = _generated_turn(
                tokenizer, template, plain[:i], plain[i], sampled[i],
                f"conversation message {i} (assistant)", eot, stops)
            ids += header + sampled[i] + closing
            if memo is not None:
                memo[keys[i]] = (list(ids), list(template))
                while len(memo) > MEMO_ENTRIES:
                    memo.pop(next(iter(memo)))
    prompt = chat_ids(tokenizer, plain, add_generation_prompt=True)
    _check_extends(template, prompt, "the conversation's generation prompt", tokenizer)
    return ids + prompt[len(template):]


def render_episode(tokenizer: Any, episode: Episode, require_logprobs: bool = True) -> list[Rendered]:
    """One ``Rendered`` per session, in ``episode.sessions`` order."""
    return [render_session(tokenizer, s, require_logprobs) for s in episode.sessions]


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def packed_attention_mask(seq_index: torch.Tensor, dtype: torch.dtype = torch.float32,
                          prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence only: ``[B, 1, T, T]`` from ``[T]``/``[B, T]``.

    Token i attends to token j iff j <= i and both belong to the same sequence (index >= 0),
    or j belongs to the sequence ``prefix[i]`` (``[T]``/``[B, T]`` long: the shared prefix
    token i also sees, -1 for none). Padding (index -1) attends only to itself, so no softmax
    row is empty. ``dtype=torch.bool`` gives True where attention is allowed; a float dtype
    gives an additive mask (0 allowed, the dtype's minimum blocked) as eager and SDPA
    attention both accept.
    """
    if seq_index.dim() == 1:
        seq_index = seq_index.unsqueeze(0)  # [1, T]
    T = seq_index.shape[-1]
    same = seq_index.unsqueeze(-1) == seq_index.unsqueeze(-2)  # [B, T, T]
    if prefix is not None:
        same = same | (prefix.reshape(-1, T, 1) == seq_index.unsqueeze(-2))  # [B, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=seq_index.device).tril()  # [T, T]
    real = (seq_index >= 0).unsqueeze(-2)  # [B, 1, T] the key is a real token
    eye = torch.eye(T, dtype=torch.bool, device=seq_index.device)  # [T, T]
    allowed = (same & causal & real) | eye  # [B, T, T]
    allowed = allowed.unsqueeze(1)  # [B, 1, T, T]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=seq_index.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


@dataclass
class SharedRow:
    """Sequences that begin alike, in one row: the shared prefix once, then each one's rest."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long: the prefix 0..P-1, every rest from P on
    seq_index: torch.Tensor  # [T] long: 0 for the prefix, m + 1 for member m's rest
    prefix: int  # P, the shared tokens
    members: list[int]  # indices into the list given to share_prefixes()
    starts: list[int]  # where member m's rest begins in the row

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def share_prefixes(rendered: Sequence[Rendered], min_shared: int = 16,
                   max_tokens: int = ROW_TOKENS) -> list[SharedRow]:
    """Group sequences by common token prefix (at least ``min_shared`` tokens, never reaching
    a trained token) and lay each group out as one ``SharedRow``; every sequence is in exactly
    one row (alone when nothing begins like it). Greedy over the sequences in token order: the
    next one joins the current group while that does not shrink the tokens the group saves
    and the row stays within ``max_tokens`` (attention over a row costs its length squared)."""
    def first_trained(r: Rendered) -> int:
        trained = r.loss_mask.nonzero()
        return int(trained[0]) if len(trained) else len(r)

    for r in rendered:
        if len(r) and bool(r.loss_mask[0]):
            raise ValueError(f"session {r.session_id}: its first token is trained; cannot pack it")
    order = sorted(range(len(rendered)), key=lambda k: rendered[k].input_ids.tolist())
    groups: list[tuple[list[int], int]] = []  # (members, shared length)
    for k in order:
        r = rendered[k]
        limit = max(1, min(first_trained(r), len(r) - 1)) if len(r) > 1 else len(r)
        if groups:
            members, p = groups[-1]
            first = rendered[members[0]]
            shared = min(_common_prefix(first.input_ids, r.input_ids), limit, p)
            length = shared + sum(len(rendered[m]) - shared for m in [*members, k])
            # join when the tokens saved by the group do not shrink: n * shared >= (n - 1) * p
            if (shared >= min_shared and len(members) * shared >= (len(members) - 1) * p
                    and length <= max_tokens):
                groups[-1] = (members + [k], shared)
                continue
        groups.append(([k], limit))
    rows = []
    for members, p in groups:
        seqs = [rendered[k] for k in members]
        rests = [r.input_ids[p:] for r in seqs]
        starts = list(np.cumsum([p] + [len(x) for x in rests[:-1]]))
        rows.append(SharedRow(
            input_ids=torch.cat([seqs[0].input_ids[:p], *rests]),
            position_ids=torch.cat([torch.arange(p), *[torch.arange(p, len(r)) for r in seqs]]),
            seq_index=torch.cat([torch.zeros(p, dtype=torch.long),
                                 *[torch.full((len(x),), m + 1) for m, x in enumerate(rests)]]),
            prefix=p, members=members, starts=[int(s) for s in starts]))
    return rows


def pack(rows: Sequence[SharedRow], max_tokens: int = ROW_TOKENS) -> list[list[SharedRow]]:
    """First-fit decreasing: shared rows into bins of at most ``max_tokens`` tokens, a longer
    row alone in its own. Each bin is one row of a batch (``collate_shared``). Deterministic:
    rows of equal length keep their order."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    bins: list[list[SharedRow]] = []
    room: list[int] = []
    for row in sorted(rows, key=len, reverse=True):  # sorted() is stable
        slot = next((j for j, free in enumerate(room) if free >= len(row)), None)
        if slot is None:
            bins.append([])
            room.append(max_tokens)
            slot = len(bins) - 1
        bins[slot].append(row)
        room[slot] -= len(row)
    return bins


def collate_shared(bins: Sequence[Sequence[SharedRow]], rendered: Sequence[Rendered], pad_id: int,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Right-pad bins of shared rows (``pack``) into a batch, one bin per batch row, and list
    every trained token of ``rendered`` (the list the rows were made from) once, in sequence
    order.

    Returns ``input_ids``, ``position_ids`` ``[R, T]``, ``attention_mask`` ``[R, 1, T, T]`` and,
    per trained token ``[N]``: ``row``, ``predictor`` (the row position whose logits predict
    it), ``target`` (its id), ``seq`` (its sequence, an index into ``rendered``), ``rank``
    (its place among its sequence's trained tokens) and ``old_logprobs``.
    """
    T = max(sum(map(len, b)) for b in bins)
    R = len(bins)
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)  # [R, T]
    position_ids = torch.zeros((R, T), dtype=torch.long)  # [R, T]
    seq_index = torch.full((R, T), -1, dtype=torch.long)  # [R, T] unique within a batch row
    prefix = torch.full((R, T), -1, dtype=torch.long)  # [R, T] the prefix each token sees
    tokens = {name: [] for name in ("row", "predictor", "target", "seq", "rank", "old_logprobs")}
    for i, rows in enumerate(bins):
        offset, ids = 0, 0  # where the shared row starts in the batch row; its first index
        for row in rows:
            n = len(row)
            input_ids[i, offset:offset + n], position_ids[i, offset:offset + n] = (
                row.input_ids, row.position_ids)
            seq_index[i, offset:offset + n] = row.seq_index + ids
            prefix[i, offset:offset + n] = ids  # the row's prefix is its sequence 0
            for k, start in zip(row.members, row.starts, strict=True):
                r = rendered[k]
                at = r.loss_mask.nonzero().flatten()  # [n_k] trained positions in the sequence
                where = offset + start + at - row.prefix  # [n_k] their places in the batch row
                tokens["row"].append(torch.full_like(at, i))
                tokens["predictor"].append(torch.where(at == row.prefix, offset + row.prefix - 1, where - 1))
                tokens["target"].append(r.input_ids[at])
                tokens["seq"].append(torch.full_like(at, k))
                tokens["rank"].append(torch.arange(len(at)))
                tokens["old_logprobs"].append(r.old_logprobs[at])
            offset, ids = offset + n, ids + len(row.members) + 1
    return {"input_ids": input_ids, "position_ids": position_ids,
            "attention_mask": packed_attention_mask(seq_index, dtype, prefix=prefix),
            **{name: torch.cat(parts) for name, parts in tokens.items()}}


def micro_batches(bins: list[list[SharedRow]], max_tokens: int) -> list[list[list[SharedRow]]]:
    """Consecutive bins (``pack``), as many per micro-batch as fit ``max_tokens`` once
    padded to the longest (>= 1)."""
    out: list[list[list[SharedRow]]] = []
    for b in bins:
        if out and padded_tokens([*out[-1], b]) <= max_tokens:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def bin_tokens(rows: Sequence[SharedRow]) -> int:
    """The tokens of one bin: its rows side by side."""
    return sum(map(len, rows))


def padded_tokens(bins: Sequence[Sequence[SharedRow]]) -> int:
    """The tokens one micro-batch of ``bins`` computes: each bin a batch row, padded to the
    longest."""
    return len(bins) * max(map(bin_tokens, bins))
