"""The policy server's connections (benchmarks/agent_proxy.py found both): a call on a
kept-alive connection (what the ``openai`` client uses) is not held back by Nagle's algorithm
until the client's delayed ACK (40 ms or more a call), and many agents connecting at once are
all let in at once (the default listen backlog of 5 dropped the rest until a SYN retry)."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time

from envs.agent_proxy import PolicyServer
from envs.runner import Completion, Sampling


class Instant:
    """A policy with no model: the same short reply at once."""

    def generate(self, batch, sampling):
        return [Completion("ok", [7, 2], [-0.5, -0.1], prompt_ids=[1, 5, 6]) for _ in batch]


def test_calls_on_a_kept_alive_connection_wait_for_no_delayed_ack():
    body = json.dumps({"model": "p", "messages": [{"role": "user", "content": "hi"}]})
    with PolicyServer(Instant(), Sampling(), window_s=0.0) as server:
        link = server.open_episode()
        path = link.base_url.split(str(server.port), 1)[1] + "/chat/completions"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        seconds = []
        for _ in range(12):  # one connection: Linux acknowledges its first segments at once
            start = time.perf_counter()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = json.loads(reply.read())
            seconds.append(time.perf_counter() - start)
            assert reply.status == 200 and data["choices"][0]["message"]["content"] == "ok"
        conn.close()
    # a delayed ACK waits at least 40 ms (Linux's minimum); a call here takes a few ms
    assert statistics.median(seconds[2:]) < 0.03, [round(s * 1e3, 1) for s in seconds]


def test_many_agents_connecting_at_once_are_all_let_in_at_once():
    """128 connections opened together: each is accepted well before the first SYN retry
    (1 s), so none waits a second or times out."""
    with PolicyServer(Instant(), Sampling()) as server:
        failed, opened = [], []

        def connect() -> None:
            try:
                conn = socket.create_connection(("127.0.0.1", server.port), timeout=0.9)
            except OSError as exc:
                failed.append(exc)
                return
            opened.append(conn)

        threads = [threading.Thread(target=connect) for _ in range(128)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for conn in opened:
            conn.close()
    assert not failed and len(opened) == 128, failed[:3]
