"""agent_rl.accel's entry point: ``accel.step`` checks where it runs before anything else (off the
CPU, under another backend than TorchBackend, or inside ``accel.disabled()`` it yields None,
builds no kernel and patches nothing), and on the CPU applies its patches for the step only.
(Same losses with it on and off: tests/agent_rl/test_train.py; the kernels themselves:
test_kernels.py, test_attention.py.)"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from transformers.models.llama import modeling_llama

from agent_rl import accel
from agent_rl.accel import kernels
from agent_rl.policies.models import tiny_model
from agent_rl.run.distributed import TorchBackend
from agent_rl.training import update


def no_build():
    raise AssertionError("kernels.load called: the accelerator was entered")


class ShardedBackend:
    """What the trainer sees of DeepSpeed in a world of one: not a TorchBackend."""

    rank, world_size, is_main = 0, 1, True

    def __init__(self, model):
        self.model = self.module = model


def patched_state(model) -> tuple:
    """What the accelerator changes while it runs: instance forwards, the attention
    implementation, the tied lookup's sparsity, the modeling module's rotary function."""
    forwards = sorted(name for name, m in model.named_modules() if "forward" in vars(m))
    return (forwards, model.config._attn_implementation, model.get_input_embeddings().sparse,
            modeling_llama.apply_rotary_pos_emb)


@pytest.mark.parametrize("where", ["meta", "sharded", "disabled"])
def test_off_the_cpu_the_step_builds_nothing_and_patches_nothing(monkeypatch, where):
    """A model on the meta device (as a CUDA model: not the CPU), a backend that is not
    TorchBackend (DeepSpeed), or inside accel.disabled(): None, kernels.load never called
    (it raises here), the model as it was; the trainer's functions take the plain path."""
    model, _ = tiny_model(0)
    if where == "meta":
        model = model.to("meta")
    backend = (ShardedBackend(model) if where == "sharded"
               else TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0)))
    before = patched_state(model)
    monkeypatch.setattr(kernels, "load", no_build)
    context = accel.disabled() if where == "disabled" else contextlib.nullcontext()
    with context, accel.step(backend, model, torch.bfloat16) as fast:
        assert fast is None
        assert patched_state(model) == before
        if where != "meta":  # a forward runs through the plain path, no kernel asked for
            batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.arange(4)[None],
                     "attention_mask": None, "row": torch.tensor([0, 0]), "predictor": torch.tensor([1, 2])}
            logits = update.trained_token_logits(model, batch, fast)  # [2, V]
            logp, _ = update.trained_logprobs(logits, torch.tensor([7, 8]), 1.0, fast)
            assert logp.shape == (2,) and "TokenLogprobs" not in logp.grad_fn.name()
    assert patched_state(model) == before


def test_on_the_cpu_the_step_patches_for_its_duration_only(monkeypatch):
    """A CPU model under TorchBackend: the kernels are asked for (here: load raises, so
    entering proves it), and with them built the model is patched inside (norms, MLPs as
    instance forwards, blocked attention, the tied lookup sparse, the rotary function
    swapped) and as it was afterwards, also when the step raises."""
    model, _ = tiny_model(0)
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))
    before = patched_state(model)
    with monkeypatch.context() as m:
        m.setattr(kernels, "load", no_build)
        with pytest.raises(AssertionError, match="kernels.load called"):
            with accel.step(backend, model, torch.float32):
                pass
    assert patched_state(model) == before
    with accel.step(backend, model, torch.float32) as fast:
        assert fast is not None
        forwards, attention, sparse, rotary = patched_state(model)
        norms = [n for n, m in model.named_modules() if hasattr(m, "variance_epsilon")]
        mlps = [n for n, m in model.named_modules() if hasattr(m, "gate_proj")]
        assert set(norms) | set(mlps) <= set(forwards)
        assert attention == "agent_rl_blocked" and sparse and rotary is not before[3]
    assert patched_state(model) == before
    with pytest.raises(RuntimeError, match="boom"), accel.step(backend, model, torch.bfloat16):
        raise RuntimeError("boom")
    assert patched_state(model) == before


def test_disabled_is_undone_on_the_way_out():
    model, _ = tiny_model(0)
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with accel.disabled(), accel.step(backend, model, torch.float32) as fast:
        assert fast is None
    with accel.step(backend, model, torch.float32) as fast:
        assert fast is not None


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "agent_rl_kernels_test"
    folder.mkdir()
    (folder / "lock").touch()  # torch's baton, left by a build killed before it released it
    with pytest.warns(RuntimeWarning, match="left by a build that was killed"):
        with kernels.build_lock("agent_rl_kernels_test"):
            assert not (folder / "lock").exists()  # torch's build would have waited forever
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no left-over: nothing to say
        with kernels.build_lock("agent_rl_kernels_test"):
            pass
