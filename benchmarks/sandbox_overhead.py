"""What a sandbox costs per run: an empty program (``pass``) through each available backend,
against a plain ``subprocess.run([python, "-I", "-S", "-c", "pass"])`` measured in the same run.

    python benchmarks/sandbox_overhead.py            # median of 20 runs per backend
    python benchmarks/sandbox_overhead.py --runs 5 --backends subprocess bwrap

``bwrap`` runs through its fork server (the default, ``envs.sandbox.FORK_SERVER``: each run
a fork of a warm sandboxed interpreter), ``bwrap-fresh`` with a fresh bwrap and interpreter per
run (``FORK_SERVER = False``). Each figure is the median wall time of
``envs.sandbox.run("pass", backend=...)`` as the caller sees it (temp dir, cgroups, container create/start/wait/remove and the audit of the work dir
included); ``overhead_ms`` is that minus the baseline's median. One warm-up run per backend is
not counted (Docker's first run pays for the image check). Prints a table, then, last, one JSON
line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from envs import sandbox  # noqa: E402


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def baseline() -> None:
    subprocess.run([sandbox.PYTHON, "-I", "-S", "-c", "pass"], check=True)


MODES = {"docker": "docker", "bwrap": "bwrap", "bwrap-fresh": "bwrap", "subprocess": "subprocess"}


def through(mode: str):
    backend = MODES[mode]

    def once() -> None:
        sandbox.FORK_SERVER = mode != "bwrap-fresh"
        result = sandbox.run("pass", backend=backend)
        if result.status != "ok":
            raise RuntimeError(f"{backend}: {result.status}: {result.detail}")
    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per backend")
    parser.add_argument("--backends", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "envs.sandbox: the 'subprocess' backend", RuntimeWarning)

    baseline()
    base = timed(baseline, args.runs)
    summary: dict = {"runs": args.runs, "python": sandbox.PYTHON,
                     "baseline": {"median_ms": 1e3 * statistics.median(base),
                                  "min_ms": 1e3 * min(base)}}
    for backend in args.backends:
        if not sandbox.available(MODES[backend]):
            summary[backend] = {"available": False, "why": sandbox.unavailable_reason(MODES[backend])}
            continue
        through(backend)()
        times = timed(through(backend), args.runs)
        median = statistics.median(times)
        summary[backend] = {"available": True, "median_ms": 1e3 * median, "min_ms": 1e3 * min(times),
                            "max_ms": 1e3 * max(times),
                            "overhead_ms": 1e3 * (median - statistics.median(base)),
                            "ratio": median / statistics.median(base)}

    print(f"{'backend':<12} {'median ms':>10} {'min ms':>8} {'overhead ms':>12} {'x baseline':>11}")
    print(f"{'baseline':<12} {summary['baseline']['median_ms']:>10.1f} "
          f"{summary['baseline']['min_ms']:>8.1f} {'':>12} {'':>11}")
    for backend in args.backends:
        row = summary[backend]
        if not row["available"]:
            print(f"{backend:<12} unavailable: {row['why']}")
            continue
        print(f"{backend:<12} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f} "
              f"{row['overhead_ms']:>12.1f} {row['ratio']:>11.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
