"""The policy server: an OpenAI-compatible endpoint on 127.0.0.1 for agents written as code.

An agent that already talks to an OpenAI-compatible API is trained unchanged: it gets a base
URL instead of OpenAI's. ``PolicyServer(policy)`` serves any ``envs.runner.Policy``;
``server.open_episode()`` returns an ``EpisodeLink`` whose ``base_url`` is
``http://127.0.0.1:PORT/e/<token>/v1`` (``secrets.token_urlsafe``: an agent reaches only its
own episode). Routes under it: ``POST /chat/completions``, ``GET /models``. A request for an
ended or unknown episode gets 404 with an OpenAI-style error body.

**What the policy is shown.** The request's messages become the messages a built-in env would
show (``chat_messages``): the ``tools`` as Hermes instructions at the end of the system message
(``HermesParser.format_instructions``, a system message added when there is none), an assistant
message with ``tool_calls`` as its text with ``<tool_call>{json}</tool_call>`` blocks, a
``tool`` message as a ``tool`` turn named after the call it answers, ``developer`` as
``system``. An assistant message that is a reply this server sent in the same episode, after
the same earlier messages, carries the ids the policy sampled for it (``token_ids``): the
policy lays it out as ``agent_rl``'s ``render_session`` lays out a generated turn, so nothing
sampled is ever re-tokenized. The reply's text is parsed for tool calls (unless ``tool_choice``
is ``"none"``); they come back as OpenAI ``tool_calls`` (ids ``call_<call>_<k>``) and the rest
of the text as ``content``.

**What is recorded.** Every answered call is a ``trajectories.ModelCall``: those messages
(without the ids), the prompt ids the policy reports (``Completion.prompt_ids``: the ids the
trainer renders), the sampled ids and log-probs, the finish reason and the policy revision;
the reply is recorded as the policy's own text (tool-call blocks included). A call the policy
refuses as too long (``Sampling.max_prompt_tokens``) gets a 400 ``context_length_exceeded``
the agent can react to, and is kept in ``EpisodeLink.refused``. ``trajectories.
sessions_from_calls`` turns ``EpisodeLink.calls()`` into the session tree.

**Batching.** Requests that arrive within ``window_s`` of the one before (up to ``max_batch``,
and at most ``COLLECT_MAX_S`` or ``window_s`` after the first) go to the policy as one
``generate`` call per distinct sampling setting. Agents answered by one batch send their next
calls over a spread that grows with their number and the machine's load: a window counted
from the first arrival split such a round in two (two ``generate`` calls instead of one).
Sampling: the server's ``Sampling``, with the request's ``temperature``, ``top_p`` and
``max_tokens`` / ``max_completion_tokens`` where given (``fixed_sampling=True`` ignores them:
a trainer samples as its contract says). Random streams: an episode opened with a ``stream``
key k samples its c-th call (in arrival order) from the stream ``(k, c)``
(``Sampling.streams``), as ``envs.runner.run_episodes`` keys the t-th call of job k, so no
call replays another's random numbers and what a call samples does not depend on the
batch it lands in; an episode opened without one samples from its row of the batch.

**Refused (400, the field named in ``error.param``).** Bad JSON, a body that is not an object,
no messages, an unknown role, a non-text content part, ``n`` other than 1, ``logit_bias``,
``stop``, non-zero ``frequency_penalty`` / ``presence_penalty``, a ``response_format`` other
than text, legacy ``functions``, a tool schema that is not ``{"type": "function",
"function": {"name": ..., "parameters": {...}}}``, a ``tool_choice`` other than ``"auto"`` /
``"none"`` (the policy samples freely: it cannot be forced to call a tool), an out-of-range
sampling value. ``stream: true`` answers as server-sent events (the whole reply in one content
chunk, then the tool calls, then the finish reason and ``data: [DONE]``). Nothing a client
sends stops the server: an unexpected failure is a 500 error body.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envs.core import PROMPT_TOO_LONG
from envs.runner import Completion, Policy, Sampling
from envs.tools import HermesParser, ToolCall
from trajectories.calls import ModelCall, StatedPlace

MAX_BODY_BYTES = 32 * 2**20
COLLECT_MAX_S = 0.5  # a batch waits at most this (or window_s) after its first request
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


# ---------------------------------------------------------------------------------------------
# Requests: OpenAI JSON -> the messages the policy is shown
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    """One validated ``/chat/completions`` request. ``shown``: the messages the policy is
    given (generated replies carrying ``token_ids``); ``recorded``: the same without them."""

    shown: list[dict[str, Any]]
    recorded: list[dict[str, Any]]
    parse_tools: bool
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stated: StatedPlace | None


def _messages_key(messages: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(list(messages), sort_keys=True, default=str).encode()).hexdigest()


def _reply_key(before: Sequence[dict[str, Any]], content: str,
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
    docstring). ``replies`` maps ``_reply_key`` to the (text, sampled ids) of a reply this
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
            sent = replies.get(_reply_key(recorded, content, ids))
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
    if body.get("stop"):
        raise RequestError("stop sequences are not supported: the policy stops at its "
                           "end-of-turn token", "stop")
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


def parse_request(body: Any, replies: dict) -> ChatRequest:
    """A ``/chat/completions`` body, checked (``RequestError`` naming the field)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
    tools = check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {choice!r} is not supported: the policy samples "
                           "freely (use 'auto' or 'none')", "tool_choice")
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
    shown, recorded = chat_messages(body.get("messages"), tools, replies)
    return ChatRequest(shown=shown, recorded=recorded, parse_tools=bool(tools) and choice != "none",
                       stream=stream, include_usage=bool(options.get("include_usage")),
                       temperature=_number(body, "temperature", 0.0, 2.0),
                       top_p=_number(body, "top_p", 1e-9, 1.0), max_tokens=limit, stated=stated)


# ---------------------------------------------------------------------------------------------
# Replies: the policy's text -> an OpenAI assistant message
# ---------------------------------------------------------------------------------------------


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


def _finish(completion: Completion, tool_finish: str | None) -> str:
    if tool_finish is not None:
        return tool_finish
    return "length" if completion.finish_reason == "length" else "stop"


def _usage(completion: Completion) -> dict[str, int]:
    prompt = completion.prompt_tokens or len(completion.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt + len(completion.token_ids)}


def completion_body(message: dict[str, Any], finish: str, completion: Completion, model: str,
                    call_id: str, created: int) -> dict[str, Any]:
    return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": _usage(completion)}


def stream_chunks(message: dict[str, Any], finish: str, completion: Completion, model: str,
                  call_id: str, created: int, include_usage: bool) -> list[dict[str, Any]]:
    """The chunks of a streamed reply: the role, the content, the tool calls, the finish
    reason (and the usage when asked for)."""
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
    chunks.append(chunk({}, finish))
    if include_usage:
        chunks.append({"id": call_id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [], "usage": _usage(completion)})
    return chunks


# ---------------------------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------------------------


@dataclass
class EpisodeLink:
    """One episode's place on the server: its URL, and every call its agent made."""

    token: str
    base_url: str
    _server: PolicyServer
    stream: int | None = None  # the key of this episode's random streams (module docstring)
    _calls: list[ModelCall] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    _replies: dict = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    @property
    def api_key(self) -> str:
        """What to give a client that insists on a key (the URL is what admits it)."""
        return self.token

    def calls(self) -> list[ModelCall]:
        """The answered calls so far, in arrival order."""
        with self._lock:
            return sorted(self._calls, key=lambda c: c.index)

    def close(self) -> None:
        """End the episode: later requests to its URL get 404."""
        self._server._close(self)

    def _arrive(self) -> int:
        with self._lock:
            index, self._next = self._next, self._next + 1
            return index

    def _record(self, request: ChatRequest, index: int, started: float,
                completion: Completion, message: dict[str, Any]) -> None:
        call = ModelCall(index=index, started=started, ended=max(time.monotonic(), started),
                         messages=request.recorded, prompt_ids=list(completion.prompt_ids),
                         reply={"role": "assistant", "content": completion.text},
                         completion_ids=list(completion.token_ids),
                         logprobs=list(completion.logprobs),
                         finish_reason=completion.finish_reason,
                         revision=completion.policy_revision, stated=request.stated)
        ids = [c["id"] for c in message.get("tool_calls") or []]
        key = _reply_key(request.recorded, message.get("content") or "", ids)
        with self._lock:
            self._calls.append(call)
            self._replies[key] = (completion.text, list(completion.token_ids))

    def _refuse(self, index: int, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            self.refused.append({"index": index, "reason": reason, "prompt_tokens": prompt_tokens})


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


@dataclass
class _Job:
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: tuple[int, ...] | None = None  # the call's random stream; None: its batch row
    future: Future = field(default_factory=Future)


class _Batcher:
    """One thread that sends waiting requests to the policy in batches (module docstring)."""

    def __init__(self, policy: Policy, window_s: float, max_batch: int):
        self.policy, self.window_s, self.max_batch = policy, window_s, max_batch
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.batches: list[int] = []  # the size of every generate call, for tests and benchmarks
        self.thread = threading.Thread(target=self._run, name="agent-proxy-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict[str, Any]], sampling: Sampling,
               stream: tuple[int, ...] | None = None) -> Future:
        job = _Job(messages, sampling, stream)
        self.jobs.put(job)
        return job.future

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, last = [first], time.monotonic() + max(self.window_s, COLLECT_MAX_S)
        deadline = min(time.monotonic() + self.window_s, last)
        while len(jobs) < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            deadline = min(time.monotonic() + self.window_s, last)
        return jobs, False

    def _run(self) -> None:
        while (first := self.jobs.get()) is not None:
            jobs, stopping = self._collect(first)
            groups: dict[Sampling, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.sampling, []).append(job)
            for sampling, group in groups.items():
                self._generate(sampling, group)
            if stopping:
                break
        while True:  # answer whatever still waits, so no handler hangs
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.future.set_exception(RuntimeError("the policy server is shutting down"))

    def _generate(self, sampling: Sampling, group: list[_Job]) -> None:
        self.batches.append(len(group))
        streams = tuple(job.stream if job.stream is not None else (row,)
                        for row, job in enumerate(group))
        try:
            completions = self.policy.generate([job.messages for job in group],
                                               replace(sampling, streams=streams))
            if len(completions) != len(group):
                raise RuntimeError(f"the policy returned {len(completions)} completions for "
                                   f"{len(group)} conversations")
        except Exception as exc:  # the handlers report it; the batcher keeps serving
            for job in group:
                job.future.set_exception(exc)
            return
        for job, completion in zip(group, completions, strict=True):
            job.future.set_result(completion)


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class PolicyServer:
    """An OpenAI-compatible server for ``policy`` on 127.0.0.1 (module docstring). Use as a
    context manager, or ``start()`` and ``close()``."""

    def __init__(self, policy: Policy, sampling: Sampling | None = None, port: int = 0,
                 window_s: float = 0.01, max_batch: int = 64, model: str = "agent-rl-policy",
                 fixed_sampling: bool = False, request_timeout_s: float = 600.0):
        if window_s < 0 or max_batch < 1:
            raise ValueError(f"window_s must be >= 0 and max_batch >= 1, got {window_s}, {max_batch}")
        # streams are the server's to name, per call (module docstring)
        self.policy, self.sampling = policy, replace(sampling or Sampling(), streams=None)
        self.model, self.fixed_sampling = model, fixed_sampling
        self.window_s, self.max_batch, self.request_timeout_s = window_s, max_batch, request_timeout_s
        self.port = port
        self._links: dict[str, EpisodeLink] = {}
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._batcher: _Batcher | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PolicyServer:
        if self._http is not None:
            return self
        self._batcher = _Batcher(self.policy, self.window_s, self.max_batch)
        self._http = _HTTPServer(("127.0.0.1", self.port), _handler(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="agent-proxy-http",
                         daemon=True).start()
        return self

    def close(self) -> None:
        if self._http is None:
            return
        with self._lock:
            for link in self._links.values():
                link.closed = True
            self._links.clear()
        self._http.shutdown()
        self._http.server_close()
        self._batcher.stop()
        self._http = self._batcher = None

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def batches(self) -> list[int]:
        """The size of every ``generate`` call made so far."""
        return list(self._batcher.batches) if self._batcher else []

    # --- episodes ----------------------------------------------------------------------------
    def open_episode(self, stream: int | None = None) -> EpisodeLink:
        """A new episode with its own unguessable base URL; ``stream``: the key of its random
        streams (module docstring)."""
        if self._http is None:
            raise RuntimeError("PolicyServer.open_episode: start the server first (a `with` "
                               "block or start())")
        token = secrets.token_urlsafe(24)
        link = EpisodeLink(token=token, base_url=f"http://127.0.0.1:{self.port}/e/{token}/v1",
                           _server=self, stream=stream)
        with self._lock:
            self._links[token] = link
        return link

    def _close(self, link: EpisodeLink) -> None:
        with self._lock:
            link.closed = True
            self._links.pop(link.token, None)

    def _link(self, token: str) -> EpisodeLink:
        with self._lock:
            link = self._links.get(token)
        if link is None or link.closed:
            raise RequestError("no open episode at this URL: it has ended, or the token is "
                               "wrong", None, 404, "episode_not_found")
        return link

    # --- one call ----------------------------------------------------------------------------
    def _sampling(self, request: ChatRequest) -> Sampling:
        if self.fixed_sampling:
            return self.sampling
        chosen = {k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p),
                                    ("max_new_tokens", request.max_tokens)) if v is not None}
        return replace(self.sampling, **chosen)

    def chat(self, link: EpisodeLink, body: Any) -> tuple[ChatRequest, dict[str, Any], list]:
        """Answer one request for ``link``: (the request, the reply body, its stream chunks)."""
        started = time.monotonic()
        with link._lock:
            replies = dict(link._replies)
        request = parse_request(body, replies)
        index = link._arrive()
        stream = (link.stream, index) if link.stream is not None else None
        future = self._batcher.submit(request.shown, self._sampling(request), stream)
        try:
            completion = future.result(timeout=self.request_timeout_s)
        except TimeoutError:
            raise RequestError(f"the policy gave no reply within {self.request_timeout_s:g} s",
                               None, 503, "timeout") from None
        except Exception as exc:
            raise RequestError(f"the policy failed: {type(exc).__name__}: {str(exc)[:500]}",
                               None, 500, "policy_error") from None
        if link.closed:
            raise RequestError("the episode ended while this call waited", None, 404,
                               "episode_not_found")
        if completion.finish_reason == PROMPT_TOO_LONG:
            link._refuse(index, PROMPT_TOO_LONG, completion.prompt_tokens)
            raise RequestError(f"the prompt is {completion.prompt_tokens} tokens, more than "
                               f"the policy's limit of {self._sampling(request).max_prompt_tokens}: "
                               "shorten the conversation (summarise it and start a new one)",
                               "messages", 400, "context_length_exceeded")
        message, tool_finish = reply_message(completion.text, request.parse_tools, index)
        link._record(request, index, started, completion, message)
        finish, created = _finish(completion, tool_finish), int(time.time())
        call_id = f"chatcmpl-{link.token[:8]}-{index}"
        if request.stream:
            return request, {}, stream_chunks(message, finish, completion, self.model, call_id,
                                              created, request.include_usage)
        return request, completion_body(message, finish, completion, self.model, call_id,
                                        created), []

    def models_body(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "agent-rl"}]}


class _HTTPServer(ThreadingHTTPServer):
    # agents connect all at once (a client each); the default backlog of 5 dropped their
    # connections, which then waited a SYN retry (1 s, 3 s, ...) or timed out
    request_queue_size = 1024


_ROUTE = re.compile(r"^/e/([A-Za-z0-9_-]+)/v1/(chat/completions|models)/?$")


def _handler(server: PolicyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY: a reply's headers and body are two writes, and Nagle's algorithm held
        # the body until the client's delayed ACK (40 ms a call on a kept-alive connection)
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
            return

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, chunks: list[dict[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _route(self, method: str) -> tuple[EpisodeLink, str]:
            match = _ROUTE.match(self.path.split("?", 1)[0])
            if match is None:
                raise RequestError(f"no route {method} {self.path[:200]!r}: the API is under "
                                   "/e/<token>/v1 (chat/completions, models)", None, 404,
                                   "not_found")
            link = server._link(match.group(1))
            want = "POST" if match.group(2) == "chat/completions" else "GET"
            if method != want:
                raise RequestError(f"{method} is not allowed here: use {want}", None, 405,
                                   "method_not_allowed")
            return link, match.group(2)

        def _body(self) -> Any:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY_BYTES:
                raise RequestError(f"the body must have a Content-Length in 1..{MAX_BODY_BYTES}",
                                   None, 413 if length > MAX_BODY_BYTES else 400)
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the body is not valid JSON: {exc}"[:300]) from None

        def _serve(self, method: str) -> None:
            try:
                link, route = self._route(method)
                if route == "models":
                    self._send(200, server.models_body())
                    return
                _, body, chunks = server.chat(link, self._body())
                if chunks:
                    self._stream(chunks)
                else:
                    self._send(200, body)
            except RequestError as exc:
                self.close_connection = True  # a body left unread must not be read as a request
                self._send(exc.status, exc.body())
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            except Exception as exc:  # nothing a client sends stops the server
                self.close_connection = True
                self._send(500, RequestError(f"internal error: {type(exc).__name__}: "
                                             f"{str(exc)[:300]}", None, 500, "internal").body())

        def do_POST(self) -> None:  # noqa: N802 (http.server's names)
            self._serve("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._serve("GET")

    return Handler
