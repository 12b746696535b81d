"""OpenAIPolicy: any OpenAI-compatible ``/v1/chat/completions`` endpoint as a ``Policy``.

Evaluation only. It cannot be trained: the server applies its own chat template and
tokenizer, returns no prompt token ids and at best the ids of the sampled tokens, so the
trainer cannot rebuild the exact token sequence (``agent_rl.policies.render``) nor recompute the
log-probs the PPO ratio needs. ``trainable`` is False to say so.

Standard library only (``http.client`` + ``json``): one POST per conversation, run by a small
thread pool over the batch; order is kept. Each request asks for

    {"model", "messages", "temperature", "top_p", "max_tokens": sampling.max_new_tokens,
     "n": 1, "seed": stream_seed(sampling.seed, *sampling.stream(i)) mod 2**31 (when set),
     "logprobs": true, **extra_body}

and each reply becomes a ``Completion``:

- ``text``: ``choices[0].message.content`` (``""`` when null);
- ``token_ids``: ``choices[0].token_ids`` (vLLM with ``extra_body={"return_token_ids": True}``)
  or parsed from ``logprobs.content[i].token`` when tokens come as ``"token_id:N"`` (vLLM with
  ``{"return_tokens_as_token_ids": True}``); otherwise empty;
- ``logprobs``: ``logprobs.content[i].logprob``, kept only alongside token ids of the same
  length (an episode turn never carries log-probs without the tokens they score) and only
  when all are finite (values a hair above 0 are clipped to 0);
- ``finish_reason``: ``length`` stays ``length``; anything else (``stop``, ``tool_calls``,
  ``content_filter``, ...) is ``stop``;
- ``prompt_tokens``: ``usage.prompt_tokens`` when given.

If the server rejects the request with HTTP 400 while log-probs were asked for, the request is
retried once without them and later requests leave them out. Connection failures and HTTP
408/429/5xx are retried ``max_retries`` times with exponential back-off; the error then raised
(``OpenAIPolicyError``) names the URL. Non-JSON or malformed replies are not retried.

Hostile or broken servers: ``timeout`` is a wall-clock deadline on the whole request (connect,
send, wait, read, retries and back-off together), enforced by shutting the socket down when it
passes, so a server that sends one byte a second cannot stall evaluation; the error names the URL
and the deadline. Redirects (3xx) are refused, never followed, so the ``Authorization`` header
never reaches another origin and a POST never turns into a GET; the error names the status and
the Location's origin. Replies over ``MAX_REPLY_BYTES`` are refused. The API key is redacted
(``***``) from every error message and from ``repr``.

Proxies: as ``urllib`` reads them from the environment (``http_proxy`` / ``https_proxy`` /
``all_proxy``, skipped for the hosts ``no_proxy`` names), fixed when the policy is made. An
``http://`` endpoint is asked through the proxy with the absolute URL, an ``https://`` one
through a ``CONNECT`` tunnel (TLS end to end); a ``user:password@`` in the proxy URL becomes
a ``Proxy-Authorization: Basic`` header, kept out of every message. Only ``http://`` proxies.

Messages: the environments call tools in the text (``<tool_call>...</tool_call>``), so there are
no OpenAI tool-call ids; a ``tool`` turn is sent as a ``user`` message holding
``<tool_response name="...">RESULT</tool_response>`` (the Hermes/Qwen convention the env's
tool instructions follow) and assistant turns are sent as their text.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envs.runner import Completion, Sampling, stream_seed

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_REPLY_BYTES = 64 * 2**20
# `Authorization: Bearer X`, `"api_key": "X"`, `Bearer X`: the credential X becomes ***
SECRET = re.compile(r"(?i)((?:authorization|api[-_]?key)[\"']?\s*[:=]\s*[\"']?"
                    r"(?:(?:bearer|basic)\s+)?|\bbearer\s+)[^\s\"',;&]+")


class OpenAIPolicyError(RuntimeError):
    """A request to the endpoint failed; the message names the URL."""


class _BadRequest(OpenAIPolicyError):
    """HTTP 400: maybe a parameter the server does not support (retried without logprobs)."""


def origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL, without any user name or password."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")


def redact(text: str, secret: str | None = None) -> str:
    """``text`` with ``secret`` and anything that looks like a credential header replaced by ***."""
    if secret:
        text = text.replace(secret, "***")
    return SECRET.sub(r"\1***", re.sub(r"(?<=//)[^/\s@]+@", "***@", text))  # and URL user:pass@


def _cut(sock: socket.socket) -> None:
    """Shut a socket down from another thread: a blocked read or write returns at once."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the base method also cuts TLS sockets


def chat_url(base_url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` or the full ``.../chat/completions`` URL -> the full URL;
    ``ValueError`` for anything but an ``http(s)://host`` URL without credentials in it."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        raise ValueError(f"bad endpoint URL {redact(base_url)!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad endpoint URL {redact(base_url)!r}: expected "
                         "http(s)://HOST[:PORT][/PATH]")
    if parts.username or parts.password:
        raise ValueError(f"bad endpoint URL {redact(base_url)!r}: credentials in the URL are "
                         "refused; pass api_key ($OPENAI_API_KEY for the CLI)")
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def proxy_for(url: str) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for ``url`` (module docstring), or None."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    if "://" not in proxy:
        proxy = "http://" + proxy
    try:
        out = urllib.parse.urlsplit(proxy)
        out.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        raise ValueError(f"bad proxy URL {redact(proxy)!r} in the environment: {exc}") from None
    if out.scheme != "http" or not out.hostname:
        raise ValueError(f"proxy {redact(proxy)!r} from the environment: only http://HOST[:PORT] "
                         "proxies are supported (unset it, or name the endpoint in no_proxy)")
    return out


def to_openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Env messages -> OpenAI chat messages (tool results as ``user`` turns, see module doc)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            out.append({"role": "user", "content": f'<tool_response name="{m.get("name", "")}">'
                                                   f"{content}</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    return out


def _token_ids(choice: dict[str, Any], tokens: list[dict[str, Any]]) -> list[int]:
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    parsed = [t.get("token", "") for t in tokens]
    if parsed and all(isinstance(t, str) and t.startswith("token_id:") for t in parsed):
        try:
            return [int(t.split(":", 1)[1]) for t in parsed]
        except ValueError:
            return []
    return []


def parse_completion(body: dict[str, Any]) -> Completion:
    """One chat-completions reply -> ``Completion``; ``ValueError`` when it has no message."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("no choices[0].message in the reply") from None
    text = message.get("content") or ""
    tokens = (choice.get("logprobs") or {}).get("content") or []
    ids = _token_ids(choice, tokens)
    logprobs = [t.get("logprob") for t in tokens]
    if (len(logprobs) != len(ids) or not ids
            or not all(isinstance(lp, (int, float)) and math.isfinite(lp) for lp in logprobs)):
        logprobs = []
    usage = body.get("usage") or {}
    return Completion(
        text=text, token_ids=list(ids), logprobs=[min(float(lp), 0.0) for lp in logprobs],
        finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
        prompt_tokens=int(usage.get("prompt_tokens") or 0))


class OpenAIPolicy:
    """A ``Policy`` backed by an OpenAI-compatible chat-completions server (evaluation only)."""

    trainable = False

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 60, max_retries: int = 2, concurrency: int = 8,
                 logprobs: bool = True, extra_body: dict[str, Any] | None = None,
                 backoff_s: float = 0.5):
        if max_retries < 0 or concurrency < 1:
            raise ValueError("max_retries must be >= 0 and concurrency >= 1")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a positive, finite number of seconds, "
                             f"got {timeout!r}")
        if api_key and not re.fullmatch(r"[\x21-\x7e]+", api_key):
            raise ValueError("api_key must be printable ASCII without spaces or newlines")
        self.url = chat_url(base_url)
        self.model = model
        self._api_key = api_key  # kept out of repr and of every message (see `redact`)
        self.timeout = timeout
        self.max_retries = max_retries
        self.concurrency = concurrency
        self.logprobs = logprobs
        self.extra_body = dict(extra_body or {})
        self.backoff_s = backoff_s
        self.proxy = proxy_for(self.url)

    def __repr__(self) -> str:
        key = "***" if self._api_key else None
        return (f"OpenAIPolicy(url={self.url!r}, model={self.model!r}, api_key={key}, "
                f"timeout={self.timeout})")

    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]:
        """One completion per conversation, in order (requests run concurrently)."""
        sampling.check_batch(len(batch))
        if not batch:
            return []
        jobs = list(enumerate(batch))
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self._complete(job[1], sampling, job[0]), jobs))

    # --- one request ----------------------------------------------------------------------
    def _payload(self, messages: list[dict[str, Any]], sampling: Sampling, index: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model, "messages": to_openai_messages(messages),
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens, "n": 1}
        if sampling.seed is not None:
            payload["seed"] = stream_seed(sampling.seed, *sampling.stream(index)) % 2**31  # servers take int32
        if self.logprobs:
            payload["logprobs"] = True
        return {**payload, **self.extra_body}

    def _complete(self, messages: list[dict[str, Any]], sampling: Sampling, index: int) -> Completion:
        payload = self._payload(messages, sampling, index)
        try:
            raw = self._post(payload)
        except _BadRequest:
            if "logprobs" not in payload:
                raise
            self.logprobs = False  # the server rejects `logprobs`: stop asking for them
            raw = self._post({k: v for k, v in payload.items() if k != "logprobs"})
        try:
            return parse_completion(json.loads(raw))
        except (ValueError, AttributeError, TypeError) as exc:
            raise self._error(f"malformed chat-completions reply ({exc}): "
                              f"{self._quote(raw)}") from None

    def _redact(self, text: str) -> str:  # the key, and a proxy's password
        password = self.proxy.password if self.proxy is not None else None
        return redact(redact(text, self._api_key), password and urllib.parse.unquote(password))

    def _error(self, problem: str, kind=OpenAIPolicyError) -> OpenAIPolicyError:
        return kind(self._redact(f"{self.url}: {problem}"))

    def _quote(self, text: str) -> str:  # redacted before it is cut, so no part of a key shows
        return repr(self._redact(text)[:300])

    def _post(self, payload: dict[str, Any]) -> str:
        """POST with bounded retries, all within ``timeout`` seconds; the 200 reply's text."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = json.dumps(payload).encode()
        deadline = time.monotonic() + self.timeout
        problem, attempts = "", 0
        while attempts <= self.max_retries:
            if attempts:
                left = max(deadline - time.monotonic(), 0)
                time.sleep(min(self.backoff_s * 2 ** (attempts - 1), left))
            if time.monotonic() >= deadline:
                break
            attempts += 1
            try:
                status, location, text = self._attempt(data, headers, deadline)
            except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, cut
                if time.monotonic() < deadline:
                    via = f" via the proxy {origin(self.proxy.geturl())}" if self.proxy else ""
                    problem = f"connection failed{via}: {exc!r}"
                continue
            if status == 200:
                return text
            problem = f"HTTP {status}: {self._quote(text)}"
            if 300 <= status < 400:
                target = origin(urllib.parse.urljoin(self.url, location))
                raise self._error(f"HTTP {status} redirect to {target} refused (credentials are "
                                  "never sent across a redirect; use the final URL)")
            if status == 400:
                raise self._error(f"request rejected, {problem}", _BadRequest)
            if status not in RETRY_STATUSES:
                raise self._error(problem)
        if time.monotonic() >= deadline:
            last = f"; last: {problem}" if problem else ""
            raise self._error(f"no complete reply within the {self.timeout:g} s deadline "
                              f"(timeout; {attempts} attempts{last})")
        raise self._error(f"{problem} (after {attempts} attempts; is the server running and the "
                          "URL right?)")

    def _attempt(self, data: bytes, headers: dict, deadline: float) -> tuple[int, str, str]:
        """One POST, cut off at ``deadline``: (status, Location header, reply text)."""
        parts, proxy = urllib.parse.urlsplit(self.url), self.proxy
        kind = {"https": http.client.HTTPSConnection}.get(parts.scheme, http.client.HTTPConnection)
        left = max(deadline - time.monotonic(), 1e-3)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        if proxy is None:
            conn = kind(parts.hostname, parts.port, timeout=left)
        else:
            auth = {}
            if proxy.username is not None:
                pair = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
                auth = {"Proxy-Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}
            conn = kind(proxy.hostname, proxy.port or 80, timeout=left)
            if parts.scheme == "https":
                conn.set_tunnel(parts.hostname, parts.port, headers=auth)
            else:
                path, headers = self.url, {**headers, **auth}  # the absolute URL, to the proxy
        try:
            conn.connect()  # bounded by the socket timeout, which is the time left
            timer = threading.Timer(deadline - time.monotonic(), _cut, (conn.sock,))
            timer.daemon = True
            timer.start()
            try:
                conn.request("POST", path, body=data, headers=headers)
                response = conn.getresponse()
                body = response.read(MAX_REPLY_BYTES + 1)
            finally:
                timer.cancel()
        finally:
            conn.close()
        if time.monotonic() >= deadline:  # the socket was cut: what was read may be truncated
            raise TimeoutError("deadline passed")
        if len(body) > MAX_REPLY_BYTES:
            raise self._error(f"reply over {MAX_REPLY_BYTES} bytes refused")
        text = body.decode("utf-8", errors="replace")
        return response.status, response.getheader("Location", ""), text
