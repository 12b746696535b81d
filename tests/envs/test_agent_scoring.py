"""Agent-v0 scores a rollout's answers on the deadline workers it keeps: episodes that end
together do not each start a worker (~0.4 s apiece, one after another; found by
benchmarks/agent_proxy.py)."""

from __future__ import annotations

import json
import time
import urllib.request

from envs import deadline
from envs.agents import run_agent_episodes
from envs.datasets import DatasetEnv
from envs.runner import Completion, Sampling


def slow_reward(answer, task) -> float:
    """A reward that takes a while, so every episode's scoring overlaps the others'."""
    time.sleep(0.3)
    return float(answer.strip() == "50")


class Instant:
    def generate(self, batch, sampling):
        return [Completion("50", [7, 2], [-0.5, -0.1], prompt_ids=[1, 5, 6]) for _ in batch]


def ask_once(task, base_url, api_key):
    body = json.dumps({"model": "p", "messages": [{"role": "user", "content": task["prompt"]}]})
    request = urllib.request.Request(base_url + "/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())["choices"][0]["message"]["content"]


def test_episodes_ending_together_reuse_the_kept_workers(tmp_path, monkeypatch):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "t1", "prompt": "12 + 38?", "answer": "50"}) + "\n")
    scorer = DatasetEnv(path=path, reward=f"{__name__}:slow_reward", task_id="id")

    def rollout():
        return run_agent_episodes(ask_once, scorer.tasks, Instant(), scorer, Sampling(),
                                  samples_per_task=2 * deadline.MAX_IDLE, seed=0)

    rollout()  # the first step starts the workers it keeps
    started = []
    start = deadline._start
    monkeypatch.setattr(deadline, "_start", lambda: started.append(1) or start())
    episodes = rollout()
    assert [e.reward.total for e in episodes] == [1.0] * 2 * deadline.MAX_IDLE
    assert started == []  # every answer was scored on a kept worker
