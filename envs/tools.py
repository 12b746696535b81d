"""Tools: declared specs, their JSON schemas, tool-call parsing, permissions and dispatch.

A tool is an env method decorated with ``envs.core.tool``: its typed arguments become a
pydantic model and so an OpenAI-style JSON schema (``ToolSpec.schema``). The policy calls tools
in its text; a ``ToolCallParser`` finds the calls (``HermesParser``:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the default). ``dispatch`` runs
one parsed call against the tools a task allows and never raises on what the agent wrote:

=====================================  ============================================  =========
the call                               result text                                   error
=====================================  ============================================  =========
unparseable (``ParseError``)           ``error: tool call is not valid JSON ...``    format
unknown tool                           ``error: unknown tool ...; available: [...]``  format
a tool the task does not allow         ``error: tool ... is not allowed ...``         tool (+ violation)
arguments that fail validation         ``error: bad arguments for ...: ...``          format
the tool raises ``PermissionDenied``   ``error: permission denied: ...``              tool (+ violation)
the tool raises ``ToolError``          ``error: ...``                                 tool
success                                the result (JSON unless it is a string)       None
=====================================  ============================================  =========

Write scopes are the tool's business (it knows which argument names the record) and are
refused by raising ``PermissionDenied``; every violation is recorded for the verifier.

An action reaches the env as text or as a dict with the sampled tokens (``assistant_turn``);
lone surrogates in it become U+FFFD (``clean_text``) so every episode is valid UTF-8 JSON.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from trajectories import Turn


class ToolError(Exception):
    """Raised by a tool: the message goes back to the agent as the tool result."""


class PermissionDenied(ToolError):
    """Raised by a tool for a call outside the task's permissions: recorded as a violation."""


# ---------------------------------------------------------------------------------------------
# Specs and schemas
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    args_model: type[BaseModel]
    writes: bool
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None, writes: bool = False) -> ToolSpec:
        """The spec of a method ``fn(self, arg: type, ...)``: every argument needs a type."""
        params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
        fields = {}
        for p in params:
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {fn.__name__}: argument {p.name!r} needs a type annotation")
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[p.name] = (p.annotation, default)
        model = create_model(f"{fn.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
        doc = inspect.getdoc(fn) or ""
        return cls(name or fn.__name__, doc.split("\n\n")[0], model, writes, fn)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (a fresh copy each call)."""
        return copy.deepcopy(_schema(self.name, self.description, self.args_model))


@functools.cache
def _schema(name: str, description: str, args_model: type[BaseModel]) -> dict[str, Any]:
    params = args_model.model_json_schema()
    params.pop("title", None)
    return function_schema(name, description, params)


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": parameters}}


def collect_tools(cls: type) -> dict[str, ToolSpec]:
    """Every ``@tool`` method of a class and its bases, by tool name (subclasses win)."""
    tools: dict[str, ToolSpec] = {}
    for klass in reversed(cls.__mro__):
        for attr in vars(klass).values():
            spec = getattr(attr, "__tool__", None)
            if spec is not None:
                tools[spec.name] = spec
    return tools


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    message: str


class ToolCallParser(Protocol):
    """Finds tool calls in the policy's text."""

    def parse(self, text: str) -> list[ToolCall | ParseError]: ...

    def format_instructions(self, tools: list[dict[str, Any]]) -> str: ...


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


MAX_JSON_DEPTH = 32  # deeper tool-call JSON is refused, the same at any stack depth


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate (``"\\ud800"``, which UTF-8 cannot encode and so no
    episode record can hold) replaced by U+FFFD; split surrogate pairs are joined."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k): _clean(v) for k, v in value.items()}
    return value


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (iterative: no recursion limit)."""
    depth, level = 0, [value]
    while level := [x for x in level if isinstance(x, dict | list)]:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)]
    return depth


def strict_json(text: str) -> Any:
    """json.loads for agent text. Refused with ``ValueError``: NaN/Infinity (a non-finite
    argument would make the episode unhashable), integers over Python's 4,300 digits, nesting
    deeper than ``MAX_JSON_DEPTH``; ``RecursionError`` on nesting the stack cannot hold. Lone
    surrogates in strings (``"\\ud800"`` escapes) are replaced (``clean_text``)."""
    value = json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant)
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return _clean(value)


def assistant_turn(action: str | dict[str, Any]) -> tuple[Turn, int | None]:
    """An action as an assistant turn, and the policy revision that sampled it (None: not
    given). ``action``: the text, or a dict with ``text`` and optionally ``token_ids``,
    ``logprobs``, ``finish_reason``, ``policy_revision``."""
    if isinstance(action, str):
        return Turn(role="assistant", content=clean_text(action)), None
    if not isinstance(action, dict) or not isinstance(action.get("text"), str):
        raise TypeError("action must be a str or a dict with 'text' (and optionally "
                        "'token_ids', 'logprobs', 'finish_reason', 'policy_revision')")
    turn = Turn(role="assistant", content=clean_text(action["text"]),
                token_ids=action.get("token_ids"),
                logprobs=action.get("logprobs"), finish_reason=action.get("finish_reason"))
    return turn, action.get("policy_revision")


class HermesParser:
    """Hermes/Qwen style: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``."""

    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | ParseError]:
        calls: list[ToolCall | ParseError] = []
        for raw in self.pattern.findall(text):
            try:
                obj = strict_json(raw.strip())
            except json.JSONDecodeError as exc:
                calls.append(ParseError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
                continue
            except (ValueError, RecursionError) as exc:  # NaN, 1e999, > 4300 digits, nesting
                calls.append(ParseError(f"tool call is not valid JSON ({type(exc).__name__}: "
                                        f"{str(exc)[:80]})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ParseError('tool call must be an object with a string "name"'))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models double-encode
                try:
                    args = strict_json(args)
                except (ValueError, RecursionError):
                    pass
            if not isinstance(args, dict):
                calls.append(ParseError(f'tool call "{obj["name"][:80]}": "arguments" must be an object'))
                continue
            calls.append(ToolCall(obj["name"], args))
        return calls

    def format_instructions(self, tools: list[dict[str, Any]]) -> str:
        if not tools:
            return ""
        lines = [json.dumps(t["function"], sort_keys=True) for t in tools]
        return (
            "You can call tools. To call one, write exactly:\n"
            '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>\n'
            "Tools:\n" + "\n".join(lines)
        )


# ---------------------------------------------------------------------------------------------
# Permissions and dispatch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolResult:
    """What one call gave back: the text the agent sees, the error kind, any violation."""

    name: str
    content: str
    error: Literal["format", "tool"] | None = None
    violation: dict[str, Any] | None = None


def allowed_specs(tools: dict[str, ToolSpec], allowed: Iterable[str] | None) -> list[ToolSpec]:
    """The env's tools a task may use (``allowed=None``: all of them), in declaration order."""
    if allowed is None:
        return list(tools.values())
    allowed = set(allowed)
    return [spec for spec in tools.values() if spec.name in allowed]


def schemas(tools: dict[str, ToolSpec], allowed: Iterable[str] | None) -> list[dict[str, Any]]:
    """The JSON schemas of the tools a task may use (``allowed_specs``)."""
    return [spec.schema() for spec in allowed_specs(tools, allowed)]


def dispatch(owner: Any, tools: dict[str, ToolSpec], allowed: Iterable[str] | None,
             call: ToolCall | ParseError, known: Iterable[str] = ()) -> ToolResult:
    """Run one parsed call as the module docstring's table says. ``owner`` is the env the tool
    methods are bound to; ``known`` names further callable names the agent can see (control
    actions), listed in the unknown-tool message."""
    if isinstance(call, ParseError):
        return ToolResult("error", f"error: {call.message}", "format")
    visible = {s.name for s in allowed_specs(tools, allowed)}
    spec = tools.get(call.name)
    if spec is None:
        available = sorted(visible | set(known))
        return ToolResult(call.name, f"error: unknown tool {call.name[:80]!r}; available: "
                          f"{available}", "format")
    if spec.name not in visible:
        return ToolResult(call.name, f"error: tool {call.name!r} is not allowed for this task",
                          "tool", {"tool": call.name, "reason": "tool not allowed for this task"})
    try:
        args = spec.args_model.model_validate(call.arguments)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                             for e in exc.errors())
        return ToolResult(call.name, f"error: bad arguments for {call.name}: {problems}", "format")
    try:
        result = spec.fn(owner, **args.model_dump())
    except PermissionDenied as exc:
        return ToolResult(call.name, f"error: permission denied: {exc}", "tool",
                          {"tool": call.name, "arguments": call.arguments, "reason": str(exc)})
    except ToolError as exc:
        return ToolResult(call.name, f"error: {exc}", "tool")
    text = result if isinstance(result, str) else json.dumps(result, sort_keys=True)
    return ToolResult(call.name, text)
