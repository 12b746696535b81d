"""``agent-rl canary``: release a bundle (offline gate -> shadow -> canary -> promote, or
roll back; ``evals.canary``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from agent_rl.cli.common import CLIError, command, console, print_lines
from agent_rl.cli.evaluate import eval_tasks
from agent_rl.policies.load import default_device, load_bundle_policy, response_limit

if TYPE_CHECKING:
    from agent_rl.policies.load import LoadedPolicy


def _canary_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--candidate", required=True, metavar="BUNDLE",
                        help="bundle (or run dir) to release")
    parser.add_argument("--baseline", required=True, metavar="BUNDLE",
                        help="bundle (or run dir) now serving")
    parser.add_argument("--env", default=None, metavar="ID",
                        help="environment id (default: the candidate run's env)")
    parser.add_argument("--n", type=int, default=32,
                        help="offline and shadow tasks; the canary serves about as many")
    parser.add_argument("--canary-fraction", type=float, default=0.25,
                        help="share of live traffic the candidate serves (default: 0.25)")
    parser.add_argument("--model", default=None, metavar="ID",
                        help="base model of both bundles (default: from their runs)")
    parser.add_argument("--seed", type=int, default=1234, help="episode seeds and traffic split")


def bundle_candidate(loaded: LoadedPolicy):
    """A canary ``Candidate`` of a loaded bundle; before promotion its whole bundle is verified
    again (every file against the manifest, the COMPLETE marker present)."""
    from functools import partial

    from agent_rl.run.checkpoint import verify_bundle
    from evals.canary import Candidate

    return Candidate(loaded.name, loaded.bundle_hash, loaded.policy,
                     current_hash=partial(verify_bundle, loaded.bundle))


@command("canary", "release a bundle: offline gate -> shadow -> canary -> promote, or roll back",
         _canary_arguments)
def canary(args: argparse.Namespace) -> int:
    from agent_rl.run.contract import AcceptanceSection
    from evals import canary as release

    if args.n < 1:
        raise CLIError(f"--n must be >= 1, got {args.n}")
    try:  # before any bundle is loaded
        count = args.n + release.live_task_count(args.n, args.canary_fraction)
    except ValueError as exc:
        raise CLIError(f"--canary-fraction: {exc}") from exc
    device = default_device()
    cand, base = (load_bundle_policy(p, args.model, device) for p in (args.candidate, args.baseline))
    if cand.bundle_hash == base.bundle_hash:
        raise CLIError(f"candidate and baseline are the same bundle ({cand.bundle_hash[:12]})")
    contract = cand.contract or base.contract
    env_id = args.env or (contract.env.id if contract else None)
    if env_id is None:
        raise CLIError("pass --env ID: neither bundle comes from a run with a contract")
    held, env_kwargs = eval_tasks(env_id, ["holdout"], count, contract)
    (tasks,) = held.values()  # holdout, or holdout_iid in a pool with nothing compositional
    try:
        plan = release.release_plan(
            env_id, tasks, args.n, args.canary_fraction,
            contract.acceptance if contract else AcceptanceSection(), response_limit(contract),
            args.seed, base.bundle_hash, env_kwargs)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    result = release.run(bundle_candidate(cand), bundle_candidate(base), plan)
    print_lines(console(), verdict_lines(result))  # the reasons quote task ids and slice names
    return 0 if result.status == "promoted" else 1


def verdict_lines(result) -> list[str]:
    """A ``CanaryResult`` as lines: each stage's status and its reasons, then the result (and
    the rollback, if one ran)."""
    lines = [line for stage in result.stages
             for line in (f"{stage.stage}: {stage.status.upper()}",
                          *(f"  {reason}" for reason in stage.reasons))]
    lines.append(f"result: {result.status} at {result.stage}; serving {result.serving[:12]}")
    if result.rollback is not None:
        lines.append(f"rollback: live store restored to {result.rollback.store_hash[:12]}")
    return lines
