"""``agent_rl.train``: GRPO training from Python, the twin of ``agent-rl train CONFIG --set ...``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from agent_rl.run.contract import ExperimentContract
from agent_rl.training.train import RunResult, run


def train(contract: ExperimentContract | Mapping[str, Any] | str | os.PathLike, /, *,
          resume: bool = False, progress: bool = True, **overrides: Any) -> RunResult:
    """Train under an experiment contract and return the run's ``RunResult`` (steps, losses,
    held-out reward before and after, their paired comparison, the guard that stopped it).

    ``contract``: an ``ExperimentContract``, a dict of its sections as the YAML holds them, or
    the path of a contract YAML. ``overrides`` change contract keys before validation, as the
    CLI's ``--set`` does, with Python values (not YAML text): a dotted key with ``__`` for the
    dot as a keyword (``optim__max_steps=4``, ``rollout__group_size=8``), or a dict of dotted
    keys unpacked (``**{"optim.max_steps": 4, "env.kwargs": {"difficulty": 2}}``)::

        import agent_rl
        result = agent_rl.train("examples/tiny.yaml", optim__max_steps=4, run_dir="runs/t")

    The contract is validated whole, with the overrides, before anything runs, and its run
    directory checked (a file in its way): a broken one raises ``ContractError`` (a
    ``ValueError``) naming the key, as ``agent-rl train`` reports it. ``resume``: continue the
    run in ``run_dir`` from its newest complete checkpoint; ``progress``: the progress bar.
    """
    values = {key.replace("__", "."): value for key, value in overrides.items()}
    if isinstance(contract, ExperimentContract):
        if values:
            contract = ExperimentContract.from_dict(contract.model_dump(mode="json"), values=values)
    elif isinstance(contract, Mapping):
        contract = ExperimentContract.from_dict(contract, values=values)
    else:
        contract = ExperimentContract.from_yaml(contract, values=values)
    contract.check_run_dir()
    return run(contract, resume=resume, progress=progress)
