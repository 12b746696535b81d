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
sampled is ever re-tokenized. The reply's text is parsed for tool calls; they come back as
OpenAI ``tool_calls`` (ids ``call_<call>_<k>``) and the rest of the text as ``content``.

**``tool_choice``.** The policy samples freely whatever the choice: nothing is prefilled or
masked (a prefilled tool-call opener would be a token the policy did not sample inside the
turn the trainer scores), and the tools are listed in the prompt whatever the choice (so a
session's prompts keep extending each other). ``"auto"`` (the default): replies are parsed
for tool calls. ``"none"``: they are not; the reply's whole text is its ``content``.
``"required"``, or ``{"type": "function", "function": {"name": NAME}}`` naming one of the
request's tools: replies are parsed as with ``"auto"``, and the choice is met when the reply
calls at least one tool (every call to NAME, for a named choice). A reply that does not meet
it is returned as the policy wrote it, with the usual finish reason (``"stop"`` for a text
reply: never ``"tool_calls"`` without tool calls), and says so: the body (the last chunk,
streamed) carries ``"agent_rl": {"tool_choice_met": false}`` (``true`` when met; absent for
``"auto"`` / ``"none"``), and the call is listed in ``EpisodeLink.unmet_tool_choice`` (``{"index",
"tool_choice": "required" | NAME}``, in the episode's ``reward.audit["unmet_tool_choice"]``).
``"required"`` or a named choice without ``tools``, a name not among them, or any other value
is a 400 naming ``tool_choice``. ``parallel_tool_calls`` (true or false) is accepted and does
not constrain the policy: every call it wrote is returned.

**``stop``** (a string or up to 4): the policy samples as usual, and the reply is cut at the
first stop string (``proxy_replies.sampled_reply``): the agent gets the text before it
(OpenAI excludes the stop string) with finish reason ``"stop"``; the call is recorded with
the sampled ids and log-probs up to and including the token that completes the stop string,
and as text those ids' decoding (the returned text, the stop string, and whatever else that
token carried), so the trainer scores exactly the tokens the agent's next prompt follows.
Cutting needs the policy's tokenizer (``PolicyServer(tokenizer=...)``, by default
``policy.tokenizer``, as ``HFPolicy`` and ``VLLMPolicy`` have): without one ``stop`` is a 400.

**What is recorded.** Every answered call is a ``trajectories.ModelCall``: those messages
(without the ids), the prompt ids the policy reports (``Completion.prompt_ids``: the ids the
trainer renders), the sampled ids and log-probs, the finish reason and the policy revision;
the reply is recorded as the policy's own text (tool-call blocks included). A call the policy
refuses as too long (``Sampling.max_prompt_tokens``) gets a 400 ``context_length_exceeded``
the agent can react to, and is kept in ``EpisodeLink.refused``. ``trajectories.
sessions_from_calls`` turns ``EpisodeLink.calls()`` into the session tree.

**Batching.** Requests that arrive within ``window_s`` of the one before (up to ``max_batch``,
and at most ``COLLECT_MAX_S`` or ``window_s`` after the first) go to the policy as one
``generate`` call per distinct sampling setting (``envs.proxy_batcher``).
Sampling: the server's ``Sampling``, with the request's ``temperature``, ``top_p`` and
``max_tokens`` / ``max_completion_tokens`` where given (``fixed_sampling=True`` ignores them:
a trainer samples as its contract says). Random streams: an episode opened with a ``stream``
key k samples its c-th call (in arrival order) from the stream ``(k, c)``
(``Sampling.streams``), as ``envs.runner.run_episodes`` keys the t-th call of job k, so no
call replays another's random numbers and what a call samples does not depend on the
batch it lands in; an episode opened without one samples from its row of the batch.

**Refused (400, the field named in ``error.param``).** Bad JSON, a body that is not an object,
no messages, an unknown role, a non-text content part, ``n`` other than 1, ``logit_bias``, a
``stop`` that is not a non-empty string or a list of up to 4 (or any ``stop`` without a
tokenizer), non-zero ``frequency_penalty`` / ``presence_penalty``, a ``response_format``
other than text, legacy ``functions``, a tool schema that is not ``{"type": "function",
"function": {"name": ..., "parameters": {...}}}``, a ``tool_choice`` as above, a
``parallel_tool_calls`` that is not a boolean, an out-of-range sampling value. Nothing a
client sends stops the server: an unexpected failure is a 500 error body.

**Streaming** (``stream: true``): server-sent events, sent once the call's batch has finished
generating, not while the policy samples. The ``Policy`` protocol returns whole completions
(``generate(batch, sampling) -> list[Completion]``): vLLM's batched ``generate`` and an
OpenAI-compatible endpoint offer no per-step hook, and a stop string or a tool call can only
be told from text once it is complete. What is streamed: the role; then the content, one
delta per sampled token that adds to it (``proxy_replies.token_pieces``: decoded
incrementally, so a multi-byte character split over byte tokens arrives whole with the token
that completes it, and the deltas join to exactly the non-streamed ``content``); then each
tool call as OpenAI streams them (a delta with its ``index``, ``id``, ``type`` and name, then
one with its arguments); then the finish reason (with ``agent_rl`` where a ``tool_choice``
requires it), the usage if ``stream_options.include_usage``, and ``data: [DONE]``. A policy
without a tokenizer, or whose ids do not decode to its text, streams its content as one
delta.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envs.core import PROMPT_TOO_LONG
from envs.proxy_batcher import FIRST_CALL_S, Batcher
from envs.proxy_replies import (
    completion_body,
    finish_reason,
    reply_message,
    sampled_reply,
    stream_chunks,
)
from envs.proxy_requests import (
    ROLES,
    ChatRequest,
    RequestError,
    chat_messages,
    check_tools,
    parse_request,
    reply_key,
)
from envs.runner import Completion, Policy, Sampling
from trajectories.calls import ModelCall

__all__ = ["ROLES", "ChatRequest", "EpisodeLink", "PolicyServer", "RequestError",
           "chat_messages", "check_tools", "completion_body", "parse_request", "reply_message",
           "stream_chunks"]

MAX_BODY_BYTES = 32 * 2**20


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
    # calls whose reply did not call the tool that tool_choice required (module docstring)
    unmet_tool_choice: list[dict[str, Any]] = field(default_factory=list)
    _replies: dict = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    opened: float = field(default_factory=time.monotonic)

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
        key = reply_key(request.recorded, message.get("content") or "", ids)
        with self._lock:
            self._calls.append(call)
            self._replies[key] = (completion.text, list(completion.token_ids))

    def _unmet(self, index: int, choice: str) -> None:
        with self._lock:
            self.unmet_tool_choice.append({"index": index, "tool_choice": choice})

    def _refuse(self, index: int, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            self.refused.append({"index": index, "reason": reason, "prompt_tokens": prompt_tokens})



# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class PolicyServer:
    """An OpenAI-compatible server for ``policy`` on 127.0.0.1 (module docstring). Use as a
    context manager, or ``start()`` and ``close()``."""

    def __init__(self, policy: Policy, sampling: Sampling | None = None, port: int = 0,
                 window_s: float = 0.01, max_batch: int = 64, model: str = "agent-rl-policy",
                 fixed_sampling: bool = False, request_timeout_s: float = 600.0,
                 tokenizer: Any = None):
        if window_s < 0 or max_batch < 1:
            raise ValueError(f"window_s must be >= 0 and max_batch >= 1, got {window_s}, {max_batch}")
        # what decodes the sampled ids (stop strings, streamed pieces): the policy's own
        self.tokenizer = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
        # streams are the server's to name, per call (module docstring)
        self.policy, self.sampling = policy, replace(sampling or Sampling(), streams=None)
        self.model, self.fixed_sampling = model, fixed_sampling
        self.window_s, self.max_batch, self.request_timeout_s = window_s, max_batch, request_timeout_s
        self.port = port
        self._links: dict[str, EpisodeLink] = {}
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._batcher: Batcher | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PolicyServer:
        if self._http is not None:
            return self
        self._batcher = Batcher(self.policy, self.window_s, self.max_batch, self._awaited)
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

    def _awaited(self) -> int:
        """Open episodes, opened less than ``FIRST_CALL_S`` ago, that have not called yet."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for link in self._links.values()
                       if link._next == 0 and now - link.opened < FIRST_CALL_S)

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

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, link: EpisodeLink, body: Any) -> tuple[ChatRequest, dict[str, Any], list]:
        """Answer one request for ``link``: (the request, the reply body, its stream chunks)."""
        started = time.monotonic()
        with link._lock:
            replies = dict(link._replies)
        request = parse_request(body, replies)
        if request.stop and self.tokenizer is None:
            raise RequestError("stop: this policy has no tokenizer to cut its sampled ids at a "
                               "stop string (serve it with PolicyServer(..., tokenizer=...))",
                               "stop")
        index = link._arrive()
        sampled = sampled_reply(self._generate(link, request, index), request.stop,
                                self._decode if self.tokenizer is not None else None)
        message, tool_finish = reply_message(sampled.text, request.tool_choice.parse, index)
        completion = sampled.completion
        link._record(request, index, started, completion, message)
        extra = {}
        if request.tool_choice.required:  # the policy sampled freely: say whether it complied
            met = request.tool_choice.met(message.get("tool_calls") or [])
            extra["agent_rl"] = {"tool_choice_met": met}
            if not met:
                link._unmet(index, request.tool_choice.label())
        finish = finish_reason(completion, tool_finish)
        head = {"id": f"chatcmpl-{link.token[:8]}-{index}", "created": int(time.time()),
                "model": self.model}
        if request.stream:
            return request, {}, stream_chunks(head, message, sampled.pieces, finish, completion,
                                              request.include_usage, extra)
        return request, completion_body(head, message, finish, completion, extra), []

    def _generate(self, link: EpisodeLink, request: ChatRequest, index: int) -> Completion:
        """The policy's completion for call ``index`` of ``link`` (batched with others)."""
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
        return completion

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
