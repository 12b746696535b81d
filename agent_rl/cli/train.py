"""``agent-rl train CONFIG`` (GRPO) and ``agent-rl sft CONFIG`` (the supervised warm start)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent_rl.cli.common import (
    CLIError,
    StopSignal,
    command,
    console,
    echo,
    holding,
    ignore_library_deprecations,
    interval,
    no_space,
    number,
    plain_warnings,
    print_lines,
    show,
)
from agent_rl.policies.load import load_base_model


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="experiment contract (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a contract key by its dotted path, e.g. optim.max_steps=4")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run_dir from its newest complete checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _split(summary: dict, name: str) -> dict | None:
    """The held-out summary (or paired comparison) of split ``name``; ``all``: the overall one."""
    return summary if name == "all" else (summary.get("splits") or {}).get(name)


def _splits(result) -> list[str]:
    before, after = result.before or {}, result.after or {}
    return ["all", *(before.get("splits") or after.get("splits") or {})]


def before_after_table(result):
    """Held-out reward of the starting and the trained policy and the paired difference,
    overall and (when several splits were evaluated) per split, with what crossed
    compression boundaries (notes per episode, note tokens, share of notes used)."""
    from rich.table import Table

    from trajectories.display import terminal_text

    table = Table(title=f"held-out reward before/after ({sampled(result)}, hint-free)")
    for column in ("split", "policy", "reward mean", "95% interval", "n", "success",
                   "95% Wilson", "notes/ep", "note tok", "notes used"):
        table.add_column(column, justify="left" if column in ("split", "policy") else "right")
    comparison = result.comparison or {}

    def notes(summary: dict) -> list[str]:  # single-session episodes wrote no notes
        if not summary.get("compressions_per_episode"):
            return ["–"] * 3
        return [number(summary[k]) for k in ("compressions_per_episode", "summary_tokens",
                                             "summary_used_frac")]

    for name in _splits(result):
        for tag, summary in (("before", _split(result.before or {}, name)),
                             ("after", _split(result.after or {}, name))):
            if summary:
                table.add_row(terminal_text(name), tag, number(summary["reward_mean"]),
                              interval(summary["reward_lo"], summary["reward_hi"]),
                              str(summary["n"]), number(summary["success"]),
                              interval(summary["success_lo"], summary["success_hi"]),
                              *notes(summary))
        c = _split(comparison, name) if comparison else None
        if c:
            table.add_row(terminal_text(name), "paired diff", f"{c['reward_diff']:+.3f}",
                          interval(c["lo"], c["hi"]), str(c["n"]), "", "", "", "", "")
    return table


def sampled(result) -> str:
    """How the held-out episodes were sampled: ``greedy``, or ``T=0.7`` under a contract's
    ``eval.temperature`` (a summary without the key, logged before it was recorded: greedy)."""
    temperature = (result.before or {}).get("temperature") or 0.0
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def before_after_lines(result) -> list[str]:
    """``before_after_table`` as plain lines (a log, a narrow terminal: ``common.show``): per
    split, overall first, the key line ``held-out all: 0.371 -> 0.565, paired +0.194 [0.121,
    0.272] (n=96)``, then each policy's reward and success with 95% intervals and, where
    episodes wrote notes, notes per episode, tokens per note and the share used; where they
    spawned sub-agents, sub-agents per episode, the share of episodes with one and the share
    of sub-agents whose answer was used."""
    comparison = result.comparison or {}
    lines = [f"held-out reward before -> after ({sampled(result)}, hint-free; 95% intervals)"]
    for name in _splits(result):
        sides = [(tag, s) for tag, s in (("before", _split(result.before or {}, name)),
                                         ("after", _split(result.after or {}, name))) if s]
        if not sides:
            continue
        c = _split(comparison, name) if comparison else None
        if c and len(sides) == 2:
            key = (f"{number(sides[0][1]['reward_mean'])} -> {number(sides[1][1]['reward_mean'])}, "
                   f"paired {c['reward_diff']:+.3f} {interval(c['lo'], c['hi'])} (n={c['n']})")
        else:  # one side only: a run stopped by a guard was not evaluated after
            key = ", ".join(f"{tag} {number(s['reward_mean'])} (n={s['n']})" for tag, s in sides)
        lines.append(f"held-out {name}: {key}")
        lines.append("  reward: " + ", ".join(
            f"{tag} {number(s['reward_mean'])} {interval(s['reward_lo'], s['reward_hi'])} "
            f"n={s['n']}" for tag, s in sides))
        lines.append("  success: " + ", ".join(
            f"{tag} {number(s['success'])} {interval(s['success_lo'], s['success_hi'])}"
            for tag, s in sides) + " (Wilson)")
        if any(s.get("compressions_per_episode") for _, s in sides):
            summaries = [s for _, s in sides]
            lines.append(f"  notes: {_arrow(summaries, 'compressions_per_episode', '.2f')} per "
                         f"episode, {_arrow(summaries, 'summary_tokens', '.1f')} tokens each, "
                         f"{_arrow(summaries, 'summary_used_frac', '.0%')} used")
        if any(s.get("branches_per_episode") for _, s in sides):
            summaries = [s for _, s in sides]
            lines.append(f"  sub-agents: {_arrow(summaries, 'branches_per_episode', '.2f')} per "
                         f"episode, {_arrow(summaries, 'branched_frac', '.0%')} spawned, "
                         f"{_arrow(summaries, 'branch_used_frac', '.0%')} used")
    return lines


def _arrow(summaries: list[dict], key: str, form: str) -> str:
    """``key`` of each summary in ``form``, joined ``before -> after``."""
    return " -> ".join(format(s.get(key) or 0.0, form) for s in summaries)


@command("train", "run GRPO training from an experiment contract", _train_arguments)
def train(args: argparse.Namespace) -> int:
    from agent_rl.run.contract import ExperimentContract

    contract, run_dir = read_contract(ExperimentContract, args)
    with holding(run_dir, args.resume):  # before the model loads: a busy or unwritable run_dir fails at once
        return train_held(args, contract, run_dir)


def train_held(args: argparse.Namespace, contract, run_dir: Path) -> int:
    """``agent-rl train`` once its run directory is held."""
    from agent_rl.training import train as trainer
    from evals.report import write_run_report

    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun / deepspeed: rank 0 reports

    def report_so_far() -> None:  # the run got as far as pinning its folder
        if (run_dir / "contract.sha256").is_file():
            write_run_report(run_dir)

    result = run_trainer("train", args, contract, run_dir, run_dir / "checkpoints",
                         trainer.run, "no complete checkpoint yet", main_rank, report_so_far)
    if result is None:
        return 130
    if not main_rank:
        return stopped_code(result.stopped)
    report = write_run_report(run_dir)
    if result.before or result.after:
        show(console(), before_after_table(result), before_after_lines(result))
    echo(f"report: {report}\nrun dir: {run_dir}")
    if result.stopped is not None:
        trip = result.stopped
        echo(f"agent-rl train: stopped by guard {trip.rule} ({trip.action}) at step "
             f"{result.steps}: {trip.message}", file=sys.stderr)
    return stopped_code(result.stopped)


def read_contract(kind, args: argparse.Namespace):
    """``(contract, run_dir)``: ``kind.from_yaml`` of CONFIG with the --set overrides, and its
    run directory; a broken contract is a CLIError before torch is imported."""
    from agent_rl.run.contract import ContractError

    try:
        contract = kind.from_yaml(args.config, args.overrides)
        return contract, contract.check_run_dir()
    except ContractError as exc:
        raise CLIError(str(exc)) from exc


def run_trainer(name: str, args: argparse.Namespace, contract, run_dir: Path, checkpoints: Path,
                run, none_yet: str, main_rank: bool = True, on_interrupt=None):
    """``run(contract, resume=..., progress=...)`` (a trainer's ``run``) for ``agent-rl
    NAME`` once its run directory is held: the model libraries' deprecation notices silenced,
    the base model loaded first (a bad model id fails before the run dir is touched). Its
    result, or None when interrupted (Ctrl-C, SIGTERM): the main rank then prints how to
    resume from the newest complete bundle under ``checkpoints`` (``none_yet``: what it says
    when there is none) and calls ``on_interrupt``. A full disk names the last complete
    bundle; a bad env id, run dir, resume point or missing extra is a CLIError."""
    import gymnasium

    from agent_rl.run import checkpoint

    ignore_library_deprecations()
    load_base_model(contract.model.id, contract.model.dtype)  # fail fast, before the run dir
    stop = StopSignal()
    try:
        with stop, plain_warnings(name):
            return run(contract, resume=args.resume, progress=not args.no_progress)
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # a full disk while writing a log line
        if stop.received is None:
            if (error := no_space(exc, run_dir, checkpoints)) is None:
                raise
            raise error from exc
    except (ValueError, ImportError, checkpoint.BundleError, gymnasium.error.Error) as exc:
        if stop.received is None:  # a bad env id, run dir, resume point or missing extra
            raise CLIError(str(exc)) from exc
    except Exception:
        if stop.received is None:
            raise
    if main_rank:  # interrupted
        latest = checkpoint.latest_complete(checkpoints)
        where = f"from {latest}" if latest else f"from the start ({none_yet})"
        echo(f"agent-rl {name}: interrupted; `agent-rl {name} {args.config} --resume` (same "
             f"--set options) continues {where}", file=sys.stderr)
        if on_interrupt is not None:
            on_interrupt()
    return None


def stopped_code(trip) -> int:
    """``train``'s exit code for a run that ended (``RunResult.stopped``): 0 finished, 4 the
    guard ``nothing_trained`` (nothing was trained), 3 any other guard."""
    from agent_rl.run.guards import NothingTrained

    return 0 if trip is None else 4 if isinstance(trip, NothingTrained) else 3


# --- sft ----------------------------------------------------------------------------------


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="SFT contract (YAML: env, eval, model, "
                        "data, optim, limits, run_dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a contract key by its dotted path, e.g. optim.epochs=1")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run_dir from its newest resume bundle")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("sft", "supervised warm start on episodes (solver or a rollout store); writes a bundle "
         "`train` starts from with model.init", _sft_arguments)
def sft(args: argparse.Namespace) -> int:
    from agent_rl.run.contract import SFTContract

    contract, run_dir = read_contract(SFTContract, args)
    with holding(run_dir, args.resume):  # before the model loads: a busy or unwritable run_dir fails at once
        return sft_held(args, contract, run_dir)


def sft_held(args: argparse.Namespace, contract, run_dir: Path) -> int:
    """``agent-rl sft`` once its run directory is held."""
    from agent_rl.training import sft as warm_start

    result = run_trainer("sft", args, contract, run_dir, run_dir / warm_start.RESUME_DIR,
                         warm_start.run, "no resume bundle yet")
    if result is None:
        return 130
    data = result.data
    out = console()
    losses = result.losses or [float("nan")]
    print_lines(out, [
        f"trained on {data['sessions']} sessions of {data['episodes_kept']} episodes "
        f"({data['episodes_read']} read, dropped {data['dropped'] or 'none'}, sessions skipped "
        f"{data.get('skipped_sessions') or 'none'}), {result.steps} steps, loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f}"])
    show(out, before_after_table(result), before_after_lines(result))
    echo(f"bundle: {result.bundle} (sha256 {result.bundle_hash[:12]})\n"  # whole, to be copied
         f"start RL from it: agent-rl train CONFIG --set model.init={result.bundle}")
    return 0
