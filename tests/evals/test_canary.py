"""Canary release: a regressed candidate stops offline, live failures and inconclusive gates roll
back to the pre-canary store, swapped weights are refused, shadow never writes live, a good
candidate is promoted, and the rollback drill restores bundle, conversations and tool effects.
A real bundle corrupted or unmarked after the gates is refused at promotion (the CLI's wiring);
shadow reports the tool effects it compared; tasks with their own stores act on their own entry.

Offline gate: Arithmetic-v0, answered by parsing the expression. Shadow and canary: Records-v0
tasks built on one shared live store (disjoint records, so serving order does not change any
task's answer), solved by the env's own scripted solver driven from the messages alone.
"""

from __future__ import annotations

import ast
import copy
import json
import operator
import re

import numpy as np
import pytest
import torch

import envs  # noqa: F401  (registers the environments)
from agent_rl.cli.canary import bundle_candidate
from agent_rl.policies.load import LoadedPolicy
from agent_rl.run.checkpoint import bundle_hash, save_bundle, verify_bundle
from envs import TaskMeta, TaskSpec
from envs.arithmetic import ArithmeticEnv
from envs.records.env import solver_plan, solver_progress
from envs.records.world import COLLECTIONS, STRUCTURES, _chain, _Draw, make_store
from envs.runner import Completion
from evals.canary import (
    ARTIFACT_CHANGED,
    MARGIN,
    CanaryPlan,
    Candidate,
    LiveSystem,
    RollbackError,
    canary_split,
    live_task_count,
    release_plan,
    rollback_drill,
    run,
)
from evals.gates import Criterion
from evals.splits import default_splits
from trajectories import Outcome
from trajectories.hashing import canonical_hash

RECORDS = "agent_rl/Records-v0"
BASE, CAND = "b" * 64, "c" * 64
OFFLINE = [Criterion(name="held-out success", metric="success", kind="min", threshold=0.8),
           Criterion(name="no regression", kind="no_regression", margin=0.05)]
CANARY = [Criterion(name="canary success", metric="success", kind="min", threshold=0.7),
          Criterion(name="canary errors", metric="error_rate", kind="max", threshold=0.3)]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


# --- tasks on one shared store ---------------------------------------------------------------


def traffic(store: dict, n: int, seed: int, prefix: str, avoid=()) -> list[TaskSpec]:
    """``n`` Records tasks on ``store``, none with a prompt in ``avoid`` (policies tell tasks
    apart by prompt); no task touches a record an earlier task writes."""
    rng = np.random.default_rng(seed)
    tasks, read, written = [], set(), set()
    for i in range(10 * n):
        if len(tasks) == n:
            break
        structure = STRUCTURES[i % len(STRUCTURES)]
        d = _Draw(rng, store)
        coll = d.pick(COLLECTIONS)
        prompt, steps, answer, diff = _chain(structure, d, coll)
        ids = {s["arguments"]["id"] for s in steps if "id" in s["arguments"]}
        writes = {s["arguments"]["id"] for s in steps if s["tool"] == "update"}
        if ids & written or writes & read or prompt in avoid:
            continue
        read, written = read | ids, written | writes
        skills = structure.split(">")
        tasks.append(TaskSpec(
            task_id=f"{prefix}-{len(tasks)}", prompt=prompt,
            meta=TaskMeta(skills=skills, structure=structure, entity_group=coll,
                          length=len(steps), difficulty=len(skills)),
            target={"answer": answer, "diff": diff, "solution": [
                {"item": 0, "steps": steps, "delegate": None, "returns": None}]},
            data=store, write_scopes=sorted(writes)))
    assert len(tasks) == n, "store too small for disjoint tasks"
    return tasks


STORE = make_store(np.random.default_rng(11), size=60)
SHADOW = traffic(STORE, 20, seed=1, prefix="shadow")
LIVE = traffic(STORE, 100, seed=2, prefix="live", avoid={t.prompt for t in SHADOW})
LIVE_PROMPTS = {t.prompt for t in LIVE}
HELD_OUT = ArithmeticEnv().task_pool(30, seed=5)
UNTOUCHED = next(rid for rid in sorted(STORE["people"])
                 if all(rid not in json.dumps(t.target) for t in SHADOW + LIVE))


# --- deterministic policies ------------------------------------------------------------------


def calc(expr: str) -> int:
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        return node.value

    return ev(ast.parse(expr, mode="eval").body)


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Agent:
    """Right on everything here: Arithmetic by parsing, Records by the env's scripted solver
    (the task looked up by its prompt, progress read from the messages)."""

    def __init__(self, tasks=()):
        self.tasks = {t.prompt: t for t in [*SHADOW, *LIVE, *tasks]}

    def generate(self, batch, sampling):
        return [Completion(self.reply(messages)) for messages in batch]

    def reply(self, messages) -> str:
        prompt = messages[1]["content"]
        if prompt.startswith("Compute "):
            return str(calc(prompt.split("Compute ", 1)[1].split(". Answer", 1)[0]))
        steps, answer = solver_plan(self.tasks[prompt], branching=False)
        done, _ = solver_progress(messages, steps)
        if done < len(steps):
            return tool_call(steps[done]["tool"], steps[done]["arguments"])
        return answer


class Zero(Agent):
    """The regressed candidate: always answers 0."""

    def reply(self, messages) -> str:
        return "0"


class DriftsOnLive(Agent):
    """Fine offline and in shadow; on live traffic it writes 7 everywhere and answers nonsense."""

    def reply(self, messages) -> str:
        action = super().reply(messages)
        if messages[1]["content"] not in LIVE_PROMPTS:
            return action
        if '"name": "update"' in action:
            call = json.loads(action.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            return tool_call("update", {**call["arguments"], "value": "7"})
        return action if action.startswith("<tool_call>") else "not sure"


class WritesElsewhere(Agent):
    """On live traffic its writes go to a record no task may touch; it watches that record."""

    def __init__(self, live: LiveSystem):
        super().__init__()
        self.live, self.seen = live, []

    def reply(self, messages) -> str:
        self.seen.append(copy.deepcopy(self.live.store["people"][UNTOUCHED]))
        action = super().reply(messages)
        if messages[1]["content"] not in LIVE_PROMPTS:
            return action
        if messages[-1]["content"].startswith("error: permission denied"):
            return "done"
        if '"name": "update"' in action:
            return tool_call("update", {"collection": "people", "id": UNTOUCHED,
                                        "field": "city", "value": "Nowhere"})
        return action


class SwapsWeights(Agent):
    """Someone overwrites the artifact on disk while the canary runs."""

    def __init__(self, artifact: dict):
        super().__init__()
        self.artifact = artifact

    def reply(self, messages) -> str:
        if messages[1]["content"] in LIVE_PROMPTS:
            self.artifact["hash"] = "d" * 64
        return super().reply(messages)


class LeaksIntoLive(Agent):
    """Reaches past its sandbox: edits the live store directly while it runs in shadow."""

    def __init__(self, live: LiveSystem):
        super().__init__()
        self.live = live

    def reply(self, messages) -> str:
        if messages[1]["content"] in {t.prompt for t in SHADOW}:
            self.live.store["people"][UNTOUCHED]["city"] = "Leaked"
        return super().reply(messages)


class SpoilsBundle(Agent):
    """Damages its own bundle on disk once live traffic reaches it (after every gate)."""

    def __init__(self, path, how: str):
        super().__init__()
        self.path, self.how, self.spoiled = path, how, False

    def reply(self, messages) -> str:
        if messages[1]["content"] in LIVE_PROMPTS and not self.spoiled:
            self.spoiled = True
            if self.how == "unmark":
                (self.path / "COMPLETE").unlink()
            else:
                weights = bytearray((self.path / "model.safetensors").read_bytes())
                weights[-1] ^= 0x01
                (self.path / "model.safetensors").write_bytes(bytes(weights))
        return super().reply(messages)


class WritesSevenInShadow(Agent):
    """Writes 7 instead of the right value, in shadow only."""

    def reply(self, messages) -> str:
        action = super().reply(messages)
        if messages[1]["content"] in LIVE_PROMPTS or '"name": "update"' not in action:
            return action
        call = json.loads(action.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        return tool_call("update", {**call["arguments"], "value": "7"})


class CrashesOnLive(Agent):
    def reply(self, messages) -> str:
        if messages[1]["content"] in LIVE_PROMPTS:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return super().reply(messages)


# --- plans -----------------------------------------------------------------------------------


def fixed(name: str, digest: str, policy) -> Candidate:
    return Candidate(name, digest, policy, current_hash=lambda: digest)


def plan_for(**overrides) -> CanaryPlan:
    fields = dict(env_id=RECORDS, offline_env_id="agent_rl/Arithmetic-v0",
                  offline_tasks=HELD_OUT, criteria=OFFLINE, shadow_tasks=SHADOW,
                  live_tasks=LIVE, canary_fraction=0.15, canary_criteria=CANARY,
                  n_boot=2000, live=LiveSystem(store=STORE, serving=BASE))
    return CanaryPlan(**{**fields, **overrides})


def release(policy, **overrides):
    plan = plan_for(**overrides)
    result = run(fixed("candidate", CAND, policy), fixed("baseline", BASE, Agent()), plan)
    return result, plan.live


def stage(result, name):
    return next(s for s in result.stages if s.stage == name)


@pytest.fixture(scope="module")
def promoted():
    return release(Agent())


# --- tests -----------------------------------------------------------------------------------


def test_a_regressed_candidate_stops_at_the_offline_gate():
    result, live = release(Zero())
    assert (result.status, result.stage) == ("stopped", "offline")
    assert result.stages[0].status == "fail" and result.rollback is None
    assert any(r.startswith("FAIL held-out success") for r in result.stages[0].reasons)
    assert live.serving == BASE == result.serving and live.history == []
    assert live.store_hash() == canonical_hash(STORE) and live.conversations == []


def test_a_good_candidate_is_promoted(promoted):
    result, live = promoted
    assert (result.status, result.stage) == ("promoted", "promote")
    assert [s.status for s in result.stages] == ["pass"] * 4
    assert live.serving == CAND == result.serving and live.canary is None
    assert [(e.kind, e.serving_before, e.serving_after) for e in live.history] == [
        ("promote", BASE, CAND)]
    canary = stage(result, "canary")
    assert len(canary.candidate_records) == 15 and len(canary.baseline_records) == 85
    assert {r.bundle_hash for r in canary.candidate_records} == {CAND}
    served = [c["served_by"] for c in live.conversations]
    assert len(served) == 100 and served.count(CAND) == 15
    assert live.store_hash() == canary.hashes["live_after"] != canonical_hash(STORE)  # writes kept


def test_shadow_writes_land_on_a_copy_never_on_the_live_store(promoted):
    result, _ = promoted
    shadow = stage(result, "shadow")
    assert shadow.hashes["live_before"] == shadow.hashes["live_after"] == canonical_hash(STORE)
    assert shadow.hashes["shadow_after"] != shadow.hashes["live_before"]  # the copy was written
    assert any(t.meta.structure.endswith("update") for t in SHADOW)
    assert all(r.success for r in shadow.candidate_records)
    canary = stage(result, "canary")
    assert canary.hashes["live_before"] == canonical_hash(STORE)  # nothing leaked before the canary


def test_a_candidate_that_fails_on_live_traffic_is_rolled_back():
    result, live = release(DriftsOnLive())
    assert [s.status for s in result.stages[:2]] == ["pass", "pass"]
    assert (result.status, result.stage) == ("rolled_back", "canary")
    canary = stage(result, "canary")
    assert canary.status == "fail"
    assert canary.hashes["live_after"] != canary.hashes["live_before"]  # its writes landed
    assert live.store_hash() == canary.hashes["live_before"] == result.store_hash
    assert result.rollback.store_hash_before == canary.hashes["live_after"]
    assert live.conversations == [] and live.serving == BASE and live.canary is None
    assert [e.kind for e in live.history] == ["rollback"]
    assert "canary success" in live.history[0].reason


def test_writes_outside_the_canary_scope_are_refused():
    live = LiveSystem(store=STORE, serving=BASE)
    policy = WritesElsewhere(live)
    plan = plan_for(live=live)
    result = run(fixed("candidate", CAND, policy), fixed("baseline", BASE, Agent()), plan)
    assert (result.status, result.stage) == ("rolled_back", "canary")
    outcomes = {r.outcome for r in stage(result, "canary").candidate_records}
    assert Outcome.policy_violation in outcomes
    assert all(rec == STORE["people"][UNTOUCHED] for rec in policy.seen)  # never written
    assert live.store_hash() == canonical_hash(STORE)


@pytest.mark.parametrize("restriction", [{"canary_writes": "none"},
                                         {"canary_allowed_tools": ["search", "get", "transform"]}])
def test_restricted_canary_permissions_refuse_writes(restriction):
    result, live = release(Agent(), **restriction)
    canary = stage(result, "canary")
    writers = [r for r in canary.candidate_records if r.structure.endswith("update")]
    # the scripted solver retries the refused write until the turn limit
    assert writers and all(r.outcome == Outcome.tool_error for r in writers)
    assert (result.status, result.stage) == ("rolled_back", "canary")
    assert live.store_hash() == canonical_hash(STORE)


def test_a_shadow_run_that_touches_the_live_store_is_rolled_back():
    live = LiveSystem(store=STORE, serving=BASE)
    plan = plan_for(live=live)
    result = run(fixed("candidate", CAND, LeaksIntoLive(live)), fixed("baseline", BASE, Agent()),
                 plan)
    assert (result.status, result.stage) == ("rolled_back", "shadow")
    shadow = stage(result, "shadow")
    assert shadow.status == "fail" and shadow.reasons[0].startswith("FAIL shadow wrote")
    assert shadow.hashes["live_after"] != shadow.hashes["live_before"]
    assert live.store_hash() == canonical_hash(STORE) and live.history[0].kind == "rollback"


@pytest.mark.parametrize("where", ["offline", "canary"])
def test_an_inconclusive_gate_never_promotes(where):
    too_many = [c.model_copy(update={"min_n": 1000}) for c in (OFFLINE if where == "offline"
                                                                 else CANARY)]
    key = "criteria" if where == "offline" else "canary_criteria"
    result, live = release(Agent(), **{key: too_many})
    assert stage(result, where).status == "inconclusive" and result.stage == where
    assert result.status == ("stopped" if where == "offline" else "rolled_back")
    assert live.serving == BASE and live.store_hash() == canonical_hash(STORE)
    assert all(e.kind != "promote" for e in live.history)


def test_weights_swapped_after_evaluation_are_refused_at_promotion():
    artifact = {"hash": CAND}
    candidate = Candidate("candidate", CAND, SwapsWeights(artifact),
                          current_hash=lambda: artifact["hash"])
    plan = plan_for()
    result = run(candidate, fixed("baseline", BASE, Agent()), plan)
    assert stage(result, "canary").status == "pass"
    assert (result.status, result.stage) == ("rolled_back", "promote")
    assert stage(result, "promote").reasons[0].startswith(ARTIFACT_CHANGED)
    assert plan.live.serving == BASE and plan.live.store_hash() == canonical_hash(STORE)
    assert plan.live.conversations == []


@pytest.mark.parametrize(("how", "named"), [("flip", r"model\.safetensors: sha256 differs"),
                                             ("unmark", r"COMPLETE is missing")])
def test_a_bundle_corrupted_after_the_gates_is_refused_at_promotion(tmp_path, how, named):
    path = save_bundle(tmp_path, 1, model=torch.nn.Linear(4, 2), meta={})
    address = verify_bundle(path)
    loaded = LoadedPolicy(SpoilsBundle(path, how), "candidate", path, address)
    plan = plan_for()
    result = run(bundle_candidate(loaded), fixed("baseline", BASE, Agent()), plan)
    assert bundle_hash(path) == address  # the manifest alone does not see the damage
    assert stage(result, "canary").status == "pass"
    assert (result.status, result.stage) == ("rolled_back", "promote")
    reason = stage(result, "promote").reasons[0]
    assert reason.startswith("FAIL the artifact does not verify now") and str(path) in reason
    assert re.search(named, reason)
    assert plan.live.serving == BASE and plan.live.store_hash() == canonical_hash(STORE)


def test_shadow_reports_the_tool_effects_it_compared(promoted):
    compared = stage(promoted[0], "shadow").compared
    assert compared.tasks == len(SHADOW) and compared.differing == []
    writers = sum(bool(t.target["diff"]) for t in SHADOW)
    assert writers and compared.writing_tasks == {"candidate": writers, "baseline": writers}
    assert compared.tool_calls["candidate"] == compared.tool_calls["baseline"] > len(SHADOW)

    result, _ = release(WritesSevenInShadow())
    shadow = stage(result, "shadow")
    assert shadow.compared.differing == [t.task_id for t in SHADOW if t.target["diff"]]
    assert f"tool effects differ on {writers} (" in shadow.reasons[-1]


def test_tasks_with_their_own_stores_act_on_their_own_entry():
    held_out = list(default_splits(RECORDS, 64, seed=0)["holdout"])
    shadow, live_tasks = held_out[:10], held_out[10:34]
    stores = {t.task_id: t.data for t in shadow + live_tasks}
    live = LiveSystem(store=stores, serving=BASE)
    result = run(fixed("candidate", CAND, Agent(held_out)),
                 fixed("baseline", BASE, Agent(held_out)),
                 plan_for(shadow_tasks=shadow, live_tasks=live_tasks, canary_fraction=0.5,
                          shadow_criteria=OFFLINE[1:], store_per_task=True, live=live))
    assert (result.status, result.stage) == ("promoted", "promote")
    canary = stage(result, "canary")
    assert all(r.success for r in canary.candidate_records + canary.baseline_records)
    assert stage(result, "shadow").compared.writing_tasks["candidate"] > 0
    for task in live_tasks:  # every write landed on its own task's store, nowhere else
        want = copy.deepcopy(task.data)
        for coll, records in task.target["diff"].items():
            for rid, fields in records.items():
                want[coll][rid].update({f: change["new"] for f, change in fields.items()})
        assert live.store[task.task_id] == want
    with pytest.raises(ValueError, match="no store for tasks"):
        plan_for(shadow_tasks=shadow, live_tasks=live_tasks, store_per_task=True,
                 live=LiveSystem(store={}, serving=BASE))


def test_an_artifact_that_does_not_match_its_hash_is_not_evaluated():
    candidate = Candidate("candidate", CAND, Agent(), current_hash=lambda: "e" * 64)
    plan = plan_for()
    result = run(candidate, fixed("baseline", BASE, Agent()), plan)
    assert (result.status, result.stage) == ("stopped", "offline")
    assert result.stages[0].candidate_records == []


def test_a_crash_during_the_canary_rolls_back():
    result, live = release(CrashesOnLive())
    assert (result.status, result.stage) == ("rolled_back", "canary")
    assert "CUDA error" in stage(result, "canary").reasons[0]
    assert live.store_hash() == canonical_hash(STORE) and live.conversations == []


def test_rollback_drill_restores_bundle_conversations_and_tool_effects():
    live = LiveSystem(store=STORE, serving=BASE, conversations=[{"episode_id": "e0"}])
    snapshot = live.snapshot()
    live.serving = CAND
    live.store["people"][UNTOUCHED]["city"] = "Nowhere"
    live.conversations.append({"episode_id": "e1"})
    report = rollback_drill(live, snapshot)
    assert (report.serving, live.serving) == (BASE, BASE)
    assert report.store_hash == snapshot.store_hash == canonical_hash(STORE) != report.store_hash_before
    assert live.conversations == [{"episode_id": "e0"}]
    live.store["people"][UNTOUCHED]["city"] = "Elsewhere"  # the snapshot is not aliased
    assert rollback_drill(live, snapshot).store_hash == canonical_hash(STORE)
    assert [e.kind for e in live.history] == ["rollback", "rollback"]
    forged = snapshot.model_copy(update={"store_hash": "0" * 64})
    with pytest.raises(RollbackError, match="did not reproduce"):
        rollback_drill(live, forged)


def test_live_system_owns_its_store():
    live = LiveSystem(store=STORE, serving=BASE)
    live.store["people"][UNTOUCHED]["age"] = -1
    assert STORE["people"][UNTOUCHED]["age"] != -1


def test_canary_split_is_seeded_and_at_least_one():
    assert canary_split(100, 0.15, seed=0) == canary_split(100, 0.15, seed=0)
    assert sum(canary_split(100, 0.15, seed=0)) == 15
    assert sum(canary_split(5, 0.01, seed=0)) == 1


def test_paired_canary_criteria_are_rejected():
    with pytest.raises(ValueError, match="never pair"):
        plan_for(canary_criteria=OFFLINE)


def test_the_baseline_must_be_what_is_served():
    with pytest.raises(ValueError, match="must be what is served"):
        run(fixed("candidate", CAND, Agent()), fixed("baseline", "f" * 64, Agent()), plan_for())


def test_a_release_plan_from_held_out_tasks():
    """release_plan (what `agent-rl canary` builds): the first n tasks offline and again in
    shadow, the rest live, enough for the candidate's share to be about n; the gate is no
    regression within MARGIN plus the acceptance bounds, the canary keeps only the bounds;
    greedy replies. A fraction outside (0, 1) or too few tasks is refused, saying what to
    change."""
    from agent_rl.run.contract import AcceptanceSection

    tasks = HELD_OUT[:7]
    assert live_task_count(3, 0.75) == 4 and live_task_count(2, 0.5) == 4
    plan = release_plan("agent_rl/Arithmetic-v0", tasks, 3, 0.75,
                        AcceptanceSection(max_error_rate=0.1), 16, 5, "base-hash")
    assert plan.offline_tasks == plan.shadow_tasks == tasks[:3] and plan.live_tasks == tasks[3:]
    assert plan.criteria[0].kind == "no_regression" and plan.criteria[0].margin == MARGIN
    assert [c.name for c in plan.canary_criteria] == [c.name for c in plan.criteria[1:]]
    assert plan.canary_criteria and all(c.kind != "no_regression" for c in plan.canary_criteria)
    assert (plan.sampling.temperature, plan.sampling.max_new_tokens, plan.seed) == (0.0, 16, 5)
    assert plan.live.serving == "base-hash" and plan.canary_fraction == 0.75
    for fraction in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
            live_task_count(3, fraction)
    with pytest.raises(ValueError, match="too few for 3 offline and shadow tasks"):
        release_plan("agent_rl/Arithmetic-v0", tasks[:3], 3, 0.75, AcceptanceSection(), 16, 5,
                     "base-hash")
