"""Write Relay-v0's tasks as a tasks file for an agent written as code (Agent-v0).

    python examples/agents/make_relay_tasks.py --n 384 --out examples/agents/relay_tasks.jsonl

One JSON object a line: ``id``, ``prompt`` (every fact and the question: what the task is
about, for the leakage checks), ``answer`` (the number), the metadata columns ``skills``,
``structure``, ``entity_group``, ``length`` (sessions a correct agent needs: 2 or 3),
``difficulty`` (from which the compositional holdout is chosen, as for Relay-v0), and what the
agent reads: ``parts`` (the facts, in the batches Relay-v0 shows them: one batch per note),
``requests`` (Relay-v0's note request after each batch: which lines to copy), ``question``, and
the worked examples Relay-v0 opens its sessions with: ``note_example`` (the first note's) and
``answer_example`` (the answer's: same entities' family and operation), each ``[user, reply]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from envs.relay import RelayEnv, note_request


def rows(n: int, seed: int) -> list[dict]:
    env = RelayEnv()
    out = []
    for task in env.task_pool(n, seed=seed):
        data, meta = task.data, task.meta
        env.reset(options={"task": task})  # Relay-v0's worked examples for this task
        note_example, answer_example = env.examples(0)[0], env.examples(len(data["batches"]))[0]
        parts = ["\n".join(data["facts"][j] for j in batch) for batch in data["batches"]]
        seen: set[int] = set()
        requests = []
        for batch in data["batches"]:  # each note keeps the needed facts shown so far
            seen |= set(batch)
            requests.append(note_request([data["facts"][j] for j in data["needed"] if j in seen]))
        out.append({"id": task.task_id, "prompt": "\n".join(parts) + f"\n\n{data['question']}",
                    "answer": task.target["answer"], "skills": meta.skills,
                    "structure": meta.structure, "entity_group": meta.entity_group,
                    "length": meta.length, "difficulty": meta.difficulty, "parts": parts,
                    "requests": requests, "question": data["question"],
                    "note_example": list(note_example), "answer_example": list(answer_example)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=384, help="tasks (default: 384)")
    parser.add_argument("--seed", type=int, default=0, help="Relay-v0's task_pool seed")
    parser.add_argument("--out", default="examples/agents/relay_tasks.jsonl", metavar="PATH")
    args = parser.parse_args()
    path = Path(args.out)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(args.n, args.seed)))
    print(f"{path}: {args.n} Relay-v0 tasks")


if __name__ == "__main__":
    main()
