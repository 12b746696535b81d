"""The ``agent-rl`` command line.

Each subcommand is one small function ``run(args) -> exit code`` registered with
``@command(name, help, arguments)``, where ``arguments(parser)`` adds its flags. Keep heavy
imports (torch, transformers) inside the command function so ``agent-rl inspect`` stays fast.

Exit codes: 0 success, 1 a check failed (e.g. ``inspect --verify`` found bad records), 2 a
usage error, a missing file or an unreadable record.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


class CLIError(Exception):
    """A user-facing failure: printed as ``agent-rl <command>: error: <message>``, exit 2."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``run(args) -> int`` as the subcommand ``name``."""

    def decorator(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"agent-rl command {name!r} is already registered")
        COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return decorator


# --- inspect ------------------------------------------------------------------------------


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="rollout store (.jsonl or .jsonl.zst)")
    parser.add_argument("--assigner", default="broadcast",
                        help="credit assigner drawn on each session (default: broadcast)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="inspect only the first N episodes")
    parser.add_argument("--verify", action="store_true",
                        help="recompute every content hash first; exit 1 if any record is bad")


@command("inspect", "draw the session trees and credit of stored episodes", _inspect_arguments)
def inspect(args: argparse.Namespace) -> int:
    from itertools import islice

    from rich.console import Console

    from trajectories import ASSIGNERS, RolloutStore, assign
    from trajectories.display import episode_tree, summary_table

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
        console.print(str(report), markup=False, highlight=False)
        if not report.ok:
            return 1

    def drawn():  # streams: each tree is printed as its episode is read
        for episode in islice(store.read(), args.limit):
            console.print(episode_tree(episode, assign(episode, args.assigner)))
            yield episode

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = summary_table(drawn(), args.assigner)
        except ValueError as exc:  # StoreError (a bad record) or an assigner refusing an episode
            raise CLIError(str(exc)) from exc
        finally:
            for warning in caught:
                Console(stderr=True).print(f"warning: {warning.message}", style="yellow",
                                           markup=False, highlight=False)
    console.print(table)
    return 0


# --- entry point --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-rl",
        description="Multi-session agentic RL: environments, GRPO training, evaluation.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except CLIError as exc:
        print(f"agent-rl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
