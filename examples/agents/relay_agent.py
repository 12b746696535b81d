"""The Relay task as an ordinary agent script: it reads facts, keeps a note, and answers from
the note alone. It imports nothing from agent-rl; any OpenAI-compatible server can run it:

    python examples/agents/relay_agent.py --base-url http://localhost:8000/v1 --task-file \
        examples/agents/relay_tasks.jsonl

and agent-rl trains it unchanged (examples/smollm2_agent.yaml: ``env.kwargs.agent:
examples/agents/relay_agent.py:run``).

The agent compresses its own context. For each part of the facts it starts a fresh message
list holding its note so far and that part, and asks for a note (the lines the task says to
copy); then it starts a fresh message list holding only the last note and the question, and
returns the reply. Each message list opens with one worked example of its kind (a prompt,
never trained on). agent-rl sees a chain of sessions joined by compressions: the facts, (more
facts,) the answer.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

SYSTEM = ("You are a careful assistant. When asked for a note, copy the needed facts exactly, "
          "numbers included. When asked a question, reply with only the final number.")
NOTE_EXAMPLE = ("The gray box has code 25.\nThe gold box has code 61.\nThe silver box has code 83."
                "\n\nCopy the line that starts with \"The gold box has code\".",
                "The gold box has code 61.")
ANSWER_EXAMPLE = ("Your note: The gold box has code 61.\n\nQuestion: What is the code of the gold "
                  "box?\nAnswer with just the number.", "61")


def ask(client: OpenAI, example: tuple[str, str], text: str, max_tokens: int) -> str:
    """One call on a fresh message list: the system prompt, a worked example, ``text``."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": example[0]},
                {"role": "assistant", "content": example[1]},
                {"role": "user", "content": text}]
    reply = client.chat.completions.create(model="policy", messages=messages,
                                           max_tokens=max_tokens, temperature=0.0)
    return (reply.choices[0].message.content or "").strip()


def run(task: dict, base_url: str, api_key: str) -> str:
    """Read the task's facts part by part into a note, then answer from the note."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    meta = task["meta"]
    note = ""
    for part, request in zip(meta["parts"], meta["requests"], strict=True):
        shown = f"Your note: {note}\n\nMore facts:\n{part}" if note else part
        note = ask(client, NOTE_EXAMPLE, f"{shown}\n\n{request}", max_tokens=48)
    return ask(client, ANSWER_EXAMPLE,
               f"Your note: {note}\n\nQuestion: {meta['question']}\nAnswer with just the number.",
               max_tokens=16)


def main() -> None:
    parser = argparse.ArgumentParser(description="run the Relay agent on a few tasks")
    parser.add_argument("--base-url", required=True, help="an OpenAI-compatible /v1 URL")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--task-file", default="examples/agents/relay_tasks.jsonl")
    parser.add_argument("--n", type=int, default=3, help="tasks (default: 3)")
    args = parser.parse_args()
    with open(args.task_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f.read().splitlines()[:args.n]]
    for row in rows:  # the task as agent-rl hands it over: id, prompt and metadata
        task = {"task_id": row["id"], "prompt": row["prompt"], "meta": row}
        print(f"{row['id']}: {run(task, args.base_url, args.api_key)!r} "
              f"(expected {row['answer']})")


if __name__ == "__main__":
    main()
