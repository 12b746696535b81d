"""Credit-assigner ablation on Relay-v0: the same training run under each assigner.

    python benchmarks/assigners.py                        # 5 assigners, seed 0, the demo config
    python benchmarks/assigners.py --seeds 0 1 --steps 20 --assigners broadcast terminal_only
    python benchmarks/assigners.py --config examples/smollm2_relay_optional.yaml \
        --seeds 0 1 2 --out runs/assigners-optional      # optional sub-agents (Relay, branching)

Every run uses the same contract (``examples/smollm2_relay.yaml`` by default) but for
``credit.assigner``, ``optim.seed`` and ``run_dir``: the same tasks in the same order, the same
rollout budget (steps x tasks x group size), the same sampling seeds and the same held-out
tasks, evaluated greedily and hint-free before and after. Printed per assigner: held-out reward
before and after, the paired difference after - before, and the paired difference of its
trained policy against broadcast's (the same held-out tasks and seeds). With several seeds a
task's differences are averaged over the seeds first, so a task is one unit of the bootstrap.
Also: the share of held-out roots that spawn a sub-agent after training, and the sessions per
episode of the training rollouts on the first and last step (on a branching config: 1 +
sub-agents spawned). ``terminal_only`` gives the note-writing session nothing but a negative
advantage in rewarded groups: it is the control that shows whether credit for the note matters.

The starting policy is evaluated once, by the first run, and every other run reuses that
evaluation (``train.run(before=...)``, which checks it scored the same held-out tasks at the
same temperature): every arm starts from the same base model, so its evaluation would be the
same, and on CPU it is a third of an arm's time.

Writes ``OUT/assigners.json`` (after every run) and ``OUT/assigners.md`` (the table in docs/concepts.md).
Rerunning with the same ``--out`` reuses every run that finished under the same contract and
continues the one that was cut short (from its newest checkpoint, else from its start), so an
interrupted ablation picks up where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent_rl.run.contract import ExperimentContract  # noqa: E402
from agent_rl.run.rundir import pinned_to  # noqa: E402
from agent_rl.training import train  # noqa: E402
from evals.stats import paired_bootstrap  # noqa: E402

ASSIGNERS = ("broadcast", "terminal_only", "uniform_split", "discounted", "usage_weighted", "turn_discount")


def run_one(config: Path, assigner: str, seed: int, steps: int | None, out: Path,
            earlier: dict[str, dict], before: dict | None) -> dict:
    overrides = [f"credit.assigner={assigner}", f"optim.seed={seed}",
                 f"run_dir={out / f'{assigner}-seed{seed}'}"]
    if steps is not None:
        overrides.append(f"optim.max_steps={steps}")
    contract = ExperimentContract.from_yaml(config, overrides)
    if contract.contract_hash() in earlier:
        print("   finished earlier under the same contract: reusing its result", flush=True)
        return earlier[contract.contract_hash()]
    t0 = time.perf_counter()
    resume = pinned_to(contract.resolved_run_dir, contract.contract_hash())  # cut short: continue
    result = train.run(contract, resume=resume, progress=True, before=before)
    metrics = [json.loads(line) for line in
               (contract.resolved_run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"assigner": assigner, "seed": seed, "contract_hash": contract.contract_hash(),
            "steps": result.steps,
            "seconds": time.perf_counter() - t0, "before": result.before, "after": result.after,
            "comparison": result.comparison,
            "tokens_generated": sum(m["rollout/tokens_generated"] for m in metrics),
            "sessions_per_episode": [m["sessions/per_episode"] for m in metrics],
            "stopped": None if result.stopped is None else result.stopped.rule}


def finished_runs(out: Path) -> dict[str, dict]:
    """Runs an interrupted earlier invocation finished, by contract hash: rerunning resumes."""
    path = out / "assigners.json"
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    runs = saved["runs"] if isinstance(saved, dict) else saved
    return {r["contract_hash"]: r for r in runs if "contract_hash" in r}


def kept(results: list[dict], earlier: dict[str, dict]) -> list[dict]:
    """This invocation's runs, then the earlier ones it did not ask for (none is dropped)."""
    done = {r["contract_hash"] for r in results}
    return results + [r for h, r in earlier.items() if h not in done]


def per_task(summary: dict) -> dict[str, float]:
    return dict(zip(summary["keys"], summary["rewards"], strict=True))


def seed_averaged(pairs: list[tuple[dict, dict]]) -> tuple[float, float, float, int]:
    """Paired a - b over held-out tasks, one (a, b) evaluation pair per seed: a task's
    differences are averaged over the seeds first, so a task is one unit of the bootstrap."""
    diffs: dict[str, list[float]] = {}
    for a, b in pairs:
        mine, theirs = per_task(a), per_task(b)
        for key in mine.keys() & theirs.keys():
            diffs.setdefault(key, []).append(mine[key] - theirs[key])
    values = [float(np.mean(v)) for v in diffs.values()]
    diff, lo, hi = paired_bootstrap(values, [0.0] * len(values), n_boot=5000)
    return diff, lo, hi, len(values)


def table(results: list[dict], assigners: list[str], seeds: list[int]) -> list[dict]:
    by = {(r["assigner"], r["seed"]): r for r in results}
    rows = []
    for name in assigners:
        runs = [by[name, s] for s in seeds]
        before = float(np.mean([r["before"]["reward_mean"] for r in runs]))
        after = float(np.mean([r["after"]["reward_mean"] for r in runs]))
        gain, lo, hi, _ = seed_averaged([(r["after"], r["before"]) for r in runs])
        row = {"assigner": name, "before": before, "after": after,
               "gain": gain, "gain_lo": lo, "gain_hi": hi,
               "gain_intervals": [(r["comparison"]["lo"], r["comparison"]["hi"]) for r in runs],
               "note_used_after": (float(np.mean([r["after"]["summary_used_frac"] for r in runs]))
                                   if any(r["after"]["compressions_per_episode"] for r in runs)
                                   else None),  # no note was written (a branching config)
               "spawning_after": (float(np.mean([r["after"]["branched_frac"] for r in runs]))
                                  if any(r[when].get("branches_per_episode")
                                         for r in runs for when in ("before", "after"))
                                  else None),  # nothing spawned (not a branching config)
               "sessions_first_last": first_and_last(runs),
               "tokens": int(np.mean([r["tokens_generated"] for r in runs]))}
        if name != "broadcast" and "broadcast" in assigners:
            d, lo, hi, n = seed_averaged([(r["after"], by["broadcast", r["seed"]]["after"])
                                          for r in runs])
            row.update({"vs_broadcast": d, "vs_lo": lo, "vs_hi": hi, "vs_n": n})
        rows.append(row)
    return rows


def first_and_last(runs: list[dict]) -> tuple[float, float] | None:
    """Sessions per training episode on the first and the last step, mean over seeds (None
    for runs recorded before this was kept)."""
    kept_runs = [r["sessions_per_episode"] for r in runs if r.get("sessions_per_episode")]
    if not kept_runs:
        return None
    return float(np.mean([s[0] for s in kept_runs])), float(np.mean([s[-1] for s in kept_runs]))


def markdown(rows: list[dict], seeds: list[int], steps: int) -> str:
    """The table; a column no row has a value for (notes on a branching config, spawning
    on a compression config) is left out."""
    columns = ["assigner", "held-out before", "after", "after - before (95% CI)", "per seed",
               "after vs broadcast (95% CI)"]
    notes = any(r["note_used_after"] is not None for r in rows)
    spawning = any(r.get("spawning_after") is not None for r in rows)
    columns += (["notes used after"] * notes + ["roots spawning after"] * spawning
                + ["sessions/episode, step 1 -> last"])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r["assigner"], f"{r['before']:.3f}", f"{r['after']:.3f}",
                 f"{r['gain']:+.3f} [{r['gain_lo']:+.3f}, {r['gain_hi']:+.3f}]",
                 "; ".join(f"[{lo:+.3f}, {hi:+.3f}]" for lo, hi in r["gain_intervals"]),
                 (f"{r['vs_broadcast']:+.3f} [{r['vs_lo']:+.3f}, {r['vs_hi']:+.3f}]"
                  if "vs_broadcast" in r else "(baseline)")]
        if notes:
            cells.append("-" if r["note_used_after"] is None else f"{r['note_used_after']:.2f}")
        if spawning:
            cells.append("-" if r.get("spawning_after") is None
                         else f"{100 * r['spawning_after']:.0f}%")
        cells.append("-" if r["sessions_first_last"] is None else
                     "{:.2f} -> {:.2f}".format(*r["sessions_first_last"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {steps} steps each; "
                 "intervals over held-out tasks, each task's difference averaged over the "
                 "seeds first.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "smollm2_relay.yaml")
    parser.add_argument("--assigners", nargs="+", default=list(ASSIGNERS), choices=ASSIGNERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's max_steps")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "assigners")
    args = parser.parse_args()
    for module in ("transformers", "peft", "torch"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = finished_runs(args.out)
    results = []
    for seed in args.seeds:
        for name in args.assigners:
            print(f"== {name}, seed {seed}", flush=True)
            before = next((r["before"] for r in [*results, *earlier.values()]), None)
            results.append(run_one(args.config, name, seed, args.steps, args.out, earlier,
                                   before))
            (args.out / "assigners.json").write_text(json.dumps(kept(results, earlier), indent=1))
    rows = table(results, args.assigners, args.seeds)
    md = markdown(rows, args.seeds, results[0]["steps"])
    (args.out / "assigners.json").write_text(
        json.dumps({"runs": kept(results, earlier), "rows": rows}, indent=1))
    (args.out / "assigners.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
