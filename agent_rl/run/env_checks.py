"""What the contract checks against the installed code before any work: that the splits it
names exist (``evals.splits``) and that ``env.id`` is registered and takes every
``env.kwargs`` name (``envs.accepted_kwargs``; Dataset-v0 and Agent-v0 arguments checked
without reading a file). Called by the contracts' validators (``run.contract``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_rl.run.overrides import did_you_mean
from agent_rl.run.pins import AGENT_ENV, DATASET_ENV

if TYPE_CHECKING:
    from agent_rl.run.contract import EnvSection, EvalSection


def check_split_names(env: EnvSection, eval_: EvalSection) -> None:
    """``env.split`` and every ``eval.split`` name a split ``evals.splits`` builds."""
    from evals.splits import SPLIT_NAMES

    for key, names in (("env.split", [env.split]), ("eval.split", eval_.splits)):
        unknown = [n for n in names if n not in SPLIT_NAMES]
        if unknown:
            raise ValueError(f"{key}: no split {unknown[0]!r}"
                             f"{did_you_mean(unknown[0], SPLIT_NAMES)}; splits are "
                             f"{list(SPLIT_NAMES)}")


def check_env_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    """``env.id`` is registered and its constructor takes every ``env.kwargs`` name, without
    building the environment (``envs.accepted_kwargs``)."""
    import envs

    try:
        takes = envs.accepted_kwargs(env_id)
    except (LookupError, ImportError) as exc:
        raise ValueError(f"env.id: {exc}") from None
    unknown = sorted(set(kwargs) - takes) if takes is not None else []
    if unknown:
        raise ValueError(f"env.kwargs.{unknown[0]}: {env_id} takes no such argument"
                         f"{did_you_mean(unknown[0], takes, 'env.kwargs.')}; it takes "
                         f"{sorted(takes)}")
    if env_id in (DATASET_ENV, AGENT_ENV):  # arguments checked without reading a file
        from envs.agent_env import AgentSpecError
        from envs.agent_env import check_arguments as check_agent
        from envs.datasets import DatasetError, check_arguments

        try:
            (check_arguments if env_id == DATASET_ENV else check_agent)(**kwargs)
        except (DatasetError, AgentSpecError) as exc:
            raise ValueError(f"env.kwargs.{exc.key}: {exc}" if exc.key else
                             f"env.kwargs: {exc}") from None
