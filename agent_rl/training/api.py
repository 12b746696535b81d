"""``agent_rl.train``: GRPO training from Python, the twin of ``agent-rl train CONFIG --set ...``,
with typed arguments for what a YAML file can only name by string (TRL's ``reward_funcs``,
``train_dataset`` and ``peft_config``, in agent-rl's terms).

How each typed argument becomes contract keys (what the run directory's ``contract.yaml``
records, so ``--resume`` and ``agent-rl eval`` see the same run):

==============  ==========================================  ===================================
argument        contract keys                               recorded as
==============  ==========================================  ===================================
``reward``      ``env.kwargs.reward`` (env Dataset-v0)      ``module:function``; a function
                                                            from a script ``__main__:name``
``dataset``     ``env.kwargs.path`` (env Dataset-v0)        ``RUN/inputs/<sha256>.jsonl``: the
                                                            rows, written into the run dir
``assigner``    ``credit.assigner``                         ``module:function``; a function
                                                            from a script ``__main__:name``
``peft_config`` ``model.adapter: lora``, ``model.lora_rank``  the numbers (r, lora_alpha)
                ``model.lora_alpha``
==============  ==========================================  ===================================

A function that cannot be imported by name (defined in the script, a lambda, a closure:
``trajectories.functions``) lives only in the process it was passed to; the contract pins
its source (``contract.sha256`` changes when it does). Resuming such a run means passing it
again (``agent_rl.train(RUN / "contract.yaml", resume=True, reward=my_reward)``); without
it, the contract check stops before any work with ``NotPassedError``'s message saying so.
A function in an importable module needs nothing more: its name is the YAML spelling.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent_rl.run.contract import ContractError, EnvSection, ExperimentContract
from agent_rl.run.pins import DATASET_ENV
from agent_rl.run.rundir import inputs_file
from agent_rl.training.train import RunResult, run
from trajectories.functions import function_spec

# LoraConfig fields that do not change what is trained (bookkeeping); the rest must be
# mapped (r, lora_alpha, target_modules) or left at LoraConfig's defaults
LORA_BOOKKEEPING = ("task_type", "peft_type", "auto_mapping", "peft_version",
                    "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
                    "megatron_core")
LORA_MAPPED = ("r", "lora_alpha", "target_modules")


def train(contract: ExperimentContract | Mapping[str, Any] | str | os.PathLike, /, *,
          reward: str | Callable[..., Any] | None = None,
          dataset: str | os.PathLike | Iterable[Mapping[str, Any]] | None = None,
          assigner: str | Callable[..., Any] | None = None,
          peft_config: Any = None,
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

    Typed arguments (module docstring: what the contract records for each):

    * ``reward``: Dataset-v0's reward, a function ``(reply: str, task: TaskSpec) -> float |
      dict[str, float]`` (``task.target`` is the row's answer, ``task.data["record"]`` the
      row) or a name (``"numeric"``, ``"module:function"``);
    * ``dataset``: Dataset-v0's rows: a list of dicts, a ``datasets.Dataset`` (any iterable
      of mappings), or a path (``.jsonl``/``.csv``/a saved ``datasets`` folder). Rows are
      written to ``RUN/inputs/<sha256>.jsonl`` and checked there as a file's rows are (a bad
      row is named before training). ``reward`` and ``dataset`` set ``env.id`` to
      ``agent_rl/Dataset-v0`` (a contract naming another env is refused);
    * ``assigner``: ``credit.assigner``, a function ``(episode, **credit.params) ->
      {session_id: credit}`` (a ``unit`` attribute sets its reward unit) or a name;
    * ``peft_config``: a ``peft.LoraConfig``: ``r`` and ``lora_alpha`` become
      ``model.lora_rank``/``model.lora_alpha`` under ``model.adapter: lora``; agent-rl trains
      LoRA on every linear layer (``target_modules`` None or ``"all-linear"``) and any other
      field set away from LoraConfig's default is refused, naming it.

    The contract is validated whole, with the overrides, before anything runs, and its run
    directory checked (a file in its way): a broken one raises ``ContractError`` (a
    ``ValueError``) naming the key, as ``agent-rl train`` reports it. ``resume``: continue the
    run in ``run_dir`` from its newest complete checkpoint; ``progress``: the progress bar.
    """
    plain = {key.replace("__", "."): value for key, value in overrides.items()}
    values = {**plain, **typed_values(reward, assigner, peft_config)}
    if reward is not None or dataset is not None:
        values["env.id"] = dataset_env_id(contract, plain)
    if dataset is not None and not isinstance(dataset, str | os.PathLike):
        rows = dataset_jsonl(dataset)  # checked before anything is written
        dataset = inputs_file(build(contract, values).check_run_dir(), rows, ".jsonl")
    if dataset is not None:
        values["env.kwargs.path"] = str(dataset)
    contract = build(contract, values)
    contract.check_run_dir()
    contract.contract_hash()  # reads every pinned input: a missing file or function stops here
    return run(contract, resume=resume, progress=progress)


def build(contract: ExperimentContract | Mapping[str, Any] | str | os.PathLike,
          values: dict[str, Any]) -> ExperimentContract:
    """``contract`` with ``values`` (dotted key -> Python value) applied, validated."""
    if isinstance(contract, ExperimentContract):
        if not values:
            return contract
        return ExperimentContract.from_dict(contract.model_dump(mode="json"), values=values)
    if isinstance(contract, Mapping):
        return ExperimentContract.from_dict(contract, values=values)
    return ExperimentContract.from_yaml(contract, values=values)


def typed_values(reward: Any, assigner: Any, peft_config: Any) -> dict[str, Any]:
    """The contract keys of the typed arguments ``reward``, ``assigner``, ``peft_config``."""
    values: dict[str, Any] = {}
    for key, what, given in (("env.kwargs.reward", "reward", reward),
                             ("credit.assigner", "assigner", assigner)):
        if given is None or isinstance(given, str):
            values.update({key: given} if given is not None else {})
            continue
        try:
            values[key] = function_spec(given, what)
        except TypeError as exc:
            raise ContractError(f"{what}: {exc}") from None
    if peft_config is not None:
        values.update(lora_values(peft_config))
    return values


def dataset_env_id(contract: ExperimentContract | Mapping[str, Any] | str | os.PathLike,
                   overrides: dict[str, Any]) -> str:
    """``agent_rl/Dataset-v0``, unless ``contract`` (with ``overrides``) names another env
    than the default: refused, since ``reward`` and ``dataset`` are Dataset-v0's."""
    named = build(contract, overrides).env.id
    if named not in (DATASET_ENV, EnvSection.model_fields["id"].default):
        raise ContractError(f"env.id: reward= and dataset= are the arguments of {DATASET_ENV}, "
                            f"but the contract trains on {named}; drop env.id (or set it to "
                            f"{DATASET_ENV})")
    return DATASET_ENV


def dataset_jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    """The rows as JSONL bytes (one JSON object a line); a ``ContractError`` naming the row
    that is not a mapping of JSON values, or an empty dataset."""
    if isinstance(rows, Mapping):
        splits = sorted(map(str, rows))
        raise ContractError(f"dataset: a mapping (splits or columns {splits}), not rows; pass "
                            f"one split (dataset['train']) or a list of dicts")
    try:
        iterator = iter(rows)
    except TypeError:
        raise ContractError(f"dataset: {type(rows).__name__} is not a list of dicts, a "
                            "datasets.Dataset or a path") from None
    lines = []
    for number, row in enumerate(iterator, 1):
        if not isinstance(row, Mapping):
            raise ContractError(f"dataset row {number}: a {type(row).__name__}, not a dict "
                                "({'prompt': ..., 'answer': ...})")
        try:
            lines.append(json.dumps(dict(row), ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ContractError(f"dataset row {number}: not JSON ({exc}); rows hold text, "
                                "numbers, booleans, lists and dicts") from None
    if not lines:
        raise ContractError("dataset: no rows")
    return ("\n".join(lines) + "\n").encode()


def lora_values(config: Any) -> dict[str, Any]:
    """The contract keys of a ``peft.LoraConfig`` (``train``'s docstring); a ``ContractError``
    naming every field the trainer would not honour."""
    if not dataclasses.is_dataclass(config) or type(config).__name__ != "LoraConfig":
        raise ContractError(f"peft_config: a peft.LoraConfig, got {type(config).__name__}")
    defaults = type(config)()
    unsupported = [f.name for f in dataclasses.fields(config)
                   if f.name not in LORA_BOOKKEEPING + LORA_MAPPED
                   and getattr(config, f.name) != getattr(defaults, f.name)]
    if config.target_modules not in (None, "all-linear"):
        unsupported.insert(0, "target_modules")
    if unsupported:
        shown = ", ".join(f"{name}={_plain(getattr(config, name))!r}" for name in unsupported)
        raise ContractError(
            f"peft_config: agent-rl's LoRA (model.adapter: lora) sets only r and lora_alpha "
            f"(on every linear layer, dropout 0, no bias); this LoraConfig also sets {shown}: "
            "drop those fields")
    return {"model.adapter": "lora", "model.lora_rank": int(config.r),
            "model.lora_alpha": int(config.lora_alpha)}




def _plain(value: Any) -> Any:
    return sorted(value) if isinstance(value, set | frozenset) else value
