"""Acceptance gates: critical slices block, inconclusive never passes, error-rate bounds,
criteria from the contract's acceptance section."""

from __future__ import annotations

import random

import pytest

from evals.gates import Criterion, criteria_from_acceptance, decide, parse_slice
from evals.run import EvalRecord
from trajectories import Outcome

CRITICAL = "search>transform>update"
N_BOOT = 2000


def rec(task: str, reward: float, *, sample: int = 0, structure: str = "lookup",
        outcome: Outcome | None = None, latency_s: float = 0.0) -> EvalRecord:
    outcome = outcome or (Outcome.correct if reward >= 1.0 else Outcome.wrong)
    return EvalRecord(task_id=task, episode_id=f"{task}#{sample}", env_id="test/Env-v0",
                      sample_id=sample, reward=reward, outcome=outcome,
                      success=outcome == Outcome.correct,
                      infra_fault=outcome == Outcome.sandbox_error,
                      skills=structure.split(">"), structure=structure,
                      atomic=">" not in structure, latency_s=latency_s)


def population(critical_rewards, other_rewards) -> list[EvalRecord]:
    return ([rec(f"c{i}", r, structure=CRITICAL) for i, r in enumerate(critical_rewards)]
            + [rec(f"o{i}", r) for i, r in enumerate(other_rewards)])


def statuses(decision) -> dict[str, str]:
    return {r.criterion.name: r.status for r in decision.results}


def test_higher_mean_but_regressed_critical_slice_is_blocked():
    # baseline: the critical slice is solved (1.0), the rest mostly not; the candidate trades
    # the critical slice (0.0-0.2) for the rest (0.8-1.0): a much higher overall mean.
    baseline = population([1.0] * 30, [0.2, 0.0] * 50)
    candidate = population([0.0, 0.2] * 15, [1.0, 0.8] * 50)
    mean = lambda rs: sum(r.reward for r in rs) / len(rs)  # noqa: E731
    assert mean(candidate) > mean(baseline) + 0.3

    criteria = [Criterion(name="overall", metric="reward/mean", kind="no_regression"),
                Criterion(name="holdout reward", metric="reward/mean", kind="min", threshold=0.5),
                *criteria_from_acceptance(critical_slices=[f"structure={CRITICAL}"])]
    decision = decide(candidate, criteria, baseline=baseline, n_boot=N_BOOT)

    assert decision.status == "fail"
    critical = f"no regression on structure={CRITICAL}"
    assert statuses(decision) == {"overall": "pass", "holdout reward": "pass", critical: "fail"}
    assert decision.blocking == [critical]
    assert decision.reasons[0].startswith(f"FAIL [critical] {critical}")
    assert "n=30" in decision.reasons[0]
    detail = next(r for r in decision.results if r.criterion.critical)
    assert detail.value == pytest.approx(-0.9)
    assert detail.hi < 0 and detail.n == 30 and detail.n_tasks == 30


def test_tiny_n_is_inconclusive_never_pass():
    candidate = population([1.0] * 3, [1.0] * 40)
    baseline = population([0.0] * 3, [0.0] * 40)
    criteria = [Criterion(name="holdout reward", kind="min", threshold=0.5),
                *criteria_from_acceptance(critical_slices=[f"structure={CRITICAL}"])]
    decision = decide(candidate, criteria, baseline=baseline, n_boot=N_BOOT)
    # the critical slice improved on every pair, but 3 pairs are below min_n
    assert statuses(decision)[f"no regression on structure={CRITICAL}"] == "inconclusive"
    assert statuses(decision)["holdout reward"] == "pass"
    assert decision.status == "inconclusive" and not decision.passed
    assert "n=3 < min_n=10" in " ".join(decision.reasons)


def test_overlapping_interval_is_inconclusive():
    records = [rec(f"t{i}", float(i % 2)) for i in range(40)]  # mean 0.5, wide interval
    decision = decide(records, [Criterion(name="holdout", kind="min", threshold=0.55)],
                      n_boot=N_BOOT)
    result = decision.results[0]
    assert result.lo < 0.55 < result.hi
    assert decision.status == "inconclusive"


def test_missing_slice_is_inconclusive():
    records = [rec(f"t{i}", 1.0) for i in range(40)]
    criterion = Criterion(name="composed", kind="min", threshold=0.5,
                          slice={"structure": "absent"}, critical=True)
    decision = decide(records, [criterion], n_boot=N_BOOT)
    assert decision.status == "inconclusive" and decision.results[0].n == 0


def errors(n: int, k: int, outcome: Outcome = Outcome.format_error) -> list[EvalRecord]:
    return [rec(f"t{i}", 0.0, outcome=outcome) if i < k else rec(f"t{i}", 1.0) for i in range(n)]


@pytest.mark.parametrize("n, k, expected", [
    (200, 0, "pass"),           # Wilson hi for 0/200 is 0.019
    (100, 30, "fail"),          # lo well above 0.05
    (20, 0, "inconclusive"),    # Wilson hi for 0/20 is 0.16: not enough evidence
    (100, 5, "inconclusive"),   # 0.05 inside the interval
])
def test_max_error_rate(n, k, expected):
    criteria = criteria_from_acceptance(max_error_rate=0.05)
    decision = decide(errors(n, k), criteria, n_boot=N_BOOT)
    assert decision.status == expected
    assert decision.results[0].value == pytest.approx(k / n)


def test_error_rate_counts_infrastructure_faults_but_reward_does_not():
    records = errors(100, 30, Outcome.sandbox_error)
    decision = decide(records, [Criterion(name="err", metric="error_rate", kind="max",
                                          threshold=0.05),
                                Criterion(name="reward", kind="min", threshold=0.9)],
                      n_boot=N_BOOT)
    by_name = {r.criterion.name: r for r in decision.results}
    assert by_name["err"].status == "fail" and by_name["err"].n == 100
    assert by_name["reward"].status == "pass" and by_name["reward"].n == 70
    assert decision.status == "fail" and decision.blocking == []  # non-critical failure


def test_pass_case():
    baseline = population([0.6, 0.4] * 20, [0.5, 0.3] * 50)
    candidate = population([1.0, 0.8] * 20, [0.9, 0.7] * 50)
    criteria = [Criterion(name="overall", kind="no_regression"),
                *criteria_from_acceptance(holdout_min=0.5, max_error_rate=0.05,
                                          critical_slices=[f"structure={CRITICAL}"])]
    decision = decide(candidate, criteria, baseline=baseline, n_boot=N_BOOT)
    assert decision.status == "pass" and decision.passed, decision.reasons
    assert len(decision.reasons) == 4
    assert all(reason.startswith("PASS") for reason in decision.reasons)


def test_pairs_match_by_task_and_sample_not_order():
    baseline = [rec(f"t{i}", 0.5 + 0.01 * (i % 7), sample=j) for i in range(20) for j in range(3)]
    candidate = [rec(r.task_id, r.reward + 0.05, sample=r.sample_id) for r in baseline]
    shuffled = list(baseline)
    random.Random(0).shuffle(shuffled)
    criterion = [Criterion(name="nr", kind="no_regression")]
    a = decide(candidate, criterion, baseline=baseline, n_boot=N_BOOT).results[0]
    b = decide(candidate, criterion, baseline=shuffled, n_boot=N_BOOT).results[0]
    assert a.value == pytest.approx(0.05) and b.value == pytest.approx(0.05)
    assert a.status == b.status == "pass"
    assert a.n == 60 and a.n_tasks == 20

    unpaired = decide(candidate[:30], criterion, baseline=baseline, n_boot=N_BOOT).results[0]
    assert unpaired.n == 30 and unpaired.n_unpaired == 30


def test_no_regression_for_lower_is_better_metric():
    baseline = [rec(f"t{i}", 1.0, latency_s=1.0 + 0.01 * i) for i in range(30)]
    slower = [rec(f"t{i}", 1.0, latency_s=2.0 + 0.01 * i) for i in range(30)]
    criterion = [Criterion(name="latency", metric="latency_s", kind="no_regression", margin=0.1)]
    result = decide(slower, criterion, baseline=baseline, n_boot=N_BOOT).results[0]
    assert result.status == "fail" and result.value == pytest.approx(-1.0)
    assert decide(baseline, criterion, baseline=slower, n_boot=N_BOOT).status == "pass"


def test_criteria_from_acceptance():
    criteria = criteria_from_acceptance(
        holdout_min=0.6, max_error_rate=0.05,
        critical_slices=["structure=search>transform>update",
                         "entity_group=people, composition=composed"])
    holdout, error, first, second = criteria
    assert (holdout.metric, holdout.kind, holdout.threshold) == ("reward/mean", "min", 0.6)
    assert (error.metric, error.kind, error.threshold) == ("error_rate", "max", 0.05)
    assert first.slice == {"structure": "search>transform>update"}
    assert first.kind == "no_regression" and first.critical
    assert second.slice == {"entity_group": "people", "composition": "composed"}
    assert criteria_from_acceptance(holdout_min=None, max_error_rate=None) == []

    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_slice("structure")
    with pytest.raises(ValueError, match="cannot slice by 'nope'"):
        criteria_from_acceptance(critical_slices=["nope=1"])
    with pytest.raises(ValueError, match="unknown metric"):
        Criterion(name="x", metric="bogus", kind="min", threshold=0)
    with pytest.raises(ValueError, match="needs a threshold"):
        Criterion(name="x", kind="max")


def test_decide_needs_criteria_and_baseline_for_no_regression():
    records = [rec("t", 1.0)]
    with pytest.raises(ValueError, match="at least one criterion"):
        decide(records, [])
    with pytest.raises(ValueError, match="need `baseline`"):
        decide(records, criteria_from_acceptance(critical_slices=["structure=x"]))


def test_slice_by_list_field_and_composition():
    records = ([rec(f"a{i}", 1.0, structure="add") for i in range(20)]
               + [rec(f"m{i}", 0.0, structure="add>mul") for i in range(20)])
    by_skill = Criterion(name="mul", kind="max", threshold=0.5, slice={"skills": "mul"})
    atomic = Criterion(name="atomic", kind="min", threshold=0.9, slice={"composition": "atomic"})
    decision = decide(records, [by_skill, atomic], n_boot=N_BOOT)
    assert [(r.n, r.status) for r in decision.results] == [(20, "pass"), (20, "pass")]
