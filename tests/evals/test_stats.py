"""Interval statistics against analytic values and bootstrap sanity checks."""

import numpy as np
import pytest

from evals.stats import cluster_bootstrap, paired_bootstrap, summarize, wilson

# z = Phi^-1(0.975) = 1.959964, z^2 = 3.841459; for n = 10: z^2 / n = 0.384146,
# denominator 1 + z^2 / n = 1.384146.


@pytest.mark.parametrize(
    ("k", "n", "conf", "lo", "hi"),
    [
        # k = 0: lo 0;  hi = (z^2 / n) / (1 + z^2 / n) = 0.384146 / 1.384146
        (0, 10, 0.95, 0.0, 0.2775),
        # k = 5: centre 0.5;  half = z sqrt(0.25 / 10 + z^2 / 400) / 1.384146
        #      = 1.959964 * sqrt(0.025 + 0.009604) / 1.384146 = 0.364594 / 1.384146 = 0.263407
        (5, 10, 0.95, 0.2366, 0.7634),
        # k = n: mirror image of k = 0
        (10, 10, 0.95, 0.7225, 1.0),
        # k = 1: centre (0.1 + 0.192073) / 1.384146 = 0.211013;
        #        half 1.959964 * sqrt(0.009 + 0.009604) / 1.384146 = 0.193137
        (1, 10, 0.95, 0.0179, 0.4042),
        # conf 0.9, z = 1.644854, z^2 / n = 0.270554, denominator 1.270554;
        # k = 8: centre (0.8 + 0.135277) / 1.270554 = 0.736117;
        #        half 1.644854 * sqrt(0.016 + 0.006764) / 1.270554 = 0.195325
        (8, 10, 0.90, 0.5408, 0.9314),
    ],
)
def test_wilson_analytic(k, n, conf, lo, hi):
    got = wilson(k, n, conf=conf)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_endpoints_exact_and_errors():
    assert wilson(0, 3)[0] == 0.0 and wilson(3, 3)[1] == 1.0
    with pytest.raises(ValueError, match="n must be positive"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="k must be"):
        wilson(4, 3)
    with pytest.raises(ValueError, match="conf"):
        wilson(1, 3, conf=1.0)


def test_paired_bootstrap_identical_is_zero():
    a = np.random.default_rng(1).normal(size=50)
    assert paired_bootstrap(a, a) == (0.0, 0.0, 0.0)


def test_paired_bootstrap_constant_shift():
    # d_i = 0.5 for every pair: every resample has mean 0.5
    b = np.arange(20) / 4
    assert paired_bootstrap(b + 0.5, b, n_boot=500) == pytest.approx((0.5, 0.5, 0.5))


def test_paired_bootstrap_noisy_shift():
    rng = np.random.default_rng(2)
    b = rng.normal(size=200)
    a = b + 1.0 + rng.normal(scale=0.1, size=200)
    diff, lo, hi = paired_bootstrap(a, b, n_boot=2000)
    assert lo < 1.0 < hi
    assert diff == pytest.approx(float(np.mean(a) - np.mean(b)))
    # pairing cancels the between-item spread of b (sd 1); only the noise (sd 0.1) remains
    assert hi - lo < 0.05
    # same seed, same interval; a lower coverage narrows it
    assert paired_bootstrap(a, b, n_boot=2000, seed=0) == (diff, lo, hi)
    assert paired_bootstrap(a, b, n_boot=2000, conf=0.5)[1] > lo


def test_paired_bootstrap_errors():
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match=r"a\[1\] is not finite"):
        paired_bootstrap([1.0, float("nan")], [1.0, 2.0])


def test_cluster_bootstrap_wider_than_iid_on_correlated_clusters():
    # 10 clusters of 20 identical members: effectively 10 samples, not 200
    rng = np.random.default_rng(3)
    cluster_values = rng.integers(0, 2, size=10).astype(float)
    values = np.repeat(cluster_values, 20)
    clusters = np.repeat(np.arange(10), 20).tolist()
    mean, lo, hi = cluster_bootstrap(values, clusters, n_boot=2000)
    iid = summarize(values, n_boot=2000)
    assert mean == pytest.approx(values.mean()) == pytest.approx(iid["mean"])
    assert hi - lo > 2 * (iid["hi"] - iid["lo"])
    assert (iid["n"], iid["n_clusters"]) == (200, 200)


def test_cluster_bootstrap_unequal_clusters_and_summarize():
    # clusters x: [1, 1, 1] and y: [0]; overall mean 3 / 4.  Resamples are xx (mean 1),
    # yy (0) or xy / yx (3 / 4), so every bootstrap mean lies in [0, 1].
    values, clusters = [1.0, 0.0, 1.0, 1.0], ["x", "y", "x", "x"]
    mean, lo, hi = cluster_bootstrap(values, clusters, n_boot=1000)
    assert mean == 0.75 and lo == 0.0 and hi == 1.0
    s = summarize(values, clusters, n_boot=1000)
    assert s == {"mean": 0.75, "lo": 0.0, "hi": 1.0, "n": 4, "n_clusters": 2}
    with pytest.raises(ValueError, match="4 values but 3 cluster labels"):
        cluster_bootstrap(values, clusters[:3])
