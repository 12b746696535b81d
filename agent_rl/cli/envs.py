"""``agent-rl envs list|new|check``: registered environments, a scaffolded package, the
contract checks."""

from __future__ import annotations

import argparse
import sys

from agent_rl.cli.common import CLIError, command, console, echo


def _envs_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="envs_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="registered environment ids").set_defaults(_envs=envs_list)
    new = sub.add_parser("new", help="scaffold an installable environment package")
    new.add_argument("name", metavar="NAME", help="lowercase identifier, e.g. letter_count")
    new.add_argument("--dest", default=".", metavar="DIR", help="parent folder (default: .)")
    new.set_defaults(_envs=envs_new)
    check = sub.add_parser("check", help="run the contract checks on an environment id")
    check.add_argument("id", metavar="ID", help="registered environment id")
    check.add_argument("--episodes", type=int, default=20, help="episodes per check")
    check.set_defaults(_envs=envs_check)


@command("envs", "list, scaffold or check environments", _envs_arguments)
def envs_(args: argparse.Namespace) -> int:
    return args._envs(args)


def describe_env(env_id: str) -> tuple[str, str]:
    """(version, first docstring line) of an env's class (its module's, when it has none),
    read off the class without building it (an env such as Agent-v0 needs arguments); a
    factory entry point is built to find its class."""
    import inspect

    import envs
    from envs.registry import env_creator

    cls = env_creator(env_id)
    env = None if inspect.isclass(cls) else envs.make(env_id)
    try:
        cls = cls if env is None else type(env.unwrapped)
        doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""
        return f"v{getattr(cls, 'version', '?')}", (doc.strip().splitlines() or [""])[0]
    finally:
        if env is not None:
            env.close()


def envs_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    import envs
    from trajectories.display import terminal_text

    table = Table(title="registered environments")
    for column in ("id", "version", "description"):
        table.add_column(column)
    for env_id in envs.list_envs():  # ids and docstrings come from installed plugins
        table.add_row(*map(terminal_text, (env_id, *describe_env(env_id))))
    console().print(table)
    return 0


def envs_new(args: argparse.Namespace) -> int:
    from envs.scaffold import new_env_package, next_steps, package_names

    try:
        root = new_env_package(args.name, args.dest)
    except (ValueError, FileExistsError) as exc:
        raise CLIError(str(exc)) from exc
    echo(f"{root}: the environment {package_names(args.name)['env_id']} (edit its env.py)\n"
         f"next, from this folder (the last trains it: 2 steps of the tiny model, evaluated "
         f"before and after on its unseen tasks, into runs/{args.name}/):")
    for step in next_steps(args.name, root):
        echo(f"  {step}")
    return 0


def envs_check(args: argparse.Namespace) -> int:
    import envs
    from envs.checks import check_env_id

    if args.id not in envs.list_envs():
        try:
            envs.make(args.id)  # raises with suggestions and the fix
        except Exception as exc:  # noqa: BLE001 - shown to the user as is
            raise CLIError(str(exc)) from exc
    report = check_env_id(args.id, episodes=args.episodes)
    echo(str(report))  # its messages quote the env's tasks, replies and exceptions
    return 0 if report.passed else 1
