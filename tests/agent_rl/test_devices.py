"""model.device on a machine with GPUs, seen from the CPU: torch.cuda's answers are stood in
for (availability, count, set_device); what is checked is which device each rank resolves."""

import os

import pytest
import torch

from agent_rl.run import devices


@pytest.fixture
def two_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    return chosen


@pytest.mark.parametrize("spec", ["cuda", "auto"])
def test_each_rank_takes_its_local_gpu_before_anything_is_allocated(two_gpus, monkeypatch, spec):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.resolve_device(spec) == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)]  # the current device, for every later cuda


def test_one_process_keeps_cuda_and_an_index_it_names(two_gpus, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert devices.resolve_device("cuda") == torch.device("cuda")
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)]


def test_one_gpu_index_for_several_ranks_or_a_missing_gpu_is_an_error(two_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"cuda:0 names one GPU for 2 ranks; use cuda"):
        devices.resolve_device("cuda:0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match=r"cuda:3 asked for, but this machine has 2 GPU"):
        devices.resolve_device("cuda")
    assert two_gpus == []


# --- numerics: TF32 (model.tf32) and run.deterministic ------------------------------------------

@pytest.fixture
def numerics(monkeypatch):
    """The process-wide switches prepare_device sets, restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.use_deterministic_algorithms(saved[2])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3:]


def test_the_cpu_with_the_defaults_changes_no_global_setting(numerics):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
              torch.backends.mkldnn.matmul.fp32_precision, torch.are_deterministic_algorithms_enabled())
    assert devices.prepare_device("cpu", "bfloat16") == torch.device("cpu")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
            torch.backends.mkldnn.matmul.fp32_precision,
            torch.are_deterministic_algorithms_enabled()) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_cuda_takes_tf32_by_default_and_float32_when_turned_off(two_gpus, numerics, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    assert devices.prepare_device("cuda") == torch.device("cuda")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"  # the same switch, read back
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # the CPU's products untouched
    devices.prepare_device("cuda", tf32=False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_bf16_on_a_gpu_without_it_is_refused(two_gpus, numerics, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100")
    with pytest.raises(ValueError, match=r"model.dtype: bfloat16 on Tesla V100, which has no bf16"):
        devices.prepare_device("cuda", "bfloat16")
    assert devices.prepare_device("cuda", "float32") == torch.device("cuda")


def test_deterministic_sets_cublas_before_cuda_and_the_algorithms(numerics):
    import os
    devices.prepare_device("cpu", deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_deterministic_refuses_a_workspace_or_a_cuda_already_started(numerics, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match=r"CUBLAS_WORKSPACE_CONFIG=:0:0 leaves cuBLAS non-det"):
        devices.make_deterministic()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own, deterministic: kept
    devices.make_deterministic()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match=r"CUDA started in this process before .* export CUBLAS"):
        devices.make_deterministic()


def test_to_device_is_the_tensor_itself_on_the_cpu():
    t = torch.arange(4)
    assert devices.to_device(t, torch.device("cpu")) is t
