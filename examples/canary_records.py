"""Canary two Records-v0 releases with scripted agents, so that shadow copies, scoped writes and
rollback act on real writes (a random or untrained model makes no tool calls at all).

Offline, shadow and live traffic are disjoint held-out tasks; each task acts on its own store
(``store_per_task``). The baseline and the first candidate are the env's scripted solver: the
candidate is promoted, and shadow reports the writes it compared. The second candidate solves
the offline gate but writes 0 instead of the right value on traffic: shadow lists the tasks
whose tool effects differ from the baseline's, and the release is rolled back before any live
write.

    python examples/canary_records.py
"""

from __future__ import annotations

import json

import envs  # noqa: F401  (registers the environments)
from envs.records.env import solver_plan, solver_progress
from envs.runner import Completion
from evals.canary import CanaryPlan, Candidate, LiveSystem, run
from evals.gates import Criterion
from evals.splits import default_splits

RECORDS = "agent_rl/Records-v0"


class Solver:
    """The env's scripted solver as a policy: the task found by its prompt, progress read from
    the messages. ``careless_on``: prompts on which it writes 0 instead of the right value."""

    def __init__(self, tasks, careless_on=frozenset()):
        self.tasks, self.careless_on = {t.prompt: t for t in tasks}, careless_on

    def generate(self, batch, sampling):
        return [Completion(self.reply(messages)) for messages in batch]

    def reply(self, messages) -> str:
        prompt = messages[1]["content"]
        steps, answer = solver_plan(self.tasks[prompt], branching=False)
        done, _ = solver_progress(messages, steps)
        if done == len(steps):
            return answer
        tool, arguments = steps[done]["tool"], dict(steps[done]["arguments"])
        if tool == "update" and prompt in self.careless_on:
            arguments["value"] = "0"
        return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def release(name: str, policy: Solver, baseline: Solver, tasks) -> None:
    offline, shadow, live = tasks[:20], tasks[20:40], tasks[40:]
    plan = CanaryPlan(
        env_id=RECORDS, offline_tasks=offline, shadow_tasks=shadow, live_tasks=live,
        criteria=[Criterion(name="success", metric="success", kind="min", threshold=0.8),
                  Criterion(name="no regression", kind="no_regression", margin=0.05)],
        canary_criteria=[Criterion(name="canary success", metric="success", kind="min",
                                   threshold=0.7)],
        canary_fraction=0.5, store_per_task=True, n_boot=2000,
        live=LiveSystem(store={t.task_id: t.data for t in shadow + live}, serving="b" * 64))
    result = run(Candidate(name, "c" * 64, policy, current_hash=lambda: "c" * 64),
                 Candidate("baseline", "b" * 64, baseline, current_hash=lambda: "b" * 64), plan)
    print(f"--- {name}: {result.status} at {result.stage}")
    for reason in result.reasons:
        print(f"  {reason}")
    if result.rollback is not None:
        print(f"  live store restored to {result.rollback.store_hash[:12]}")


def main() -> None:
    tasks = list(default_splits(RECORDS, 128, seed=0)["holdout"])  # 64 held-out tasks
    traffic = {t.prompt for t in tasks[20:]}
    release("careful", Solver(tasks), Solver(tasks), tasks)
    release("careless", Solver(tasks, careless_on=traffic), Solver(tasks), tasks)


if __name__ == "__main__":
    main()
