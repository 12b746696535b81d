"""The policy server's cost: the same Relay episodes rolled out by an agent written as code
through the server, and by the built-in environment, side by side in one run.

    agent     ``agent_rl/Agent-v0`` running ``examples/agents/relay_agent.py:run`` (an
              ordinary ``openai``-client script) on ``examples/agents/relay_tasks.jsonl``:
              every model call goes over HTTP to ``envs.agent_proxy.PolicyServer``, which
              batches the concurrent calls into the policy's ``generate``
    built-in  ``agent_rl/Relay-v0`` stepped by ``envs.runner.run_episodes``

Both go through ``agent_rl.training.rollout.rollout_batch`` as a training step does (collect,
truncation, group filtering, credit, advantages, rendering to token ids and masks), with the
same HFPolicy, the same tasks (the tasks file is Relay-v0's ``task_pool(384, seed=0)``, so the
ids match), the same sampling (the contract's: the server ignores the agent's own
``temperature`` and ``max_tokens``) and the same random streams (call c of job k samples from
the stream (seed + k, c) on both sides). Every repeat rolls out the same episodes on both
sides, alternating which side goes first.

    overhead          (agent - built-in) / built-in, rollout wall time (target: under 10%)
    per-token         the same on seconds per generated token: the agent's prompts hold its
                      own worked examples and its notes are not cut to 40 words, so its
                      prompts and sampled lengths differ a little from Relay-v0's
    policy / other    seconds inside ``generate`` / the rest (env steps, runner, rendering,
                      and for the agent: HTTP, JSON, the openai client, the server's parsing
                      and recording, the batching window, inferring the session tree)
    calls, batches    model calls answered / ``generate`` calls: a round the server splits
                      into several batches costs policy time (and loses shared prefills)
    window <=         batches x ``window_s``: the most the batching window can have waited
                      (a batch takes calls arriving within ``window_s`` of the one before)
    no model          the agent side again with a policy that answers at once, with the
                      window and without: milliseconds a call of HTTP, JSON, the client,
                      the server and scoring, and how many batches the window saved

OpenMP waits passively (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it): on a
shared, loaded machine the spinning wait of the main thread's OpenMP team made the same
``generate`` 10-40x slower in the main thread (where the runner calls it) than in the
server's batcher thread, which measured the machine's load, not the server.

The median repeat of each side is printed with the spread (min-max over repeats) of the
ratios. The last line is one JSON object with every figure.

    python benchmarks/agent_proxy.py                  # SmolLM2-135M-Instruct (GGUF), minutes
    python benchmarks/agent_proxy.py --model tiny     # the tiny random test model
    python benchmarks/agent_proxy.py --smoke          # seconds: a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (docstring)

import envs  # noqa: E402
from agent_rl.policies.hf import HFPolicy  # noqa: E402
from agent_rl.policies.models import load_model  # noqa: E402
from agent_rl.policies.render import conversation_ids  # noqa: E402
from agent_rl.training.rollout import RolloutSettings, rollout_batch  # noqa: E402
from envs.agents import run_agent_episodes  # noqa: E402
from envs.core import TaskSpec  # noqa: E402
from envs.runner import Completion, Sampling  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGENT_ID, BUILT_IN_ID = "agent_rl/Agent-v0", "agent_rl/Relay-v0"
WINDOW_S = 0.05  # the batching window Agent-v0 runs its server with (run_agent_episodes)
AGENT_KWARGS = {  # as examples/smollm2_agent.yaml sets them, paths from this repository
    "agent": f"{ROOT / 'examples/agents/relay_agent.py'}:run",
    "tasks": {"path": str(ROOT / "examples/agents/relay_tasks.jsonl"), "task_id": "id",
              "meta": {k: k for k in ("skills", "structure", "entity_group", "length",
                                      "difficulty", "parts", "requests", "question")}},
    "reward": "numeric", "timeout_s": 600}
POOL = 384  # rows of the tasks file: Relay-v0's task_pool(384, seed=0)


class TimedPolicy:
    """Wraps a policy: the wall time inside ``generate``, its calls, and the conversations,
    prompt tokens and generated tokens it answered."""

    def __init__(self, policy: HFPolicy):
        self.policy, self.count_tokens = policy, policy.count_tokens
        self.seconds, self.batches, self.calls, self.prompt_tokens, self.tokens = 0.0, 0, 0, 0, 0

    def generate(self, batch, sampling: Sampling) -> list[Completion]:
        start = time.perf_counter()
        try:
            out = self.policy.generate(batch, sampling)
        finally:
            self.seconds += time.perf_counter() - start
        self.batches += 1
        self.calls += len(out)
        self.prompt_tokens += sum(c.prompt_tokens or len(c.prompt_ids) for c in out)
        self.tokens += sum(len(c.token_ids) for c in out)
        return out


def same_tasks(n: int) -> dict[str, list[TaskSpec]]:
    """Relay-v0's first ``n`` tasks of ``task_pool(POOL, seed=0)`` and the same ids' rows of
    the tasks file, in the same order."""
    relay = envs.make(BUILT_IN_ID).unwrapped.task_pool(n, seed=0)
    rows = {t.task_id: t for t in envs.make(AGENT_ID, **AGENT_KWARGS).unwrapped.task_pool(POOL)}
    missing = [t.task_id for t in relay if t.task_id not in rows]
    if missing:
        raise SystemExit(f"{AGENT_KWARGS['tasks']['path']} has no rows {missing[:3]}: rewrite "
                         "it with examples/agents/make_relay_tasks.py")
    return {AGENT_ID: [rows[t.task_id] for t in relay], BUILT_IN_ID: relay}


def rollout(env_id: str, policy: HFPolicy, tasks: list[TaskSpec], group: int,
            sampling: Sampling, seed: int) -> dict[str, Any]:
    """One training step's rollout of ``tasks`` x ``group`` on ``env_id``, timed."""
    timed = TimedPolicy(policy)
    settings = RolloutSettings(env_id=env_id, group_size=group, sampling=sampling,
                               env_kwargs=AGENT_KWARGS if env_id == AGENT_ID else {},
                               truncation="keep", dynamic_sampling=False)
    start = time.perf_counter()
    batch = rollout_batch(timed, policy.tokenizer, tasks, settings, seed=seed)
    total = time.perf_counter() - start
    faults = sum(e.reward.outcome.value == "sandbox_error" for e in batch.episodes)
    return {"episodes": len(batch.episodes), "faults": faults, "sessions": len(batch.sequences),
            "calls": timed.calls, "batches": timed.batches, "tokens": timed.tokens,
            "prompt_tokens": timed.prompt_tokens, "total_s": round(total, 4),
            "policy_s": round(timed.seconds, 4), "other_s": round(total - timed.seconds, 4),
            "s_per_token": total / max(timed.tokens, 1),
            "reward_mean": round(statistics.fmean(e.reward.total for e in batch.episodes), 4)}


class InstantPolicy:
    """A policy with no model: every call is answered at once with the same short reply
    (``text`` as ``tokenizer`` encodes it, the prompt rendered by its chat template so the
    server can infer the session tree). What is left of a rollout is its machinery."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.memo = tokenizer, {}
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.text, self.count_tokens = text, None

    def generate(self, batch, sampling: Sampling) -> list[Completion]:
        prompts = [conversation_ids(self.tokenizer, messages, self.memo) for messages in batch]
        return [Completion(self.text, list(self.ids), [0.0] * len(self.ids),
                           prompt_ids=list(p), prompt_tokens=len(p)) for p in prompts]


def machinery(tokenizer, tasks: list[TaskSpec], group: int, sampling: Sampling, seed: int,
              window_s: float) -> dict[str, Any]:
    """The agent side with an instant policy (``InstantPolicy``) and batching window
    ``window_s``: the seconds per model call of everything but the model."""
    env = envs.make(AGENT_ID, **AGENT_KWARGS).unwrapped
    timed = TimedPolicy(InstantPolicy(tokenizer, "The gold box has code 61."))
    start = time.perf_counter()
    run_agent_episodes(env.agent, tasks, timed, env.scorer, sampling, samples_per_task=group,
                       seed=seed, concurrency=len(tasks) * group, window_s=window_s)
    total = time.perf_counter() - start
    return {"window_s": window_s, "calls": timed.calls, "batches": timed.batches,
            "total_s": round(total, 4), "ms_per_call": round(1e3 * total / max(timed.calls, 1), 3)}


def ratio(a: float, b: float) -> float:
    return (a - b) / b


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per repeat: the overhead on wall time and on time per generated token; their median
    and range, and each side's median run."""
    pairs = list(zip(runs[AGENT_ID], runs[BUILT_IN_ID], strict=True))
    wall = [ratio(a["total_s"], b["total_s"]) for a, b in pairs]
    per_token = [ratio(a["s_per_token"], b["s_per_token"]) for a, b in pairs]
    return {"overhead": round(statistics.median(wall), 4),
            "overhead_range": [round(min(wall), 4), round(max(wall), 4)],
            "overhead_per_token": round(statistics.median(per_token), 4),
            "overhead_per_token_range": [round(min(per_token), 4), round(max(per_token), 4)],
            "overheads": [round(w, 4) for w in wall],
            "overheads_per_token": [round(p, 4) for p in per_token]}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    print(f"{'side':<10}{'total s':>9}{'policy s':>10}{'other s':>9}{'calls':>7}{'batches':>9}"
          f"{'tokens':>8}{'ms/token':>10}{'faults':>8}")
    for name, r in rows.items():
        print(f"{name:<10}{r['total_s']:>9.2f}{r['policy_s']:>10.2f}{r['other_s']:>9.2f}"
              f"{r['calls']:>7}{r['batches']:>9}{r['tokens']:>8}{1e3 * r['s_per_token']:>10.2f}"
              f"{r['faults']:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | a local HF folder")
    ap.add_argument("--episodes", type=int, default=32, help="episodes a rollout (tasks x group)")
    ap.add_argument("--group", type=int, default=8, help="samples a task (a GRPO group)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts a side, alternated")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: tiny model, 2 episodes, 1 repeat, 8 new tokens")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.episodes, args.group, args.repeats, args.max_new_tokens = "tiny", 2, 2, 1, 8
    if args.episodes < 1 or args.group < 1 or args.episodes % args.group:
        ap.error(f"--episodes ({args.episodes}) must be a positive multiple of --group "
                 f"({args.group})")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    model, tokenizer = load_model(args.model)
    policy = HFPolicy(model.eval().requires_grad_(False), tokenizer)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        seed=args.seed, max_prompt_tokens=1024)
    tasks = same_tasks(args.episodes // args.group)
    print(f"model {args.model}, {len(tasks[AGENT_ID])} tasks x {args.group} samples, "
          f"T={args.temperature:g}, <= {args.max_new_tokens} new tokens, "
          f"{args.repeats} repeats")
    # warm-up at full concurrency (short replies): imports, caches, and Agent-v0's scoring
    # workers (one per episode scored at once, each ~0.4 s to start; kept for later steps)
    for env_id, specs in tasks.items():
        rollout(env_id, policy, specs, args.group, replace(sampling, max_new_tokens=4), args.seed)
    runs: dict[str, list[dict[str, Any]]] = {AGENT_ID: [], BUILT_IN_ID: []}
    for r in range(args.repeats):  # alternated: the machine's drift hits both sides
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for env_id in order:
            runs[env_id].append(rollout(env_id, policy, tasks[env_id], args.group, sampling,
                                        args.seed))
    rows = {"agent": median_run(runs[AGENT_ID]), "built-in": median_run(runs[BUILT_IN_ID])}
    print_table(rows)
    result = {"model": args.model, "tasks": len(tasks[AGENT_ID]), "group": args.group,
              "repeats": args.repeats, "sampling": sampling.to_dict(), "window_s": WINDOW_S,
              "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
              **summary(runs), "agent": rows["agent"], "built_in": rows["built-in"],
              "runs": {"agent": runs[AGENT_ID], "built_in": runs[BUILT_IN_ID]}}
    result["window_bound_s"] = round(rows["agent"]["batches"] * WINDOW_S, 4)
    result["machinery"] = [machinery(tokenizer, tasks[AGENT_ID], args.group, sampling,
                                     args.seed, w) for w in (WINDOW_S, 0.0)]
    lo, hi = result["overhead_range"]
    tlo, thi = result["overhead_per_token_range"]
    print(f"server overhead {result['overhead']:+.1%} of rollout time (range {lo:+.1%} to "
          f"{hi:+.1%})")
    print(f"per generated token {result['overhead_per_token']:+.1%} (range {tlo:+.1%} to "
          f"{thi:+.1%}); target under 10%")
    print(f"batching window: at most {result['window_bound_s']:.2f} s "
          f"({rows['agent']['batches']} batches x {WINDOW_S:g} s)")
    for m in result["machinery"]:
        print(f"no model, window {m['window_s']:g} s: {m['ms_per_call']:.1f} ms a call "
              f"({m['calls']} calls, {m['batches']} batches)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
