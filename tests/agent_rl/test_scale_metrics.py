"""The scale metrics of a training step (``metrics.scale_metrics``): model FLOPs and MFU
(``agent_rl.run.flops``), rollout queue age (``pipeline.py``), data wait, collective and
straggler time, and the batch ids. Hand-computed values on fakes here; the same metrics on
real runs of the tiny model in test_train.py (one process, lag 1, two gloo ranks)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.policies.models import tiny_model
from agent_rl.run.distributed import DeepSpeedBackend, TorchBackend
from agent_rl.run.flops import Peak, device_peak, flops_per_token, mfu, spec_sheet_peak
from agent_rl.training.metrics import batch_ids, scale_metrics
from agent_rl.training.pipeline import RolloutPipeline, Synchronous

# the tiny Llama's parameters, by hand: hidden 64, 4 query heads and 2 KV heads of 16, MLP 128,
# 2 layers, tied embeddings
ATTENTION = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v, o
MLP = 3 * 64 * 128  # gate, up, down
LAYER = ATTENTION + MLP + 2 * 64  # and its two RMSNorm weights
Q_PROJ = 64 * 64


def test_flops_per_token_is_six_per_trained_and_four_per_frozen_parameter():
    model, tokenizer = tiny_model(0)
    vocab = model.config.vocab_size
    # tied: the embedding table is the head, multiplied once per token
    matrices = 2 * LAYER + 64 + vocab * 64  # layers, final norm, head
    assert sum(p.numel() for p in model.parameters()) == matrices  # the count above is the model
    assert flops_per_token(model) == 6 * matrices

    # LoRA-like: one matrix trained, the rest frozen (forward and input gradient only)
    model.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    assert flops_per_token(model) == 6 * Q_PROJ + 4 * (matrices - Q_PROJ)

    # untied: the input table is a lookup (no FLOPs), the separate head is counted
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False)
    untied = LlamaForCausalLM(config)
    assert sum(p.numel() for p in untied.parameters()) == matrices + vocab * 64
    assert flops_per_token(untied) == 6 * matrices


def test_mfu_is_the_flops_over_the_seconds_and_the_peak():
    peak = Peak(2e12, "run.peak_flops")
    assert mfu(6e12, 10.0, peak) == pytest.approx(0.3)  # 6e12 / 10 s = 6e11 FLOP/s of 2e12
    assert mfu(6e12, 10.0, None) is None  # no peak: not reported
    assert mfu(6e12, 0.0, peak) is None


def test_the_peak_comes_from_the_contract_or_the_spec_sheet_never_a_guess():
    assert device_peak(torch.device("cpu"), "bfloat16", 7e11) == Peak(7e11, "run.peak_flops")
    assert device_peak(torch.device("cpu"), "bfloat16", None) is None  # a CPU: not reported
    assert spec_sheet_peak("NVIDIA H100 80GB HBM3") == Peak(989.4e12, "spec sheet (H100)")
    assert spec_sheet_peak("NVIDIA H100 PCIe") == Peak(756e12, "spec sheet (H100 PCIe)")
    assert spec_sheet_peak("NVIDIA H200 NVL") == Peak(835e12, "spec sheet (H200 NVL)")
    assert spec_sheet_peak("Tesla T4") is None


class TwoRanks:
    """A backend's all_gather_object as two ranks would answer: this rank's value, then the
    other rank's ``other``."""

    def __init__(self, other: float):
        self.other = other

    def all_gather_object(self, obj):
        return [obj, self.other]


def sequence(episode: str, session: str) -> SimpleNamespace:
    return SimpleNamespace(episode_id=episode, session_id=session)


def test_scale_metrics_by_hand():
    """Rank 0 stepped 3.0 s of which 0.5 s in collectives (2.5 s of its own work); the other
    rank worked 1.75 s: the straggler time is 0.75 s. MFU over the step and over the update."""
    trained = [sequence("step1/b#0@1", "step1/b#0@1/s1"), sequence("step1/a#1@0", "x"),
               sequence("step1/b#0@1", "step1/b#0@1/s0")]
    m = scale_metrics(TwoRanks(1.75), flops=3e9, peak=Peak(1e10, "run.peak_flops"), step_s=3.0,
                      train_s=1.5, wait_s=1.25, collective_s=0.5, queue_age_s=0.2, trained=trained)
    assert m["perf/flops"] == 3e9
    assert m["perf/mfu"] == pytest.approx(0.1)  # 3e9 / 3 s / 1e10
    assert m["perf/mfu_update"] == pytest.approx(0.2)  # 3e9 / 1.5 s / 1e10
    assert m["time/straggler_s"] == pytest.approx(0.75)
    assert (m["time/data_wait_s"], m["time/collective_s"], m["rollout/queue_age_s"]) == (1.25, 0.5, 0.2)
    assert m["batch/ids"] == {"step1/a#1@0": ["x"], "step1/b#0@1": ["step1/b#0@1/s0", "step1/b#0@1/s1"]}
    assert list(m["batch/ids"]) == ["step1/a#1@0", "step1/b#0@1"]  # sorted: one text per batch
    # one rank: no one to wait for; no peak: MFU not reported, the FLOPs still are
    one = scale_metrics(TorchBackend(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=1)),
                        flops=3e9, peak=None, step_s=3.0, train_s=1.5, wait_s=1.25,
                        collective_s=0.0, queue_age_s=0.0, trained=[])
    assert one["time/straggler_s"] == 0.0 and one["perf/mfu"] is None and one["perf/flops"] == 3e9
    assert batch_ids([]) == {}


def test_queue_age_is_how_long_the_taken_batch_waited():
    """A batch ready at once and taken 0.3 s later waited 0.3 s; a batch the trainer had to
    wait for (its rollout 0.3 s) waited for no one. Synchronous batches never wait."""
    with RolloutPipeline(lambda step: step, first=1, last=1, max_lag=1) as pipeline:
        time.sleep(0.3)
        assert pipeline.take(1) == 1
    assert 0.3 <= pipeline.queue_age_s < 0.3 + 0.2

    released = threading.Event()

    def slow(step: int) -> int:
        released.wait(5)
        return step

    with RolloutPipeline(slow, first=1, last=1, max_lag=1) as pipeline:
        threading.Timer(0.3, released.set).start()
        started = time.perf_counter()
        assert pipeline.take(1) == 1
        assert time.perf_counter() - started >= 0.25  # the trainer waited
    assert 0.0 <= pipeline.queue_age_s < 0.05
    synchronous = Synchronous(lambda step: step)
    assert synchronous.take(3) == 3 and synchronous.queue_age_s == 0.0


def test_collective_time_adds_up_the_seconds_inside_collectives():
    """``DeepSpeedBackend._timed``, the clock around every collective, on a stand-in: 0.2 s
    inside, then 0.1 s more, raising (a failed collective's time still counts)."""
    backend = SimpleNamespace(collective_seconds=0.0)
    with DeepSpeedBackend._timed(backend):
        time.sleep(0.2)
    assert 0.2 <= backend.collective_seconds < 0.3
    with pytest.raises(RuntimeError), DeepSpeedBackend._timed(backend):
        time.sleep(0.1)
        raise RuntimeError("a rank died")
    assert 0.3 <= backend.collective_seconds < 0.45
    assert TorchBackend.collective_seconds == 0.0  # a world of one communicates with no one
