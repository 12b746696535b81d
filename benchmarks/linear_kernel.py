"""One linear layer, three ways, side by side: MKL's ``F.linear`` on the plain float32 weight,
oneDNN on its own reordered layout (what packed rollout copies ran before our kernel), and our
kernel on the weight in panels (``agent_rl.accel.blocked_linear``, what they run now).

SmolLM2-135M's projection shapes (out x in) at 1, 8 and 32 rows (decode steps) and 400 rows
(a prefill); each side cycles through enough copies of the weight (~300 MB) that every call
reads it from memory, as a decode step does. Microseconds per call, best of ``--repeats``,
and the bandwidth the call's weight bytes imply.

    python benchmarks/linear_kernel.py
    python benchmarks/linear_kernel.py --quick     # one shape, few copies: a smoke run

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from agent_rl import accel

SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = (1, 8, 32, 400)


def per_call_s(fn: Callable[[int], torch.Tensor], copies: int, calls: int, repeats: int) -> float:
    for i in range(3):
        fn(i % copies)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i % copies)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def time_shape(n: int, k: int, rows: tuple[int, ...], mb: int, repeats: int) -> dict:
    """{rows: {side: us per call, ours_gb_s}} for one n x k weight."""
    copies = max(2, mb * 10**6 // (n * k * 4))
    plain = [torch.randn(n, k) for _ in range(copies)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in plain]
    panels = [accel.to_panels(w) for w in plain]
    calls = max(4, min(200, 2 * copies))
    figures = {}
    for m in rows:
        x = torch.randn(m, k)
        sides = {
            "mkl": lambda i, x=x: torch.nn.functional.linear(x, plain[i]),
            "onednn": lambda i, x=x: torch.ops.mkldnn._linear_pointwise(
                x, onednn[i], None, "none", [], ""),
            "ours": lambda i, x=x: accel.blocked_linear(x, panels[i], None, n)}
        us = {side: per_call_s(fn, copies, calls, repeats) * 1e6 for side, fn in sides.items()}
        figures[m] = {side: round(t, 1) for side, t in us.items()}
        figures[m]["ours_gb_s"] = round(n * k * 4 / us["ours"] / 1e3, 1)
        print(f"{n:>5} x {k:<5} {m:>4} rows: MKL {us['mkl']:8.1f} us   oneDNN {us['onednn']:8.1f} us   "
              f"ours {us['ours']:8.1f} us ({figures[m]['ours_gb_s']:5.1f} GB/s)   "
              f"MKL/ours {us['mkl'] / us['ours']:.2f}x", flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mb", type=int, default=300, help="MB of weight copies cycled through")
    ap.add_argument("--quick", action="store_true", help="one shape, 8 MB of copies, 1 repeat")
    args = ap.parse_args()
    shapes, rows = (SHAPES[:1], ROWS[:2]) if args.quick else (SHAPES, ROWS)
    if args.quick:
        args.mb, args.repeats = 8, 1
    if not accel.load_kernels():
        raise SystemExit("agent_rl.accel's kernels did not build here (see the warning above)")
    torch.manual_seed(0)
    result: dict = {"threads": torch.get_num_threads(), "rows": list(rows), "quick": args.quick}
    for n, k in shapes:
        result[f"{n}x{k}"] = time_shape(n, k, rows, args.mb, args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
