"""The policy's completion -> an OpenAI reply: a ``chat.completion`` body or the chunks of a
streamed one (``envs.agent_proxy``).
"""

from __future__ import annotations

import json
from typing import Any

from envs.runner import Completion
from envs.tools import HermesParser, ToolCall

_PARSER = HermesParser()


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


def completion_body(message: dict[str, Any], finish: str, completion: Completion, model: str,
                    call_id: str, created: int, extra: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` body; ``extra``: top-level keys beyond OpenAI's (``agent_rl``)."""
    return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": _usage(completion), **extra}


def stream_chunks(message: dict[str, Any], finish: str, completion: Completion, model: str,
                  call_id: str, created: int, include_usage: bool,
                  extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed reply: the role, the content, the tool calls, the finish
    reason with ``extra`` (and the usage when asked for)."""
    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"id": call_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": reason, "logprobs": None}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    if message.get("tool_calls"):
        chunks.append(chunk({"tool_calls": [{"index": k, **c}
                                            for k, c in enumerate(message["tool_calls"])]}))
    chunks.append({**chunk({}, finish), **extra})
    if include_usage:
        chunks.append({"id": call_id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [], "usage": _usage(completion)})
    return chunks

