"""How the policy server batches its agents' calls (found by benchmarks/agent_proxy.py): calls
that keep arriving within ``window_s`` of the one before join one batch, however long their
spread (up to ``COLLECT_MAX_S``)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from envs.agent_proxy import PolicyServer
from envs.runner import Completion, Sampling


class Recording:
    """A policy with no model that records the size of every batch."""

    def __init__(self):
        self.batches: list[int] = []

    def generate(self, batch, sampling):
        self.batches.append(len(batch))
        return [Completion("ok", [7, 2], [-0.5, -0.1], prompt_ids=[1, 5, 6]) for _ in batch]


def ask(base_url: str, delay_s: float) -> None:
    time.sleep(delay_s)
    body = json.dumps({"model": "p", "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(base_url + "/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def agents_at(server: PolicyServer, delays: list[float]) -> None:
    links = [server.open_episode() for _ in delays]
    threads = [threading.Thread(target=ask, args=(link.base_url, d))
               for link, d in zip(links, delays, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_calls_arriving_one_after_another_within_the_window_are_one_batch():
    """Eight calls 30 ms apart, window 0.1 s: one batch (a window counted from the first call
    sent the first four alone)."""
    policy = Recording()
    with PolicyServer(policy, Sampling(), window_s=0.1) as server:
        agents_at(server, [0.03 * k for k in range(8)])
    assert policy.batches == [8]


def test_episodes_opened_together_are_one_first_batch_however_spread_their_agents_start():
    """Eight episodes opened at once whose agents call over 1 s (each builds its client first;
    gaps of 0.15 s, longer than the window, a spread longer than COLLECT_MAX_S): their first
    calls are one batch, since each episode's first call is awaited (it took two or more)."""
    policy = Recording()
    with PolicyServer(policy, Sampling(), window_s=0.05) as server:
        agents_at(server, [0.15 * k for k in range(8)])
    assert policy.batches == [8]


def test_an_episode_that_never_calls_delays_a_batch_only_until_first_call_s():
    """An open episode whose agent never calls holds the first batch back at most FIRST_CALL_S,
    and no batch once it was opened that long ago."""
    from envs.proxy_batcher import FIRST_CALL_S

    policy = Recording()
    with PolicyServer(policy, Sampling(), window_s=0.05) as server:
        silent, link = server.open_episode(), server.open_episode()
        started = time.monotonic()
        ask(link.base_url, 0.0)
        first = time.monotonic() - started
        started = time.monotonic()
        ask(link.base_url, 0.0)
        second = time.monotonic() - started
        silent.close()
    assert FIRST_CALL_S - 0.2 < first < FIRST_CALL_S + 1.0
    assert second < 1.0
    assert policy.batches == [1, 1]
