"""The Relay task as an ordinary agent script: it reads facts, keeps a note, and answers from
the note alone. It imports nothing from agent-rl; any OpenAI-compatible server can run it:

    python examples/agents/relay_agent.py --base-url http://localhost:8000/v1 --task-file \
        examples/agents/relay_tasks.jsonl

and agent-rl trains it unchanged (examples/smollm2_agent.yaml: ``env.kwargs.agent:
examples/agents/relay_agent.py:run``).

The agent compresses its own context. For each part of the facts it starts a fresh message
list holding its note so far and that part, and asks for a note (the lines the task says to
copy); then it starts a fresh message list holding only the last note and the question, and
returns the reply. A note keeps at most its first 40 words. The first message list and the
answering one open with a worked example of their kind (a prompt, never trained on: the
task's ``note_example`` and ``answer_example`` where it has them, else a generic one). agent-rl
sees a chain of sessions joined by compressions: the facts, (more facts,) the answer.
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


NOTE_WORDS = 40  # what of a note the agent keeps


def ask(client: OpenAI, example: tuple[str, str] | None, text: str, max_tokens: int) -> str:
    """One call on a fresh message list: the system prompt, a worked example if any, ``text``."""
    shown = [{"role": "user", "content": example[0]},
             {"role": "assistant", "content": example[1]}] if example else []
    messages = [{"role": "system", "content": SYSTEM}, *shown, {"role": "user", "content": text}]
    reply = client.chat.completions.create(model="policy", messages=messages,
                                           max_tokens=max_tokens, temperature=0.0)
    return (reply.choices[0].message.content or "").strip()


def run(task: dict, base_url: str, api_key: str) -> str:
    """Read the task's facts part by part into a note, then answer from the note."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    meta = task["meta"]
    note = ""
    for i, (part, request) in enumerate(zip(meta["parts"], meta["requests"], strict=True)):
        shown = f"Your note: {note}\n\nMore facts:\n{part}" if i else part
        example = None if i else tuple(meta.get("note_example") or NOTE_EXAMPLE)
        reply = ask(client, example, f"{shown}\n\n{request}", max_tokens=48)
        note = " ".join(reply.split()[:NOTE_WORDS])
    return ask(client, tuple(meta.get("answer_example") or ANSWER_EXAMPLE),
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
