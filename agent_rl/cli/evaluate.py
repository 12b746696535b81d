"""``agent-rl eval``: a policy (``base`` | RUN | BUNDLE | ``openai:URL``) on a task split, per
slice, with intervals."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agent_rl.cli.common import (
    POLICY_HELP,
    SPLIT_NAMES,
    CLIError,
    command,
    console,
    echo,
    interval,
    number,
    show,
)
from agent_rl.policies.load import DEFAULT_MODEL, default_device, load_policy, response_limit


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default=None, metavar="ID",
                        help="environment id (default: the env of the run PATH came from)")
    parser.add_argument("--split", default=None, metavar="NAME",
                        help=f"task split: {SPLIT_NAMES} (default: the eval.split of the run's "
                             "or --config's contract, else holdout)")
    parser.add_argument("--policy", default="base", metavar="SPEC", help=POLICY_HELP)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="an experiment contract whose env section (id, kwargs, task pool, "
                             "iid_fraction) defines the tasks (default: the run's, when --policy "
                             "is a run; e.g. evaluate the base model on a run's held-out tasks)")
    parser.add_argument("--model", default=None, metavar="ID",
                        help="smollm2-135m | tiny | a local HF folder | a Hub id in the local HF cache (default: the run's model, "
                             f"else {DEFAULT_MODEL}); for openai:URL the served model's name")
    parser.add_argument("--n", type=int, default=64, help="tasks evaluated (default: 64)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling and episode seed")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where records.jsonl, episodes.jsonl and report.html go, replacing "
                             "those of an earlier eval there (default: runs/eval-ENV-SPLIT)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="M",
                        help="per reply (default: the run's max_response_tokens, else 128)")
    parser.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                        help="openai:URL only: wall-clock limit on one request, retries "
                             "included (default: 60)")
    parser.add_argument("--hinted", action="store_true",
                        help="show the tasks' hints (evaluation is hint-free without it; every "
                             "record says whether a hint was shown)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")


def eval_splits(split: str | None, env_id: str, contract) -> list[str]:
    """The splits ``eval`` evaluates: ``--split``, else the contract's ``eval.split`` (one or
    several) when it trained on ``env_id``, else ``holdout``."""
    if split is not None:
        return [split]
    if contract is not None and contract.env.id == env_id:
        return contract.eval.splits
    return ["holdout"]


def eval_tasks(env_id: str, names: list[str], n: int, contract) -> tuple[dict[str, list], dict]:
    """The first ``n`` tasks of each split in ``names`` (keyed by the split evaluated:
    ``evals.splits.Splits.evaluated``) and the env kwargs; the pool is the run's
    (``env.pool_size``, ``env.pool_seed``, ``env.holdout``, ``env.iid_fraction``) when the
    contract trained on this env, so its held-out tasks are exactly the ones the trainer held
    out."""
    import gymnasium

    from agent_rl.run.contract import EnvSection, did_you_mean
    from evals.splits import SPLIT_NAMES as KNOWN

    for name in names:
        if name not in KNOWN:
            raise CLIError(f"unknown split {name!r}{did_you_mean(name, KNOWN)}; splits: "
                           f"{SPLIT_NAMES}")
    section = contract.env if contract and contract.env.id == env_id else EnvSection(id=env_id)
    try:
        import envs

        env = envs.make(env_id, **section.kwargs)
        splits = section.splits(env, require=names)
    except (gymnasium.error.Error, ValueError) as exc:  # a bad id or holdout, an empty split
        raise CLIError(str(exc)) from exc
    return {name: list(splits[name])[:n] for name in splits.evaluated(names)}, section.kwargs


def slice_rows(records) -> list[dict[str, Any]]:
    """Overall, then (with several splits) per split, then per structure, entity group and
    composition (atomic / composed)."""
    from evals.run import slice_summary

    by_split = ("split",) if len({r.split for r in records}) > 1 else ()
    return [row for by in ((), *by_split, "structure", "entity_group", "composition")
            for row in slice_summary(records, by, n_boot=2000)]


def slice_label(row: dict[str, Any]) -> str:
    """A slice row's keys as ``structure=chain entity_group=people``; ``all`` for the overall row."""
    from evals.report import SLICE_NUMBERS

    return " ".join(f"{k}={row[k]}" for k in row if k not in SLICE_NUMBERS) or "all"


def slice_lines(rows: list[dict[str, Any]], title: str) -> list[str]:
    """``slice_table`` as plain lines (a log, a narrow terminal: ``common.show``): per slice its
    label and ``n``, then its reward mean and success rate with their 95% intervals."""
    lines = [title, "per slice: reward mean (95% interval), success rate (95% Wilson)"]
    for row in rows:
        lines += [f"{slice_label(row)} (n={row['n']})",
                  f"  reward {number(row['reward/mean'])} {interval(row['reward/lo'], row['reward/hi'])}"
                  f", success {number(row['success/rate'])} "
                  f"{interval(row['success/lo'], row['success/hi'])}"]
    return lines


def slice_table(rows: list[dict[str, Any]], title: str):
    from rich.table import Table

    from trajectories.display import terminal_text

    table = Table(title=terminal_text(title))
    for column in ("slice", "n", "reward mean", "95% interval", "success", "95% Wilson"):
        table.add_column(column, justify="left" if column == "slice" else "right", overflow="fold")
    for row in rows:
        table.add_row(terminal_text(slice_label(row)), str(row["n"]), number(row["reward/mean"]),
                      interval(row["reward/lo"], row["reward/hi"]), number(row["success/rate"]),
                      interval(row["success/lo"], row["success/hi"]))
    return table


@command("eval", "evaluate a policy on a task split, per slice, with intervals", _eval_arguments)
def eval_(args: argparse.Namespace) -> int:
    from agent_rl.training.metrics import episode_progress
    from envs.runner import Sampling
    from evals.report import inspect_command, write_report
    from evals.run import EvalRun, run_eval, write_episodes, write_records

    if args.n < 1:
        raise CLIError(f"--n must be >= 1, got {args.n}")
    loaded = load_policy(args.policy, args.model, default_device(), timeout=args.timeout)
    contract = loaded.contract
    if args.config is not None:
        from agent_rl.run.contract import ContractError, ExperimentContract

        try:
            contract = ExperimentContract.from_yaml(args.config)
        except ContractError as exc:
            raise CLIError(str(exc)) from exc
    env_id = args.env or (contract.env.id if contract else None)
    if env_id is None:
        raise CLIError("pass --env ID (e.g. agent_rl/Arithmetic-v0)")
    tasks, env_kwargs = eval_tasks(env_id, eval_splits(args.split, env_id, contract), args.n,
                                   contract)
    max_new = args.max_new_tokens or response_limit(contract)
    sampling = Sampling(temperature=args.temperature, top_p=1.0, max_new_tokens=max_new,
                        seed=args.seed)
    runs = []
    for split, split_tasks in tasks.items():
        with episode_progress(not args.no_progress, len(split_tasks), f"eval {split}") as on_round:
            runs.append(run_eval(loaded.policy, env_id, split_tasks, sampling, seed=args.seed,
                                 env_kwargs=env_kwargs, policy_name=loaded.name,
                                 bundle_hash=loaded.bundle_hash, split=split,
                                 hinted=args.hinted, on_round=on_round))
    run = EvalRun([r for one in runs for r in one.records], [e for one in runs for e in one.episodes])
    names = "+".join(tasks)
    out = Path(args.out or f"runs/eval-{env_id.rsplit('/', 1)[-1]}-{names}")
    records = write_records(run.records, out / "records.jsonl")
    episodes = write_episodes(run.episodes, out / "episodes.jsonl")  # one per record, in order
    rows = slice_rows(run.records)
    title = f"{loaded.name} on {env_id} {', '.join(tasks)} (n={len(run.records)})"
    report = write_report(out / "report.html", title=title, slices=rows, evaluation=run,
                          episodes_path=episodes)
    show(console(), slice_table(rows, title), slice_lines(rows, title))
    faults = sum(r.infra_fault for r in run.records)
    echo(f"records: {records}\nepisodes: {episodes} ({len(run.episodes)} episodes, {faults} "
         f"infrastructure faults)\nreport: {report} (the worst slices' transcripts)\n"
         f"one episode: {inspect_command(episodes)} --episode ID")
    return 0
