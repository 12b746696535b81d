"""This machine's limits, measured: the matmul peak in a dtype and the memory bandwidth. The
benchmarks compare against these, measured in the same run (imported as ``limits`` by the
scripts run as ``python benchmarks/<script>.py``).

Run as a script it prints the CPU's matmul peak in a dtype, the figure to give a training run
as ``run.peak_flops`` so that it reports ``perf/mfu`` (docs/training.md, "Scale metrics"):

    python benchmarks/limits.py --dtype bfloat16 [--seconds 5]
"""

from __future__ import annotations

import argparse
import time

import torch


def matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.bfloat16, n: int = 2048,
                repeats: int = 5, seconds: float | None = None) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` on ``device``: the mean of ``repeats`` after
    3 warm-ups, or, with ``seconds``, of as many as run in that long (the rate the machine
    sustains over as long as the work it is set against, where a few products catch its best
    moment)."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    start, done = time.perf_counter(), 0
    while (done < repeats) if seconds is None else (done == 0 or time.perf_counter() - start < seconds):
        a @ b
        if seconds is not None:
            sync()
        done += 1
    sync()
    return 2 * n**3 * done / (time.perf_counter() - start)


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s copying into an already allocated CPU buffer ((read + write) bytes / seconds),
    the best of ``repeats``."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description="This CPU's matmul peak in a dtype: the "
                                                 "run.peak_flops of a training run on it.")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the run's model.dtype (default: bfloat16)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="how long to multiply: the rate sustained over that long (default 5)")
    args = parser.parse_args()
    peak = matmul_peak("cpu", getattr(torch, args.dtype), seconds=args.seconds)
    print(f"{args.dtype} matmul peak of this CPU: {peak / 1e9:.1f} GFLOP/s")
    print(f"--set run.peak_flops={peak:.4g}")


if __name__ == "__main__":
    main()
