"""Training backends (agent_rl.run.distributed): TorchBackend against today's loop, DeepSpeed in a
world of one against TorchBackend (ZeRO 0-3, CPU offload), two ranks against one process, and
resuming from a bundle.

The DeepSpeed tests run `_ds_worker.py` in subprocesses (gloo on CPU; two ranks through
`python -m torch.distributed.run`) and compare what they write. Measured differences, which
the tolerances below cover with margin (tiny Llama, AdamW lr 1e-2, grad clip 1.0 active,
3 steps of 2 micro-batches):
    ZeRO 0 vs torch: bit-identical (the same optimizer on the same tensors)
    ZeRO 1/2 (and CPU offload) vs torch: losses 5e-8 relative, weights 8e-7 absolute
    ZeRO 3 (and CPU offload) vs torch: losses 2e-7 relative, weights 1.8e-5 absolute in
        0.01% of the entries, the rest within 1e-6
    two ranks vs one process (ZeRO 2 and 3): losses 7e-7 relative, weights 3.6e-5
        absolute in 0.1% of the entries, the rest within 1e-6
    resume from a bundle vs uninterrupted: bit-identical
    resume at another world size (2 -> 1, 1 -> 2, 2 -> 4; ZeRO 0-3) vs the uninterrupted run it
        continues: losses 1e-7 relative, weights within the two-rank tolerance
The few larger weight differences are Adam's: its update lr * m / (sqrt(v) + eps) turns
round-off in gradient entries near eps (a different summation order) into up to lr.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from agent_rl.run import checkpoint, distributed
from agent_rl.run.distributed import StepResult, TorchBackend, make_backend

WORKER = Path(__file__).with_name("_ds_worker.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
# after 3 steps: max |weight difference| by ZeRO stage against TorchBackend, and at most
# NEAR_FRACTION of the entries further apart than NEAR; losses and grad norms within LOSS_RTOL
WEIGHT_ATOL = {0: 0.0, 1: 5e-6, 2: 5e-6, 3: 1e-4}
TWO_RANKS_WEIGHT_ATOL = 1e-4
NEAR, NEAR_FRACTION = 1e-6, 0.01
LOSS_RTOL = 1e-5

WORLD_OF_ONE = [
    {"name": "torch", "backend": "torch", "save_after": 2},
    *({"name": f"zero{z}", "backend": "deepspeed", "zero": z, "save_after": 2} for z in (0, 1, 2)),
    {"name": "zero3", "backend": "deepspeed", "zero": 3, "save_after": 2},
    {"name": "zero2-offload", "backend": "deepspeed", "zero": 2, "offload": "cpu"},
    {"name": "zero3-offload", "backend": "deepspeed", "zero": 3, "offload": "cpu"},
    {"name": "zero3-recompute", "backend": "deepspeed", "zero": 3, "recompute": True},
    *({"name": f"{name}-poisoned", "backend": backend, "zero": z, "poison_step": 2}
      for name, backend, z in (("torch", "torch", 0), ("zero0", "deepspeed", 0),
                               ("zero2", "deepspeed", 2), ("zero3", "deepspeed", 3))),
    {"name": "zero2-bf16", "backend": "deepspeed", "zero": 2, "dtype": "bfloat16"},
]


# ---------------------------------------------------------------------------------------------
# Running the worker
# ---------------------------------------------------------------------------------------------


def run_worker(specs: list[dict], out: Path, nproc: int = 1) -> dict[str, dict]:
    """Run the worker on `specs` (one process, or `nproc` ranks under torch.distributed.run)
    and return {name: record} with the final weights under record["weights"]."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps([{"steps": 3, **s} for s in specs]))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launcher = [] if nproc == 1 else [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(distributed.free_port())]
    cmd = [sys.executable, *launcher, str(WORKER), str(spec_file), str(out)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        output = exc.output.decode() if isinstance(exc.output, bytes) else exc.output or ""
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s; its output ended:\n"
                    f"{output[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}; its output ended:\n"
                    f"{proc.stdout[-8000:]}")
    records = {}
    for spec in specs:
        record = json.loads((out / f"{spec['name']}.json").read_text())
        record["weights"] = safetensors.torch.load_file(out / f"{spec['name']}.safetensors")
        records[spec["name"]] = record
    return records


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def fraction_apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    apart = sum(int(((a[k].float() - b[k].float()).abs() > NEAR).sum()) for k in a)
    return apart / sum(t.numel() for t in a.values())


def losses(record: dict) -> list[float]:
    return [s["loss"] for s in record["steps"]]


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("world_of_one")
    specs = [{**s, "bundle_root": str(root / s["name"] / "checkpoints")} for s in WORLD_OF_ONE]
    return run_worker(specs, root)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("two_ranks")
    return run_worker([{"name": f"zero{z}-ranks", "backend": "deepspeed", "zero": z,
                        "split": "ranks", "save_after": 2,
                        "bundle_root": str(root / f"zero{z}" / "checkpoints")} for z in (0, 1, 2, 3)],
                      root, nproc=2)


# ---------------------------------------------------------------------------------------------
# DeepSpeed (subprocesses)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero2-offload",
                                  "zero3-offload", "zero3-recompute"])
def test_deepspeed_world_of_one_matches_torch(world_of_one, name):
    torch_run, ds_run = world_of_one["torch"], world_of_one[name]
    assert ds_run["world_size"] == 1
    assert [s["stepped"] for s in ds_run["steps"]] == [True] * 3
    assert losses(ds_run) == pytest.approx(losses(torch_run), rel=LOSS_RTOL)
    assert [s["grad_norm"] for s in ds_run["steps"]] == pytest.approx(
        [s["grad_norm"] for s in torch_run["steps"]], rel=LOSS_RTOL)
    assert torch_run["steps"][0]["grad_norm"] > 1.0  # clipping took part
    zero = int(name[4])
    assert max_abs_diff(ds_run["weights"], torch_run["weights"]) <= WEIGHT_ATOL[zero]
    assert fraction_apart(ds_run["weights"], torch_run["weights"]) <= NEAR_FRACTION


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch", "zero0", "zero2", "zero3"])
def test_non_finite_loss_skips_the_step_everywhere(world_of_one, name):
    """Step 2's loss is inf: the step is skipped and changes nothing, so step 3 repeats the
    clean run's step 2 exactly."""
    clean, poisoned = world_of_one[name], world_of_one[f"{name}-poisoned"]
    second = poisoned["steps"][1]
    assert not second["stepped"] and not math.isfinite(second["grad_norm"])
    assert [s["stepped"] for s in poisoned["steps"]] == [True, False, True]
    assert losses(poisoned)[2] == losses(clean)[1]


@pytest.mark.slow
def test_deepspeed_bf16_parameters_train(world_of_one):
    """bf16 parameters run DeepSpeed's bf16 mode (fp32 master weights): a smoke test only;
    bf16 rounding moves the losses by ~1e-2 relative to fp32."""
    run, fp32 = world_of_one["zero2-bf16"], world_of_one["zero2"]
    assert [s["stepped"] for s in run["steps"]] == [True] * 3
    assert losses(run) == pytest.approx(losses(fp32), rel=5e-2)
    assert {t.dtype for t in run["weights"].values()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_two_ranks_match_one_process(world_of_one, two_ranks, zero):
    """Rank 0 takes sequences [0] and [1] as two micro-batches, rank 1 takes [2, 3] as one and
    pads with a zero-weight one (under ZeRO-3 it would hang without); losses scaled for the
    global token count give the same steps as one process with the whole batch."""
    ranks, whole = two_ranks[f"zero{zero}-ranks"], world_of_one[f"zero{zero}"]
    assert ranks["world_size"] == 2
    assert losses(ranks) == pytest.approx(losses(whole), rel=LOSS_RTOL)
    assert [s["grad_norm"] for s in ranks["steps"]] == pytest.approx(
        [s["grad_norm"] for s in whole["steps"]], rel=LOSS_RTOL)
    assert max_abs_diff(ranks["weights"], whole["weights"]) <= TWO_RANKS_WEIGHT_ATOL
    assert fraction_apart(ranks["weights"], whole["weights"]) <= NEAR_FRACTION


@pytest.mark.slow
def test_bundles_hold_every_ranks_state(world_of_one, two_ranks):
    for zero in (2, 3):
        bundle = Path(two_ranks[f"zero{zero}-ranks"]["bundle"])
        checkpoint.verify_bundle(bundle)
        files = set(json.loads((bundle / checkpoint.MANIFEST_FILE).read_text())["files"])
        assert {"model.safetensors", "meta.json", distributed.BACKEND_FILE,
                "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
        assert not any(f.endswith(".py") for f in files)  # DeepSpeed's recovery scripts
        assert json.loads((bundle / distributed.BACKEND_FILE).read_text()) == {
            "backend": "deepspeed", "zero_stage": zero, "world_size": 2}
        assert [p.name for p in bundle.parent.iterdir()] == [bundle.name]  # no staging left
        # model.safetensors holds the full weights (ZeRO-3: gathered), as after step 2
        weights = safetensors.torch.load_file(bundle / checkpoint.MODEL_FILE)
        assert {k: tuple(t.shape) for k, t in weights.items()} == {
            k: tuple(t.shape) for k, t in two_ranks[f"zero{zero}-ranks"]["weights"].items()
            if k != "lm_head.weight"}  # tied to the embedding: saved once
    torch_bundle = Path(world_of_one["torch"]["bundle"])
    assert checkpoint.OPTIMIZER_FILE in set(
        json.loads((torch_bundle / checkpoint.MANIFEST_FILE).read_text())["files"])


@pytest.mark.slow
def test_resume_from_bundle_is_exact(world_of_one, two_ranks, tmp_path):
    """Bundles written after step 2 (torch and ZeRO-3 in a world of one, ZeRO-2 and ZeRO-3 on
    two ranks) are loaded by fresh processes, whose step 3 equals the uninterrupted runs'
    exactly."""
    one = run_worker([
        {"name": name, "backend": backend, "zero": z, "resume_from": world_of_one[name]["bundle"]}
        for name, backend, z in (("torch", "torch", 0), ("zero3", "deepspeed", 3))],
        tmp_path / "one")
    two = run_worker([{"name": f"zero{z}-ranks", "backend": "deepspeed", "zero": z,
                       "split": "ranks", "resume_from": two_ranks[f"zero{z}-ranks"]["bundle"]}
                      for z in (2, 3)], tmp_path / "two", nproc=2)
    for resumed, full in ((one["torch"], world_of_one["torch"]),
                          (one["zero3"], world_of_one["zero3"]),
                          (two["zero2-ranks"], two_ranks["zero2-ranks"]),
                          (two["zero3-ranks"], two_ranks["zero3-ranks"])):
        assert resumed["steps"] == full["steps"][2:]
        assert max_abs_diff(resumed["weights"], full["weights"]) == 0.0


@pytest.mark.slow
def test_zero_states_resume_at_another_world_size(world_of_one, two_ranks, tmp_path):
    """Bundles written after step 2 by two ranks resume on one and on four, one written by a
    world of one resumes on two (ZeRO 0-3): ZeRO 1-3 through DeepSpeed's universal checkpoint
    (``_reshard``), ZeRO 0 as saved. Step 3 is the step of the run it continues, computed by
    another number of ranks: its loss (from the loaded weights) and grad norm within
    LOSS_RTOL, its weights (Adam's update from the loaded moments) within the two-rank
    tolerance; a reset optimizer state would be ~lr = 1e-2 off. No staging folder stays."""
    stages = (0, 1, 2, 3)

    def resumed(sources: dict[int, dict], nproc: int, where: str) -> dict[int, dict]:
        out = run_worker([{"name": f"zero{z}", "backend": "deepspeed", "zero": z,
                           "split": "strided", "resume_from": sources[z]["bundle"]}
                          for z in stages], tmp_path / where, nproc=nproc)
        return {int(name[4]): record for name, record in out.items()}

    from_two = {z: two_ranks[f"zero{z}-ranks"] for z in stages}
    from_one = {z: world_of_one[f"zero{z}"] for z in stages}
    for sources, runs, nproc in ((from_two, resumed(from_two, 1, "one"), 1),
                                 (from_one, resumed(from_one, 2, "two"), 2),
                                 (from_two, resumed(from_two, 4, "four"), 4)):
        for z in stages:
            run, full = runs[z], sources[z]
            assert run["world_size"] == nproc
            assert [s["step"] for s in run["steps"]] == [3] and run["steps"][0]["stepped"]
            assert run["steps"][0]["loss"] == pytest.approx(full["steps"][2]["loss"], rel=LOSS_RTOL)
            assert run["steps"][0]["grad_norm"] == pytest.approx(full["steps"][2]["grad_norm"],
                                                                 rel=LOSS_RTOL)
            assert max_abs_diff(run["weights"], full["weights"]) <= TWO_RANKS_WEIGHT_ATOL, (z, nproc)
            assert fraction_apart(run["weights"], full["weights"]) <= NEAR_FRACTION
            bundle = Path(full["bundle"])
            assert [p.name for p in bundle.parent.iterdir()] == [bundle.name]


def test_partitions_deepspeed_cannot_merge_are_refused_with_the_fix(tmp_path):
    pytest.importorskip("deepspeed")
    bundle = tmp_path / "step-000002"
    bundle.mkdir()  # no partitions in it
    with pytest.raises(checkpoint.BundleError, match=r"could not merge its ZeRO partitions .*"
                                                     r"resume with the world size in"):
        distributed.universal_checkpoint(bundle, tmp_path / "staging" / "universal")


def test_a_state_of_another_zero_stage_is_refused_with_the_fix(tmp_path):
    (tmp_path / distributed.BACKEND_FILE).write_text(json.dumps(
        {"backend": "deepspeed", "zero_stage": 2, "world_size": 2}))
    expected = {"backend": "deepspeed", "zero_stage": 3, "world_size": 4}
    with pytest.raises(checkpoint.BundleError, match="resume with the same backend and ZeRO stage"):
        distributed._check_saved_by(tmp_path, expected)
    assert distributed._check_saved_by(tmp_path, {**expected, "zero_stage": 2}) == 2


# ---------------------------------------------------------------------------------------------
# In process (no DeepSpeed)
# ---------------------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _micro_losses(model, x, y) -> list[torch.Tensor]:  # two micro-batches, shares 3/5 and 2/5
    return [((model(x[:3]) - y[:3]) ** 2).sum() / 5, ((model(x[3:]) - y[3:]) ** 2).sum() / 5]


def test_torch_backend_is_the_plain_loop():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
    plain, wrapped = _mlp(), _mlp()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.1)
    backend = TorchBackend(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.1), 0.5)
    for _ in range(3):
        opt_plain.zero_grad()
        for loss in _micro_losses(plain, x, y):
            loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5))
        opt_plain.step()
        backend.zero_grad()
        for loss in _micro_losses(backend.model, x, y):
            backend.backward(loss)
        assert backend.step() == StepResult(norm, True)
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in wrapped.parameters())


def test_adamw_is_fused_where_it_can_be_and_takes_the_hand_computed_step():
    """distributed.adamw: torch's fused AdamW for CPU parameters, the default one where a
    parameter's device has no fused kernel (meta). Its first step, hand-computed: the bias-
    corrected moments are g and g^2, so the update is lr * g / (|g| + eps) ~ lr * sign(g) after
    decay: p (1 - lr wd) - lr sign(g) = [1 x 0.999 - 0.1, -2 x 0.999 + 0.1] = [0.899, -1.898]."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = distributed.adamw([p], lr=0.1, weight_decay=0.01)
    assert optimizer.param_groups[0]["fused"] is True
    p.grad = torch.tensor([0.5, -0.25])
    optimizer.step()
    assert torch.allclose(p.detach(), torch.tensor([0.899, -1.898]), atol=1e-6)
    meta = torch.nn.Parameter(torch.empty(2, device="meta"))
    assert not distributed.adamw([meta], lr=0.1, weight_decay=0.0).param_groups[0]["fused"]


def test_torch_backend_skips_a_non_finite_step_and_keeps_going():
    model = _mlp()
    backend = TorchBackend(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.ones(2, 4)
    backend.backward(model(x).sum() * float("inf"))
    result = backend.step()
    assert not result.stepped and not math.isfinite(result.grad_norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert backend.optimizer.state == {}  # not even Adam's step counters moved
    backend.backward(model(x).sum())
    assert backend.step().stepped


def test_torch_backend_collectives_are_identities():
    backend = TorchBackend(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1))
    t = torch.tensor([1.0, 2.0])
    assert (backend.rank, backend.world_size, backend.is_main) == (0, 1, True)
    assert backend.all_reduce_sum(3) == 3 and backend.all_reduce_sum(t) is t
    assert backend.all_gather_object({"a": 1}) == [{"a": 1}]
    assert backend.max_across(4) == 4
    backend.barrier()


def test_torch_backend_state_round_trip(tmp_path):
    model = _mlp()
    backend = TorchBackend(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    backend.backward(model(torch.ones(2, 4)).sum())
    backend.step()
    path = distributed.write_bundle(backend, tmp_path, 1, meta={"step": 1})
    checkpoint.verify_bundle(path)
    assert json.loads((path / distributed.BACKEND_FILE).read_text())["backend"] == "torch"
    fresh = _mlp(seed=1)
    checkpoint.load_bundle(path, fresh)
    resumed = TorchBackend(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    resumed.load_state(path)
    for b in (backend, resumed):
        b.backward(b.model(torch.ones(2, 4)).sum())
    assert backend.step() == resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(),
                                                  strict=True))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_state_from_another_backend_is_refused_with_the_fix(tmp_path):
    (tmp_path / distributed.BACKEND_FILE).write_text(json.dumps(
        {"backend": "deepspeed", "zero_stage": 2, "world_size": 2}))
    model = _mlp()
    backend = TorchBackend(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    with pytest.raises(checkpoint.BundleError, match="resume with the same backend and ZeRO stage"):
        backend.load_state(tmp_path)


def test_make_backend_refuses_what_torch_cannot_do(monkeypatch):
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(make_backend("torch", 0, "none", model, optimizer, 1.0), TorchBackend)
    with pytest.raises(ValueError, match="use backend.name: deepspeed"):
        make_backend("torch", 2, "none", model, optimizer, 1.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="world of one"):
        make_backend("torch", 0, "none", model, optimizer, 1.0)
    with pytest.raises(ValueError, match="not one of"):
        make_backend("jax", 0, "none", model, optimizer, 1.0)


def test_deepspeed_config():
    config = distributed.deepspeed_config(3, "cpu", 0.5, bf16=False)
    assert config["gradient_clipping"] == 0.5
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_accumulation_steps"] == 1
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": False,
                                           "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        distributed.deepspeed_config(0, "cpu", 1.0, bf16=False)
    with pytest.raises(ValueError, match="zero_stage must be"):
        distributed.deepspeed_config(4, "none", 1.0, bf16=False)


def test_the_process_group_is_destroyed_before_the_interpreter_tears_down():
    """init_distributed leaves the process group at exit (a world of one inside a Python
    session): a check registered before it, so run after it, finds no process group any more."""
    script = ("import atexit, torch.distributed as dist\n"
              "atexit.register(lambda: print('at exit, initialized:', dist.is_initialized()))\n"
              "from agent_rl.run.distributed import init_distributed\n"
              "init_distributed()\n"
              "print('running, initialized:', dist.is_initialized())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running, initialized: True" in proc.stdout
    assert "at exit, initialized: False" in proc.stdout


@pytest.mark.parametrize("leave_fails", [False, True])
def test_a_launched_rank_ends_without_the_interpreter_teardown(leave_fails):
    """end_launched_rank (how `agent-rl train` and the test workers end one of several ranks,
    where ZeRO-3's leaked gloo groups aborted ranks in the teardown): the process group left,
    unflushed output written, the run's code returned, nothing after it run, not even the
    script's own atexit check. A group that fails to leave is said and fails the rank."""
    script = ("import atexit, sys, torch.distributed as dist\n"
              "from agent_rl.run import distributed\n"
              "atexit.register(lambda: print('teardown ran'))\n"
              "distributed.init_distributed()\n"
              "kept = dist.group.WORLD  # referenced, as ZeRO-3's parameters keep theirs\n"
              "def leave():\n"
              "    if FAIL:\n"
              "        raise RuntimeError('gloo said no')\n"
              "    dist.destroy_process_group()\n"
              "    print('left:', not dist.is_initialized(), file=sys.stderr)\n"
              "distributed.leave_process_group = leave\n"
              "sys.stdout.write('written, unflushed')\n"
              "distributed.end_launched_rank(3 if not FAIL else 0)\n"
              "print('not reached')\n").replace("FAIL", str(leave_fails))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.stdout.endswith("written, unflushed")  # no teardown, nothing after the call
    if leave_fails:
        assert proc.returncode == 1 and "RuntimeError: gloo said no" in proc.stderr
    else:
        assert proc.returncode == 3 and "left: True" in proc.stderr, proc.stderr[-3000:]


def _tiny_llama(lora: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a non-zero adapter, so that the merge changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_a_zero3_push_gathers_one_layer_at_a_time(lora):
    """``by_unit`` (what ``DeepSpeedBackend.layer_by_layer`` streams under ZeRO-3) with
    partitioning simulated: outside a gather every parameter holds no data, as ZeRO-3's do.
    Counted, not timed: one gather open at a time, each holding one decoder layer or the
    tied embeddings (or the final norm), every parameter gathered once; the stream is the
    one-process push tensor for tensor (LoRA merged too), and the adapter-only stream too."""
    from agent_rl.policies.engine_weights import adapter_tensors
    from agent_rl.policies.models import named_weights_for_push

    model = _tiny_llama(lora)
    expected = [(n, t.clone()) for n, t in named_weights_for_push(model)]
    full = {id(p): p.data for p in model.parameters()}
    for p in model.parameters():
        p.data = torch.empty(0)  # partitioned: nothing to read outside a gather
    open_now, peak, gathered = [0], [0], []

    @contextlib.contextmanager
    def gather(params):
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        gathered.append(sum(full[id(p)].numel() for p in params))
        for p in params:
            p.data = full[id(p)]
        yield
        for p in params:
            p.data = torch.empty(0)
        open_now[0] -= 1

    def push(weights):
        return [(n, t.clone()) for n, t in distributed.by_unit(model, weights, gather)]

    got = push(lambda m, within: named_weights_for_push(m, within=within))
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
    base = model.get_base_model() if lora else model
    layer = sum(full[id(p)].numel() for p in base.model.layers[0].parameters())
    embeddings = 64 * 32
    assert peak[0] == 1  # never two pieces gathered at once
    assert gathered == [embeddings, layer, layer, layer, 32]  # embed, 3 layers, norm (head tied)
    assert sum(gathered) == sum(t.numel() for t in full.values())  # each parameter once
    if lora:
        wanted = [(n, t.clone()) for n, t in adapter_tensors(_tiny_llama(True))]
        got = push(adapter_tensors)
        assert [n for n, _ in got] == [n for n, _ in wanted] and len(got) == 12
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, wanted, strict=True))
