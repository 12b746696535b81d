"""``agent-rl plan CONFIG [--world-size N] [--device-memory GB] [--set KEY=VALUE ...]``: the
resource plan of one rank (``agent_rl.run.plan``), part by part, at most 80 columns; the last
line one JSON object (``Plan.to_json``)."""

from __future__ import annotations

import argparse
import json
import textwrap

from agent_rl.cli.common import CLIError, command, echo

NAME, SIZE = 14, 11  # the part and per-rank columns; the note takes the rest of 80
WIDTH = 80


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="experiment contract (YAML)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="ranks the run trains on (default: WORLD_SIZE, else 1)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GB",
                        help="GiB of memory on each rank's device (default: "
                             "model.device_memory, else a CUDA device's total; the CPU has none)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a contract key by its dotted path, e.g. "
                             "rollout.group_size=16")


@command("plan", "the memory one rank needs, part by part (parameters, gradients, optimizer, "
                 "reference, rollout copy, KV cache, activations), and what fits", _plan_arguments)
def plan(args: argparse.Namespace) -> int:
    from agent_rl.run.contract import ContractError, ExperimentContract
    from agent_rl.run.distributed import check_world_size, launched_world_size

    world = args.world_size if args.world_size is not None else launched_world_size()
    if world < 1:
        raise CLIError(f"--world-size {world}: give at least 1 rank")
    if args.device_memory is not None and args.device_memory <= 0:
        raise CLIError(f"--device-memory {args.device_memory}: give the device's GiB (> 0)")
    try:
        contract = ExperimentContract.from_yaml(args.config, args.overrides)
        check_world_size(contract.backend.name, world)
    except (ContractError, ValueError) as exc:
        raise CLIError(str(exc)) from exc
    result, where = read_plan(contract, world, args.device_memory)
    for line in plan_lines(contract, result, where):
        echo(line)
    print(json.dumps(result.to_json()))
    return 0


def read_plan(contract, world_size: int, given_gib: float | None = None):
    """``training.setup.contract_plan``; a model whose architecture cannot be read is a
    ``CLIError`` naming it."""
    from agent_rl.training.setup import contract_plan

    try:
        return contract_plan(contract, world_size, given_gib)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read the architecture of model.id {contract.model.id!r} or "
                       f"reference {contract.reference!r}: {exc}") from exc


def plan_lines(contract, plan, where: str) -> list[str]:
    """The plan as lines of at most 80 columns: what it assumes, one row per part, the
    total, the device and whether it fits, and the largest sizes that fit."""
    from agent_rl.run.plan import gib

    m, rollout, backend = contract.model, contract.rollout, contract.backend
    zero = f", ZeRO {backend.zero_stage}" if backend.name == "deepspeed" else ""
    offload = ", optimizer offloaded" if backend.offload == "cpu" else ""

    def auto(flag: bool) -> str:
        return "auto: " if flag else ""

    head = [
        f"resource plan of {contract.name}: one rank of {plan.world_size}, backend "
        f"{backend.name}{zero}{offload}",
        f"model {m.id}: {plan.params:,} parameters, {plan.trainable:,} trained (adapter "
        f"{m.adapter}), {m.dtype}",
        f"rollout {rollout.backend}: {plan.decode_rows} rows at once (decode_batch "
        f"{auto(plan.decode_auto)}{plan.decode_batch}), micro_batch_tokens "
        f"{auto(plan.micro_auto)}{plan.micro_batch_tokens}",
    ]
    lines = [part for line in head for part in textwrap.wrap(line, WIDTH, subsequent_indent="    ")]
    lines += ["", row("part", "per rank", "note")]
    lines += [text for p in plan.parts for text in row_lines(p.name, gib(p.device), p.note)]
    lines.append(row("total", gib(plan.total), ""))
    if plan.host:
        lines += row_lines("host", gib(plan.host), "offloaded: " + ", ".join(
            f"{p.name} {gib(p.host)}" for p in plan.parts if p.host))
    if plan.fits is None:
        lines.append(f"device memory: not known ({where}): give --device-memory GB to check "
                     "the fit")
        return lines
    verdict = ("fits, " + gib(plan.device_memory - plan.total) + " to spare" if plan.fits
               else "does NOT fit, " + gib(plan.total - plan.device_memory) + " over")
    lines.append(f"device memory {gib(plan.device_memory)} ({where}): {verdict}")
    lines += textwrap.wrap(
        f"largest that fit, the rest unchanged: optim.micro_batch_tokens "
        f"{plan.max_micro_batch_tokens}; {plan.max_decode_rows} rows decoded at once "
        f"(rollout.decode_batch), rollout.group_size {plan.max_group_size} in one pass at "
        f"{plan.tasks_per_rank} tasks a rank", WIDTH, subsequent_indent="    ")
    return lines


def row(name: str, size: str, note: str) -> str:
    return f"{name:<{NAME}}{size:>{SIZE}}  {note}".rstrip()


def row_lines(name: str, size: str, note: str) -> list[str]:
    """One part's row, its note wrapped under the note column."""
    notes = textwrap.wrap(note, WIDTH - NAME - SIZE - 2) or [""]
    return [row(name, size, notes[0]), *(row("", "", n) for n in notes[1:])]
