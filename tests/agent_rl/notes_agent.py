"""A small agent written as ordinary code over the official ``openai`` client (nothing from
agent-rl): two turns offering a ``lookup`` tool (a tool call is answered, a plain reply is
followed by "Go on."), then it compresses its own context: it asks for a note, starts a fresh
message list holding only the note and the question, and answers from it. Every episode is
therefore two sessions: the root (three calls) and a compression child (one call).

``flaky`` is the same agent, except that of every three episodes one raises and one hangs
(for the fault tests); ``timeout_s`` ends the hanging one.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

from openai import OpenAI

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


def run(task: dict, base_url: str, api_key: str) -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(messages: list[dict], **kw) -> dict:
        reply = client.chat.completions.create(model="policy", messages=messages, **kw)
        return reply.choices[0].message.model_dump(exclude_none=True)

    messages = [{"role": "system", "content": "You answer questions. You may use tools."},
                {"role": "user", "content": task["prompt"]}]
    for _ in range(2):  # two turns with the tool on offer
        message = ask(messages, tools=[LOOKUP])
        messages.append(message)
        for call in message.get("tool_calls", []):
            word = json.loads(call["function"]["arguments"] or "{}").get("word", "")
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"{word}: a word"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": "Go on."})
    if messages[-1]["role"] == "user":  # the last "Go on.": the note request takes its place
        messages.pop()
    messages.append({"role": "user", "content": "Write a short note of what you know."})
    note = ask(messages, tools=[LOOKUP]).get("content") or ""  # the same tools: one session
    fresh = [{"role": "user", "content": f"Note: {note}\n\nQuestion: {task['prompt']}"}]
    return ask(fresh).get("content") or ""


_episodes = itertools.count()
_lock = threading.Lock()


def flaky(task: dict, base_url: str, api_key: str) -> str:
    with _lock:
        k = next(_episodes)
    if k % 3 == 0:
        raise RuntimeError(f"the agent's own bug on {task['task_id']}")
    if k % 3 == 1:
        time.sleep(60)  # past timeout_s: the episode is ended as a timeout
    return run(task, base_url, api_key)
