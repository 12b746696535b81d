"""Evaluation runs: one record per episode, slice summaries against hand-computed numbers,
JSONL round trip."""

from __future__ import annotations

import ast
import operator

import pytest

import envs
from envs import TaskMeta, TaskSpec
from envs.runner import Completion, Sampling
from evals.run import (
    EvalRecord,
    read_records,
    run_eval,
    slice_members,
    slice_summary,
    write_episodes,
    write_records,
)
from evals.stats import wilson
from trajectories import Outcome, RewardBreakdown, RolloutStore


def evaluate(*args, **kwargs) -> list[EvalRecord]:
    """The records of ``run_eval`` (what most of these tests look at)."""
    return run_eval(*args, **kwargs).records


ARITH = "agent_rl/Arithmetic-v0"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def expression(messages) -> str:
    prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return prompt.split("Compute ", 1)[1].split(". Answer", 1)[0]


def calc(expr: str) -> int:
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"not arithmetic: {expr}")

    return ev(ast.parse(expr, mode="eval").body)


class Oracle:
    """Parses the expression from the prompt and answers its value (2 'tokens' a reply)."""

    def generate(self, batch, sampling):
        return [Completion(str(calc(expression(m))), token_ids=[1, 2], logprobs=[-0.5, -0.25])
                for m in batch]


class Zero:
    def generate(self, batch, sampling):
        return [Completion("0") for _ in batch]


class AtomicOnly:
    """Right on one-operation expressions, '0' on composed ones."""

    def generate(self, batch, sampling):
        return [Completion(str(calc(e)) if "(" not in e else "0") for e in map(expression, batch)]


def arith_task(task_id: str, expr: str, ops: list[str]) -> TaskSpec:
    return TaskSpec(task_id=task_id, prompt=f"Compute {expr}. Answer with just the number.",
                    target=calc(expr), meta=TaskMeta(
                        skills=ops, structure=">".join(ops), entity_group="integers",
                        length=len(ops), difficulty=len(ops)))


# Two atomic and two composed tasks. AtomicOnly answers: t1 "5" (1.0, correct), t2 "8" (1.0,
# correct), t3 "0" for 6 (a bare wrong number: format only, 0.2, wrong), t4 "0" for 0 (1.0,
# correct).
HAND = [
    arith_task("t1", "2 + 3", ["add"]),
    arith_task("t2", "4 * 2", ["mul"]),
    arith_task("t3", "(1 + 1) * 3", ["add", "mul"]),
    arith_task("t4", "(5 - 5) * 2", ["sub", "mul"]),
]


@pytest.fixture(scope="module")
def pool():
    env = envs.make(ARITH)
    tasks = env.unwrapped.task_pool(40, seed=0)
    env.close()
    return tasks


def test_oracle_records_one_per_episode(pool):
    records = evaluate(Oracle(), ARITH, pool, Sampling(temperature=0.0), seed=5,
                       samples_per_task=2, policy_name="oracle", bundle_hash="abc123", num_envs=8)
    assert len(records) == 2 * len(pool)
    assert [r.task_id for r in records] == [t.task_id for t in pool for _ in range(2)]
    assert [r.sample_id for r in records] == [0, 1] * len(pool)
    assert len({r.episode_id for r in records}) == len(records)
    by_id = {t.task_id: t for t in pool}
    for r in records:
        meta = by_id[r.task_id].meta
        assert r.success and r.outcome == "correct" and r.reward == pytest.approx(1.0)
        assert r.components == {"accuracy": 1.0, "format": 1.0, "exact": 1.0}
        assert (r.policy_name, r.bundle_hash, r.env_id) == ("oracle", "abc123", ARITH)
        assert (r.structure, r.entity_group, r.length, r.difficulty) == (
            meta.structure, meta.entity_group, meta.length, meta.difficulty)
        assert r.skills == meta.skills and r.atomic == (len(meta.skills) == 1)
        assert r.composition == ("atomic" if len(meta.skills) == 1 else "composed")
        assert (r.sessions, r.compressions, r.branches) == (1, 0, 0)
        assert r.generated_tokens == 2 and not r.hint_shown and not r.infra_fault
        assert r.latency_s > 0
    rows = slice_summary(records, by="composition", n_boot=500)
    assert {row["composition"]: row["success/rate"] for row in rows} == {"atomic": 1.0, "composed": 1.0}
    assert sum(row["n"] for row in rows) == 80 and sum(row["n_tasks"] for row in rows) == 40


def test_zero_policy_scores_by_target(pool):
    records = evaluate(Zero(), ARITH, pool, Sampling())
    for task, r in zip(pool, records, strict=True):
        if task.target == 0:
            assert r.success and r.reward == pytest.approx(1.0)
        else:
            assert r.outcome == "wrong" and not r.success and r.reward == pytest.approx(0.2)
        assert r.generated_tokens == 0
    overall = slice_summary(records, by=(), n_boot=200)[0]
    k = sum(t.target == 0 for t in pool)
    assert overall["success/k"] == k and overall["n"] == 40
    assert overall["success/rate"] == pytest.approx(k / 40)
    assert overall["reward/mean"] == pytest.approx((k * 1.0 + (40 - k) * 0.2) / 40)


def test_evaluation_is_hint_free_unless_hinted_is_asked_for(pool):
    # env kwargs that show hints in training do not reach evaluation ...
    hidden = evaluate(Oracle(), ARITH, pool[:3], Sampling(), env_kwargs={"hints": True})
    assert not any(r.hint_shown for r in hidden)
    assert not any("Hint:" in t.prompt for t in pool[:3])  # the prompt itself has none
    # ... only the explicit, separately named option shows them, and says so
    shown = evaluate(Oracle(), ARITH, pool[:3], Sampling(), hinted=True)
    assert all(r.hint_shown for r in shown)


def test_records_carry_the_split_they_were_drawn_from(pool):
    records = evaluate(Oracle(), ARITH, pool[:2], Sampling(), split="holdout_structure")
    assert [r.split for r in records] == ["holdout_structure"] * 2
    assert {r.split for r in evaluate(Oracle(), ARITH, pool[:1], Sampling())} == {"train"}


def test_slice_summary_hand_checked():
    records = evaluate(AtomicOnly(), ARITH, HAND, Sampling(), samples_per_task=2)
    assert [(r.task_id, r.reward, r.outcome.value) for r in records[::2]] == [
        ("t1", 1.0, "correct"), ("t2", 1.0, "correct"), ("t3", pytest.approx(0.2), "wrong"),
        ("t4", 1.0, "correct")]
    rows = {row["composition"]: row for row in slice_summary(records, by="composition", n_boot=2000)}
    # atomic: rewards [1, 1, 1, 1], 4 successes of 4 over 2 tasks
    atomic = rows["atomic"]
    assert (atomic["n"], atomic["n_tasks"], atomic["success/k"]) == (4, 2, 4)
    assert (atomic["reward/mean"], atomic["reward/lo"], atomic["reward/hi"]) == (1.0, 1.0, 1.0)
    # Wilson(4, 4): hi = 1; z^2 = 3.841459, z^2 / n = 0.960365, z^2 / (4 n^2) = 0.060023;
    # centre = (1 + 0.480182) / 1.960365 = 0.755054,
    # half = 1.959964 * sqrt(0 + 0.060023) / 1.960365 = 0.244946, lo = 0.510108
    assert atomic["success/lo"] == pytest.approx(0.5101, abs=1e-4) and atomic["success/hi"] == 1.0
    # composed: t3 twice at 0.2, t4 twice at 1.0 -> mean 0.6. Whole tasks are resampled: the
    # mean of 2 drawn clusters is 0.2 (p 1/4), 0.6 (1/2) or 1.0 (1/4), so the 2.5% and 97.5%
    # quantiles are 0.2 and 1.0.
    composed = rows["composed"]
    assert (composed["n"], composed["n_tasks"], composed["success/k"]) == (4, 2, 2)
    assert composed["reward/mean"] == pytest.approx(0.6)
    assert composed["reward/lo"] == pytest.approx(0.2) and composed["reward/hi"] == pytest.approx(1.0)
    # Wilson(2, 4): centre 0.5, half = 1.959964 * sqrt(0.0625 + 0.060023) / 1.960365 = 0.349962
    assert composed["success/rate"] == 0.5
    assert (composed["success/lo"], composed["success/hi"]) == pytest.approx((0.1500, 0.8500), abs=1e-4)
    assert (composed["success/lo"], composed["success/hi"]) == pytest.approx(wilson(2, 4))

    by_structure = slice_summary(records, by="structure", n_boot=200)
    assert [row["structure"] for row in by_structure] == ["add", "add>mul", "mul", "sub>mul"]
    assert [row["reward/mean"] for row in by_structure] == pytest.approx([1.0, 0.2, 1.0, 1.0])
    assert [row["success/rate"] for row in by_structure] == [1.0, 0.0, 1.0, 1.0]
    two_keys = slice_summary(records, by=("entity_group", "composition"), n_boot=200)
    assert [(r["entity_group"], r["composition"], r["n"]) for r in two_keys] == [
        ("integers", "atomic", 4), ("integers", "composed", 4)]


def test_slice_summary_leaves_infrastructure_faults_out():
    records = evaluate(AtomicOnly(), ARITH, HAND[:2], Sampling())
    fault = records[0].model_copy(update={"episode_id": "x", "outcome": "sandbox_error",
                                          "success": False, "infra_fault": True, "reward": 0.0})
    row = slice_summary([*records, fault], by=(), n_boot=100)[0]
    assert (row["n"], row["n_infra_faults"], row["reward/mean"], row["success/rate"]) == (2, 1, 1.0, 1.0)


def test_slice_summary_refuses_mixed_policies():
    a = evaluate(Zero(), ARITH, HAND, Sampling(), policy_name="zero")
    b = evaluate(Oracle(), ARITH, HAND, Sampling(), policy_name="oracle")
    with pytest.raises(ValueError, match="policy_name"):
        slice_summary(a + b)
    rows = slice_summary(a + b, by=("policy_name",), n_boot=100)
    assert {r["policy_name"]: r["success/rate"] for r in rows} == {"oracle": 1.0, "zero": 0.25}
    with pytest.raises(ValueError, match="no such field"):
        slice_summary(a, by="colour")


def test_jsonl_round_trip(tmp_path):
    records = evaluate(Oracle(), ARITH, HAND, Sampling(), samples_per_task=2, bundle_hash="h1")
    path = write_records(records, tmp_path / "sub" / "eval.jsonl")
    assert path.read_text().count("\n") == len(records)
    back = read_records(path)
    assert back == records
    assert [r.composition for r in back] == ["atomic"] * 4 + ["composed"] * 4
    assert slice_summary(back, n_boot=100) == slice_summary(records, n_boot=100)
    path.write_text(path.read_text() + '{"task_id": "broken"\n')
    with pytest.raises(ValueError, match=r"eval.jsonl:9"):
        read_records(path)


def test_empty_task_list():
    assert evaluate(Oracle(), ARITH, [], Sampling()) == []
    assert slice_summary([]) == []


def test_record_composition_of_a_task_without_skills():
    record = evaluate(Oracle(), ARITH, HAND[:1], Sampling())[0]
    bare = EvalRecord.model_validate({**record.model_dump(), "skills": [], "atomic": False})
    assert bare.composition == "unknown"


def test_run_eval_keeps_every_episode_beside_its_record(tmp_path):
    run = run_eval(AtomicOnly(), ARITH, HAND, Sampling(), samples_per_task=2, split="holdout")
    assert len(run.episodes) == len(run.records) == 8
    assert [e.episode_id for e in run.episodes] == [r.episode_id for r in run.records]
    assert [EvalRecord.from_episode(e).reward for e in run.episodes] == [r.reward for r in run.records]
    timeless = lambda records: [r.model_dump(exclude={"latency_s"}) for r in records]  # noqa: E731
    assert timeless(evaluate(AtomicOnly(), ARITH, HAND, Sampling(), samples_per_task=2,
                             split="holdout")) == timeless(run.records)  # evaluate: the records
    # an infrastructure fault is stored too, and says so
    fault = run.episodes[0].evolve(reward=RewardBreakdown.from_components(
        {"accuracy": 0.0}, {"accuracy": 1.0}, Outcome.sandbox_error, "hand@1"), episode_id="x",
        sessions=[s.model_copy(update={"episode_id": "x"}) for s in run.episodes[0].sessions])
    path = write_episodes([*run.episodes, fault], tmp_path / "ev" / "episodes.jsonl")
    store = RolloutStore(path)
    assert store.verify().ok and store.cursor == 9
    back = list(store.read())
    assert back[:8] == run.episodes and back[8].reward.is_infrastructure_fault
    assert EvalRecord.from_episode(back[8]).infra_fault


def test_write_episodes_replaces_the_file_whole(tmp_path):
    first = run_eval(Oracle(), ARITH, HAND, Sampling()).episodes
    path = write_episodes(first, tmp_path / "episodes.jsonl.zst")
    again = run_eval(Zero(), ARITH, HAND[:2], Sampling()).episodes
    write_episodes(again, path)  # as write_records does: the new evaluation, never both
    assert list(RolloutStore(path).read()) == again and path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    assert [p.name for p in tmp_path.iterdir()] == ["episodes.jsonl.zst"]  # no temp file left
    write_episodes([], path)
    assert path.is_file() and RolloutStore(path).cursor == 0


def test_slice_members_are_the_rows_records():
    records = evaluate(AtomicOnly(), ARITH, HAND, Sampling(), samples_per_task=2)
    for row in slice_summary(records, by=("structure", "composition"), n_boot=50):
        members = slice_members(records, {"structure": row["structure"],
                                          "composition": row["composition"]})
        assert len(members) == row["n"] and {r.structure for r in members} == {row["structure"]}
    assert slice_members(records, {}) == records
    assert [r.task_id for r in slice_members(records, {"skills": ["add", "mul"]})] == ["t3"] * 2


def test_held_out_summary_counts_sub_agents_and_their_use():
    from agent_rl.training.metrics import session_and_hint_metrics, summarize_eval
    from trajectories.testing import episode, session

    def ep(i: int, branches: list[bool]):
        root = session("root", episode_id=f"ep-{i}")
        subs = [session(f"b{j}", "root", "branch", episode_id=f"ep-{i}", used_by_final=used)
                for j, used in enumerate(branches)]
        return episode([root, *subs], 0.5, episode_id=f"ep-{i}", task_id=f"t{i}",
                       final_session_id="root")

    # 4 episodes: two sub-agents (one used), one (used), none, none
    episodes = [ep(0, [True, False]), ep(1, [True]), ep(2, []), ep(3, [])]
    step = session_and_hint_metrics(episodes, None)  # the training step's metrics
    assert step["sessions/branches"] == 3 and step["sessions/branch_used_frac"] == 2 / 3
    records = [EvalRecord.from_episode(e) for e in episodes]
    assert [r.branches_used for r in records] == [1, 1, 0, 0]
    out = summarize_eval(records)
    assert out["branches_per_episode"] == 3 / 4
    assert out["branched_frac"] == 2 / 4
    assert out["branch_used_frac"] == 2 / 3
    assert summarize_eval(records[2:])["branch_used_frac"] == 0.0  # no sub-agent: 0, not NaN
