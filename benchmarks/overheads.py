"""Everything in a rollout that is not the model: environment, runner, rendering, filtering and
credit, as a fraction of rollout time, for every built-in environment.

For each env id, one GRPO batch (``--tasks`` tasks x ``--group`` samples) is rolled out as
``agent_rl.training.rollout.rollout_batch`` does it, with the pieces timed apart:

    policy     HFPolicy.generate (the model: prefill, decode, sampling, detokenising)
    env        reset + step of every environment (tool calls, rewards, context budgets
               counted with the policy's chat template, episode records): wall time, so
               steps that run at once (``concurrent_steps`` envs) count once
    runner     run_episodes' own bookkeeping (the rest of its wall time)
    post       truncation, group filtering, credit (trajectories.assign), advantages and
               rendering every kept session to token ids and masks (build_sequences)

and overhead = (env + runner + post) / total. The target is under 2%.

CodeTests-v0 is measured several ways in the same run, alternating ``--repeats`` times (the
median run of each is printed): as it is by default (in bwrap: every run a fork of the sandbox's
warm fork server, ``envs.sandbox.FORK_SERVER``; identical code for the same task run once,
``share_runs``), with ``share_runs=False`` (every episode's code run), with ``prestart=True``
(each episode's sandbox set up at ``reset``, while the policy generates; not shared), and, in
bwrap, the last two again with a fresh bwrap and interpreter per run (``FORK_SERVER =
False``). Each batch starts with no finished run to share (``codetests.SHARED_RUNS``
cleared): only its own episodes' identical answers are shared, as in a training step on new
tasks; ``runs`` and ``shared`` count them. Compare the totals, not only the overheads: where
the policy keeps every core busy, work moved to ``reset`` comes out of generation.
Before any timed batch, one empty program runs in the sandbox: bwrap's fork server starts once
per process (~40 ms), with a training run's first episode, not in every batch.

    python benchmarks/overheads.py                    # SmolLM2-135M-Instruct (GGUF)
    python benchmarks/overheads.py --model tiny       # a smoke run

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import gymnasium

import envs
from agent_rl.policies.hf import HFPolicy
from agent_rl.policies.models import load_model
from agent_rl.training.rollout import apply_truncation, build_sequences, filter_groups
from envs import codetests, sandbox
from envs.runner import Sampling, run_episodes


class Timed(gymnasium.Wrapper):
    """Records the (start, end) of every reset and step in a shared list."""

    def __init__(self, env: gymnasium.Env, spans: list[tuple[float, float]]):
        super().__init__(env)
        self.spans = spans

    def reset(self, **kwargs):
        start = time.perf_counter()
        try:
            return self.env.reset(**kwargs)
        finally:
            self.spans.append((start, time.perf_counter()))

    def step(self, action):
        start = time.perf_counter()
        try:
            return self.env.step(action)
        finally:
            self.spans.append((start, time.perf_counter()))


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one span was open (overlapping spans count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class TimedPolicy:
    def __init__(self, policy: HFPolicy, clock: dict[str, float]):
        self.policy, self.clock = policy, clock
        self.count_tokens = policy.count_tokens

    def generate(self, batch, sampling):
        start = time.perf_counter()
        try:
            return self.policy.generate(batch, sampling)
        finally:
            self.clock["policy"] += time.perf_counter() - start


def measure(env_id: str, policy: HFPolicy, tasks: int, group: int, max_new: int, seed: int,
            **env_kwargs: Any) -> dict[str, Any]:
    clock = {"policy": 0.0}
    spans: list[tuple[float, float]] = []
    codetests.SHARED_RUNS.clear()
    pool = [Timed(envs.make(env_id, **env_kwargs), spans) for _ in range(tasks * group)]
    specs = pool[0].unwrapped.task_pool(tasks, seed=seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=max_new, seed=seed, max_prompt_tokens=1536)
    start = time.perf_counter()
    episodes = run_episodes(pool, specs, TimedPolicy(policy, clock), sampling,
                            samples_per_task=group, seed=seed)
    episodes_s = time.perf_counter() - start
    clock["env"] = covered(spans)
    post_start = time.perf_counter()
    episodes = [apply_truncation(e, "keep", 0.0) for e in episodes]
    episodes, _ = filter_groups(episodes, dynamic_sampling=False)
    sequences, _ = build_sequences(policy.tokenizer, episodes, "broadcast", {}, "per_episode",
                                   "population", "group", 1e-6)
    post = time.perf_counter() - post_start
    total = episodes_s + post
    runner = episodes_s - clock["env"] - clock["policy"]
    for env in pool:
        env.close()
    audits = [e.reward.audit for e in episodes if "shared_run" in e.reward.audit]
    return {"episodes": len(episodes), "sessions": len(sequences),
            "runs": sum(not a["shared_run"] for a in audits),
            "shared": sum(a["shared_run"] for a in audits),
            "tokens": sum(s.generated_tokens for e in episodes for s in e.sessions),
            "total_s": round(total, 5), "policy_s": round(clock["policy"], 5),
            "env_s": round(clock["env"], 5), "runner_s": round(runner, 5), "post_s": round(post, 5),
            "overhead_frac": round((clock["env"] + runner + post) / total, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | a local HF folder")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", help="measure only this env id (repeatable; "
                    "default: every built-in env)")
    ap.add_argument("--sandbox", default="auto", help="CodeTests-v0's sandbox backend")
    ap.add_argument("--repeats", type=int, default=3, help="CodeTests-v0 runs each way")
    args = ap.parse_args()
    built_in = [e for e in envs.list_envs()  # the stepped ones: Agent-v0 runs an agent's code
                if e.startswith("agent_rl/") and not envs.registry.runs_whole_episodes(e)]
    unknown = sorted(set(args.env or ()) - set(built_in))
    if unknown:
        ap.error(f"unknown env ids {unknown}; built in: {', '.join(built_in)}")

    model, tokenizer = load_model(args.model)
    policy = HFPolicy(model.eval().requires_grad_(False), tokenizer)
    result: dict[str, Any] = {"model": args.model, "tasks": args.tasks, "group": args.group,
                              "sandbox": sandbox.choose_backend(args.sandbox)}
    measure("agent_rl/Arithmetic-v0", policy, 1, 2, 4, args.seed)  # warm-up
    if "agent_rl/CodeTests-v0" in (args.env or built_in):  # the fork server's start, once
        sandbox.run("pass", backend=args.sandbox)
    print(f"{'env':<50}{'total s':>9}{'policy s':>10}{'env s':>8}{'runner s':>10}{'post s':>8}"
          f"{'overhead':>10}{'runs':>6}{'shared':>8}")
    for env_id in args.env or built_in:
        run = functools.partial(measure, env_id, policy, args.tasks, args.group,
                                args.max_new_tokens, args.seed)
        if env_id == "agent_rl/CodeTests-v0":
            ways = {"": (True, False, True), "runs not shared": (True, False, False),
                    "prestart on": (True, True, False)}
            if result["sandbox"] == "bwrap":
                ways |= {"fresh bwrap": (False, False, False),
                         "fresh bwrap, prestart on": (False, True, False)}
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in ways}
            for _ in range(args.repeats):  # alternated: the machine's drift hits them all
                for label, (forks, prestart, share) in ways.items():
                    sandbox.FORK_SERVER = forks
                    runs[label].append(run(backend=args.sandbox, prestart=prestart,
                                           share_runs=share))
            sandbox.FORK_SERVER = True
            rows = {f"{env_id} {label}".strip(): median_run(r) for label, r in runs.items()}
            result[env_id + " runs"] = {label or "default": r for label, r in runs.items()}
        else:
            rows = {env_id: run()}
        for name, r in rows.items():
            result[name] = r
            print(f"{name:<50}{r['total_s']:>9.2f}{r['policy_s']:>10.2f}{r['env_s']:>8.3f}"
                  f"{r['runner_s']:>10.3f}{r['post_s']:>8.3f}{r['overhead_frac']:>10.2%}"
                  f"{r['runs']:>6}{r['shared']:>8}",
                  flush=True)
    print(json.dumps(result))


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median overhead (its own figures, so they add up)."""
    return sorted(runs, key=lambda r: r["overhead_frac"])[len(runs) // 2]


if __name__ == "__main__":
    main()
