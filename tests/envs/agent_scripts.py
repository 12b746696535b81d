"""Agents for the tests, written as plain code (nothing from agent-rl): ``ask_once`` posts the
task's prompt to the policy server with ``urllib`` and returns the reply."""

from __future__ import annotations

import json
import urllib.request


def ask_once(task: dict, base_url: str, api_key: str) -> str:
    body = json.dumps({"model": "policy",
                       "messages": [{"role": "user", "content": task["prompt"]}]}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", body,
                                     {"Content-Type": "application/json",
                                      "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]
