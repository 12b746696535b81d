"""Throughput of the trajectories layer: RolloutStore append/read/verify and every assigner.

    python benchmarks/store_assign.py [--n 5000] [--appends 1]

Builds N multi-session episodes (a root, one or two compressions, a branch; 3-5 sessions each)
and prints episodes per second for each operation, plain JSONL and zstd. ``--appends K``
splits the writes into K append calls (K zstd frames) to show the per-frame cost of reading.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trajectories import ASSIGNERS, Episode, RolloutStore, assign
from trajectories.testing import episode, session

ASSIGNER_PARAMS = {"discounted": {"gamma": 0.9}, "usage_weighted": {"unused_value": 0.0}}


def build(i: int) -> Episode:
    """Episode i: r -> c1 -> b1 (branch), plus c2 after c1 for odd i and a second branch every third."""
    eid = f"ep-{i}"
    sessions = [
        session("r", episode_id=eid, usage=0.5),
        session("c1", "r", "compression", episode_id=eid),
        session("b1", "c1", "branch", episode_id=eid, used_by_final=i % 2 == 0),
    ]
    if i % 2:
        sessions.append(session("c2", "c1", "compression", episode_id=eid))
    if i % 3 == 0:
        sessions.append(session("b2", "r", "branch", episode_id=eid, used_by_final=False))
    return episode(sessions, reward=float(i % 2), episode_id=eid, sample_id=i,
                   group_id=f"group-{i // 8}")


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="episodes (default 5000)")
    parser.add_argument("--appends", type=int, default=1, help="append calls per store")
    args = parser.parse_args(argv)
    n = args.n
    rows: list[tuple[str, float, str]] = []

    seconds, episodes = timed(lambda: [build(i) for i in range(n)])
    rows.append(("build Episode (validate + hash)", seconds, ""))
    sessions = sum(len(e.sessions) for e in episodes)

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("rollouts.jsonl", "rollouts.jsonl.zst"):
            store = RolloutStore(Path(tmp) / name)
            kind = "zstd" if store.compress else "plain"
            step = -(-n // args.appends)

            def write(store=store, step=step):
                for start in range(0, n, step):
                    store.append(episodes[start:start + step])

            seconds, _ = timed(write)
            size = f"{store.path.stat().st_size / 1e6:.1f} MB"
            rows.append((f"append ({kind}, {args.appends} call(s))", seconds, size))
            seconds, back = timed(lambda store=store: list(store.read()))
            assert [e.content_hash for e in back] == [e.content_hash for e in episodes]
            rows.append((f"read ({kind})", seconds, ""))
            seconds, report = timed(store.verify)
            assert report.ok and report.records == n, str(report)
            rows.append((f"verify ({kind})", seconds, ""))

    for method in ASSIGNERS:
        params = ASSIGNER_PARAMS.get(method, {})
        seconds, _ = timed(lambda method=method, params=params: [
            assign(e, method, **params) for e in episodes
        ])
        rows.append((f"assign {method}", seconds, ""))

    table = Table(title=f"{n} episodes, {sessions} sessions ({sessions / n:.1f} per episode)")
    table.add_column("operation")
    table.add_column("seconds", justify="right")
    table.add_column("episodes/s", justify="right")
    table.add_column("note")
    for op, seconds, note in rows:
        table.add_row(op, f"{seconds:.3f}", f"{n / seconds:,.0f}", note)
    Console().print(table)


if __name__ == "__main__":
    main()
