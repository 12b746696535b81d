"""A policy from its name: ``load_policy("base" | RUN | BUNDLE | "openai:URL")``.

``base`` is the base model's weights (``model_id``, default ``DEFAULT_MODEL``); ``RUN`` a run
directory (its newest complete checkpoint bundle) and ``BUNDLE`` a checkpoint bundle folder,
loaded onto the base model they were trained from (a LoRA bundle gets its adapter first);
``openai:URL`` an OpenAI-compatible server (evaluation only; ``model_id`` names the served
model, ``$OPENAI_API_KEY`` is sent when set). Every failure is a ``PolicyLoadError`` whose
message names what could not be loaded and the fix. Torch and transformers are imported only
when a model is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m"


class PolicyLoadError(ValueError):
    """A policy that cannot be loaded (a missing model or bundle, a bundle that does not fit
    its model, a bad ``openai:URL``); the message says which and what to do."""


@dataclass
class LoadedPolicy:
    """A policy with what evaluation records about it."""

    policy: Any
    name: str
    bundle: Path | None = None
    bundle_hash: str | None = None
    contract: Any = None  # the ExperimentContract of the run the bundle came from, if found


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_base_model(model_id: str, dtype: str = "float32"):
    """``policies.models.load_model``; a missing or unreadable model file is a
    ``PolicyLoadError``."""
    from agent_rl.policies.models import load_model

    try:
        return load_model(model_id, dtype=dtype)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        raise PolicyLoadError(f"cannot load model {model_id!r}: {exc}") from exc


def resolve_bundle(path: str | Path) -> Path:
    """``checkpoint.resolve_bundle``; no bundle there is a ``PolicyLoadError``."""
    from agent_rl.run import checkpoint

    try:
        return checkpoint.resolve_bundle(path)
    except checkpoint.BundleError as exc:
        raise PolicyLoadError(str(exc)) from None


def run_dir_of(bundle: Path) -> Path | None:
    """The run directory a bundle belongs to (``RUN_DIR/checkpoints/step-N``): the nearest of
    its parents, or itself, that holds a ``contract.yaml``; None for a bundle on its own."""
    return next((folder for folder in (bundle.parent.parent, bundle.parent, bundle)
                 if (folder / "contract.yaml").is_file()), None)


def contract_of(bundle: Path):
    """The contract of the run a bundle belongs to (``run_dir_of``): an
    ``ExperimentContract``, or an ``SFTContract`` for a warm start's bundle; or None."""
    from agent_rl.run.contract import ContractError, read_contract

    run_dir = run_dir_of(bundle)
    if run_dir is None:
        return None
    try:
        return read_contract(run_dir / "contract.yaml")
    except ContractError as exc:
        raise PolicyLoadError(f"the run's contract is unreadable: {exc}") from exc


def response_limit(contract) -> int:
    """Tokens per reply of the run a bundle came from: an RL run's rollout limit, a warm
    start's limits.max_response_tokens, 128 without a contract."""
    if contract is None:
        return 128
    section = getattr(contract, "rollout", None) or contract.limits
    return section.max_response_tokens


def base_model_id(contract, model_id: str | None = None) -> str:
    """The base model of a bundle: ``model_id`` when given, else its run's ``model.id``, else
    ``DEFAULT_MODEL``."""
    return model_id or (contract.model.id if contract else DEFAULT_MODEL)


def parameter_names(bundle: Path) -> list[str]:
    """The names of the tensors a bundle holds (its meta's ``parameter_names``)."""
    from agent_rl.run.checkpoint import META_FILE

    return json.loads((bundle / META_FILE).read_text()).get("parameter_names", [])


def holds_lora(bundle: Path) -> bool:
    """Does the bundle hold LoRA adapters (a training checkpoint under model.adapter: lora)?"""
    return any("lora_" in name for name in parameter_names(bundle))


def lora_rank(bundle: Path, names: list[str]) -> int:
    """The LoRA rank of a bundle without a contract: rows of its first ``lora_A`` weight."""
    from safetensors import safe_open

    from agent_rl.run.checkpoint import MODEL_FILE

    name = next(n for n in names if "lora_A" in n)
    with safe_open(bundle / MODEL_FILE, framework="pt") as f:
        return int(f.get_slice(name).get_shape()[0])


@dataclass
class BundleModel:
    """A checkpoint bundle's weights on the model they were trained from."""

    model: Any  # a transformers causal LM, or a peft model (LoRA bundles), on the CPU
    tokenizer: Any
    bundle: Path
    contract: Any  # the run's ExperimentContract or SFTContract, or None
    model_id: str  # the base model's id (model.id)


def load_bundle_model(path: str | Path, model_id: str | None = None) -> BundleModel:
    """A bundle (``path``: the bundle, or a run directory: ``resolve_bundle``) loaded onto its
    base model (the run's ``model.id`` and dtype, else ``model_id``, else ``DEFAULT_MODEL``;
    the run's ``model.init`` weights first when set). LoRA bundles (parameter names with
    ``lora_``) get the adapter first, with the rank and alpha of the run's contract (rank read
    off the tensors, alpha the contract default, when the contract is gone)."""
    from agent_rl.policies.models import add_lora, model_fingerprint
    from agent_rl.run import checkpoint
    from agent_rl.run.contract import ModelSection

    bundle = resolve_bundle(path)
    contract = contract_of(bundle)
    model_id = base_model_id(contract, model_id)
    model, tokenizer = load_base_model(model_id, contract.model.dtype if contract else "float32")
    if contract is not None and contract.model.init is not None:  # the run's starting weights
        try:
            checkpoint.load_init(contract.model.init, model, model_fingerprint(model_id))
        except checkpoint.BundleError as exc:
            raise PolicyLoadError(f"the run's model.init: {exc}") from exc
    names = parameter_names(bundle)
    if holds_lora(bundle):
        section = contract.model if contract else ModelSection()
        rank = section.lora_rank if contract else lora_rank(bundle, names)
        model = add_lora(model, rank, section.lora_alpha)
    try:
        checkpoint.load_bundle(bundle, model, restore_rng=False)
    except checkpoint.BundleError as exc:
        text = str(exc) if len(str(exc)) <= 600 else str(exc)[:600] + " ..."
        if "does not fit the model" in text:
            text += f" (is {model_id!r} the model this bundle was trained from? pass --model)"
        raise PolicyLoadError(text) from exc
    return BundleModel(model.eval(), tokenizer, bundle, contract, model_id)


def load_bundle_policy(path: str | Path, model_id: str | None = None,
                       device: str | None = None) -> LoadedPolicy:
    """``load_bundle_model`` as an ``HFPolicy`` on ``device``, with the bundle's hash."""
    from agent_rl.policies.hf import HFPolicy
    from agent_rl.run import checkpoint

    loaded = load_bundle_model(path, model_id)
    bundle = loaded.bundle
    return LoadedPolicy(HFPolicy(loaded.model, loaded.tokenizer, device=device or default_device()),
                        f"{bundle.parent.parent.name}/{bundle.name}", bundle,
                        checkpoint.bundle_hash(bundle), loaded.contract)


def load_policy(spec: str, model_id: str | None = None, device: str | None = None,
                timeout: float = 60) -> LoadedPolicy:
    """``base`` | ``RUN`` | ``BUNDLE`` | ``openai:URL`` -> a ``LoadedPolicy`` (the module
    docstring); ``device``: where an HF policy runs (default: ``cuda`` when torch sees a GPU,
    else ``cpu``); ``timeout``: the wall-clock seconds one request to an ``openai:URL`` server
    may take, retries included."""
    if spec.startswith("openai:"):
        from agent_rl.policies.openai_policy import OpenAIPolicy

        try:
            policy = OpenAIPolicy(spec.removeprefix("openai:"), model=model_id or "default",
                                  api_key=os.environ.get("OPENAI_API_KEY"), timeout=timeout)
        except ValueError as exc:  # a bad URL, --timeout or $OPENAI_API_KEY
            raise PolicyLoadError(f"--policy openai:...: {exc}") from None
        return LoadedPolicy(policy, spec)
    if spec == "base":
        from agent_rl.policies.hf import HFPolicy

        model_id = model_id or DEFAULT_MODEL
        model, tokenizer = load_base_model(model_id)
        return LoadedPolicy(HFPolicy(model, tokenizer, device=device or default_device()),
                            f"base:{model_id}")
    return load_bundle_policy(spec, model_id, device)
