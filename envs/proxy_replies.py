"""The policy's completion -> an OpenAI reply: a ``chat.completion`` body or the chunks of a
streamed one (``envs.agent_proxy``).

**Token pieces.** ``token_pieces`` decodes the sampled ids incrementally, as vLLM's
detokenizer does: the piece of token k is the text ``decode(ids[p:k+1])`` adds to
``decode(ids[p:r])``, where r is the end of the last token that completed a character and p
the one before (a few tokens back, so the cost is linear, and a tokenizer that drops a
leading space decodes both sides alike). A token that ends inside a multi-byte character
(an emoji's bytes) adds ``""``; the token that completes it adds the whole character. For a
byte-level BPE tokenizer the pieces join to ``decode(ids)`` exactly.

**Stop sequences.** ``sampled_reply`` cuts a completion at the first of the request's
``stop`` strings: the first token k whose piece completes an occurrence (the earliest
occurrence when several end in it). The agent is sent the text before the stop string
(OpenAI excludes it). The call is recorded with ids and log-probs ``[:k+1]``, the token that
completes the stop string included (it was sampled and the agent's next prompt follows it),
and as text ``decode(ids[:k+1])``: the returned text, the stop string, and whatever else that
last token carried. Its finish reason is ``"stop"``. The tokens sampled after it are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from envs.runner import Completion
from envs.tools import HermesParser, ToolCall

_PARSER = HermesParser()

Decode = Callable[[Sequence[int]], str]  # ids -> text, special tokens skipped


def token_pieces(decode: Decode, ids: Sequence[int]) -> list[str]:
    """The text each of ``ids`` adds to their decoding, one piece per id (module docstring)."""
    pieces: list[str] = []
    prefix = read = 0
    for k in range(len(ids)):
        before, now = decode(ids[prefix:read]), decode(ids[prefix:k + 1])
        if now.endswith("\ufffd") or not now.startswith(before):
            pieces.append("")  # inside a character: it comes with the token that completes it
            continue
        pieces.append(now[len(before):])
        prefix, read = read, k + 1
    if pieces and read < len(ids):  # the ids end inside a character: its bytes as decoded
        before, now = decode(ids[prefix:read]), decode(ids[prefix:])
        pieces[-1] = now[len(before):] if now.startswith(before) else now
    return pieces


@dataclass(frozen=True)
class Sampled:
    """A completion as the agent gets it. ``completion``: as recorded (cut at a stop string);
    ``text``: what the agent is sent; ``pieces``: ``text`` one piece per sampled token (one
    piece, the whole text, where the ids cannot be decoded)."""

    completion: Completion
    text: str
    pieces: list[str]


def sampled_reply(completion: Completion, stop: Sequence[str], decode: Decode | None) -> Sampled:
    """``completion`` cut at the first of the ``stop`` strings (module docstring); ``decode``
    (the policy's tokenizer) is needed for that."""
    ids = completion.token_ids
    pieces = token_pieces(decode, ids) if decode is not None and ids else []
    whole = Sampled(completion, completion.text,
                    pieces if "".join(pieces) == completion.text else [completion.text])
    if not stop:
        return whole
    if decode is None or not ids:
        raise ValueError("a stop string needs the policy's tokenizer and sampled ids to cut")
    text, longest = "", max(map(len, stop))
    for k, piece in enumerate(pieces):
        start = max(len(text) - longest + 1, 0)  # where an occurrence ending in this piece starts
        text += piece
        found = [at for at in (text.find(s, start) for s in stop) if at >= 0]
        if found:
            kept = list(ids[:k + 1])
            cut = replace(completion, text=decode(kept), token_ids=kept,
                          logprobs=list(completion.logprobs[:k + 1]), finish_reason="stop")
            return Sampled(cut, text[:min(found)], _clip(pieces[:k + 1], min(found)))
    return whole


def _clip(pieces: Sequence[str], n: int) -> list[str]:
    """``pieces`` holding only the first ``n`` characters of their text (as many pieces)."""
    out, used = [], 0
    for piece in pieces:
        out.append(piece[:max(n - used, 0)])
        used += len(piece)
    return out


def reply_message(text: str, parse_tools: bool, call: int) -> tuple[dict[str, Any], str | None]:
    """The OpenAI assistant message for the policy's ``text`` and its tool-call finish reason
    (``"tool_calls"`` when it calls tools, else None). Tool calls that do not parse stay in
    the content, where the agent can see them."""
    parsed = [c for c in _PARSER.parse(text) if isinstance(c, ToolCall)] if parse_tools else []
    if not parsed:
        return {"role": "assistant", "content": text}, None
    content = _PARSER.pattern.sub("", text).strip()
    calls = [{"id": f"call_{call}_{k}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
             for k, c in enumerate(parsed)]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


def finish_reason(completion: Completion, tool_finish: str | None) -> str:
    if tool_finish is not None:
        return tool_finish
    return "length" if completion.finish_reason == "length" else "stop"


def _usage(completion: Completion) -> dict[str, int]:
    prompt = completion.prompt_tokens or len(completion.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt + len(completion.token_ids)}


def completion_body(head: dict[str, Any], message: dict[str, Any], finish: str,
                    completion: Completion, extra: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` body. ``head``: its ``id``, ``created`` and ``model``; ``extra``:
    top-level keys beyond OpenAI's (``agent_rl``)."""
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": _usage(completion), **extra}


def stream_chunks(head: dict[str, Any], message: dict[str, Any], pieces: Sequence[str],
                  finish: str, completion: Completion, include_usage: bool,
                  extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed reply, as OpenAI streams: the role; the content, one delta
    per sampled token that adds to it (``split_like``); each tool call as a delta with its
    ``index``, ``id``, ``type`` and name (arguments ``""``), then one with its arguments; the
    finish reason with ``extra``; the usage, when asked for."""
    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                             "logprobs": None}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": d}) for d in split_like(message.get("content") or "", pieces)]
    for k, call in enumerate(message.get("tool_calls") or []):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        chunks.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))
        chunks.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": arguments}}]}))
    chunks.append({**chunk({}, finish), **extra})
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [],
                       "usage": _usage(completion)})
    return chunks


def split_like(content: str, pieces: Sequence[str]) -> list[str]:
    """``content`` as deltas cut where ``pieces`` (the text each sampled token added) cut the
    text it comes from: each character is matched, in order, to the next equal character of
    the pieces. The deltas always join to ``content``; a character matched nowhere goes, with
    the rest, into the last delta. Empty deltas are left out."""
    deltas, i = [], 0
    for piece in pieces:
        start = i
        for char in piece:
            if i < len(content) and content[i] == char:
                i += 1
        deltas.append(content[start:i])
    deltas.append(content[i:])
    return [d for d in deltas if d]
