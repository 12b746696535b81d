"""The ``agent-rl`` command line.

Each subcommand is one small function ``run(args) -> exit code`` registered with
``@command(name, help, arguments)``, where ``arguments(parser)`` adds its flags. Keep heavy
imports (torch, transformers) inside the command function so ``agent-rl inspect`` stays fast.

Commands: ``train CONFIG``, ``report RUN_DIR``, ``eval``, ``canary``, ``envs list|new|check``,
``inspect EPISODES | RUN_DIR``, ``export RUN_OR_BUNDLE OUT``, ``plan CONFIG`` (the resource
plan); ``agent-rl --version``. A policy
is named ``base`` (the base model), ``PATH`` (a checkpoint bundle or a run directory) or
``openai:URL``; ``agent_rl.policies.load.load_policy`` is the one place
that turns it into one.

What is printed may quote agent or task text (replies, ids, dataset rows, check and error
messages): plain lines go through ``echo``, rich cells through ``terminal_text``, warnings
through ``plain_warnings`` (``agent-rl COMMAND: warning: ...``, no source line, each once),
all of them ``trajectories.display.escape_terminal``, so no
escape sequence, C1 control or bidi override reaches the terminal and no such text is markup.

Exit codes: 0 success; 1 a check failed (``inspect --verify`` found bad records, ``envs check``
failed, ``canary`` rolled back or stopped); 2 a usage error, a broken contract (the message names
the key), a missing file, model or bundle, an unreadable record, a run directory that another
process holds or that cannot be written, or a full disk (the message names the last complete
checkpoint); 3 ``train`` stopped by a guard; 4 ``train`` trained on no token because of a limit
the contract sets (guard ``nothing_trained``: every first prompt over
``rollout.max_prompt_tokens``, or every reply truncated under ``rollout.truncation: mask``; the
message names the key); 130 ``train`` or ``sft`` interrupted (Ctrl-C or SIGTERM; ``--resume``
continues from the last complete checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from agent_rl.cli.common import COMMANDS, CLIError, echo, escaped_warnings, plain_warnings

# One module per command group; importing it registers its commands, in this order (--help's).
# isort: off
from agent_rl.cli import train, plan, evaluate, canary, inspect, envs, export  # noqa: F401, E402
# isort: on


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-rl",
        description="Multi-session agentic RL: environments, GRPO training, evaluation.",
    )
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the agent-rl, Python, torch and transformers versions")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def version_line() -> str:
    """``agent-rl X (Python P, torch T, transformers F)``, read from the installed packages'
    metadata (nothing is imported); "not installed" for a missing one."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"agent-rl {of('agent-rl')} (Python {sys.version.split()[0]}, torch {of('torch')}, "
            f"transformers {of('transformers')})")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from agent_rl.policies.load import PolicyLoadError
    from agent_rl.policies.openai_policy import OpenAIPolicyError

    try:
        with escaped_warnings(), plain_warnings(args.command):
            code = args._run(args)
    except (CLIError, PolicyLoadError, OpenAIPolicyError) as exc:  # a remote endpoint's is redacted
        echo(f"agent-rl {args.command}: error: {exc}", file=sys.stderr)  # it may quote agent text
        code = 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "torch" in sys.modules:  # (else no group)
        from agent_rl.run.distributed import end_launched_rank

        end_launched_rank(code)  # one of several ranks: no interpreter teardown (its docstring)
    return code
