"""Confidence intervals for evaluation results (numpy only).

Every function returns plain tuples of floats; `conf` is the two-sided coverage.

Wilson score interval for k successes in n trials, p = k / n, z = Phi^-1(1 - (1 - conf) / 2):

    centre = (p + z^2 / (2n)) / (1 + z^2 / n)
    half   = z * sqrt(p (1 - p) / n + z^2 / (4 n^2)) / (1 + z^2 / n)
    (lo, hi) = (centre - half, centre + half), exactly 0 at k = 0 and 1 at k = n.

Bootstrap intervals are percentile intervals: the (1 - conf) / 2 and 1 - (1 - conf) / 2
quantiles (numpy's linear interpolation) of `n_boot` resampled statistics, drawn with
`numpy.random.default_rng(seed)`.

- `paired_bootstrap(a, b)`: the statistic is mean(a) - mean(b); index i is resampled as a
  pair (a_i, b_i), i.e. a bootstrap of the per-item differences d_i = a_i - b_i.
- `cluster_bootstrap(values, clusters)`: whole clusters (the members of one set, or one
  task family) are drawn with replacement; the statistic is the mean over all members of
  the drawn clusters, sum_c S_c / sum_c n_c. Members of a cluster are never treated as
  independent samples; with one member per cluster this is the ordinary iid bootstrap.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np

_CHUNK = 2_000_000  # indices drawn at a time, bounding memory for large inputs


def _check_conf(conf: float) -> None:
    if not 0 < conf < 1:
        raise ValueError(f"conf must be in (0, 1), got {conf}")


def _as_values(values: Sequence[float], name: str) -> np.ndarray:
    x = np.asarray(values, dtype=float)  # [n]
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}[{int(np.argmin(np.isfinite(x)))}] is not finite")
    return x


def wilson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (lo, hi) for a binomial proportion k / n."""
    _check_conf(conf)
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    z = NormalDist().inv_cdf(1 - (1 - conf) / 2)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else float(centre - half)
    hi = 1.0 if k == n else float(centre + half)
    return lo, hi


def _bootstrap(
    sums: np.ndarray, counts: np.ndarray, n_boot: int, seed: int, conf: float
) -> tuple[float, float]:
    """Percentile interval of sum(sums[idx]) / sum(counts[idx]) over resampled cluster indices."""
    _check_conf(conf)
    if n_boot <= 0:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    c = sums.size
    rows = max(1, _CHUNK // c)
    stats = []
    for start in range(0, n_boot, rows):
        idx = rng.integers(0, c, size=(min(rows, n_boot - start), c))  # [rows, C]
        stats.append(sums[idx].sum(1) / counts[idx].sum(1))  # [rows]
    alpha = (1 - conf) / 2
    lo, hi = np.quantile(np.concatenate(stats), [alpha, 1 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    n_boot: int = 10000,
    seed: int = 0,
    *,
    conf: float = 0.95,
) -> tuple[float, float, float]:
    """(diff, lo, hi): diff = mean(a) - mean(b) with a paired percentile interval."""
    x, y = _as_values(a, "a"), _as_values(b, "b")
    if x.size != y.size:
        raise ValueError(f"paired samples differ in length: {x.size} and {y.size}")
    d = x - y  # [n]
    lo, hi = _bootstrap(d, np.ones_like(d), n_boot, seed, conf)
    return float(d.mean()), lo, hi


def _cluster_sums(x: np.ndarray, clusters: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums and member counts, clusters in order of first appearance: `[C]`, `[C]`."""
    if len(clusters) != x.size:
        raise ValueError(f"{x.size} values but {len(clusters)} cluster labels")
    index = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
    cid = np.array([index[c] for c in clusters])  # [n]
    return np.bincount(cid, weights=x), np.bincount(cid).astype(float)


def cluster_bootstrap(
    values: Sequence[float],
    clusters: Sequence[Hashable],
    n_boot: int = 10000,
    seed: int = 0,
    *,
    conf: float = 0.95,
) -> tuple[float, float, float]:
    """(mean, lo, hi): mean of all values with a percentile interval resampling whole clusters."""
    x = _as_values(values, "values")
    sums, counts = _cluster_sums(x, clusters)
    lo, hi = _bootstrap(sums, counts, n_boot, seed, conf)
    return float(x.mean()), lo, hi


def summarize(
    values: Sequence[float],
    clusters: Sequence[Hashable] | None = None,
    n_boot: int = 10000,
    seed: int = 0,
    *,
    conf: float = 0.95,
) -> dict[str, float | int]:
    """{mean, lo, hi, n, n_clusters}: the cluster bootstrap, iid (one cluster per value) without clusters."""
    x = _as_values(values, "values")
    labels = range(x.size) if clusters is None else clusters
    mean, lo, hi = cluster_bootstrap(x, labels, n_boot, seed, conf=conf)
    return {"mean": mean, "lo": lo, "hi": hi, "n": int(x.size), "n_clusters": len(set(labels))}
