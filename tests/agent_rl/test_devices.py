"""model.device on a machine with GPUs, seen from the CPU: torch.cuda's answers are stood in
for (availability, count, set_device); what is checked is which device each rank resolves."""

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
