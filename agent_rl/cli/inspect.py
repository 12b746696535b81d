"""``agent-rl report RUN_DIR`` and ``agent-rl inspect EPISODES``: a run's report, stored
episodes' session trees, credit and transcripts."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from agent_rl.cli.common import CLIError, command, echo


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")


@command("report", "write RUN_DIR/report.html (reward, holdout, KL and length curves)",
         _report_arguments)
def report(args: argparse.Namespace) -> int:
    from evals.report import write_run_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CLIError(f"no run directory at {run_dir}")
    if not any((run_dir / name).exists() for name in ("metrics.jsonl", "eval.jsonl")):
        raise CLIError(f"{run_dir} is not a run directory: no metrics.jsonl or eval.jsonl")
    echo(str(write_run_report(run_dir)))
    return 0


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="rollout store (.jsonl or .jsonl.zst)")
    parser.add_argument("--assigner", default="broadcast",
                        help="credit assigner drawn on each session (default: broadcast)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="inspect only the first N episodes")
    parser.add_argument("--verify", action="store_true",
                        help="recompute every content hash first; exit 1 if any record is bad")
    parser.add_argument("--episode", action="append", default=[], metavar="ID",
                        help="only the episode with this id (repeatable), with its transcript")
    parser.add_argument("--transcript", action="store_true",
                        help="print every turn of every episode shown, not only its tree")


ROLE_STYLE = {"system": "dim", "user": "bold blue", "assistant": "bold green", "tool": "yellow"}


def print_transcript(console, episode) -> None:
    """Every turn of every session, in the order they were made. Episode text is printed as
    it is, its control characters escaped: never read as markup, never re-wrapped, newlines
    and tabs kept."""
    from trajectories.display import terminal_text

    def show(text: str, style: str = "") -> None:
        console.print(terminal_text(text, style), soft_wrap=True)

    for session in episode.sessions:
        show(f"── session {session.session_id} ({session.origin})", "bold")
        boundary = session.boundary
        if boundary is not None and boundary.summary is not None:
            show("summary carried over:", "magenta")
            show(boundary.summary)
        if boundary is not None and boundary.kind == "branch":
            show("returned to the parent:", "yellow")
            show("(not returned)" if boundary.returned is None else boundary.returned)
        for turn in session.turns:
            about = [turn.name or "", f"finish {turn.finish_reason}" if turn.finish_reason else "",
                     f"{len(turn.token_ids)} tokens" if turn.token_ids is not None else ""]
            show(" · ".join([f"[{turn.role}]", *filter(None, about)]), ROLE_STYLE[turn.role])
            if turn.content.strip():
                show(turn.content)
            else:  # an empty or whitespace-only reply would print as nothing
                more = " …" if len(turn.content) > 200 else ""
                show(f"(empty: {turn.content[:200]!r}{more})", "dim")
            if turn.tool_calls:
                show(json.dumps(turn.tool_calls, ensure_ascii=False))


@command("inspect", "draw the session trees and credit of stored episodes, or their transcripts",
         _inspect_arguments)
def inspect(args: argparse.Namespace) -> int:
    from itertools import islice

    from rich.console import Console

    from trajectories import ASSIGNERS, RolloutStore, assign
    from trajectories.display import episode_tree, summary_table, terminal_text

    path = Path(args.path)
    if not path.is_file():
        raise CLIError(f"no rollout store at {path}")
    if args.assigner not in ASSIGNERS:
        raise CLIError(f"unknown assigner {args.assigner!r}; registered: {sorted(ASSIGNERS)}")
    if args.limit is not None and args.limit < 0:
        raise CLIError(f"--limit must be >= 0, got {args.limit}")
    console = Console()
    store = RolloutStore(path)
    if args.verify:
        report = store.verify()
        console.print(terminal_text(str(report)))  # it names episode ids
        if not report.ok:
            return 1

    wanted, found, tasks = set(args.episode), set(), {}

    def selected():  # every episode, or the --episode ones (reading stops once all are found)
        for episode in store.read():
            tasks.setdefault(episode.task_id, []).append(episode.episode_id)
            if not wanted or episode.episode_id in wanted:
                found.add(episode.episode_id)
                yield episode
                if wanted and found == wanted:
                    return

    def drawn():  # streams: each tree is printed as its episode is read
        for episode in islice(selected(), args.limit):
            console.print(episode_tree(episode, assign(episode, args.assigner)))
            if wanted or args.transcript:
                print_transcript(console, episode)
            yield episode

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = summary_table(drawn(), args.assigner)
        except ValueError as exc:  # StoreError (a bad record) or an assigner refusing an episode
            raise CLIError(str(exc)) from exc
        finally:
            for warning in caught:
                Console(stderr=True).print(terminal_text(f"warning: {warning.message}",
                                                         "yellow"))
    missing = sorted(wanted - found) if args.limit is None else []
    if missing:
        as_tasks = [f"{m!r} is a task id; its episodes: {', '.join(tasks[m])}"
                    for m in missing if m in tasks]
        raise CLIError(f"no episode {', '.join(map(repr, missing))} in {path} "
                       f"({sum(map(len, tasks.values()))} episodes)"
                       + ("; " + "; ".join(as_tasks) if as_tasks else ""))
    console.print(table)
    return 0
