"""OpenAIPolicy against a local stub OpenAI-compatible server (127.0.0.1 only): episodes recorded
with the stub's answers, token ids and log-probs when the server gives them, clear errors; hostile
servers (redirects, one byte a second, echoed credentials) cannot leak the key or stall a run."""

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import envs
from agent_rl.cli import build_parser, main
from agent_rl.policies.load import PolicyLoadError, load_policy
from agent_rl.policies.openai_policy import (
    OpenAIPolicy,
    OpenAIPolicyError,
    chat_url,
    to_openai_messages,
)
from envs.arithmetic import WEIGHTS, arithmetic_reward
from envs.runner import Policy, Sampling, run_episodes, stream_seed

ARITH = "agent_rl/Arithmetic-v0"
MAX_REQUESTS = 200  # the stub answers 503 after this many: a runaway loop fails, never hangs
SECRET = "sk-secret-123"
DRIP_S = 0.05  # /drip/: one byte per DRIP_S for about 6 s


def stub_answer(messages) -> str:
    """The stub's deterministic reply: the last number of the last user message, plus one."""
    user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return str(int(re.findall(r"-?\d+", user)[-1]) + 1)


def stub_reply(request: dict) -> dict:
    answer = stub_answer(request["messages"])
    text = answer[: request["max_tokens"]]
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "finish_reason": "length" if len(text) < len(answer) else "stop"}
    if request.get("logprobs"):
        as_ids = request.get("return_tokens_as_token_ids")
        choice["logprobs"] = {"content": [
            {"token": f"token_id:{ord(c)}" if as_ids else c, "logprob": -0.1 * (i + 1),
             "bytes": [ord(c)], "top_logprobs": []} for i, c in enumerate(text)]}
    if request.get("return_token_ids"):
        choice["token_ids"] = [ord(c) for c in text]
    return {"id": "stub", "object": "chat.completion", "model": request["model"],
            "choices": [choice], "usage": {"prompt_tokens": 11, "completion_tokens": len(text)}}


class StubHandler(BaseHTTPRequestHandler):
    """``/v1/chat/completions``: answers; ``/fail/...``: HTTP 500; ``/bad/...``: not JSON;
    ``/nologprobs/...``: HTTP 400 whenever ``logprobs`` is asked for; ``/redirect/...``: HTTP
    ``redirect_status`` to ``redirect_to``; ``/echo/STATUS/...``: STATUS with the request's headers
    as the body; ``/drip/head/...``, ``/drip/body/...``: the status line or the body one byte at a
    time. GET answers like POST (the reply a POST turned into a GET by a redirect would get)."""

    def log_message(self, *args):
        pass

    def send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def drip(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the client hung up
            for byte in data:
                self.wfile.write(bytes([byte]))
                time.sleep(DRIP_S)

    def do_GET(self):
        self.do_POST()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length)) if length else {
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "GET 1"}]}
        server = self.server
        with server.lock:
            server.log.append((self.path, request, dict(self.headers)))
            over_budget = len(server.log) > MAX_REQUESTS
        if over_budget:
            self.send(503, b'{"error": "stub request budget exhausted"}')
        elif self.path.startswith("/redirect/"):
            self.send_response(server.redirect_status)
            self.send_header("Location", server.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.startswith("/echo/"):
            body = json.dumps({"Authorization": self.headers.get("Authorization"),
                               "headers": dict(self.headers)}).encode()
            self.send(int(self.path.split("/")[2]), body)
        elif self.path.startswith("/drip/head/"):
            self.drip(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * int(6 / DRIP_S))
        elif self.path.startswith("/drip/body/"):
            self.send_response(200)
            self.send_header("Content-Length", str(int(6 / DRIP_S)))
            self.end_headers()
            self.drip(b" " * int(6 / DRIP_S))
        elif self.path.startswith("/fail/"):
            self.send(500, b'{"error": "internal error"}')
        elif self.path.startswith("/bad/"):
            self.send(200, b'{"choices": [ this is not json')
        elif self.path.startswith("/nologprobs/") and "logprobs" in request:
            self.send(400, b'{"error": "unknown parameter: logprobs"}')
        elif self.path.endswith("/v1/chat/completions"):
            self.send(200, json.dumps(stub_reply(request)).encode())
        else:
            self.send(404, b'{"error": "not found"}')


def serve(request, handler=StubHandler) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.lock = threading.Lock()
    server.log = []
    server.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()

    def stop():
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    request.addfinalizer(stop)
    return server


@pytest.fixture
def stub(request, monkeypatch):
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return serve(request)


@pytest.fixture
def other(request, stub):
    """A second stub on another port: another origin."""
    return serve(request)


@pytest.fixture(scope="module")
def tasks():
    return envs.make(ARITH).unwrapped.task_pool(6, seed=0)


def reward_of(reply: str, target: int) -> float:
    return sum(WEIGHTS[k] * v for k, v in arithmetic_reward(reply, target).items())


def test_episodes_record_the_stubs_answers(stub, tasks):
    policy = OpenAIPolicy(stub.base + "/v1", "stub-model", api_key="sk-test",
                          extra_body={"return_token_ids": True}, backoff_s=0)
    assert isinstance(policy, Policy) and not policy.trainable
    sampling = Sampling(temperature=0.0, top_p=0.9, max_new_tokens=16, seed=7)
    episodes = run_episodes(ARITH, tasks, policy, sampling, num_envs=3)

    assert [e.task_id for e in episodes] == [t.task_id for t in tasks]
    for episode, task in zip(episodes, tasks, strict=True):
        expected = str(int(re.findall(r"-?\d+", task.prompt)[-1]) + 1)
        (turn,) = [t for t in episode.sessions[0].turns if t.role == "assistant"]
        assert turn.content == expected
        assert turn.token_ids == [ord(c) for c in expected]
        assert turn.logprobs == pytest.approx([-0.1 * (i + 1) for i in range(len(expected))])
        assert turn.finish_reason == "stop"
        assert episode.reward.total == pytest.approx(reward_of(expected, task.target))

    assert len(stub.log) == len(tasks)
    path, body, headers = stub.log[0]
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer sk-test"
    assert {k: body[k] for k in ("model", "temperature", "top_p", "max_tokens", "logprobs",
                                 "return_token_ids")} == {
        "model": "stub-model", "temperature": 0.0, "top_p": 0.9, "max_tokens": 16,
        "logprobs": True, "return_token_ids": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    # one stream per job and call: stream_seed(sampling.seed, job seed, call); six one-turn
    # episodes (jobs 0..5, run_episodes' seed 0), whichever envs they ran on
    assert sorted(b["seed"] for _, b, _ in stub.log) == sorted(
        stream_seed(sampling.seed, job, 0) % 2**31 for job in range(6))


def test_without_token_ids_logprobs_are_dropped(stub, tasks):
    policy = OpenAIPolicy(stub.base, "stub-model", backoff_s=0)
    (completion,) = policy.generate([[{"role": "user", "content": "Compute 2 + 40."}]],
                                    Sampling(max_new_tokens=8))
    assert completion.text == "41" and completion.token_ids == [] and completion.logprobs == []
    assert completion.prompt_tokens == 11
    episodes = run_episodes(ARITH, tasks[:2], policy, Sampling(max_new_tokens=8))
    turn = episodes[0].sessions[0].turns[-1]
    assert turn.token_ids is None and turn.logprobs is None


def test_token_ids_parsed_from_logprob_tokens_and_length_finish(stub):
    policy = OpenAIPolicy(stub.base, "m", extra_body={"return_tokens_as_token_ids": True},
                          backoff_s=0)
    batch = [[{"role": "user", "content": "what is 99"}], [{"role": "user", "content": "and 4"}]]
    long, short = policy.generate(batch, Sampling(max_new_tokens=2))
    assert (long.text, long.token_ids, long.finish_reason) == ("10", [ord("1"), ord("0")], "length")
    assert (short.text, short.token_ids, short.finish_reason) == ("5", [ord("5")], "stop")
    assert long.logprobs == pytest.approx([-0.1, -0.2])


def test_server_500_fails_after_retries_naming_the_url(stub):
    policy = OpenAIPolicy(stub.base + "/fail", "m", max_retries=2, backoff_s=0)
    with pytest.raises(OpenAIPolicyError) as info:
        policy.generate([[{"role": "user", "content": "1"}]], Sampling())
    message = str(info.value)
    assert f"{stub.base}/fail/v1/chat/completions" in message
    assert "HTTP 500" in message and "3 attempts" in message
    assert len(stub.log) == 3


def test_malformed_json_is_a_clear_error(stub):
    policy = OpenAIPolicy(stub.base + "/bad/v1/chat/completions", "m", backoff_s=0)
    with pytest.raises(OpenAIPolicyError, match="malformed") as info:
        policy.generate([[{"role": "user", "content": "1"}]], Sampling())
    assert f"{stub.base}/bad/v1/chat/completions" in str(info.value)
    assert len(stub.log) == 1  # not retried


def test_connection_refused_is_a_clear_error(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = OpenAIPolicy(f"http://127.0.0.1:{port}", "m", max_retries=1, timeout=5, backoff_s=0)
    with pytest.raises(OpenAIPolicyError) as info:
        policy.generate([[{"role": "user", "content": "1"}]], Sampling())
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in message
    assert "connection failed" in message and "2 attempts" in message


def test_logprobs_dropped_when_the_server_rejects_them(stub):
    policy = OpenAIPolicy(stub.base + "/nologprobs", "m", backoff_s=0)
    batch = [[{"role": "user", "content": "7"}]]
    assert policy.generate(batch, Sampling())[0].text == "8"
    assert policy.generate(batch, Sampling())[0].text == "8"
    assert ["logprobs" in body for _, body, _ in stub.log] == [True, False, False]


def test_urls_and_messages():
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/x/chat/completions") == "http://h:1/x/chat/completions"
    messages = to_openai_messages([
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>',
         "tool_calls": [{"name": "f"}]},
        {"role": "tool", "name": "f", "content": "42"}])
    assert messages == [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'},
        {"role": "user", "content": '<tool_response name="f">42</tool_response>'}]


def test_client_errors_are_not_retried(stub):
    policy = OpenAIPolicy(stub.base + "/nowhere/chat/completions", "m", backoff_s=0)
    with pytest.raises(OpenAIPolicyError, match="HTTP 404") as info:
        policy.generate([[{"role": "user", "content": "1"}]], Sampling())
    assert f"{stub.base}/nowhere/chat/completions" in str(info.value)
    assert len(stub.log) == 1


# --- hostile servers -----------------------------------------------------------------------

ONE = [[{"role": "user", "content": "1"}]]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("where", ["other origin", "same origin"])
def test_redirects_are_refused_and_the_key_is_never_forwarded(stub, other, status, where):
    target = other if where == "other origin" else stub
    stub.redirect_status, stub.redirect_to = status, target.base + "/v1/chat/completions"
    policy = OpenAIPolicy(stub.base + "/redirect", "m", api_key=SECRET, backoff_s=0)
    with pytest.raises(OpenAIPolicyError) as info:
        policy.generate(ONE, Sampling())
    message = str(info.value)
    assert f"HTTP {status} redirect to {target.base} refused" in message
    assert f"{stub.base}/redirect/v1/chat/completions" in message
    assert [path for path, _, _ in stub.log + other.log] == ["/redirect/v1/chat/completions"]


@pytest.mark.parametrize("phase", ["head", "body"])
def test_a_server_sending_one_byte_at_a_time_hits_the_wall_clock_deadline(stub, phase):
    policy = OpenAIPolicy(stub.base + f"/drip/{phase}", "m", timeout=1, max_retries=2, backoff_s=0)
    start = time.monotonic()
    with pytest.raises(OpenAIPolicyError) as info:
        policy.generate(ONE, Sampling())
    assert time.monotonic() - start < 3  # each read came within the timeout: only a deadline helps
    message = str(info.value)
    assert f"{stub.base}/drip/{phase}/v1/chat/completions" in message
    assert "within the 1 s deadline" in message


@pytest.mark.parametrize("status", [200, 400, 401, 500])
def test_the_api_key_is_redacted_from_every_message(stub, status):
    policy = OpenAIPolicy(stub.base + f"/echo/{status}", "m", api_key=SECRET, backoff_s=0)
    with pytest.raises(OpenAIPolicyError) as info:
        policy.generate(ONE, Sampling())
    assert stub.log[0][2]["Authorization"] == f"Bearer {SECRET}"  # it was sent, and echoed back
    for text in (str(info.value), repr(info.value), repr(policy)):
        assert SECRET not in text and "sk-secret" not in text
    assert "Bearer ***" in str(info.value) and "api_key=***" in repr(policy)


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"timeout": 0}, "timeout must be a positive, finite"),
    ({"timeout": -1}, "timeout must be a positive, finite"),
    ({"timeout": math.nan}, "timeout must be a positive, finite"),
    ({"timeout": math.inf}, "timeout must be a positive, finite"),
    ({"timeout": "5"}, "timeout must be a positive, finite"),
    ({"base_url": "ftp://h:1"}, "expected http"),
    ({"base_url": "127.0.0.1:8000"}, "expected http"),
    ({"base_url": "http://h:99999"}, "Port out of range"),
    ({"base_url": f"http://user:{SECRET}@h:1"}, "credentials in the URL are refused"),
    ({"api_key": "sk-a\nX-Evil: 1"}, "api_key must be printable ASCII"),
])
def test_bad_arguments_are_clear_errors(kwargs, problem):
    with pytest.raises(ValueError, match=problem) as info:
        OpenAIPolicy(**{"base_url": "http://127.0.0.1:1", "model": "m", **kwargs})
    assert SECRET not in str(info.value) and "sk-a" not in str(info.value)


def test_cli_timeout_reaches_the_policy_and_bounds_eval(stub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    assert build_parser().parse_args(["eval", "--timeout", "2.5"]).timeout == 2.5
    loaded = load_policy(f"openai:{stub.base}", "m", "cpu", timeout=2.5)
    assert loaded.policy.timeout == 2.5 and SECRET not in repr(loaded.policy)
    with pytest.raises(PolicyLoadError, match="timeout must be a positive"):
        load_policy(f"openai:{stub.base}", "m", "cpu", timeout=0)
    start = time.monotonic()
    code = main(["eval", "--env", ARITH, "--policy", f"openai:{stub.base}/drip/body", "--n", "1",
                 "--timeout", "1", "--out", str(tmp_path / "ev")])
    err = capsys.readouterr().err
    assert code == 2 and "within the 1 s deadline" in err  # an error line, not a traceback
    assert time.monotonic() - start < 20 and SECRET not in err and "Traceback" not in err


class ProxyHandler(BaseHTTPRequestHandler):
    """A forwarding HTTP proxy on 127.0.0.1: a POST to an absolute ``http://`` URL goes on to
    that URL without the Proxy-Authorization header; a CONNECT is refused (403). Both are
    logged as (method, target, Proxy-Authorization)."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.log.append(("POST", self.path, self.headers.get("Proxy-Authorization")))
        target = urllib.parse.urlsplit(self.path)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=10)
        conn.request("POST", target.path, body=body, headers={
            k: v for k, v in self.headers.items() if k.lower() != "proxy-authorization"})
        reply = conn.getresponse()
        data = reply.read()
        self.send_response(reply.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_CONNECT(self):
        with self.server.lock:
            self.server.log.append(("CONNECT", self.path, self.headers.get("Proxy-Authorization")))
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def proxy(request, monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return serve(request, ProxyHandler)


ASK = [[{"role": "user", "content": "What is 2 + 3?"}]]


def test_requests_go_through_the_environments_proxy(stub, proxy, monkeypatch):
    """http_proxy with credentials: the request reaches the endpoint through the proxy, with
    the absolute URL and a Basic Proxy-Authorization of the (unquoted) user and password;
    no_proxy naming the host sends it straight there."""
    port = proxy.server_address[1]
    monkeypatch.setenv("http_proxy", f"http://user:p%40ss@127.0.0.1:{port}")
    (c,) = OpenAIPolicy(stub.base, "m").generate(ASK, Sampling(max_new_tokens=8, seed=0))
    assert c.text == "4"
    basic = "Basic " + base64.b64encode(b"user:p@ss").decode()
    assert proxy.log == [("POST", stub.base + "/v1/chat/completions", basic)]
    assert len(stub.log) == 1 and "Proxy-Authorization" not in stub.log[0][2]
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    (c,) = OpenAIPolicy(stub.base, "m").generate(ASK, Sampling(max_new_tokens=8, seed=0))
    assert c.text == "4" and len(proxy.log) == 1 and len(stub.log) == 2


def test_https_goes_through_a_connect_tunnel_and_a_refusal_names_the_proxy(proxy, monkeypatch):
    """https_proxy: the policy asks the proxy for a CONNECT tunnel to the endpoint's host and
    port (with its credentials); the proxy's refusal is an error naming the URL and the proxy,
    never its password."""
    port = proxy.server_address[1]
    monkeypatch.setenv("https_proxy", f"http://user:hunter2@127.0.0.1:{port}")
    policy = OpenAIPolicy("https://127.0.0.1:9/v1", "m", max_retries=0, timeout=10)
    with pytest.raises(OpenAIPolicyError) as err:
        policy.generate(ASK, Sampling(max_new_tokens=8, seed=0))
    message = str(err.value)
    assert f"via the proxy http://127.0.0.1:{port}" in message and "403" in message
    assert "hunter2" not in message and "hunter2" not in repr(policy)
    basic = "Basic " + base64.b64encode(b"user:hunter2").decode()
    assert proxy.log == [("CONNECT", "127.0.0.1:9", basic)]


def test_a_proxy_of_another_scheme_is_refused_at_once(monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("https_proxy", "socks5://127.0.0.1:1080")
    with pytest.raises(ValueError, match="only http://HOST"):
        OpenAIPolicy("https://127.0.0.1:9/v1", "m")


# --- an agent written as code, evaluated through an endpoint that reports no ids --------------


def remote_script(messages) -> str:
    """What the endpoint's model says to tests/agent_rl/notes_agent.py (as the endpoint is
    shown it: tool results as user turns): the lookup tool first, then a plain reply, a note
    holding the question's number, and the answer from the note."""
    last = messages[-1]["content"]
    number = int(re.findall(r"\d+", next(m["content"] for m in messages if m["role"] == "user"))[0])
    if last.startswith("Note: "):
        return f"It is {number + 1}."
    if last.startswith("Write a short note"):
        return f"Notes: {number} + 1."
    if last.startswith("<tool_response"):
        return "I looked it up."
    return '<tool_call>{"name": "lookup", "arguments": {"word": "seven"}}</tool_call>'


def test_eval_of_an_agent_through_an_endpoint_infers_its_tree_from_messages(tmp_path, capsys):
    """``agent-rl eval --policy openai:URL`` on Agent-v0 with notes_agent.py (two turns with a
    tool, then the agent compresses its own context). The endpoint is our policy server
    serving the tiny model, so it returns no token ids: the tree comes from the messages, and
    is the one the agent had (a root of three calls, a compression child answering)."""
    pytest.importorskip("openai")
    from agent_rl.policies.models import tiny_model
    from envs.agent_proxy import PolicyServer
    from tests.envs.test_agent_proxy import ScriptedModel

    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(40)))
    agent = f"{Path(__file__).resolve().parent / 'notes_agent.py'}:run"
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({"env": {"id": "agent_rl/Agent-v0", "pool_size": 40, "kwargs": {
        "agent": agent, "tasks": str(rows), "reward": "numeric"}},
        "eval": {"split": "holdout_iid"}}))
    model, tok = tiny_model(seed=0)
    endpoint = PolicyServer(ScriptedModel(model, tok, remote_script),
                            Sampling(temperature=0.7), fixed_sampling=True)
    with endpoint:
        link = endpoint.open_episode()
        code = main(["eval", "--config", str(config), "--policy", f"openai:{link.base_url}",
                     "--n", "2", "--out", str(tmp_path / "ev")])
        remote_calls = link.calls()
    out = capsys.readouterr().out
    assert code == 0 and "2 episodes, 0 infrastructure faults" in out
    assert len(remote_calls) == 8  # four calls an episode, all through the endpoint
    records = [json.loads(line) for line in (tmp_path / "ev" / "records.jsonl").open()]
    assert [(r["sessions"], r["compressions"], r["branches"]) for r in records] == [(2, 1, 0)] * 2
    assert all(r["reward"] == 1.0 for r in records)
    episodes = [json.loads(line) for line in (tmp_path / "ev" / "episodes.jsonl").open()]
    for e in episodes:
        assert e["reward"]["audit"]["sessions_inferred_by"] == "messages"
        root, child = e["sessions"]
        assert (root["origin"], root["metrics"]["model_calls"]) == ("root", 3)
        assert [t["role"] for t in root["turns"]] == ["system", "user", "assistant", "tool",
                                                      "assistant", "user", "assistant"]
        assert (child["parent_id"], child["origin"]) == (root["session_id"], "compression")
        assert child["metrics"]["model_calls"] == 1
        note = f"Notes: {int(re.findall(r'[0-9]+', root['turns'][1]['content'])[0])} + 1."
        assert child["boundary"]["summary"] == root["turns"][-1]["content"] == note
        assert child["boundary"]["after"][0]["content"].startswith(f"Note: {note}")
        assert e["final_session_id"] == child["session_id"]
        assert root["used_by_final"] and child["used_by_final"]
        assert all(t["token_ids"] is None for s in e["sessions"] for t in s["turns"])
    episode_id = episodes[0]["episode_id"]
    assert main(["inspect", str(tmp_path / "ev" / "episodes.jsonl"), "--episode", episode_id]) == 0
    shown = capsys.readouterr().out
    assert "compression" in shown and shown.count("root") >= 1  # the tree a user sees


def test_training_on_an_endpoint_is_refused_before_any_work(tmp_path, capsys):
    """An endpoint's episodes carry no ids to train on: ``model.id: openai:URL`` is a contract
    error naming the key and saying what to do instead, for the CLI and the Python API."""
    from agent_rl.run.contract import ContractError, ExperimentContract

    with pytest.raises(ContractError, match=r"model.id: 'openai:http://h:1/v1' is an "
                                            "OpenAI-compatible endpoint, which is evaluation only"):
        ExperimentContract.from_dict({"model": {"id": "openai:http://h:1/v1"}})
    tiny_yaml = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
    code = main(["train", str(tiny_yaml), "--set", "model.id=openai:http://127.0.0.1:9/v1",
                 "--set", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not (tmp_path / "run").exists()
    assert "evaluate it with `agent-rl eval --policy openai:http://127.0.0.1:9/v1`" in err
