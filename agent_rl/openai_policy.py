"""OpenAIPolicy: any OpenAI-compatible ``/v1/chat/completions`` endpoint as a ``Policy``.

Evaluation only. It cannot be trained: the server applies its own chat template and
tokenizer, returns no prompt token ids and at best the ids of the sampled tokens, so the
trainer cannot rebuild the exact token sequence (``agent_rl.render``) nor recompute the
log-probs the PPO ratio needs. ``trainable`` is False to say so.

Standard library only (``urllib`` + ``json``): one POST per conversation, run by a small
thread pool over the batch; order is kept. Each request asks for

    {"model", "messages", "temperature", "top_p", "max_tokens": sampling.max_new_tokens,
     "n": 1, "seed": stream_seed(sampling.seed, i) mod 2**31 (when set), "logprobs": true, **extra_body}

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
retried once without them and later requests leave them out. Connection failures, timeouts,
HTTP 408/429/5xx are retried ``max_retries`` times with exponential back-off; the error then
raised (``OpenAIPolicyError``) names the URL. Non-JSON or malformed replies are not retried.

Messages: the environments call tools in the text (``<tool_call>...</tool_call>``), so there are
no OpenAI tool-call ids; a ``tool`` turn is sent as a ``user`` message holding
``<tool_response name="...">RESULT</tool_response>`` (the Hermes/Qwen convention the env's
tool instructions follow) and assistant turns are sent as their text.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envs.runner import Completion, Sampling, stream_seed

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class OpenAIPolicyError(RuntimeError):
    """A request to the endpoint failed; the message names the URL."""


class _BadRequest(OpenAIPolicyError):
    """HTTP 400: maybe a parameter the server does not support (retried without logprobs)."""


def chat_url(base_url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` or the full ``.../chat/completions`` URL -> the full URL."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


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
        self.url = chat_url(base_url)
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.concurrency = concurrency
        self.logprobs = logprobs
        self.extra_body = dict(extra_body or {})
        self.backoff_s = backoff_s

    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]:
        """One completion per conversation, in order (requests run concurrently)."""
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
            payload["seed"] = stream_seed(sampling.seed, index) % 2**31  # servers take int32
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
            raise OpenAIPolicyError(f"{self.url}: malformed chat-completions reply ({exc}): "
                                    f"{raw[:300]!r}") from None

    def _post(self, payload: dict[str, Any]) -> str:
        """POST with bounded retries; returns the 200 reply's text."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode()
        attempts = self.max_retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read().decode("utf-8", errors="replace")
                    if response.status == 200:
                        return text
                    problem = f"HTTP {response.status}: {text[:300]!r}"
            except urllib.error.HTTPError as exc:
                text = exc.read().decode("utf-8", errors="replace")
                problem = f"HTTP {exc.code}: {text[:300]!r}"
                if exc.code == 400:
                    raise _BadRequest(f"{self.url}: request rejected, {problem}") from None
                if exc.code not in RETRY_STATUSES:
                    raise OpenAIPolicyError(f"{self.url}: {problem}") from None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timeout, ...
                problem = f"connection failed: {getattr(exc, 'reason', None) or exc!r}"
        raise OpenAIPolicyError(f"{self.url}: {problem} (after {attempts} attempts; is the "
                                "server running and the URL right?)")
