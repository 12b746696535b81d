"""agent-rl's trainer: policies, the GRPO loop and its run infrastructure, in four
subpackages that import in one direction (``docs/layout.md``)::

    run/        the ground floor: the experiment contract, checkpoints, distributed
                backends, the run directory and its lock, guards, devices
    policies/   HF, vLLM and OpenAI-compatible policies, decoding, model loading, chat
                rendering, token log-probs, ``load_policy``        (imports run/)
    training/   the GRPO loop, SFT, rollout -> credit -> advantages, the GRPO math,
                curriculum, the async pipeline          (imports policies/ and run/)
    cli/        the ``agent-rl`` command: parses, calls, prints (imported by nothing)

The public Python API is importable from here, whatever module holds it::

    train(contract | dict | path, reward=, dataset=, assigner=,
          peft_config=, **overrides) -> RunResult             training/api.py
    ExperimentContract, read_contract                            run/contract.py
    ContractError                                                run/overrides.py
    RunResult                                                    training/train.py
    session_advantages                                           training/rollout.py
    group_advantages, policy_loss                                training/grpo.py
    HFPolicy                                                     policies/hf.py
    VLLMPolicy (needs the vllm extra)                            policies/vllm_policy.py
    OpenAIPolicy                                                 policies/openai_policy.py
    load_policy("base" | RUN | BUNDLE | "openai:URL")            policies/load.py
    export(RUN_OR_BUNDLE, OUT, merge_lora=False) -> Exported     policies/export.py

Each is imported on first use (a module ``__getattr__``), so ``import agent_rl`` pulls in
neither torch nor transformers and ``agent-rl inspect`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

PUBLIC = {
    "train": "agent_rl.training.api",
    "ExperimentContract": "agent_rl.run.contract",
    "read_contract": "agent_rl.run.contract",
    "ContractError": "agent_rl.run.overrides",
    "RunResult": "agent_rl.training.train",
    "session_advantages": "agent_rl.training.rollout",
    "group_advantages": "agent_rl.training.grpo",
    "policy_loss": "agent_rl.training.grpo",
    "HFPolicy": "agent_rl.policies.hf",
    "VLLMPolicy": "agent_rl.policies.vllm_policy",
    "OpenAIPolicy": "agent_rl.policies.openai_policy",
    "load_policy": "agent_rl.policies.load",
    "export": "agent_rl.policies.export",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_rl' has no attribute {name!r}; its public names: "
                             f"{', '.join(__all__)}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
