"""Acceptance gates: criteria decided on confidence intervals, with critical slices that block.

A ``Criterion`` names a per-episode metric, an optional slice of the records and a rule:

- ``min``: the metric's mean must be >= ``threshold`` (e.g. held-out reward);
- ``max``: the metric's mean must be <= ``threshold`` (error rate, latency, generated tokens);
- ``no_regression``: the candidate minus the baseline must be >= ``-margin`` (for metrics where
  lower is better, ``error_rate``, ``latency_s``, ``generated_tokens``, ..., the baseline minus
  the candidate), on episodes paired by ``(task_id, sample_id)``.

Every criterion is judged on its interval [lo, hi], never on the mean alone:

    min:            pass if lo >= threshold,  fail if hi < threshold
    max:            pass if hi <= threshold,  fail if lo > threshold
    no_regression:  pass if lo >= -margin,    fail if hi < -margin
    otherwise, or with fewer than ``min_n`` episodes (pairs): inconclusive.

The decision: any failed criterion fails it (``Decision.blocking`` lists the failed critical
ones: a critical slice blocks however good the overall mean is); else any inconclusive
criterion makes it inconclusive; else it passes. Inconclusive is never a pass.

Intervals (``evals.stats``, percentile bootstrap, ``conf`` two-sided):

- ``min`` / ``max``: ``cluster_bootstrap`` over the slice's episodes, clustered by task (the
  samples of one task are never independent draws). For 0/1 metrics (``success``,
  ``error_rate``) the interval is the hull of that and the Wilson interval, so that 0 errors
  in 20 episodes reads [0, 0.16], not the bootstrap's degenerate [0, 0].
- ``no_regression``: ``paired_bootstrap`` of the per-pair differences; when a task has several
  paired samples, the differences are resampled a whole task at a time (``cluster_bootstrap``
  of the differences), which is the same bootstrap with task clusters.

Infrastructure faults (``sandbox_error``) are not scored: they are left out of every metric
except ``error_rate``, which counts them (an infrastructure error is an error). A pair is
dropped when either side is left out; unpaired episodes are counted in the details.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evals.run import EvalRecord
from evals.stats import cluster_bootstrap, paired_bootstrap, wilson
from trajectories import Outcome

Status = Literal["pass", "fail", "inconclusive"]

# Outcomes counted by the ``error_rate`` metric: everything but a scored right or wrong answer.
ERROR_OUTCOMES = frozenset(Outcome) - {Outcome.correct, Outcome.wrong}


class _Metric:
    """How to read one metric from a record, which direction is better, whether it is 0/1."""

    def __init__(self, read: Callable[[EvalRecord], float], higher_is_better: bool,
                 binary: bool = False, counts_infra_faults: bool = False):
        self.read, self.higher_is_better = read, higher_is_better
        self.binary, self.counts_infra_faults = binary, counts_infra_faults


def _field(name: str) -> Callable[[EvalRecord], float]:
    return lambda r: float(getattr(r, name))


METRICS: dict[str, _Metric] = {
    "reward/mean": _Metric(lambda r: r.reward, higher_is_better=True),
    "success": _Metric(lambda r: float(r.success), higher_is_better=True, binary=True),
    "error_rate": _Metric(lambda r: float(r.outcome in ERROR_OUTCOMES), higher_is_better=False,
                          binary=True, counts_infra_faults=True),
    "latency_s": _Metric(_field("latency_s"), higher_is_better=False),
    "generated_tokens": _Metric(_field("generated_tokens"), higher_is_better=False),
    "sessions": _Metric(_field("sessions"), higher_is_better=False),
}
ALIASES = {"reward": "reward/mean", "success/rate": "success", "error": "error_rate",
           "cost": "generated_tokens"}


def metric(name: str) -> _Metric:
    """The metric called ``name`` (or one of its aliases); a ``ValueError`` lists the known ones."""
    name = ALIASES.get(name, name)
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; known: {sorted(METRICS)} "
                         f"(aliases {sorted(ALIASES)})")
    return METRICS[name]


class Criterion(BaseModel):
    """One acceptance rule on one metric of one slice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="shown in the decision's reasons")
    metric: str = Field("reward/mean", description=f"one of {sorted(METRICS)} or an alias")
    slice: dict[str, str] | None = Field(
        None, description="record field -> value, e.g. {'structure': 'search>transform>update'}; "
                          "None: all records. A list field (skills) matches when it holds the value")
    kind: Literal["min", "max", "no_regression"]
    threshold: float | None = Field(None, description="bound for min / max")
    margin: float = Field(0.0, ge=0.0, description="allowed drop for no_regression")
    critical: bool = Field(False, description="a failure blocks the decision (reported in `blocking`)")
    min_n: int = Field(10, ge=1, description="fewer episodes (pairs) than this: inconclusive")

    @model_validator(mode="after")
    def _check(self) -> Criterion:
        metric(self.metric)
        if self.kind in ("min", "max") and self.threshold is None:
            raise ValueError(f"criterion {self.name!r}: kind {self.kind!r} needs a threshold")
        for key in self.slice or {}:
            if key not in EvalRecord.model_fields and not hasattr(EvalRecord, key):
                raise ValueError(f"criterion {self.name!r}: cannot slice by {key!r}: EvalRecord "
                                 "has no such field or property")
        return self

    def describe_slice(self) -> str:
        return ",".join(f"{k}={v}" for k, v in (self.slice or {}).items()) or "all"


class CriterionResult(BaseModel):
    """How one criterion was judged: the value (mean, or mean difference), its interval, n."""

    model_config = ConfigDict(frozen=True)

    criterion: Criterion
    status: Status
    value: float | None = None
    lo: float | None = None
    hi: float | None = None
    n: int = 0
    n_tasks: int = 0
    n_unpaired: int = 0
    reason: str


class Decision(BaseModel):
    """``status`` pass | fail | inconclusive, one reason line per criterion, and the details."""

    model_config = ConfigDict(frozen=True)

    status: Status
    reasons: list[str]
    results: list[CriterionResult]
    blocking: list[str] = Field(default_factory=list, description="failed critical criteria")

    @property
    def passed(self) -> bool:
        return self.status == "pass"


# --- building criteria from the contract -------------------------------------------------


def parse_slice(entry: str) -> dict[str, str]:
    """``"structure=search>transform>update"`` or ``"entity_group=x,composition=composed"`` -> dict."""
    out: dict[str, str] = {}
    for part in entry.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"critical slice {entry!r}: expected FIELD=VALUE[,FIELD=VALUE], "
                             "e.g. 'structure=search>transform>update'")
        out[key.strip()] = value.strip()
    return out


def criteria_from_acceptance(
    holdout_min: float | None = None,
    max_error_rate: float | None = None,
    critical_slices: Sequence[str] = (),
    margin: float = 0.0,
    min_n: int = 10,
) -> list[Criterion]:
    """Criteria for the contract's ``acceptance`` section: held-out reward >= ``holdout_min``,
    ``error_rate`` <= ``max_error_rate``, and a critical no-regression criterion on reward per
    critical slice (``"FIELD=VALUE"``; these need baseline records)."""
    criteria = []
    if holdout_min is not None:
        criteria.append(Criterion(name="holdout reward", metric="reward/mean", kind="min",
                                  threshold=holdout_min, min_n=min_n))
    if max_error_rate is not None:
        criteria.append(Criterion(name="error rate", metric="error_rate", kind="max",
                                  threshold=max_error_rate, min_n=min_n))
    for entry in critical_slices:
        criteria.append(Criterion(name=f"no regression on {entry}", metric="reward/mean",
                                  slice=parse_slice(entry), kind="no_regression", margin=margin,
                                  critical=True, min_n=min_n))
    return criteria


# --- judging -----------------------------------------------------------------------------


def _norm(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _in_slice(record: EvalRecord, where: dict[str, str] | None) -> bool:
    for key, expected in (where or {}).items():
        value = getattr(record, key)
        if isinstance(value, (list, tuple)):
            if expected not in map(_norm, value):
                return False
        elif _norm(value) != expected:
            return False
    return True


def _scored(records: Sequence[EvalRecord], c: Criterion) -> list[EvalRecord]:
    counts_faults = metric(c.metric).counts_infra_faults
    return [r for r in records if _in_slice(r, c.slice) and (counts_faults or not r.infra_fault)]


def _pairs(candidate: list[EvalRecord], baseline: list[EvalRecord]):
    """Records matched by (task_id, sample_id, occurrence); returns pairs and the unpaired count."""

    def keyed(records):
        seen: dict[tuple, int] = {}
        out = {}
        for r in records:
            k = (r.task_id, r.sample_id)
            out[(*k, seen.get(k, 0))] = r
            seen[k] = seen.get(k, 0) + 1
        return out

    a, b = keyed(candidate), keyed(baseline)
    common = [k for k in a if k in b]
    return [(a[k], b[k]) for k in common], len(a) + len(b) - 2 * len(common)


def _interval(values: list[float], tasks: list[str], binary: bool, n_boot: int, seed: int,
              conf: float) -> tuple[float, float, float]:
    mean, lo, hi = cluster_bootstrap(values, tasks, n_boot, seed, conf=conf)
    if binary:
        w_lo, w_hi = wilson(int(round(sum(values))), len(values), conf)
        lo, hi = min(lo, w_lo), max(hi, w_hi)
    return mean, lo, hi


def _judge(c: Criterion, results: Sequence[EvalRecord], baseline: Sequence[EvalRecord] | None,
           n_boot: int, seed: int, conf: float) -> CriterionResult:
    m = metric(c.metric)
    n_unpaired = 0
    if c.kind == "no_regression":
        pairs, n_unpaired = _pairs(_scored(results, c), _scored(baseline or [], c))
        sign = 1.0 if m.higher_is_better else -1.0
        diffs = [sign * (m.read(a) - m.read(b)) for a, b in pairs]
        tasks = [a.task_id for a, _ in pairs]
        bound, what = -c.margin, f"{c.metric} change ({'cand-base' if sign > 0 else 'base-cand'})"
    else:
        records = _scored(results, c)
        values = [m.read(r) for r in records]
        tasks = [r.task_id for r in records]
        bound, what = c.threshold, c.metric
    n, n_tasks = len(tasks), len(set(tasks))
    tag = f"{'[critical] ' if c.critical else ''}{c.name} (slice {c.describe_slice()})"
    bound = bound + 0.0  # no "-0" in the reasons
    if n < c.min_n:
        return CriterionResult(criterion=c, status="inconclusive", n=n, n_tasks=n_tasks,
                               n_unpaired=n_unpaired,
                               reason=f"INCONCLUSIVE {tag}: n={n} < min_n={c.min_n}")
    if c.kind == "no_regression":
        if n_tasks == n:
            value, lo, hi = paired_bootstrap(diffs, [0.0] * n, n_boot, seed, conf=conf)
        else:
            value, lo, hi = cluster_bootstrap(diffs, tasks, n_boot, seed, conf=conf)
    else:
        value, lo, hi = _interval(values, tasks, m.binary, n_boot, seed, conf)
    if c.kind == "max":
        status = "pass" if hi <= bound else "fail" if lo > bound else "inconclusive"
        rule = f"needs <= {bound:.4g}"
    else:
        status = "pass" if lo >= bound else "fail" if hi < bound else "inconclusive"
        rule = f"needs >= {bound:.4g}"
    reason = (f"{status.upper()} {tag}: {what} {value:.4g} [{lo:.4g}, {hi:.4g}] "
              f"n={n} ({n_tasks} tasks) {rule}")
    if n_unpaired:
        reason += f"; {n_unpaired} unpaired episodes ignored"
    return CriterionResult(criterion=c, status=status, value=value, lo=lo, hi=hi, n=n,
                           n_tasks=n_tasks, n_unpaired=n_unpaired, reason=reason)


def decide(
    results: Sequence[EvalRecord],
    criteria: Sequence[Criterion],
    baseline: Sequence[EvalRecord] | None = None,
    n_boot: int = 10000,
    seed: int = 0,
    conf: float = 0.95,
) -> Decision:
    """Judge the candidate's ``results`` (one ``EvalRecord`` per episode) against ``criteria``.

    ``baseline`` (the records of the policy to compare with, same tasks and seeds) is required
    by ``no_regression`` criteria. See the module docstring for the rules.
    """
    if not criteria:
        raise ValueError("decide needs at least one criterion (a gate with no criteria would pass anything)")
    needs_baseline = [c.name for c in criteria if c.kind == "no_regression"]
    if needs_baseline and baseline is None:
        raise ValueError(f"criteria {needs_baseline} are no_regression and need `baseline` "
                         "records (the previous policy evaluated on the same tasks and seeds)")
    judged = [_judge(c, results, baseline, n_boot, seed, conf) for c in criteria]
    statuses = {j.status for j in judged}
    status: Status = ("fail" if "fail" in statuses
                      else "inconclusive" if "inconclusive" in statuses else "pass")
    blocking = [j.criterion.name for j in judged if j.status == "fail" and j.criterion.critical]
    ordered = sorted(judged, key=lambda j: (j.status != "fail", not j.criterion.critical))
    return Decision(status=status, reasons=[j.reason for j in ordered], results=judged,
                    blocking=blocking)
