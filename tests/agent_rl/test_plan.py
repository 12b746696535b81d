"""The resource plan (agent_rl.run.plan, `agent-rl plan`): each part by hand for the tiny
model, ZeRO's division, LoRA, the reference, what fits, the refusal by `agent-rl train`, and
the command's output (80 columns, the last line JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_rl.cli import main
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.plan import GIB, Architecture, PlanError, check_fits, resource_plan

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "examples" / "tiny.yaml"

# the tiny Llama by hand: vocab 640, hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16
EMBED = 640 * 64  # tied head
LINEARS = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down
LAYER = LINEARS + 2 * 64  # + two norms
P = EMBED + 2 * LAYER + 64  # + the final norm: 115,008
LORA_DIMS = 2 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + 3 * (64 + 128))  # in + out, per layer
TINY = Architecture(params=P, layers=2, hidden=64, intermediate=128, kv_width=32, vocab=640,
                    lora_dims=LORA_DIMS, lora_weights=2 * LINEARS, largest_module=EMBED)
TOKEN = 2 * 4 * (9 * 64 + 4 * 128 + 3 * 32) + 12 * 640  # activations a token (run.sizing)
ROW = 2 * 2 * 32 * 4 * (512 + 8) + 16 * 640  # a decoded row: KV of 520 tokens + logits


def tiny(*overrides: str) -> ExperimentContract:
    return ExperimentContract.from_yaml(TINY_YAML, list(overrides))


def parts(plan) -> dict[str, int]:
    return {p.name: p.device for p in plan.parts}


def test_tiny_parts_by_hand():
    plan = resource_plan(tiny(), TINY)
    assert P == 115_008
    assert parts(plan) == {
        "parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P, "reference": 0,
        "rollout copy": 0,  # the trained weights sample (hf, lag 0, full fine-tuning)
        "KV cache": 4 * ROW,  # rows: min(decode_batch 32, max(2 tasks x 2, eval.n 4))
        "activations": 512 * TOKEN,  # the CPU's micro_batch_tokens (auto)
        "bf16 casts": 0, "collectives": 0}
    assert plan.total == 16 * P + 4 * ROW + 512 * TOKEN
    assert plan.fits is None and plan.max_micro_batch_tokens is None


def test_the_registry_reads_the_tiny_architecture_without_weights():
    from agent_rl.policies.models import add_lora, architecture, tiny_model

    assert architecture("tiny") == TINY
    model, _ = tiny_model()
    lora = add_lora(model, rank=16, alpha=32)
    assert TINY.lora_params(16) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_divide_by_the_world_size(stage):
    W = 4
    contract = tiny("backend.name=deepspeed", f"backend.zero_stage={stage}",
                    "rollout.tasks_per_step=4")
    got = parts(resource_plan(contract, TINY, world_size=W))
    assert got["parameters"] == (4 * P // W if stage == 3 else 4 * P)
    assert got["gradients"] == (4 * P // W if stage >= 2 else 4 * P)
    moments = {0: 8 * P, 1: 12 * P // W, 2: 12 * P // W, 3: 8 * P // W}  # + master at 1-2
    assert got["optimizer"] == moments[stage]
    assert got["rollout copy"] == (4 * P if stage == 3 else 0)  # ZeRO-3's full copy
    # the CPU commits the pages of the reduce bucket gradients touch; ZeRO-3 gathers a module
    # (+ prefetch) at a time: here the whole model is smaller than that
    assert got["collectives"] == {0: 4 * P, 1: 4 * P, 2: 4 * P, 3: 4 * P + 4 * P}[stage]
    assert got["KV cache"] == 2 * ROW  # 4 tasks / 4 ranks x group 2 = 2 rows, eval 4 / 4 = 1


def test_offload_moves_the_optimizer_and_zero2_gradients_to_the_host():
    contract = tiny("backend.name=deepspeed", "backend.zero_stage=2", "backend.offload=cpu")
    plan = resource_plan(contract, TINY, world_size=2)
    assert plan.part("optimizer").device == 0 and plan.part("optimizer").host == 12 * P // 2
    assert plan.part("gradients").device == 0 and plan.part("gradients").host == 4 * P // 2
    assert plan.host == 12 * P // 2 + 4 * P // 2


def test_a_gpu_allocates_deepspeeds_whole_reduce_bucket():
    contract = tiny("backend.name=deepspeed", "backend.zero_stage=1")
    plan = resource_plan(contract, TINY, device_memory=80 * GIB, gpu=True)
    assert plan.part("collectives").device == 4 * 500_000_000


def test_lora_trains_and_copies_only_what_it_must():
    T = 16 * LORA_DIMS  # 32,768
    got = parts(resource_plan(tiny("model.adapter=lora"), TINY))
    assert got["parameters"] == 4 * (P + T)
    assert got["gradients"] == 4 * T and got["optimizer"] == 8 * T
    assert got["rollout copy"] == 4 * 2 * LINEARS  # merged float32 linears; the rest shared
    bf16 = parts(resource_plan(tiny("model.adapter=lora", "rollout.dtype=bfloat16"), TINY))
    assert bf16["rollout copy"] == 2 * P  # every weight converted
    assert bf16["KV cache"] == 4 * (ROW - 2 * 2 * 32 * 2 * 520)  # keys and values in bf16
    half = parts(resource_plan(tiny("model.adapter=lora", "model.dtype=bfloat16"), TINY))
    assert half["bf16 casts"] == 2 * T


def test_the_reference_is_counted_only_when_loaded(tmp_path):
    other = Architecture(**{**TINY.__dict__, "params": 1000})
    kl = tiny("loss.kl.beta=0.1", f"reference={tmp_path}")
    assert parts(resource_plan(kl, TINY, reference=other))["reference"] == 4 * 1000
    off = tiny("loss.kl.beta=0.1", "reference=tiny", "model.adapter=lora")  # the adapter off
    assert parts(resource_plan(off, TINY))["reference"] == 0
    unused = tiny(f"reference={tmp_path}")  # beta 0: never loaded
    assert parts(resource_plan(unused, TINY))["reference"] == 0


def test_what_fits_is_solved_for_by_hand():
    memory = 20 * 2**20
    plan = resource_plan(tiny(), TINY, device_memory=memory)  # a CPU with a stated limit
    assert plan.fits is (plan.total <= memory)
    others = 16 * P + 4 * ROW  # everything but the activations
    assert plan.max_micro_batch_tokens == (memory - others) // TOKEN
    assert plan.max_decode_rows == (memory - 16 * P - 512 * TOKEN) // ROW
    assert plan.max_group_size == plan.max_decode_rows // 2  # 2 tasks a rank


def test_auto_sizes_follow_the_device_memory():
    plan = resource_plan(tiny(), TINY, device_memory=80 * GIB, gpu=True)
    assert plan.micro_batch_tokens == 16384 and plan.decode_batch == 256  # sizing's ceilings
    assert plan.decode_rows == 4  # no more rows than a step has


def test_check_fits_names_the_biggest_parts_and_the_fix():
    plan = resource_plan(tiny(), TINY, device_memory=2**20)
    with pytest.raises(PlanError) as err:
        check_fits(plan, "model.device_memory")
    message = str(err.value)
    assert "activations" in message and "optim.micro_batch_tokens" in message
    assert "model.device_memory" in message
    check_fits(resource_plan(tiny(), TINY), "the CPU")  # memory unknown: never refused


def test_device_memory_is_not_hashed():
    assert tiny("model.device_memory=40").contract_hash() == tiny().contract_hash()


def test_train_refuses_a_plan_that_cannot_fit_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", str(TINY_YAML), "--set", "model.device_memory=0.001",
                 "--set", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "resource plan needs" in err and "activations" in err and "micro_batch_tokens" in err
    assert not run_dir.exists()


def test_the_api_refuses_too(tmp_path):
    from agent_rl.training import train

    contract = tiny("model.device_memory=0.001", f"run_dir={tmp_path / 'run'}")
    with pytest.raises(PlanError):
        train.run(contract, progress=False)
    assert not (tmp_path / "run").exists()


def test_plan_command_prints_80_columns_and_json_last(capsys):
    assert main(["plan", str(TINY_YAML), "--device-memory", "0.5", "--set", "model.device=cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines[:-1])
    result = json.loads(lines[-1])
    assert result["parts"]["parameters"] == 4 * P
    assert sum(result["parts"].values()) == result["total_bytes"]
    assert result["fits"] is True and result["device_memory_gib"] == 0.5
    assert result["max_micro_batch_tokens"] == (GIB // 2 - 16 * P - 4 * ROW) // TOKEN
    assert any(line.startswith("total") for line in lines)


def test_plan_command_refuses_several_ranks_on_backend_torch(capsys):
    assert main(["plan", str(TINY_YAML), "--world-size", "2"]) == 2
    assert "deepspeed" in capsys.readouterr().err


def test_plan_command_with_zero3_over_two_ranks(capsys):
    assert main(["plan", str(TINY_YAML), "--world-size", "2", "--set", "backend.name=deepspeed",
                 "--set", "backend.zero_stage=3"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["world_size"] == 2 and result["parts"]["parameters"] == 4 * P // 2


def test_smollm2s_architecture_without_reading_the_gguf():
    from agent_rl.policies.models import architecture

    arch = architecture("smollm2-135m")
    assert arch.params == 134_515_008  # the de-quantized GGUF's parameter count
    assert (arch.layers, arch.hidden, arch.intermediate, arch.kv_width, arch.vocab) == \
        (30, 576, 1536, 3 * 64, 49152)
    assert arch.lora_params(16) == 4_884_480  # 30 x 16 x (1152 + 768 + 768 + 1152 + 3 x 2112)
