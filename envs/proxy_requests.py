"""OpenAI chat-completion requests -> the messages the policy is shown (``envs.agent_proxy``).

``parse_request`` checks a ``/chat/completions`` body and returns a ``ChatRequest``; anything
the server cannot honour is a ``RequestError`` naming the field (``error.param`` of an
OpenAI-style 400). What the policy is shown, and what is refused, is described in
``envs.agent_proxy``'s docstring.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envs.tools import HermesParser
from trajectories.calls import StatedPlace

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PARSER = HermesParser()


class RequestError(Exception):
    """A request the server refuses: ``status``, an OpenAI ``code``, the field (``param``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class ToolChoice:
    """The request's ``tool_choice``. ``parse``: whether replies are parsed for tool calls
    (False for ``"none"`` or when no tools are given); ``required``: the reply must call a
    tool (``"required"``, or a named function); ``function``: the one function a named choice
    asks for. The policy samples freely either way: ``met`` says whether a reply complied."""

    parse: bool = False
    required: bool = False
    function: str | None = None

    def met(self, calls: Sequence[dict[str, Any]]) -> bool:
        """Whether a reply's OpenAI ``tool_calls`` satisfy this choice."""
        if not self.required:
            return True
        return bool(calls) and all(self.function in (None, c["function"]["name"]) for c in calls)

    def label(self) -> str:
        """How a required choice reads in a record: ``"required"`` or the named function."""
        return self.function or "required"


@dataclass(frozen=True)
class ChatRequest:
    """One validated ``/chat/completions`` request. ``shown``: the messages the policy is
    given (generated replies carrying ``token_ids``); ``recorded``: the same without them."""

    shown: list[dict[str, Any]]
    recorded: list[dict[str, Any]]
    tool_choice: ToolChoice
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    stated: StatedPlace | None


def _messages_key(messages: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(list(messages), sort_keys=True, default=str).encode()).hexdigest()


def reply_key(before: Sequence[dict[str, Any]], content: str,
               call_ids: Sequence[str]) -> tuple[str, str, tuple[str, ...]]:
    """What identifies a reply this server sent: the messages it followed, its visible content
    and its tool-call ids."""
    return _messages_key(before), content.strip(), tuple(call_ids)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI content parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{k}]: only text content parts are supported",
                                   f"{where}[{k}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _tool_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _written_calls(calls: Any, where: str) -> tuple[list[str], list[tuple[str, str, Any]]]:
    """An assistant message's ``tool_calls`` as (ids, [(id, name, arguments)])."""
    if calls is None:
        return [], []
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list", where)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{k}] must be {{'id', 'type': 'function', 'function': "
                               "{'name', 'arguments'}}", f"{where}[{k}]")
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass  # kept as the string the agent wrote
        out.append((str(call.get("id") or ""), fn["name"], arguments))
    return [c[0] for c in out], out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools``, checked: each ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}`` with a JSON-schema object as parameters."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                               f"{where}.function.name")
        if "description" in fn and not isinstance(fn["description"], str):
            raise RequestError(f"{where}.function.description must be a string",
                               f"{where}.function.description")
        params = fn.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise RequestError(f"{where}.function.parameters must be a JSON schema of type "
                               "object", f"{where}.function.parameters")
        try:
            json.dumps(fn, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{where}.function cannot be rendered as JSON: {exc}",
                               f"{where}.function") from None
    return tools


def chat_messages(messages: Any, tools: list[dict[str, Any]], replies: dict
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(shown, recorded): the request's messages as the policy is shown them (module
    docstring). ``replies`` maps ``reply_key`` to the (text, sampled ids) of a reply this
    server sent."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    names: dict[str, str] = {}  # tool-call id -> function name, for tool messages
    listed = _PARSER.format_instructions(tools) if tools else ""
    first_system = isinstance(messages[0], dict) and ROLES.get(messages[0].get("role")) == "system"
    recorded: list[dict[str, Any]] = [] if first_system or not listed else [
        {"role": "system", "content": listed}]
    shown: list[dict[str, Any]] = [dict(m) for m in recorded]
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", where)
        role = ROLES.get(message.get("role"))
        if role is None:
            raise RequestError(f"{where}.role {message.get('role')!r} is not one of "
                               f"{sorted(ROLES)}", f"{where}.role")
        content = _text(message.get("content"), f"{where}.content")
        if role == "assistant":
            ids, calls = _written_calls(message.get("tool_calls"), f"{where}.tool_calls")
            names.update((cid, name) for cid, name, _ in calls)
            sent = replies.get(reply_key(recorded, content, ids))
            if sent is not None:
                text, token_ids = sent
                recorded.append({"role": "assistant", "content": text})
                shown.append({"role": "assistant", "content": text, "token_ids": list(token_ids)})
                continue
            text = "\n".join([content] * bool(content) + [_tool_call_text(n, a) for _, n, a in calls])
            out = {"role": "assistant", "content": text}
        elif role == "tool":
            out = {"role": "tool", "content": content}
            name = message.get("name") or names.get(str(message.get("tool_call_id")))
            if isinstance(name, str) and name:
                out["name"] = name
        else:
            if i == 0 and role == "system" and listed:
                content = content + "\n\n" + listed
            out = {"role": role, "content": content}
        recorded.append(out)
        shown.append(dict(out))
    return shown, recorded


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n={n!r}: only one choice per request is served (n=1); send "
                           "several requests instead", "n")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: the trainer scores the policy's own "
                           "distribution", "logit_bias")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key):
            raise RequestError(f"{key} is not supported (only 0)", key)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format")
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise RequestError(f"{key} (the legacy function API) is not supported: use tools "
                               "and tool_choice", key)


MAX_STOP = 4


def stop_sequences(stop: Any) -> tuple[str, ...]:
    """The request's ``stop``: a string or a list of up to ``MAX_STOP`` non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of up to {MAX_STOP} "
                           f"non-empty strings, got {str(stop)[:100]!r}", "stop")
    return tuple(dict.fromkeys(stops))


def tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """The request's ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or ``{"type":
    "function", "function": {"name": ...}}`` naming one of ``tools``), checked."""
    if choice in (None, "auto", "none"):
        return ToolChoice(parse=bool(tools) and choice != "none")
    names = [t["function"]["name"] for t in tools]
    if choice != "required" and not (
            isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise RequestError(f"tool_choice {str(choice)[:100]!r} must be 'none', 'auto', "
                           "'required' or {'type': 'function', 'function': {'name': ...}}",
                           "tool_choice")
    if not tools:
        raise RequestError("tool_choice asks for a tool call, but the request has no tools",
                           "tool_choice")
    if choice == "required":
        return ToolChoice(parse=True, required=True)
    name = choice["function"]["name"]
    if name not in names:
        raise RequestError(f"tool_choice names the function {name[:64]!r}, which is not among "
                           f"the request's tools {names}", "tool_choice")
    return ToolChoice(parse=True, required=True, function=name)


def parse_request(body: Any, replies: dict) -> ChatRequest:
    """A ``/chat/completions`` body, checked (``RequestError`` naming the field)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
    tools = check_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, got {parallel!r}",
                           "parallel_tool_calls")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(f"max_tokens must be an integer >= 1, got {limit!r}",
                           "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    stated = body.get("agent_rl")
    if stated is not None:
        try:
            stated = StatedPlace.model_validate(stated)
        except ValueError as exc:
            raise RequestError(f"agent_rl must be {{'session'?, 'parent'?, 'origin'?: 'branch' | "
                               f"'compression'}}: {str(exc)[:300]}", "agent_rl") from None
    stop = stop_sequences(body.get("stop"))
    shown, recorded = chat_messages(body.get("messages"), tools, replies)
    return ChatRequest(shown=shown, recorded=recorded, tool_choice=choice, stream=stream,
                       include_usage=bool(options.get("include_usage")),
                       temperature=_number(body, "temperature", 0.0, 2.0),
                       top_p=_number(body, "top_p", 1e-9, 1.0), max_tokens=limit, stop=stop,
                       stated=stated)

