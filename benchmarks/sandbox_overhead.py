"""What a sandbox costs per run: an empty program (``pass``) through each available backend,
against a plain ``subprocess.run([python, "-I", "-S", "-c", "pass"])`` measured in the same run.

    python benchmarks/sandbox_overhead.py            # median of 20 runs per backend
    python benchmarks/sandbox_overhead.py --runs 5 --backends subprocess bwrap

``bwrap`` runs through its fork server (the default, ``envs.sandbox.FORK_SERVER``: each run
a fork of a warm sandboxed interpreter), ``bwrap-fresh`` with a fresh bwrap and interpreter per
run (``FORK_SERVER = False``). Each figure is the median wall time of
``envs.sandbox.run("pass", backend=...)`` as the caller sees it (temp dir, cgroups, container create/start/wait/remove and the audit of the work dir
included); ``overhead_ms`` is that minus the baseline's median. One warm-up run per backend is
not counted (Docker's first run pays for the image check).

Then CodeTests-v0's scoring (``score`` of a correct answer: the harness and the agent's module
run in the sandbox, the verdict judged; ``share_runs=False``, so each score runs),
``--score-runs`` times on as many threads as ``run_episodes`` steps on (cores + 4), per bwrap
mode: wall time per run and CPU time per run, this process's own and the whole machine's
(``/proc/stat``: the sandbox's processes and the kernel's work for them included, and whatever
else the machine runs meanwhile). Prints two tables, then, last, one JSON line with every
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import envs  # noqa: E402
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


def machine_cpu_s() -> float:
    """CPU seconds every core has spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def scoring(mode: str, runs: int) -> dict:
    """CodeTests-v0 scoring a correct answer ``runs`` times on the runner's step threads."""
    sandbox.FORK_SERVER = mode != "bwrap-fresh"
    # every score its own run (identical answers are otherwise run once: ``share_runs``)
    env = envs.make("agent_rl/CodeTests-v0", backend=MODES[mode], share_runs=False).unwrapped
    task = env.task_pool(1)[0]
    answer = f"```python\n{task.data['solution']}```"

    def once(_: int) -> bool:
        reward = env.score(task, answer, None)
        if reward.outcome.value != "correct":
            raise RuntimeError(f"CodeTests-v0 through {mode}: {reward.outcome.value}, not correct")
        return reward.audit["shared_run"]

    once(0)
    workers = (os.cpu_count() or 1) + 4
    with ThreadPoolExecutor(workers) as pool:
        t0, machine, own = time.perf_counter(), machine_cpu_s(), os.times()
        shared = sum(pool.map(once, range(runs)))
        wall, machine, end = time.perf_counter() - t0, machine_cpu_s() - machine, os.times()
    return {"runs": runs, "shared": shared, "threads": workers, "wall_ms_per_run": 1e3 * wall / runs,
            "machine_cpu_ms_per_run": 1e3 * machine / runs,
            # each clock's difference on its own: summed first, equal tick counts could leave -2e-15
            "own_cpu_ms_per_run": 1e3 * ((end.user - own.user) + (end.system - own.system)) / runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per backend")
    parser.add_argument("--backends", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--score-runs", type=int, default=160,
                        help="CodeTests-v0 scoring runs per bwrap mode (0: none)")
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

    scored = [m for m in ("bwrap", "bwrap-fresh") if m in args.backends and summary[m]["available"]]
    if args.score_runs > 0 and scored:
        print(f"\nCodeTests-v0 scoring, {args.score_runs} runs on {(os.cpu_count() or 1) + 4} threads, "
              "per run:")
        print(f"{'mode':<12} {'wall ms':>8} {'machine CPU ms':>15} {'own CPU ms':>11}")
        for mode in scored:
            row = summary[f"codetests {mode}"] = scoring(mode, args.score_runs)
            print(f"{mode:<12} {row['wall_ms_per_run']:>8.2f} {row['machine_cpu_ms_per_run']:>15.2f} "
                  f"{row['own_cpu_ms_per_run']:>11.2f}", flush=True)
        sandbox.FORK_SERVER = True
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
