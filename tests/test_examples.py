"""The example scripts run as a user runs them: `python examples/NAME.py`, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_train_from_script(tmp_path):
    run_dir = tmp_path / "run"
    result = run_example("train_from_script.py", "--run-dir", str(run_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "agent_rl/Records-v0, model tiny, 3 steps" in out
    assert out.count("loss/policy") == 3
    assert "held-out reward before" in out and "paired diff" in out
    assert f"trained 3 steps; run dir {run_dir}" in out
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "result.json").is_file()
    trained = [json.loads(line)["train/tokens"] for line in (run_dir / "metrics.jsonl").open()]
    assert len(trained) == 3 and all(n > 0 for n in trained)  # its prompts fit its limit


@pytest.mark.slow
def test_train_with_functions_and_resume_needs_them_again(tmp_path):
    """A script's reward and assigner functions, rows as a list of dicts and a LoraConfig,
    trained for two steps; the reward ran in the scoring workers (sent by value), and a
    process that does not pass the functions again cannot resume the run."""
    run_dir = tmp_path / "run"
    result = run_example("train_with_functions.py", "--run-dir", str(run_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert ("reward __main__:near_miss, assigner __main__:final_full_others_half, "
            "lora r=4 alpha=8") in out
    rows = Path(out.split("rows ", 1)[1].split()[0])
    assert rows.parent == run_dir / "inputs" and len(rows.read_text().splitlines()) == 24
    assert out.count("loss/policy") == 2 and f"trained 2 steps; run dir {run_dir}" in out
    episodes = [json.loads(line) for line in (run_dir / "rollouts.jsonl").open()]
    assert episodes and all(e["reward"]["verifier"].endswith("/__main__:near_miss")
                            and e["reward"]["outcome"] != "sandbox_error" for e in episodes)
    assert {e["reward"]["total"] for e in episodes} <= {0.0, 0.5, 1.0}
    resume = (f"import agent_rl; agent_rl.train({str(run_dir / 'contract.yaml')!r}, "
              "resume=True, optim__max_steps=3)")
    resumed = subprocess.run([sys.executable, "-c", resume], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
    assert resumed.returncode != 0
    assert ("env.kwargs.reward: reward '__main__:near_miss' is a function that was passed "
            "from Python") in resumed.stderr
    assert "resume=True, reward=near_miss)" in resumed.stderr


def test_verifiers_tools_runs_a_multi_turn_tool_taskset(tmp_path):
    pytest.importorskip("verifiers.v1", reason="verifiers==0.4.0 is not installed")
    result = run_example("verifiers_tools.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ShelfTaskset-0: 3 assistant turns, tools said ['3', '4'], answer '7'" in out
    assert out.count("reward 1.5 (correct): {'correct': 1.0, 'looked_up': 1.0}") == 3


def test_register_env(tmp_path):
    result = run_example("register_env.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "registered: True" in out
    assert out.count("reward 1 (correct, 2 assistant turns)") == 4
    assert "mean reward 1" in out
    assert "examples/Capitals-v0: PASS" in out and "FAIL" not in out


@pytest.mark.parametrize("config", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid_contracts_with_their_splits(config):
    """Every shipped config validates, and its train and evaluation splits exist, are
    non-empty and do not leak into each other (what `agent-rl train` checks first)."""
    import envs
    from agent_rl.run.contract import read_contract
    from agent_rl.training.shared import check_data

    contract = read_contract(config)  # an RL contract, or a warm start's (examples/*_sft.yaml)
    limits = getattr(contract, "rollout", None) or contract.limits
    env = envs.make(contract.env.id, **contract.env.kwargs)
    splits = contract.env.splits(env)  # with the config's env.holdout, as training splits
    eval_sets = {name: list(splits[name])[: contract.eval.n] for name in contract.eval.splits}
    check_data(contract.env, env, list(splits[contract.env.split]), eval_sets,
               limits.max_prompt_tokens)
    assert all(len(tasks) == contract.eval.n for tasks in eval_sets.values())


def run_gpu_check(tmp_path: Path, *args: str, pythonpath: str = "",
                  wheels: Path | None = None) -> subprocess.CompletedProcess:
    """``bash benchmarks/gpu_check.sh ARGS`` with this interpreter; carried wheels from
    ``wheels`` (default: an empty folder, whatever .whl/ this checkout holds)."""
    import os

    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": pythonpath,
           "GPU_CHECK_WHEELS": str(wheels or tmp_path / "no-wheels"),
           "GPU_CHECK_SITE": str(tmp_path / "site")}
    script = EXAMPLES.parent / "benchmarks" / "gpu_check.sh"
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)


@pytest.mark.slow
def test_gpu_check_sh_runs_as_a_cpu_smoke(tmp_path):
    """benchmarks/gpu_check.sh (what a lent GPU runs) cannot rot unnoticed: --smoke runs every
    check on the CPU, tiny sizes, and ends with its JSON summary: the bf16 rollout took the
    shared-prompt layout (a group of 8 in a batch of 32, a prompt past decode's threshold),
    the bf16/float32 mismatch, the trainer's throughput and MFU, the resource plan, and the
    vLLM check says why it did not run."""
    result = run_gpu_check(tmp_path, "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["smoke"] and summary["failed"] == []
    assert summary["peak_source"] == "measured" and summary["peak_bf16_tflops"] > 0
    (name, checks), = summary["models"].items()
    assert name == "tiny" and checks["params"] > 0
    rollout = checks["shared_rollout_bf16"]
    assert rollout["status"] == "ok" and rollout["shared_layout"]
    assert (rollout["rows"], rollout["group"]) == (32, 8) and rollout["prompt_tokens"] >= 120
    assert rollout["generated_tokens"] > 0 and rollout["rollout_tokens_per_s"] > 0
    mismatch = checks["logprob_mismatch"]
    assert mismatch["status"] == "ok"
    assert 0 < mismatch["logprob_diff_mean"] <= mismatch["logprob_diff_max"] < 0.1
    trainer = checks["trainer"]
    assert trainer["status"] == "ok" and trainer["steps"] == 1
    assert trainer["rollout_tokens_per_s"] > 0 and trainer["train_tokens_per_s"] > 0
    assert 0 < trainer["mfu"] < 1 and 0 <= trainer["logprob_diff_mean"] <= trainer["logprob_diff_max"]
    assert 0 < trainer["mfu_step"] < trainer["mfu"]  # the trainer's perf/mfu: rollouts count too
    assert all(check["peak_memory_gib"] is None for check in checks.values() if isinstance(check, dict))
    plan = checks["plan_vs_measured"]
    assert plan["status"] == "ok" and plan["plan"]["total_bytes"] > 0  # the CPU: no peak, no error
    assert plan["plan"]["fits"] is None and plan["measured_peak_gib"] is None and plan["error"] is None
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert checks["vllm"]["status"] == "skipped" and "vllm does not import" in checks["vllm"]["reason"]
    else:
        assert checks["vllm"]["status"] == "ok"


@pytest.mark.slow
def test_gpu_check_sh_stops_at_once_naming_what_is_missing(tmp_path):
    """A module the lent machine lacks (here zstandard made to fail its import) stops the
    script before any work, exit 2, naming the module and the wheel to carry."""
    broken = tmp_path / "broken" / "zstandard"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('not on this machine')\n")
    result = run_gpu_check(tmp_path, "--smoke", pythonpath=str(broken.parent))
    assert result.returncode == 2
    assert "zstandard does not import" in result.stderr and "zstandard wheel" in result.stderr
    assert "bash scripts/gpu_wheels.sh" in result.stderr and result.stdout == ""


def test_gpu_check_sh_stops_when_the_carried_wheels_do_not_install(tmp_path):
    """A carried folder pip cannot install from (here a wheel that is no zip file) is an error
    naming the folder, not a run on whatever the machine has."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "pydantic-2.14.4-py3-none-any.whl").write_text("not a wheel")
    result = run_gpu_check(tmp_path, "--smoke", wheels=wheels)
    assert result.returncode == 2
    assert f"could not install the wheels in {wheels}/" in result.stderr
    assert "gpu_check:" not in result.stdout  # gpu_check.py never started


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", EXAMPLES.parent / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kv_heads, threshold", [(3, 97), (8, 36)])
def test_gpu_check_prompt_reaches_decodes_shared_layout(kv_heads, threshold):
    """The prompt length gpu_check asks for is decode's own threshold: 4 prompts x 8 rows, keys
    and values in float32 (autocast's rotary), heads of 64: 4 * 2**20 / (28 * kv * 64 * 8)
    bytes, 97 tokens for SmolLM2 (3 KV heads), 36 for the 1B config (8); StaticDecoder holds
    the prompt once from one token past it, not at it."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent_rl.policies.decode import StaticDecoder

    config = LlamaConfig(vocab_size=32, hidden_size=64 * kv_heads, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=kv_heads,
                         num_key_value_heads=kv_heads, head_dim=64)
    assert load_gpu_check().shared_layout_tokens(config, group=8, batch=32) == threshold
    model = LlamaForCausalLM(config)
    which = torch.arange(4).repeat_interleave(8)  # [32] each row's prompt
    for length, shared in ((threshold, False), (threshold + 1, True)):
        keys = torch.zeros(4, kv_heads, length, 64)  # [U, kvh, L, d] float32
        cache = SimpleNamespace(layers=[SimpleNamespace(keys=keys, values=keys.clone())])
        assert StaticDecoder(model, cache, which, max_new_tokens=2).shared is shared


def test_gpu_check_sh_refuses_an_unknown_option(tmp_path):
    result = run_gpu_check(tmp_path, "--steps", "4")
    assert result.returncode == 2 and "unknown option --steps (takes --smoke)" in result.stderr


def test_linear_kernel_runs_as_a_smoke(tmp_path):
    """benchmarks/linear_kernel.py --quick: MKL, oneDNN and our kernel timed on one shape at
    1 and 8 rows; its last line is the JSON summary with every side's time."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "linear_kernel.py"
    result = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["quick"] and summary["rows"] == [1, 8]
    for rows in ("1", "8"):
        figures = summary["192x576"][rows]
        assert all(figures[side] > 0 for side in ("mkl", "onednn", "ours"))
        # both printed rounded to 0.1: GB/s within half of that of what the time implies
        assert figures["ours_gb_s"] == pytest.approx(192 * 576 * 4 / figures["ours"] / 1e3,
                                                     rel=0.01, abs=0.051)


@pytest.mark.slow
def test_rollout_throughput_runs_as_a_smoke(tmp_path):
    """benchmarks/rollout_throughput.py on the tiny model: every workload ran both policies
    (HFPolicy and the plain model.generate loop) and the decode figures are against a
    measured roofline; its last line is the JSON summary."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "rollout_throughput.py"
    result = subprocess.run([sys.executable, str(script), "--model", "tiny", "--quick",
                             "--repeats", "1"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("grpo", "records", "relay"):
        w = summary[name]
        assert w["hfpolicy_tokens"] > 0 and w["generate_tokens"] > 0
        assert w["ratio"] == pytest.approx(w["hfpolicy_tok_s"] / w["generate_tok_s"], rel=0.01)
    assert summary["machine"]["bandwidth_gb_s"] > 0 and summary["machine"]["matmul_gflop_s"] > 0
    for batch in (1, 8, 32):
        d = summary[f"decode_b{batch}"]
        assert d["step_ms"] > 0 and d["of_roofline"] == pytest.approx(
            d["roofline_ms"] / d["step_ms"], rel=0.01, abs=1e-3)


@pytest.mark.slow
def test_overheads_runs_as_a_smoke(tmp_path):
    """benchmarks/overheads.py on the tiny model times every stepped built-in env's batch apart:
    policy + env + runner + post add up to the total, and the fraction is theirs; CodeTests-v0
    also set up ahead (and, in bwrap, both with a fresh sandbox per run), on the same
    episodes."""
    import json

    import envs

    script = EXAMPLES.parent / "benchmarks" / "overheads.py"
    result = subprocess.run([sys.executable, str(script), "--model", "tiny", "--tasks", "1",
                             "--group", "2", "--max-new-tokens", "8", "--repeats", "1"],
                            capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    built_in = [e for e in envs.list_envs()  # the stepped ones (Agent-v0 runs an agent's code)
                if e.startswith("agent_rl/") and not envs.registry.runs_whole_episodes(e)]
    assert len(built_in) >= 5
    ways = ["runs not shared", "prestart on"] + (["fresh bwrap", "fresh bwrap, prestart on"]
                                                 if summary["sandbox"] == "bwrap" else [])
    for env_id in [*built_in, *(f"agent_rl/CodeTests-v0 {way}" for way in ways)]:
        r = summary[env_id]
        assert r["episodes"] == 2 and r["policy_s"] > 0
        parts = r["policy_s"] + r["env_s"] + r["runner_s"] + r["post_s"]
        assert parts == pytest.approx(r["total_s"], abs=1e-4)
        assert r["overhead_frac"] == pytest.approx(1 - r["policy_s"] / r["total_s"], abs=1e-3)
        if env_id.startswith("agent_rl/CodeTests-v0"):
            assert r["runs"] + r["shared"] <= 2
            assert r["shared"] == 0 or env_id == "agent_rl/CodeTests-v0"  # only shared by default


@pytest.mark.slow
def test_agent_proxy_runs_as_a_smoke(tmp_path):
    """benchmarks/agent_proxy.py --smoke: the same Relay episodes through the policy server
    (Agent-v0 running examples/agents/relay_agent.py) and as Relay-v0, side by side; the
    overheads are the ratios of the runs' own times, and the no-model runs answered every call."""
    script = EXAMPLES.parent / "benchmarks" / "agent_proxy.py"
    result = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    ours = lines[next(k for k, line in enumerate(lines) if line.startswith("model tiny")):-1]
    assert len(ours) >= 8 and all(len(line) <= 80 for line in ours), ours
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["model"] == "tiny" and summary["repeats"] == 1
    agent, built_in = summary["agent"], summary["built_in"]
    for side in (agent, built_in):
        assert side["episodes"] == 2 and side["faults"] == 0 and side["tokens"] > 0
        assert side["policy_s"] + side["other_s"] == pytest.approx(side["total_s"], abs=2e-4)
        assert side["s_per_token"] == pytest.approx(side["total_s"] / side["tokens"], rel=1e-3)
    # relay-0-0 needs three sessions: two notes and the answer, one call each, both ways
    assert agent["calls"] == built_in["calls"] == 6
    assert summary["overhead"] == pytest.approx(
        (agent["total_s"] - built_in["total_s"]) / built_in["total_s"], abs=1e-3)
    assert summary["overhead_per_token"] == pytest.approx(
        agent["s_per_token"] / built_in["s_per_token"] - 1, abs=1e-3)
    assert summary["overhead_range"] == [summary["overhead"]] * 2
    assert summary["window_bound_s"] == pytest.approx(agent["batches"] * summary["window_s"])
    assert [m["window_s"] for m in summary["machinery"]] == [summary["window_s"], 0.0]
    assert all(m["calls"] == 6 and m["ms_per_call"] > 0 for m in summary["machinery"])


@pytest.mark.slow
def test_train_throughput_kernel_pairs_by_hand(monkeypatch):
    """One causal segment of 8 queries, one chunk of 8 keys, extents 1..8: the bf16 kernel's
    tiles of 6 queries cover 16 keys each (whole vectors), 6 x 16 + 2 x 16 = 128 pairs where
    the plan holds 64; 20 queries: tiles up to 6, 12, 18, 20 keys -> 16, 16, 32, 32."""
    import torch

    from agent_rl.accel import plan_blocks

    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    from train_throughput import kernel_pairs

    def causal(t):
        return torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)

    assert kernel_pairs(plan_blocks(causal(8))) == 128
    assert kernel_pairs(plan_blocks(causal(20))) == 6 * 16 + 6 * 16 + 6 * 32 + 2 * 32


def test_train_throughput_runs_as_a_smoke(tmp_path):
    """benchmarks/train_throughput.py on the tiny model: both dtypes timed against their
    measured peaks, and the padding fractions follow from the token counts it printed."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "train_throughput.py"
    result = subprocess.run([sys.executable, str(script), "--model", "tiny", "--tasks", "1",
                             "--repeats", "1", "--sustain", "0.2", "--warmup", "1"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout.strip().splitlines()[-1])
    assert s["sequences"] >= 16 and s["session_tokens"] > s["shared_tokens"] > 0  # 8 two-session episodes
    for micro in ("micro512", "micro2048"):
        p = s[micro]
        for kind in ("packed", "unpacked"):
            assert p[f"{kind}_padded_tokens"] >= s["shared_tokens"]
            assert p[f"{kind}_waste"] == pytest.approx(1 - s["shared_tokens"] / p[f"{kind}_padded_tokens"], abs=1e-4)
        assert p["packed_padded_tokens"] <= p["unpacked_padded_tokens"]
        # pairs allowed (each real token sees at least itself, a rest more than its own rest)
        # <= computed blocked <= every row's T^2
        a = s[f"attention_pairs_{micro}"]
        assert s["shared_tokens"] < a["allowed"] <= a["blocked"] <= a["whole_rows"]
        assert a["whole_rows"] >= p["packed_padded_tokens"]
        assert a["allowed"] <= a["bf16_kernel"] and a["bf16_kernel"] % 16 == 0  # whole vectors of keys
    from agent_rl.policies.models import tiny_model

    config = tiny_model(0)[0].config
    per_pair = 12 * config.hidden_size * config.num_hidden_layers
    assert s["attention_flops_per_step"] == per_pair * s["attention_pairs_micro512"]["allowed"]
    assert s["attention_flops_computed_per_step"] == {
        "float32": per_pair * s["attention_pairs_micro512"]["blocked"],
        "bfloat16": per_pair * s["attention_pairs_micro512"]["bf16_kernel"]}
    for dtype in ("float32", "bfloat16"):
        d = s[dtype]
        assert 0.0 <= d["recomputed_frac"] <= 1.0
        assert d["of_peak_all_work"] >= d["of_peak_with_attention"] > d["of_peak"]
        # achieved is printed to 0.1 GFLOP/s and of_peak to 1e-4: tiny figures round coarsely
        assert d["step_s"] > 0 and d["of_peak"] == pytest.approx(
            d["achieved_gflop_s"] / d["matmul_peak_gflop_s"],
            rel=0.02, abs=0.05 / d["matmul_peak_gflop_s"] + 5e-5)
        # one sustained rate before each timed step and one after the last; each step against
        # the mean of the two beside it, and their median
        steps, sustained = d["steps_s"], d["matmul_sustained_gflop_s"]
        assert len(steps) == 1 and len(sustained) == 2 and min(steps) == pytest.approx(d["step_s"], abs=1e-3)
        want = d["achieved_gflop_s"] / ((sustained[0] + sustained[1]) / 2)
        assert d["of_sustained_paired"][0] == pytest.approx(want, rel=0.02, abs=5e-4)
        assert d["of_sustained_median"] == d["of_sustained_paired"][0]
        # the passes alone: part of the step, the same FLOPs over fewer seconds
        assert 0 < d["forward_backward_s"] < d["step_s"]
        assert d["of_peak_forward_backward"] == pytest.approx(
            d["of_peak"] * d["step_s"] / d["forward_backward_s"], rel=0.02, abs=5e-4)


@pytest.mark.slow
def test_vs_trl_runs_as_a_smoke(tmp_path):
    """benchmarks/vs_trl.py on the tiny model, one timed step of each side (TRL's GRPOTrainer in
    .venv-trl, built by the script when missing): every ratio is ours over TRL's own figures,
    and both sides generated completions of the configured workload."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "vs_trl.py"
    result = subprocess.run([sys.executable, str(script), "--models", "tiny", "--adapters", "none",
                             "--steps", "1", "--repeats", "1"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    s = json.loads(result.stdout.strip().splitlines()[-1])
    row = s["tiny/none"]
    for side in ("trl", "ours"):
        r = row[side]
        assert r["n_steps"] == 1 and 0 < r["rollout_s"] < r["step_s"]
        assert 32 <= r["tokens"] <= 4 * 8 * 32  # 32 completions, 1 to 32 tokens each
    for part in ("rollout", "train", "step"):
        assert row[f"{part}_ratio"] == pytest.approx(row["ours"][f"{part}_s"] / row["trl"][f"{part}_s"], rel=0.01)


@pytest.mark.slow
def test_sandbox_overhead_runs_as_a_smoke(tmp_path):
    """benchmarks/sandbox_overhead.py, two runs per backend: every available backend timed
    against the baseline measured in the same run, its overhead the difference of the medians;
    then CodeTests-v0 scored through each bwrap mode here (a wrong verdict fails the script),
    its CPU counted."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "sandbox_overhead.py"
    result = subprocess.run([sys.executable, str(script), "--runs", "2", "--score-runs", "6"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout.strip().splitlines()[-1])
    assert s["runs"] == 2 and s["baseline"]["median_ms"] > 0 and s["subprocess"]["available"]
    for backend in ("docker", "bwrap", "bwrap-fresh", "subprocess"):
        r = s[backend]
        if r["available"]:
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["overhead_ms"] == pytest.approx(r["median_ms"] - s["baseline"]["median_ms"])
        else:
            assert r["why"]
    scored = [m for m in ("bwrap", "bwrap-fresh") if s[m]["available"]]
    assert sorted(k for k in s if k.startswith("codetests")) == [f"codetests {m}" for m in scored]
    for mode in scored:
        r = s[f"codetests {mode}"]
        assert r["runs"] == 6 and r["shared"] == 0 and r["wall_ms_per_run"] > 0
        assert r["machine_cpu_ms_per_run"] > 0 and r["own_cpu_ms_per_run"] >= 0  # clock ticks


@pytest.mark.slow
def test_transfer_runs_as_a_smoke(tmp_path):
    """benchmarks/transfer.py at its tiny scale: the warm start, both GRPO arms and the four
    policies' rewards on the same held-out atomic and composed tasks, paired by task."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "transfer.py"
    result = subprocess.run([sys.executable, str(script), "--scale", "tiny", "--out",
                             str(tmp_path / "runs")], capture_output=True, text=True,
                            cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    s = json.loads(result.stdout.strip().splitlines()[-1])
    assert s["scale"] == "tiny" and f"scale tiny: {json.dumps(s['config'])}" in result.stdout
    assert [m["policy"] for m in s["means"]] == ["base", "sft", "grpo_atomic", "grpo_composed"]
    assert s["sft_data"]["episodes_kept"] == s["config"]["sft_episodes"]
    assert all(d["n"] == s["config"]["n_eval"] and d["lo"] <= d["mean"] <= d["hi"]
               for d in s["paired"])
    means = {m["policy"]: m for m in s["means"]}
    for d in s["paired"]:
        a, b = d["diff"].split(" - ")
        assert d["mean"] == pytest.approx(means[a][d["kind"]] - means[b][d["kind"]], abs=2e-3)
    for arm in ("atomic", "composed"):
        assert (tmp_path / "runs" / arm / "checkpoints").is_dir()
    # the same command again: the warm start reused, both finished arms resumed (no step
    # trained again: their logs untouched), the same table
    logs = {arm: (tmp_path / "runs" / arm / "metrics.jsonl").stat().st_mtime_ns
            for arm in ("atomic", "composed")}
    again = subprocess.run([sys.executable, str(script), "--scale", "tiny", "--out",
                            str(tmp_path / "runs")], capture_output=True, text=True,
                           cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    t = json.loads(again.stdout.strip().splitlines()[-1])
    assert "reusing the warm start" in again.stdout
    assert t["means"] == s["means"] and t["grpo"] == s["grpo"]
    for arm in ("atomic", "composed"):
        metrics = (tmp_path / "runs" / arm / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == s["config"]["steps"]  # no step logged twice
        assert (tmp_path / "runs" / arm / "metrics.jsonl").stat().st_mtime_ns == logs[arm]


@pytest.mark.slow
def test_an_interrupted_assigner_ablation_continues(tmp_path):
    """A run the ablation started but did not record (killed mid-run) is continued by the
    same command, not refused as a run directory in use, and recorded."""
    import json

    script = EXAMPLES.parent / "benchmarks" / "assigners.py"
    cmd = [sys.executable, str(script), "--config", str(EXAMPLES / "tiny.yaml"), "--assigners",
           "broadcast", "--seeds", "0", "--steps", "1", "--out", str(tmp_path / "abl")]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stderr[-4000:]
    (tmp_path / "abl" / "assigners.json").unlink()  # as if killed before it was recorded
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    runs = json.loads((tmp_path / "abl" / "assigners.json").read_text())["runs"]
    assert [(r["assigner"], r["seed"], r["steps"]) for r in runs] == [("broadcast", 0, 1)]


def test_assigners_table_averages_seeds_per_task_and_counts_sub_agents(monkeypatch):
    """Two held-out tasks, two seeds. usage_weighted - broadcast per task: a (1.0-0.5,
    1.0-0.0) -> 0.75, b (1.0-1.0, 0.0-1.0) -> -0.5; the bootstrap sees 2 units (not 4), so
    its interval is the range of their resampled means, [-0.5, +0.75]. after - before the
    same way: broadcast a (0.5, 0.0) -> 0.25, b (1.0, 1.0) -> 1.0: +0.625 [+0.25, +1.0]. A
    branching run wrote no note (no such column); its held-out roots spawning after are
    averaged over the seeds and its sessions per episode are read from the training steps."""
    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    from assigners import markdown, table

    def run(assigner, seed, a, b, sessions, spawning):
        after = {"keys": ["t:a:0", "t:b:0"], "rewards": [a, b], "reward_mean": (a + b) / 2,
                 "summary_used_frac": 0.0, "compressions_per_episode": 0.0,
                 "branched_frac": spawning, "branches_per_episode": spawning}
        before = {**after, "rewards": [0.0, 0.0], "reward_mean": 0.0}
        return {"assigner": assigner, "seed": seed, "before": before, "after": after,
                "comparison": {"reward_diff": (a + b) / 2, "lo": 0.0, "hi": 1.0},
                "tokens_generated": 10, "sessions_per_episode": sessions}

    runs = [run("broadcast", 0, 0.5, 1.0, [2.0, 1.5], 0.5),
            run("broadcast", 1, 0.0, 1.0, [2.0, 2.5], 0.0),
            run("usage_weighted", 0, 1.0, 1.0, [1.5, 1.0], 0.25),
            run("usage_weighted", 1, 1.0, 0.0, [2.5, 1.0], 0.25)]
    rows = table(runs, ["broadcast", "usage_weighted"], [0, 1])
    usage = rows[1]
    assert usage["vs_broadcast"] == pytest.approx(0.125) and usage["vs_n"] == 2
    assert (usage["vs_lo"], usage["vs_hi"]) == pytest.approx((-0.5, 0.75))
    assert rows[0]["gain"] == pytest.approx(0.625)
    assert (rows[0]["gain_lo"], rows[0]["gain_hi"]) == pytest.approx((0.25, 1.0))
    assert rows[0]["note_used_after"] is None
    assert rows[0]["spawning_after"] == pytest.approx(0.25)
    assert rows[0]["sessions_first_last"] == (2.0, 2.0)
    assert usage["sessions_first_last"] == (2.0, 1.0)
    text = markdown(rows, [0, 1], 10)
    assert "| broadcast | 0.000 | 0.625 | +0.625 [+0.250, +1.000] |" in text
    assert text.splitlines()[0].endswith("| roots spawning after | sessions/episode, step 1 -> last |")
    assert "notes used after" not in text  # no row wrote a note
    assert "| +0.125 [-0.500, +0.750] | 25% | 2.00 -> 1.00 |" in text
    assert max(len(line) for line in text.splitlines()[2:]) < 160
    no_spawn = [{**r, "before": {**r["before"], "branches_per_episode": 0.0},
                 "after": {**r["after"], "branches_per_episode": 0.0}} for r in runs]
    assert table(no_spawn, ["broadcast"], [0, 1])[0]["spawning_after"] is None
