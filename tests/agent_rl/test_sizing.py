"""Batch sizes chosen from the device (agent_rl.run.sizing): the pure rule against numbers
worked by hand, and ``auto`` keeping the CPU's values on the CPU."""

import pytest
import torch

from agent_rl.policies.hf import HFPolicy
from agent_rl.policies.models import tiny_model
from agent_rl.run import sizing
from agent_rl.run.contract import ExperimentContract, SFTContract
from agent_rl.run.sizing import ModelShape, Sizes, gpu_sizes
from agent_rl.training.setup import size_batches

# 2 layers, hidden 64, intermediate 128, kv 2 x 16, vocabulary 1000, 1M trainable parameters
SHAPE = ModelShape(trainable=1_000_000, layers=2, hidden=64, intermediate=128, kv_width=32,
                   vocab=1000)


def test_per_token_and_per_row_bytes_by_hand():
    # 2 layers x 4 B x (9 x 64 + 4 x 128 + 3 x 32 = 1184) = 9472, + 12 x 1000 for the logits
    assert sizing.trainer_token_bytes(SHAPE, half=False) == 21472
    assert sizing.trainer_token_bytes(SHAPE, half=True) == pytest.approx(9472 * 0.72 + 12000)
    # 2 (k, v) x 2 layers x 32 x 4 B x 640 tokens = 327680, + 16 x 1000 for the logits
    assert sizing.decode_row_bytes(SHAPE, kv_bytes=4, row_tokens=640) == 343680
    assert sizing.decode_row_bytes(SHAPE, kv_bytes=2, row_tokens=640) == 179840


def test_gpu_sizes_by_hand():
    # usable 0.8 x 2e8 - 12 x 1e6 = 148e6, each half 74e6; 74e6 / 21472 = 3446 tokens -> 2048
    # (a power of two); 74e6 / 343680 = 215 rows
    assert gpu_sizes(200_000_000, SHAPE, half=False, kv_bytes=4, row_tokens=640) == Sizes(2048, 215)
    # bf16: 74e6 / 18819.84 = 3932 -> 2048; 74e6 / 179840 = 411 rows -> the cap, 256
    assert gpu_sizes(200_000_000, SHAPE, half=True, kv_bytes=2, row_tokens=640) == Sizes(2048, 256)
    # a large GPU: 394e6 / 21472 = 18349 tokens -> 16384, the cap
    assert gpu_sizes(1_000_000_000, SHAPE, False, 4, 640).micro_batch_tokens == 16384
    # little left: 2e6 / 21472 = 93 -> 64, raised to the floor 256; 2e6 / 343680 = 5 rows
    assert gpu_sizes(20_000_000, SHAPE, False, 4, 640) == Sizes(256, 5)
    # less than the optimizer state: the floors
    assert gpu_sizes(10_000_000, SHAPE, False, 4, 640) == Sizes(256, 1)


def test_model_shape_is_read_from_the_config():
    model, tokenizer = tiny_model(0)
    shape = ModelShape.of(model)
    assert shape == ModelShape(trainable=sum(p.numel() for p in model.parameters()), layers=2,
                               hidden=64, intermediate=128, kv_width=32, vocab=len(tokenizer))
    model.requires_grad_(False)
    assert ModelShape.of(model).trainable == 0


def test_auto_keeps_the_cpu_values_on_the_cpu_and_numbers_are_taken_as_given():
    model, _ = tiny_model(0)
    cpu = torch.device("cpu")
    assert sizing.resolve_sizes("auto", "auto", cpu, model, "float32", 640) == Sizes(512, 32)
    assert sizing.resolve_sizes("auto", "auto", cpu, model, "bfloat16", 9000) == Sizes(512, 32)
    assert sizing.resolve_sizes(1024, 8, cpu, model, "float32", 640) == Sizes(1024, 8)
    assert sizing.cpu_micro_batch_tokens("auto") == 512
    assert sizing.cpu_micro_batch_tokens(64) == 64


def test_auto_on_cuda_is_sized_from_the_free_memory(monkeypatch):
    model, _ = tiny_model(0)
    monkeypatch.setattr(sizing, "free_cuda_bytes", lambda device: 200_000_000)
    cuda = torch.device("cuda")
    expected = gpu_sizes(200_000_000, ModelShape.of(model), True, 2, 640)
    assert sizing.resolve_sizes("auto", "auto", cuda, model, "bfloat16", 640) == expected
    assert sizing.resolve_sizes(4096, "auto", cuda, model, "bfloat16", 640) == Sizes(
        4096, expected.decode_batch)


def test_the_contract_defaults_are_auto_and_a_cpu_run_uses_the_cpu_values():
    contract = ExperimentContract()
    assert (contract.optim.micro_batch_tokens, contract.rollout.decode_batch) == ("auto", "auto")
    assert SFTContract().optim.micro_batch_tokens == "auto"
    model, tokenizer = tiny_model(0)
    policy = HFPolicy(model, tokenizer, batch_size=7)
    assert size_batches(contract, model, torch.device("cpu"), policy, policy) == Sizes(512, 32)
    assert policy.batch_size == 32
    given = ExperimentContract.from_dict({"rollout": {"decode_batch": 5}})
    assert size_batches(given, model, torch.device("cpu"), policy, policy).decode_batch == 5
    assert policy.batch_size == 5
