"""Can the embedded SmolLM2-135M-Instruct call ``spawn`` at all? The rate of valid calls.

    python benchmarks/spawn_rate.py            # n=48 per condition, greedy, T=0.7 and T=1.0

A call is valid when ``HermesParser`` parses it, it is named ``spawn`` and its ``task`` is a
non-empty string (what ``envs.sessions.control_action`` turns into a ``Spawn``). Conditions:

* ``longrecords``: the first turn of LongRecords-v0 (``branching=True``): the env's own system
  message with every tool schema, ``spawn`` included, and a task the scripted solver delegates;
* ``relay``: the first turn of Relay-v0 (``branching=True``): facts, a worked example of a
  spawn call, and the explicit request to delegate the question with the needed facts;
* ``explicit``: the same tool instructions with one example call, and a user turn that says
  to call spawn: ``Use the spawn tool to start a sub-agent with the task "...". Reply with
  only the tool call.``

This decides whether a branching Relay-v0 variant could learn anything (docs/concepts.md).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import envs  # noqa: E402
from agent_rl.policies.hf import HFPolicy  # noqa: E402
from agent_rl.policies.models import load_model  # noqa: E402
from envs.runner import Sampling  # noqa: E402
from envs.sessions import Spawn, control_action  # noqa: E402
from envs.tools import HermesParser  # noqa: E402

EXAMPLE = ('Example: <tool_call>{"name": "spawn", "arguments": {"task": "Find the city of '
           'person PER-0001."}}</tool_call>')


def conversations(n: int) -> dict[str, list[list[dict]]]:
    env = envs.make("agent_rl/LongRecords-v0").unwrapped
    first_turns, explicit = [], []
    for task in env.task_pool(n, seed=5):
        obs, _ = env.reset(seed=0, options={"task": task})
        first_turns.append(obs)
        sub_task = next(b["delegate"] for b in task.target["solution"] if b["delegate"])
        explicit.append([{"role": "system", "content": obs[0]["content"] + "\n" + EXAMPLE},
                         {"role": "user", "content": f'Use the spawn tool to start a sub-agent '
                                                     f'with the task "{sub_task}". Reply with '
                                                     'only the tool call.'}])
    relay_env = envs.make("agent_rl/Relay-v0", branching=True).unwrapped
    relay = [relay_env.reset(seed=0, options={"task": task})[0]
             for task in relay_env.task_pool(n, seed=5)]
    return {"longrecords": first_turns, "relay": relay, "explicit": explicit}


def valid_spawn(text: str) -> bool:
    return any(isinstance(control_action(call, can_spawn=True, in_branch=False), Spawn)
               for call in HermesParser().parse(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, tokenizer = load_model("smollm2-135m")
    policy = HFPolicy(model, tokenizer, batch_size=16)
    print("| condition | temperature | valid spawn calls | rate |\n|---|---|---|---|")
    for name, batch in conversations(args.n).items():
        for t in args.temperatures:
            out = policy.generate(batch, Sampling(temperature=t, max_new_tokens=64, seed=3))
            k = sum(valid_spawn(c.text) for c in out)
            print(f"| {name} | {t} | {k}/{len(out)} | {k / len(out):.2f} |", flush=True)


if __name__ == "__main__":
    main()
