"""What every ``agent-rl`` command shares: the command registry (``@command``), the
user-facing error (``CLIError``), the shared flags' help and the printing helpers (``echo``,
``console``, escaped warnings: everything printed may quote agent or task text).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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



# --- shared flags and printing -------------------------------------------------------------

SPLIT_NAMES = "train, holdout, holdout_structure, holdout_entity, holdout_length, holdout_iid"
POLICY_HELP = ("base (the --model weights), PATH (a checkpoint bundle folder, or a run dir: its "
               "newest complete bundle) or openai:URL (an OpenAI-compatible server, evaluation "
               "only; --model names the served model, $OPENAI_API_KEY is sent when set)")


def interval(lo: Any, hi: Any) -> str:
    return "–" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"


def number(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def console():
    from rich.console import Console

    return Console()


PLAIN_WIDTH = 80  # plain lines are wrapped at most this wide when stdout is no terminal (a log)
# a word, or a bracketed interval with its inner spaces ("[0.121, 0.272]"): never split apart
_WORD = re.compile(r"[^\s\[]*\[[^\]]*\]\S*|\S+")


def wrap_line(line: str, width: int) -> list[str]:
    """``line`` cut at spaces into lines of at most ``width`` columns, each continuation
    indented four columns past the line's own indent (at most half the width); a bracketed interval stays whole, and
    only a single word wider than a line is cut inside."""
    indent = " " * (len(line) - len(line.lstrip(" ")))
    hanging = (indent + "    ")[:width // 2]  # a narrow width keeps room for the words
    lines, current = [], indent
    for word in _WORD.findall(line):
        gap = "" if current.strip() == "" else " "
        if current.strip() and len(current) + len(gap) + len(word) > width:
            lines.append(current)
            current, gap = hanging, ""
        room = max(width - len(current) - len(gap), 1)
        while len(word) > room and current.strip() == "":  # one word wider than a line
            lines.append(current + word[:room])
            word = word[room:]
        current += gap + word
    return [*lines, current] if current.strip() or not lines else lines


def show(out, table, lines: list[str]) -> None:
    """Print a result on console ``out``: the rich ``table`` on a terminal at least as wide as
    the table needs, else ``lines`` (the same numbers as plain text: ``print_lines``): a narrow
    terminal or a log gets every digit, never a column cut to ``…``."""
    unbounded = out.options.update_width(10**6)  # what the table needs, not what it gets
    if out.is_terminal and out.measure(table, options=unbounded).maximum <= out.width:
        out.print(table)
    else:
        print_lines(out, lines)


def print_lines(out, lines: list[str]) -> None:
    """Plain ``lines`` on console ``out``, escaped (they may quote task or agent text), each
    wrapped (``wrap_line``) at the terminal's width or, when stdout is no terminal, at most
    ``PLAIN_WIDTH``."""
    from rich.text import Text

    from trajectories.display import escape_terminal

    width = out.width if out.is_terminal else min(out.width, PLAIN_WIDTH)
    for line in lines:
        for part in wrap_line(escape_terminal(line), width):
            out.print(Text(part), soft_wrap=True)


def echo(text: str, file=None) -> None:
    """``print`` for the CLI's plain lines: they may quote agent or task text (ids, replies,
    dataset rows, check and error messages), so control characters are escaped
    (``trajectories.display.escape_terminal``)."""
    from trajectories.display import escape_terminal

    print(escape_terminal(text), file=file)


@contextmanager
def escaped_warnings():
    """While a command runs, a printed warning has its message escaped like every other line:
    it may quote agent or task text (a task id, a path, a record). Only the printing changes
    (``warnings.formatwarning``); filters and recorders see the warning as it was raised."""
    from trajectories.display import escape_terminal

    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        return original(escape_terminal(str(message)), category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = original


def ignore_library_deprecations() -> None:
    """Deprecation notices of the model libraries (transformers, peft, torch) say nothing
    about the user's run or model: not shown for the rest of the command. Their own progress
    bars (loading and writing weights) are left out of a log, where each redraw would be a
    line of carriage returns: only on a terminal are they drawn."""
    for module in ("transformers", "peft", "torch"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    if not sys.stderr.isatty():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    quiet_deepspeed_detection()


def quiet_deepspeed_detection() -> None:
    """transformers imports DeepSpeed wherever it is installed, and DeepSpeed warns "Setting
    accelerator to CPU. If you have GPU ..." on every command of a machine without one: where
    torch sees no CUDA device, DeepSpeed is told the CPU (``DS_ACCELERATOR``, unless set)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


_SHOWN: set[tuple[type, str]] = set()  # (category, message) of the warnings printed so far


@contextlib.contextmanager
def plain_warnings(command: str):
    """Warnings print as ``agent-rl COMMAND: warning: MESSAGE``, without the source line
    Python adds (a run's warnings are for its user, not about this code), each distinct one
    once per process (a notice repeated by every split or evaluation says nothing new), escaped
    as every other line (they may quote agent or task text)."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if (category, str(message)) in _SHOWN:
            return
        _SHOWN.add((category, str(message)))
        echo(f"agent-rl {command}: warning: {message}", file=file or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


class StopSignal:
    """While active, SIGTERM and SIGINT (Ctrl-C) raise KeyboardInterrupt, so a run stops the
    same way on either (a checkpoint being written is discarded whole; finished bundles stay),
    and ``received`` names the signal. An interrupt that lands inside a library's lock handling
    can surface as another error instead (tensorboard's writer queue: RuntimeError "release
    unlocked lock"); with ``received`` set, that error is the stop too."""

    received: int | None = None

    def __enter__(self):
        def stop(signum, frame):
            self.received = signum
            raise KeyboardInterrupt(f"signal {signum}")

        self.previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)


def holding(run_dir: Path, resume: bool) -> contextlib.AbstractContextManager:
    """``runlock.hold_if_main(run_dir, resume)``, entered: the run directory is this process's until
    the returned context exits; one held by another process or that cannot be written is a
    ``CLIError`` naming it (exit 2)."""
    from agent_rl.run.rundir import RunDirError
    from agent_rl.run.runlock import hold_if_main

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(hold_if_main(run_dir, resume))
    except RunDirError as exc:
        raise CLIError(str(exc)) from None
    return stack


def no_space(exc: OSError, run_dir: Path, checkpoints: Path) -> CLIError | None:
    """A full disk while writing a file of the run (a log line; a checkpoint's is a
    ``checkpoint.DiskFullError`` already) as a ``CLIError`` naming the file and the newest
    complete bundle in ``checkpoints``; None for any other error."""
    from agent_rl.run import checkpoint

    if not checkpoint.is_disk_full(exc):
        return None
    return CLIError(str(checkpoint.no_space(exc.filename or run_dir, checkpoints, exc)))
