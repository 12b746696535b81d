"""agent_rl.training.curriculum: pass rates estimated through a scripted policy on Arithmetic-v0 are
exactly known, so the kept set, the inclusive band edges, the token cost and the per-difficulty
record are checked by hand; then the trainer on the tiny model: the band's cost in the budget,
its record, an empty band refused before anything is written, and an exact resume."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import envs
from agent_rl.run.contract import ExperimentContract
from agent_rl.training import curriculum, train
from agent_rl.training.curriculum import CurriculumError, Selection, TaskEstimate
from envs.runner import Completion, Sampling, stream_seed
from tests.agent_rl.test_train import bundle_params_hash, read_jsonl

ARITH = "agent_rl/Arithmetic-v0"
TOKENS = 3  # every scripted reply is 3 tokens
REPO = Path(__file__).resolve().parents[2]

# arith-0-7 (difficulty 1) always right, arith-0-2 (2) right every other call, arith-0-3 (2)
# always wrong, arith-0-1 (1) right with extra words (outcome correct, reward 0.5: it passes)
PLAN = {"arith-0-7": "right", "arith-0-2": "alternate", "arith-0-3": "wrong", "arith-0-1": "verbose"}


@pytest.fixture(scope="module")
def tasks():
    pool = {t.task_id: t for t in envs.make(ARITH).unwrapped.task_pool(12, seed=0)}
    return [pool[task_id] for task_id in PLAN]


class Scripted:
    """Answers every task as PLAN says: the target, the target + 1 (a bare wrong number, reward
    0.2: partial credit that never passes), alternately (right on the task's 1st, 3rd, ...
    call), or the target inside a sentence."""

    def __init__(self, tasks):
        self.tasks = {t.prompt: t for t in tasks}
        self.calls: Counter = Counter()

    def generate(self, batch, sampling):
        out = []
        for messages in batch:
            task = self.tasks[messages[-1]["content"]]
            mode, n = PLAN[task.task_id], self.calls[task.task_id]
            self.calls[task.task_id] += 1
            right = mode in ("right", "verbose") or (mode == "alternate" and n % 2 == 0)
            text = str(task.target if right else task.target + 1)
            out.append(Completion(f"It is {text} I think" if mode == "verbose" else text,
                                  token_ids=[5] * TOKENS, logprobs=[-0.5] * TOKENS))
        return out


def estimates_of(tasks, k=2, **kwargs):
    return curriculum.estimate_pass_rates(Scripted(tasks), ARITH, tasks, k=k,
                                          sampling=Sampling(seed=0), **kwargs)


def test_pass_rates_are_exact(tasks):
    estimates = estimates_of(tasks, k=2)
    assert [(e.task_id, e.passes, e.samples, e.pass_rate) for e in estimates] == [
        ("arith-0-7", 2, 2, 1.0), ("arith-0-2", 1, 2, 0.5), ("arith-0-3", 0, 2, 0.0),
        ("arith-0-1", 2, 2, 1.0)]
    assert [e.difficulty for e in estimates] == [1, 2, 2, 1]
    assert estimates_of(tasks, k=4)[1].pass_rate == 0.5  # 2 of 4


@pytest.mark.parametrize("band, kept", [
    ((0.5, 1.0), ["arith-0-7", "arith-0-2", "arith-0-1"]),  # both edges are inclusive
    ((0.0, 0.5), ["arith-0-2", "arith-0-3"]),
    ((0.1, 0.9), ["arith-0-2"]),
    ((0.0, 1.0), list(PLAN)),
    ((1.0, 1.0), ["arith-0-7", "arith-0-1"]),
    ((0.0, 0.0), ["arith-0-3"]),
])
def test_the_kept_set_is_the_band_edges_included(tasks, band, kept):
    chosen = curriculum.select(estimates_of(tasks), *band, round_=0, step=1, k=2)
    assert chosen.kept == kept and not chosen.kept_previous
    assert chosen.dropped == [t for t in PLAN if t not in kept]
    assert [t.task_id for t in chosen.tasks(tasks[::-1])] == kept[::-1]  # the split's order


def test_the_estimate_costs_every_generated_token(tasks):
    chosen = curriculum.select(estimates_of(tasks, k=2), 0.1, 0.9, round_=0, step=1, k=2)
    assert [e.tokens for e in chosen.estimates] == [2 * TOKENS] * 4
    assert chosen.tokens == len(PLAN) * 2 * TOKENS == chosen.record()["tokens_generated"]
    assert chosen.metrics(1) == {"curriculum/round": 0, "curriculum/kept": 1,
                                 "curriculum/dropped": 3, "curriculum/tokens_generated": 24}
    assert chosen.metrics(2)["curriculum/tokens_generated"] == 0  # counted once, at its step


def test_the_record_counts_kept_and_dropped_per_difficulty(tasks):
    chosen = curriculum.select(estimates_of(tasks), 0.1, 0.9, round_=0, step=1, k=2)
    record = json.loads(json.dumps(chosen.record()))  # what curriculum.jsonl holds
    assert record["by_difficulty"] == {
        "1": {"estimated": 2, "kept": 0, "dropped": 2, "too_hard": 0, "too_easy": 2, "no_rate": 0},
        "2": {"estimated": 2, "kept": 1, "dropped": 1, "too_hard": 1, "too_easy": 0, "no_rate": 0}}
    assert [(t["task_id"], t["pass_rate"], t["kept"]) for t in record["tasks"]] == [
        ("arith-0-7", 1.0, False), ("arith-0-2", 0.5, True), ("arith-0-3", 0.0, False),
        ("arith-0-1", 1.0, False)]
    assert (record["step"], record["round"], record["k"], record["min"], record["max"]) == \
        (1, 0, 2, 0.1, 0.9)
    assert (record["estimated"], record["kept"], record["dropped"]) == (4, 1, 3)


def test_infrastructure_faults_are_no_samples():
    faulty = [TaskEstimate("a", 1, passes=1, samples=1, faults=1), TaskEstimate("b", 1, 0, 0, 2)]
    assert [e.pass_rate for e in faulty] == [1.0, None]
    chosen = curriculum.select(faulty, 0.0, 1.0, round_=0, step=1, k=2)
    assert chosen.kept == ["a"] and chosen.by_difficulty["1"]["no_rate"] == 1


def test_an_empty_band_says_what_to_change(tasks):
    never = [TaskEstimate(t, 1, 0, 2) for t in "abc"]
    with pytest.raises(CurriculumError, match=r"none of the 3 estimated tasks has a pass rate "
                       r"in \[0.1, 0.9\].*0 on 3.*lower curriculum.min"):
        curriculum.select(never, 0.1, 0.9, round_=0, step=1, k=2)
    always = [TaskEstimate(t, 1, 2, 2) for t in "abc"]
    with pytest.raises(CurriculumError, match="raise curriculum.max"):
        curriculum.select(always, 0.1, 0.9, round_=0, step=1, k=2)
    with pytest.raises(CurriculumError, match="widen curriculum.min / curriculum.max"):
        curriculum.select(estimates_of(tasks), 0.6, 0.9, round_=0, step=1, k=2)
    # a later round keeping nothing keeps the previous round's tasks, and says so
    later = curriculum.select(never, 0.1, 0.9, round_=1, step=5, k=2, previous=["x", "y"])
    assert later.kept == ["x", "y"] and later.kept_previous and later.dropped == list("abc")


def test_the_pool_is_a_seeded_draw_capped_at_its_size():
    split = envs.make(ARITH).unwrapped.task_pool(20, seed=0)
    pool = curriculum.estimation_pool(split, 8, seed=0, round_=0)
    assert len(pool) == 8 and len({t.task_id for t in pool}) == 8
    assert pool == curriculum.estimation_pool(split, 8, seed=0, round_=0)
    assert pool != curriculum.estimation_pool(split, 8, seed=0, round_=1)  # a new round redraws
    assert pool != curriculum.estimation_pool(split, 8, seed=1, round_=0)
    assert sorted(t.task_id for t in curriculum.estimation_pool(split, 64, 0, 0)) == \
        sorted(t.task_id for t in split)


def test_rounds():
    assert [curriculum.round_of(s, 0) for s in (1, 2, 50)] == [0, 0, 0]
    assert [curriculum.round_of(s, 3) for s in (1, 3, 4, 6, 7)] == [0, 0, 1, 1, 2]
    assert [curriculum.round_start(r, 3) for r in (0, 1, 2)] == [1, 4, 7]
    held = Selection(1, 4, (0.0, 1.0), [], ["a"], k=2)
    assert curriculum.due(None, 1, 3) and not curriculum.due(held, 6, 3) and curriculum.due(held, 7, 3)


class StreamCoin:
    """Right when its row's random stream says so: what a job samples depends only on the job."""

    def __init__(self, tasks):
        self.tasks = {t.prompt: t for t in tasks}

    def generate(self, batch, sampling):
        return [Completion(str(self.tasks[m[-1]["content"]].target
                               + stream_seed(sampling.seed, *sampling.stream(b)) % 2), [5], [-0.1])
                for b, m in enumerate(batch)]


def test_the_estimate_is_seeded_and_shards_as_a_whole():
    split = envs.make(ARITH).unwrapped.task_pool(12, seed=0)
    sampling = curriculum.round_sampling(Sampling(temperature=1.0, seed=None), seed=0, round_=0)
    assert sampling.seed == stream_seed(0, curriculum.CURRICULUM_STREAM, 0)

    def rates(tasks, seed, num_envs=16):
        return curriculum.estimate_pass_rates(StreamCoin(split), ARITH, tasks, k=4,
                                              sampling=sampling, seed=seed, num_envs=num_envs)

    whole = rates(split, 0)
    assert len({e.passes for e in whole}) > 1  # the coin really varies
    assert rates(split, 0, num_envs=3) == whole  # whatever the batch
    assert rates(split[:5], 0) + rates(split[5:], 5 * 4) == whole  # two ranks' shards


def test_state_round_trips_through_json(tasks):
    chosen = curriculum.select(estimates_of(tasks), 0.1, 0.9, round_=2, step=7, k=2)
    again = Selection.from_state(json.loads(json.dumps(chosen.state())))
    assert again == chosen and again.record() == chosen.record()


def test_a_resume_cuts_the_rounds_after_its_checkpoint(tmp_path):
    """A round's record carries the first step it trains: a checkpoint of step 3 keeps round 0
    (step 1, whose band it holds) and sets round 1 (step 4, estimated again on resume) aside."""
    from agent_rl.run.rundir import rewind_logs

    lines = [json.dumps({"step": 1, "round": 0}), json.dumps({"step": 4, "round": 1})]
    (tmp_path / "curriculum.jsonl").write_text("".join(line + "\n" for line in lines))
    rewind_logs(tmp_path, 3, 0)
    assert read_jsonl(tmp_path / "curriculum.jsonl") == [{"step": 1, "round": 0}]
    assert read_jsonl(tmp_path / "curriculum.jsonl.rewound") == [{"step": 4, "round": 1}]


# --- the trainer, on the tiny random model (its pass rates are all 0) -------------------------


def tiny(run_dir: Path, *overrides: str) -> ExperimentContract:
    return ExperimentContract.from_yaml(REPO / "examples" / "tiny.yaml", [
        f"run_dir={run_dir}", "curriculum.filter=pass_rate", "curriculum.k=2",
        "curriculum.min=0.0", *overrides])


def test_a_tiny_run_draws_from_the_band_and_counts_its_cost(tmp_path):
    contract = tiny(tmp_path / "run", "curriculum.pool=3")
    result = train.run(contract, progress=False)
    (record,) = read_jsonl(result.run_dir / "curriculum.jsonl")
    assert record["step"] == 1 and record["estimated"] == 3 and record["kept"] == 3
    assert record["by_difficulty"] and all(t["pass_rate"] == 0.0 for t in record["tasks"])
    kept = set(record["kept_task_ids"])
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert all(set(m["batch/task_ids"]) <= kept for m in metrics)  # only kept tasks are drawn
    assert record["tokens_generated"] == sum(t["tokens"] for t in record["tasks"]) > 0
    assert [m["curriculum/tokens_generated"] for m in metrics] == [record["tokens_generated"], 0]
    rollout = 0
    for m in metrics:  # the run's token total holds the estimate's tokens
        rollout += m["rollout/tokens_generated"]
        assert m["total/tokens_generated"] == rollout + record["tokens_generated"]
        assert m["total/curriculum_tokens_generated"] == record["tokens_generated"]
        assert (m["curriculum/kept"], m["curriculum/dropped"], m["curriculum/round"]) == (3, 0, 0)


def test_an_empty_band_fails_before_anything_is_written(tmp_path):
    with pytest.raises(CurriculumError, match="lower curriculum.min"):
        train.run(tiny(tmp_path / "run", "curriculum.min=0.5"), progress=False)
    assert not (tmp_path / "run").exists()


def test_resume_reloads_the_band_in_force_and_is_the_straight_run(tmp_path):
    """Rounds at steps 1 and 4 (every 3). Stopped after step 2 and resumed to 4: round 0 comes
    back from the checkpoint (not re-estimated with the moved weights: one record, counted
    once), round 1 is estimated as the straight run did; logs and weights are the straight run's."""
    overrides = ("curriculum.every=3", "curriculum.pool=4", "checkpoint.every=1")
    straight = train.run(tiny(tmp_path / "straight", *overrides, "optim.max_steps=4"),
                         progress=False)
    run_dir = tmp_path / "resumed"
    train.run(tiny(run_dir, *overrides, "optim.max_steps=2"), progress=False)
    train.run(tiny(run_dir, *overrides, "optim.max_steps=4"), resume=True, progress=False)

    records = read_jsonl(run_dir / "curriculum.jsonl")
    assert [(r["round"], r["step"]) for r in records] == [(0, 1), (1, 4)]
    assert records == read_jsonl(straight.run_dir / "curriculum.jsonl")
    assert records[0]["kept_task_ids"] != records[1]["kept_task_ids"]  # a new pool
    keys = ("loss/policy", "batch/task_ids", "total/tokens_generated", "curriculum/round",
            "curriculum/kept", "curriculum/tokens_generated")
    assert [{k: m[k] for k in keys} for m in read_jsonl(run_dir / "metrics.jsonl")] == \
        [{k: m[k] for k in keys} for m in read_jsonl(straight.run_dir / "metrics.jsonl")]
    assert bundle_params_hash(run_dir) == bundle_params_hash(straight.run_dir)
