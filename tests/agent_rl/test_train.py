"""The training loop end to end on CPU: the tiny random model on tests/Digits-v0 (whose reward
gives random text graded partial credit, so groups have contrast and the loss has a gradient).

One straight 4-step run (a module fixture) is checked for its run-directory contents, its
ratio-1 first updates and its changed parameters; resuming (after a clean stop, and after a
real SIGKILL) must reproduce it bit for bit; guards stop runs on injected faults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import safetensors.torch
import torch

import envs
from agent_rl import accel
from agent_rl.accel import casts as accel_casts
from agent_rl.accel import head as accel_head
from agent_rl.accel import patches, trainer
from agent_rl.policies.models import tiny_model
from agent_rl.run import checkpoint
from agent_rl.run.contract import ExperimentContract
from agent_rl.run.distributed import TorchBackend
from agent_rl.run.flops import flops_per_token
from agent_rl.run.guards import NothingTrained
from agent_rl.training import shared, train, update
from agent_rl.training.rollout import TrainSequence, session_advantages
from agent_rl.training.setup import check_world
from tests.agent_rl import toy_env
from trajectories import Outcome, RolloutStore

REPO = Path(__file__).resolve().parents[2]
STEPS, TASKS, GROUP = 4, 2, 4
BASE = {
    "name": "digits",
    "env": {"id": toy_env.ENV_ID, "pool_size": 64},
    "eval": {"n": 4, "every": 2},
    "model": {"id": "tiny", "adapter": "none"},
    "rollout": {"group_size": GROUP, "tasks_per_step": TASKS, "max_response_tokens": 12,
                "truncation": "keep"},
    "optim": {"lr": 1e-3, "max_steps": STEPS},
    "checkpoint": {"every": 2, "keep": 2},
    # Random text almost never ends its turn within 12 tokens: the length guard stays off.
    "guards": {"max_truncated_frac": 1.01},
}
DROP_REASONS = {"all_correct", "all_wrong", "zero_contrast", "too_few_valid"}


def make_contract(run_dir: Path, *overrides: str, base: dict = BASE) -> ExperimentContract:
    return ExperimentContract.from_dict({**base, "run_dir": str(run_dir)}, list(overrides))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of a state dict, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def bundle_params_hash(run_dir: Path) -> str:
    latest = checkpoint.latest_complete(run_dir / "checkpoints")
    return tensors_hash(safetensors.torch.load_file(latest / "model.safetensors"))


def initial_params_hash() -> str:
    model, _ = tiny_model(0)
    return tensors_hash(dict(model.named_parameters()))


@pytest.fixture(scope="module", autouse=True)
def digits_env():
    """tests/Digits-v0 is registered only while these tests run."""
    yield toy_env.register()
    toy_env.unregister()


@pytest.fixture(scope="module")
def straight(digits_env, tmp_path_factory):
    """The reference: STEPS steps in one go."""
    contract = make_contract(tmp_path_factory.mktemp("straight") / "run")
    return contract, train.run(contract, progress=False)


def test_toy_env_gives_random_text_partial_credit():
    assert toy_env.digits_reward("a1 b2", "12") == {"digits": 0.5, "exact": 0.0}
    assert toy_env.digits_reward(" 12\n", "12") == {"digits": 1.0, "exact": 1.0}
    assert toy_env.digits_reward("", "12") == {"digits": 0.0, "exact": 0.0}
    env = envs.make(toy_env.ENV_ID)
    env.reset(seed=0)
    *_, terminated, _, info = env.step(env.unwrapped.reference_action())
    assert terminated and info["episode"].reward.total == 1.0
    assert info["episode"].reward.outcome == Outcome.correct


# --- one run, everything it leaves behind -----------------------------------------------------


def test_run_dir_holds_every_artefact(straight):
    contract, result = straight
    run_dir = result.run_dir
    assert result.steps == STEPS and result.stopped is None

    assert ExperimentContract.from_yaml(run_dir / "contract.yaml") == contract
    assert (run_dir / "contract.sha256").read_text().strip() == contract.contract_hash()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert {"loss/policy", "reward/mean", "policy/entropy", "ratio/min", "optim/grad_norm",
                "groups/dropped", "rollout/tokens_generated", "sessions/per_episode"} <= m.keys()
        assert all("/" in key for key in m if key != "step"), "metrics are namespaced"
    assert [m["loss/policy"] for m in metrics] == result.losses
    peaks = [m["memory/peak_rss_mb"] for m in metrics]  # the process's peak so far: it holds a model
    assert peaks == sorted(peaks) and peaks[0] > 50
    for m in metrics:  # the update's parts, within its seconds (kl: where the step was taken)
        parts = [m[f"train/{k}_seconds"] for k in ("forward_backward", "optimizer", "kl")]
        assert parts[0] > 0 and parts[1] >= 0 and (parts[2] is None) == (m["optim/skipped"] == 1.0)
        assert sum(p or 0.0 for p in parts) <= m["train/seconds"]

    store = RolloutStore(run_dir / "rollouts.jsonl")
    report = store.verify()
    assert report.ok and report.records == STEPS * TASKS * GROUP, str(report)
    groups = defaultdict(list)
    for episode in store.read():
        assert isinstance(episode.filter["kept"], bool) and episode.filter["reason"]
        groups[episode.group_id].append(episode)
    assert len(groups) == STEPS * TASKS and all(len(g) == GROUP for g in groups.values())
    dropped = [g for g in groups.values() if not g[0].filter["kept"]]
    for group in groups.values():  # a group is kept or dropped as a whole, with one reason
        assert len({(e.filter["kept"], e.filter["reason"]) for e in group}) == 1
    assert all(g[0].filter["reason"] in DROP_REASONS for g in dropped)
    assert len(dropped) == sum(m["groups/dropped"] for m in metrics)
    assert all(g[0].filter["reason"] == "kept" for g in groups.values() if g[0].filter["kept"])

    bundles = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert bundles == ["step-000002", "step-000004"]  # every 2, keep 2
    for name in bundles:
        assert (run_dir / "checkpoints" / name / "COMPLETE").is_file()
        checkpoint.verify_bundle(run_dir / "checkpoints" / name)

    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [(e["tag"], e["step"]) for e in evals] == [("before", 0), ("step2", 2), ("after", STEPS)]
    assert all(e["n"] == contract.eval.n for e in evals)
    assert evals[-1]["task_ids"] == evals[0]["task_ids"]  # the same held-out tasks
    outcome = json.loads((run_dir / "result.json").read_text())
    strip = lambda record: {k: v for k, v in record.items() if k not in ("step", "tag")}  # noqa: E731
    assert outcome["before"] == strip(evals[0]) and outcome["after"] == strip(evals[-1])
    assert outcome["comparison"]["n"] == contract.eval.n

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [(s.step, s.value) for s in events.Scalars("reward/mean")]
    assert logged == [(m["step"], pytest.approx(m["reward/mean"])) for m in metrics]


def test_losses_have_gradients_and_parameters_move(straight):
    _, result = straight
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert sum(m["train/sequences"] for m in metrics) > 0
    for m in metrics:
        assert math.isfinite(m["loss/policy"]) and m["optim/skipped"] == 0.0
        if m["train/sequences"]:
            assert m["optim/grad_norm"] > 0.0
            # the step moved the policy on its own batch (k3 KL >= 0, > 0 after a real step),
            # while before the step the fresh batch is on-policy (kl/approx ~ 0)
            assert m["kl/update"] > 1e-9 and abs(m["kl/approx"]) < 1e-5
    # At ratio 1 the token-mean loss is -sum_b A_b n_b / sum_b n_b over the trained sessions
    # (n_b: sampled tokens): recomputed from the stored rollouts, step by step. (It is 0 when
    # every response has the same length, as random text cut at 12 tokens often has.)
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    for m in metrics:
        kept = [e for e in episodes if e.group_id.startswith(f"step{m['step']}/") and e.filter["kept"]]
        adv = session_advantages(kept)
        n = {(e.episode_id, s.session_id): s.generated_tokens for e in kept for s in e.sessions}
        expected = -sum(a * n[key] for key, a in adv.items()) / sum(n[key] for key in adv)
        assert m["loss/policy"] == pytest.approx(expected, abs=1e-5)
    assert any(m["reward/std"] > 0 for m in metrics)
    assert bundle_params_hash(result.run_dir) != initial_params_hash()


def test_first_update_on_fresh_data_has_ratio_one(straight):
    _, result = straight
    for m in read_jsonl(result.run_dir / "metrics.jsonl"):
        assert abs(m["ratio/min"] - 1.0) < 1e-4 and abs(m["ratio/max"] - 1.0) < 1e-4, m
        assert m["clip/low_frac"] == 0.0 and m["clip/high_frac"] == 0.0


def test_second_pass_over_a_batch_moves_the_ratio(tmp_path):
    """Control for the test above: with updates_per_batch=2 the logged (last) pass runs on
    weights already updated once, so its ratio is no longer 1."""
    result = train.run(make_contract(tmp_path / "run", "optim.max_steps=1", "eval.every=0",
                                     "optim.updates_per_batch=2"), progress=False)
    (m,) = read_jsonl(result.run_dir / "metrics.jsonl")
    assert max(abs(m["ratio/min"] - 1.0), abs(m["ratio/max"] - 1.0)) > 1e-3, m


def test_lora_with_kl_to_the_base_weights(tmp_path):
    """LoRA + beta > 0 with the base model as the fixed reference: the reference is the same
    weights with the adapter disabled. LoRA's B starts at 0, so on step 1 the policy equals the
    reference (kl/ref exactly 0); once the adapter has moved, KL to the reference is > 0, and only
    adapter weights are trained and saved."""
    result = train.run(make_contract(tmp_path / "run", "model.adapter=lora", "model.lora_rank=4",
                                     "reference=tiny", "loss.kl.beta=0.1", "optim.max_steps=3",
                                     "eval.every=0", "optim.lr=0.05"), progress=False)
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert metrics[0]["kl/ref"] == pytest.approx(0.0, abs=1e-7)
    assert max(m["kl/ref"] for m in metrics[1:]) > 1e-6
    saved = safetensors.torch.load_file(checkpoint.latest_complete(result.run_dir / "checkpoints")
                                        / "model.safetensors")
    assert saved and all("lora_" in name for name in saved)


def test_lora_rollouts_sample_a_merged_copy_that_follows_the_adapter(tmp_path):
    """Under LoRA the HF rollouts run on a plain copy with the adapters merged (no adapter
    work per token), given the merged weights after every update: with lr 0.05 the adapter
    moves a lot, yet every step's rollout log-probs are the trainer's to float32 round-off
    (a stale copy would be off by the update); a bf16 copy (rollout.dtype) is measured off by
    more, and the trained weights stay float32."""
    result = train.run(make_contract(tmp_path / "run", "model.adapter=lora", "model.lora_rank=4",
                                     "optim.max_steps=3", "eval.every=0", "optim.lr=0.05"),
                       progress=False)
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert max(m["kl/update"] for m in metrics) > 1e-4  # the adapter really moved
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in metrics)
    bf16 = train.run(make_contract(tmp_path / "bf16", "model.adapter=lora", "model.lora_rank=4",
                                   "optim.max_steps=2", "eval.every=0", "rollout.dtype=bfloat16"),
                     progress=False)
    diffs = [m["rollout/logprob_diff_max"] for m in read_jsonl(bf16.run_dir / "metrics.jsonl")]
    assert all(1e-4 < d < 1.0 for d in diffs)
    saved = safetensors.torch.load_file(checkpoint.latest_complete(bf16.run_dir / "checkpoints")
                                        / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}


def test_no_reward_contrast_trains_nothing(tmp_path, recwarn):
    """Arithmetic-v0 gives a random model 0 everywhere: every group is dropped as all_wrong,
    no sequence is trained, no optimizer step is taken. Normal on hard tasks: the steps are
    recorded as empty for zero contrast, counted and warned once, and the run ends as usual."""
    result = train.run(make_contract(tmp_path / "run", "env.id=agent_rl/Arithmetic-v0",
                                     "optim.max_steps=2", "eval.every=0", "rollout.max_response_tokens=6"),
                       progress=False)
    assert result.stopped is None and result.steps == 2 and result.after is not None
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert all(m["groups/dropped"] == TASKS and m["groups/all_wrong"] == TASKS for m in metrics)
    assert all(m["train/sequences"] == 0 and m["optim/skipped"] == 1.0 for m in metrics)
    assert [(m["train/empty_step"], m["train/empty_reason"]) for m in metrics] == \
        [(1, "zero_contrast")] * 2
    assert [m["total/zero_contrast_steps"] for m in metrics] == [1, 2]
    said = [str(w.message) for w in recwarn if "reward for all its samples" in str(w.message)]
    assert said == ["step 1: every group had one reward for all its samples (2 all wrong, 0 all "
                    "correct, 0 other), so no policy gradient and no token trained (dynamic "
                    "sampling); normal on hard tasks, counted in total/zero_contrast_steps "
                    "(warned once)"]
    assert not [w for w in recwarn if "trained on no token" in str(w.message)]
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    assert len(episodes) == 2 * TASKS * GROUP
    assert all(e.filter["kept"] is False and e.filter["reason"] == "all_wrong" for e in episodes)
    assert bundle_params_hash(result.run_dir) == initial_params_hash()


# --- resume ---------------------------------------------------------------------------------


def test_resume_after_a_stop_is_the_straight_run(straight, tmp_path):
    """j steps, then a fresh run(resume=True) to K: the same losses, episodes and weights.
    Extending max_steps keeps the contract hash (max_steps says where to stop, not how)."""
    _, reference = straight
    run_dir, j = tmp_path / "run", 2
    first = train.run(make_contract(run_dir, f"optim.max_steps={j}"), progress=False)
    assert first.steps == j and (run_dir / "checkpoints" / f"step-{j:06d}" / "COMPLETE").exists()
    second = train.run(make_contract(run_dir), resume=True, progress=False)
    assert second.steps == STEPS and second.before == first.before

    assert first.losses + second.losses == reference.losses
    assert [m["loss/policy"] for m in read_jsonl(run_dir / "metrics.jsonl")] == reference.losses
    assert bundle_params_hash(run_dir) == bundle_params_hash(reference.run_dir)
    ours = [e.content_hash for e in RolloutStore(run_dir / "rollouts.jsonl").read()]
    theirs = [e.content_hash for e in RolloutStore(reference.run_dir / "rollouts.jsonl").read()]
    assert ours == theirs


def test_a_shared_before_evaluation_is_the_run_that_evaluated(straight, tmp_path):
    """An ablation's arms share one evaluation of the starting policy: a run given the
    straight run's ``before`` trains the same and reports the same comparison, without
    evaluating before (no before records of its own)."""
    contract, reference = straight
    shared = train.run(make_contract(tmp_path / "run"), progress=False, before=reference.before)
    assert shared.before == reference.before and shared.after == reference.after
    assert shared.comparison == reference.comparison and shared.losses == reference.losses
    assert not (tmp_path / "run" / "evals" / "before.jsonl").exists()
    assert (reference.run_dir / "evals" / "before.jsonl").exists()


def held_out_of(contract) -> tuple[dict, float]:
    from agent_rl.training.shared import load_data

    data = load_data(contract.env, contract.eval, contract.rollout.max_prompt_tokens)
    return data.eval_sets, contract.eval.temperature


def test_a_before_evaluation_of_other_tasks_or_temperature_is_refused(straight, tmp_path):
    contract, reference = straight
    fewer = {**reference.before, "keys": reference.before["keys"][1:]}
    with pytest.raises(ValueError, match="held-out tasks"):
        train.run(make_contract(tmp_path / "a"), progress=False, before=fewer)
    # a task the other run lost to an infrastructure fault is still the same evaluation
    faulted = {**reference.before, "keys": reference.before["keys"][1:], "infra_faults": 1}
    assert train.same_held_out(faulted, *held_out_of(contract)) is faulted
    hotter = {**reference.before, "temperature": 1.5}
    with pytest.raises(ValueError, match="temperature 1.5"):
        train.run(make_contract(tmp_path / "b"), progress=False, before=hotter)


KILLED_RUN = """
import sys, time
import envs
from agent_rl.run import checkpoint
from agent_rl.training import train
from tests.agent_rl import toy_env
from agent_rl.run.contract import ExperimentContract

save_bundle = checkpoint.save_bundle
def save_slowly(root, step, **kwargs):  # hangs before writing checkpoint 2: killed there
    if step == 2:
        time.sleep(600)
    return save_bundle(root, step, **kwargs)
checkpoint.save_bundle = save_slowly
toy_env.register()
train.run(ExperimentContract.from_yaml(sys.argv[1]), progress=False)
"""


@pytest.mark.slow
def test_resume_after_sigkill_matches_the_straight_run(straight, tmp_path):
    """SIGKILL after checkpoint 1, once step 2 is logged (its rollouts, eval and metrics are
    on disk, its checkpoint is not). Resuming redoes step 2 and ends on the straight run's
    weights, with every step logged once."""
    _, reference = straight
    run_dir = tmp_path / "run"
    contract = make_contract(run_dir, "checkpoint.every=1", "checkpoint.keep=5")
    (tmp_path / "contract.yaml").write_text(contract.to_yaml())
    (tmp_path / "killed.py").write_text(KILLED_RUN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "killed.py"), str(tmp_path / "contract.yaml")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "checkpoints" / "step-000001" / "COMPLETE").exists()
                   and (run_dir / "metrics.jsonl").exists()
                   and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the training subprocess made no progress"
            time.sleep(0.02)
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert checkpoint.latest_complete(run_dir / "checkpoints").name == "step-000001"
    assert RolloutStore(run_dir / "rollouts.jsonl").cursor == 2 * TASKS * GROUP  # step 2's too

    result = train.run(contract, resume=True, progress=False)
    assert result.steps == STEPS and result.stopped is None
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss/policy"] for m in metrics] == reference.losses
    assert bundle_params_hash(run_dir) == bundle_params_hash(reference.run_dir)
    store = RolloutStore(run_dir / "rollouts.jsonl")
    assert store.verify().ok and store.cursor == STEPS * TASKS * GROUP
    assert [e.content_hash for e in store.read()] == [
        e.content_hash for e in RolloutStore(reference.run_dir / "rollouts.jsonl").read()]
    assert [e["tag"] for e in read_jsonl(run_dir / "eval.jsonl")] == ["before", "step2", "after"]
    # what the killed run did after its checkpoint is kept aside, not lost
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl.rewound")] == [2]
    assert len(read_jsonl(run_dir / "rollouts.jsonl.rewound")) == TASKS * GROUP


def test_resume_refuses_a_changed_contract(straight):
    contract, result = straight
    before = {p: p.read_bytes() for p in result.run_dir.glob("*.*")}
    changed = make_contract(result.run_dir, "optim.lr=0.002")
    with pytest.raises(ValueError, match=r"another contract.*optim\.lr: 0\.001 -> 0\.002"):
        train.run(changed, resume=True, progress=False)
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train.run(contract, resume=False, progress=False)
    assert {p: p.read_bytes() for p in result.run_dir.glob("*.*")} == before  # untouched


def test_a_run_killed_before_its_first_checkpoint_restarts_clean(tmp_path):
    """Killed before checkpoint 1 (its "before" evaluation and some rollouts written): a new
    run there is refused; --resume starts over at step 0 and sets the old logs aside."""
    contract = make_contract(tmp_path / "run", "optim.max_steps=1", "eval.every=0")
    run_dir = contract.resolved_run_dir
    run_dir.mkdir()
    (run_dir / "contract.sha256").write_text(contract.contract_hash() + "\n")
    (run_dir / "eval.jsonl").write_text('{"step": 0, "tag": "before"}\n')
    (run_dir / "rollouts.jsonl").write_text('{"episode": "of the killed run"}\n{"torn')
    with pytest.raises(ValueError, match="already holds a run"):
        train.run(contract, progress=False)

    result = train.run(contract, resume=True, progress=False)
    assert result.steps == 1
    assert [e["tag"] for e in read_jsonl(run_dir / "eval.jsonl")] == ["before", "after"]
    assert RolloutStore(run_dir / "rollouts.jsonl").verify().ok
    assert (run_dir / "rollouts.jsonl.rewound").read_text() == \
        '{"episode": "of the killed run"}\n{"torn\n'
    assert read_jsonl(run_dir / "eval.jsonl.rewound") == [{"step": 0, "tag": "before"}]


# --- guards ---------------------------------------------------------------------------------


def test_nonfinite_loss_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    def nan_loss(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        return loss * float("nan"), metrics

    real_loss = update.policy_loss
    monkeypatch.setattr(update, "policy_loss", nan_loss)
    result = train.run(make_contract(tmp_path / "run", "checkpoint.every=0"), progress=False)

    assert result.stopped is not None and result.stopped.rule == "nonfinite"
    assert result.steps == 2  # guards.max_nonfinite_steps: one bad step only skips its update
    guard = json.loads((result.run_dir / "guard.json").read_text())
    assert guard["rule"] == "nonfinite" and guard["action"] == "abort"
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert all(math.isnan(m["loss/policy"]) and m["optim/skipped"] == 1.0 for m in metrics)
    bundle = checkpoint.latest_complete(result.run_dir / "checkpoints")
    assert bundle.name == "step-000002"
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["guard"]["rule"] == "nonfinite" and meta["guards"]["nonfinite_streak"] == 2
    assert bundle_params_hash(result.run_dir) == initial_params_hash()  # no NaN reached the weights
    assert not (result.run_dir / "result.json").exists()


def test_entropy_collapse_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(update, "trained_logprobs", lambda logits, targets, temperature, fast=None: (
        update.picked_logprobs(logits, targets, temperature), torch.zeros(logits.shape[:1])))
    result = train.run(make_contract(tmp_path / "run"), progress=False)
    assert result.stopped is not None and result.stopped.rule == "entropy_collapse"
    assert result.steps == 1
    assert json.loads((result.run_dir / "guard.json").read_text())["rule"] == "entropy_collapse"
    assert checkpoint.latest_complete(result.run_dir / "checkpoints").name == "step-000001"



# --- what the loop records and refuses ---------------------------------------------------------


def test_rollouts_record_the_policy_revision_and_the_lag_is_measured(straight):
    _, result = straight
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    for e in episodes:
        step = int(e.group_id.split("/")[0][len("step"):])
        assert {s.policy_revision for s in e.sessions} == {step - 1}  # one update per step
        assert e.split == "train"
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert [m["rollout/policy_lag"] for m in metrics] == [0.0] * STEPS


def test_policy_lag_by_hand():
    sequences = [TrainSequence("e", f"s{k}", "g", None, 0.0, 1.0, policy_revision=r)
                 for k, r in enumerate((5, 3, None))]
    assert train.policy_lag(sequences, 5) == {"max": 2.0, "mean": 1.0}
    assert train.policy_lag([], 5) == {"max": 0.0, "mean": 0.0}


def test_evaluation_is_hint_free_and_records_its_splits(tmp_path):
    run_dir = tmp_path / "run"
    contract = make_contract(run_dir, "env.id=agent_rl/Arithmetic-v0", "env.kwargs={hints: true}",
                             "env.iid_fraction=0.25", "eval.split=[holdout_iid, holdout]",
                             "eval.n=3", "optim.max_steps=1", "rollout.tasks_per_step=1",
                             "checkpoint.every=0")
    result = train.run(contract, progress=False)
    before = read_jsonl(run_dir / "evals" / "before.jsonl")
    assert [r["split"] for r in before] == ["holdout_iid"] * 3 + ["holdout"] * 3
    assert not any(r["hint_shown"] for r in before)  # env.kwargs.hints is for training only
    trained = list(RolloutStore(run_dir / "rollouts.jsonl").read())
    assert trained and all(e.hint and e.hint["shown"] for e in trained)
    assert {e.split for e in trained} == {"train"}
    assert set(result.before["splits"]) == set(result.comparison["splits"]) == {"holdout_iid",
                                                                                "holdout"}
    assert result.comparison["n"] == 6 and result.comparison["splits"]["holdout"]["n"] == 3


def test_annealed_hints_show_on_the_scheduled_share_and_never_in_evaluation(tmp_path):
    """hints linear 1.0 -> 0.0 over 2 steps, 2 tasks x 2 samples: step 1 shows all 4 hints,
    step 2 exactly round(0.5 * 4) = 2; every shown hint says why; evaluation shows none (the
    holdout guard, at step 1, has no unhinted reward to compare and records nothing)."""
    run_dir = tmp_path / "run"
    contract = make_contract(run_dir, "env.id=agent_rl/Arithmetic-v0", "eval.n=3",
                             "eval.every=1", "optim.max_steps=2", "rollout.tasks_per_step=2",
                             "rollout.group_size=2", "rollout.max_response_tokens=4",
                             "checkpoint.every=0", "hints.schedule=linear", "hints.start=1.0",
                             "hints.end=0.0", "hints.over_steps=2")
    train.run(contract, progress=False)
    episodes = list(RolloutStore(run_dir / "rollouts.jsonl").read())
    by_step = defaultdict(list)
    for e in episodes:
        by_step[int(e.group_id.split("/")[0].removeprefix("step"))].append(e)
    assert {s: sum(e.hint is not None for e in es) for s, es in by_step.items()} == {1: 4, 2: 2}
    for step, share in ((1, 1.0), (2, 0.5)):
        for e in by_step[step]:
            if e.hint is not None:
                assert e.hint["provenance"] == "solution-derived" and e.hint["shown"]
                assert e.hint["schedule"] == {"schedule": "linear", "step": step, "share": share}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["hint/share"] for m in metrics] == [1.0, 0.5]
    assert [m["hint/used_frac"] for m in metrics] == [1.0, 0.5]
    assert metrics[0]["reward/unhinted_mean"] is None and metrics[1]["reward/unhinted_mean"] is not None
    assert "holdout/reward" in metrics[0]
    for tag in ("before", "step1", "after"):
        assert not any(r["hint_shown"] for r in read_jsonl(run_dir / "evals" / f"{tag}.jsonl"))


def test_max_prompt_tokens_is_enforced(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="longer than rollout.max_prompt_tokens"):
        result = train.run(make_contract(run_dir, "rollout.max_prompt_tokens=8", "optim.max_steps=1",
                                         "eval.n=2", "checkpoint.every=0"), progress=False)
    episodes = list(RolloutStore(run_dir / "rollouts.jsonl").read())
    assert len(episodes) == TASKS * GROUP
    assert {e.reward.audit["truncated_by"] for e in episodes} == {"max_prompt_tokens"}
    assert all(e.reward.audit["prompt_tokens"] > 8 for e in episodes)  # how long it was
    assert {e.reward.outcome for e in episodes} == {Outcome.truncated}
    assert {r["outcome"] for r in read_jsonl(run_dir / "evals" / "before.jsonl")} == {"truncated"}
    (m,) = read_jsonl(run_dir / "metrics.jsonl")
    assert m["rollout/tokens_generated"] == 0 and m["train/sequences"] == 0
    # a run of one step, that step blocked by the limit: it trained nothing, and says so
    assert isinstance(result.stopped, NothingTrained) and result.steps == 1


def test_a_run_whose_every_prompt_is_over_the_limit_stops_naming_the_key(tmp_path, recwarn):
    """Every first prompt longer than rollout.max_prompt_tokens: each step is recorded empty
    (and warned), the first step names the prompts (task, tokens, the limit), and the guard
    nothing_trained stops the run at its second step, with a checkpoint and guard.json; every
    episode is in the store."""
    run_dir = tmp_path / "run"
    result = train.run(make_contract(run_dir, "rollout.max_prompt_tokens=8", "optim.max_steps=4",
                                     "eval.every=0", "eval.n=2"), progress=False)
    trip = result.stopped
    assert isinstance(trip, NothingTrained) and trip.rule == "nothing_trained"
    assert trip.action == "abort" and result.steps == 2 and result.after is None
    episodes = list(RolloutStore(run_dir / "rollouts.jsonl").read())
    longest = max(e.reward.audit["prompt_tokens"] for e in episodes)
    assert trip.message == (f"no token trained in steps 1-2: {2 * TASKS * GROUP} episodes ended "
                            f"before generating a token, their first prompt (up to {longest} "
                            "tokens) longer than rollout.max_prompt_tokens: raise "
                            "rollout.max_prompt_tokens (the contract changes: start a new run_dir)")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [(m["train/tokens"], m["train/empty_step"], m["train/empty_reason"]) for m in metrics] \
        == [(0, 1, "prompt_too_long")] * 2
    assert [m["total/prompt_too_long"] for m in metrics] == [TASKS * GROUP, 2 * TASKS * GROUP]
    assert [m["total/zero_contrast_steps"] for m in metrics] == [0, 0]  # the limit, not contrast
    assert json.loads((run_dir / "guard.json").read_text())["rule"] == "nothing_trained"
    assert checkpoint.latest_complete(run_dir / "checkpoints").name == "step-000002"
    assert len(episodes) == 2 * TASKS * GROUP
    said = [str(w.message) for w in recwarn]
    (first,) = [w for w in said if "their first prompt longer" in w]  # once, at step 1
    tasks = {e.task_id: e.reward.audit["prompt_tokens"] for e in episodes[:TASKS * GROUP]}
    assert first.startswith(f"step 1: {TASKS * GROUP} of {TASKS * GROUP} episodes generated "
                            "nothing, their first prompt longer than rollout.max_prompt_tokens (8): ")
    assert all(f"task {t} ({n} tokens)" in first for t, n in tasks.items())
    per_step = [max(e.reward.audit["prompt_tokens"] for e in episodes[k:k + TASKS * GROUP])
                for k in (0, TASKS * GROUP)]
    assert [w for w in said if "trained on no token" in w] == [
        f"step {s} trained on no token: {TASKS * GROUP} episodes ended before generating a token, "
        f"their first prompt (up to {n} tokens) longer than rollout.max_prompt_tokens (8): raise "
        "rollout.max_prompt_tokens" for s, n in zip((1, 2), per_step, strict=True)]


def test_every_reply_masked_overlong_stops_naming_the_response_limit(tmp_path):
    """truncation: mask on a policy whose every reply hits max_response_tokens: no token is
    trained (the replies serve the baseline only), and the run says which keys to change."""
    result = train.run(make_contract(tmp_path / "run", "rollout.truncation=mask",
                                     "rollout.max_response_tokens=4", "optim.max_steps=3",
                                     "eval.every=0", "eval.n=2"), progress=False)
    assert isinstance(result.stopped, NothingTrained) and result.steps == 2
    assert result.stopped.message == (
        f"no token trained in steps 1-2: {2 * TASKS * GROUP} episodes hit "
        "rollout.max_response_tokens under rollout.truncation: mask, which keeps them out of the "
        "loss: raise rollout.max_response_tokens, or set rollout.truncation to keep or penalize "
        "(the contract changes: start a new run_dir)")
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert [m["train/empty_reason"] for m in metrics] == ["overlong_masked"] * 2
    assert all(m["rollout/overlong_masked"] == TASKS * GROUP for m in metrics)


def test_a_baseline_of_zero_steps_is_no_run_that_trained_nothing(tmp_path):
    """optim.max_steps: 0 trains nothing by design (a canary baseline): it ends as usual, even
    under a prompt limit every prompt exceeds."""
    result = train.run(make_contract(tmp_path / "run", "optim.max_steps=0",
                                     "rollout.max_prompt_tokens=8", "eval.n=2"), progress=False)
    assert result.stopped is None and result.steps == 0 and result.after is not None
    assert (result.run_dir / "result.json").exists()


@pytest.mark.parametrize("setting", [["hints.schedule=constant", "hints.start=1.0"],
                                     ["env.kwargs={hints: true}"]])
def test_hints_on_an_env_without_hints_are_refused_before_anything_is_written(tmp_path, setting):
    """tests/Digits-v0's tasks carry no hint: a run asking for hints would log a share it
    never showed."""
    key = "hints" if setting[0].startswith("hints") else "env.kwargs.hints"
    with pytest.raises(ValueError, match=rf"^{key}: tests/Digits-v0 gives no task hints"):
        train.run(make_contract(tmp_path / "run", *setting), progress=False)
    assert not (tmp_path / "run").exists()


def test_cli_exits_4_when_nothing_was_trained_and_2_on_hints_without_hints(tmp_path, capsys):
    """The distinct exit code of a run whose limits let nothing train (3 stays a guard's)."""
    from agent_rl import cli

    tiny = str(REPO / "examples" / "tiny.yaml")
    code = cli.main(["train", tiny, "--set", f"run_dir={tmp_path}/starved", "--set",
                     "rollout.max_prompt_tokens=8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 4
    assert "stopped by guard nothing_trained (abort) at step 2: no token trained in steps 1-2" in err
    assert "raise rollout.max_prompt_tokens" in err
    # the warnings read as the CLI's own lines, without Python's source line
    assert "agent-rl train: warning: step 1: 4 of 4 episodes generated nothing" in err
    assert "RuntimeWarning" not in err and "note_untrained(" not in err
    code = cli.main(["train", tiny, "--set", f"run_dir={tmp_path}/hints", "--set",
                     "env.id=agent_rl/Records-v0", "--set", "hints.schedule=constant"])
    assert code == 2 and "error: hints: agent_rl/Records-v0 gives no task hints" in capsys.readouterr().err
    assert not (tmp_path / "hints").exists()


@pytest.mark.slow
def test_tiny_records_example_trains_on_real_tokens(tmp_path):
    """examples/tiny_records.yaml (the README's SFT-then-RL and canary sections): its prompts
    fit, so every step trains tokens (a random model's replies, at advantage 0: zero contrast)."""
    contract = ExperimentContract.from_yaml(REPO / "examples" / "tiny_records.yaml",
                                            [f"run_dir={tmp_path / 'run'}", "optim.max_steps=1"])
    result = train.run(contract, progress=False)
    (m,) = read_jsonl(result.run_dir / "metrics.jsonl")
    assert result.stopped is None
    assert m["train/tokens"] > 0 and m["rollout/prompt_too_long"] == 0


def test_evaluation_tasks_that_overlap_training_are_refused_before_anything_is_written(tmp_path):
    contract = make_contract(tmp_path / "run", "env.split=holdout_structure", "eval.split=holdout")
    with pytest.raises(ValueError, match="eval.split 'holdout' overlaps env.split 'holdout_structure'"):
        train.run(contract, progress=False)
    assert not (tmp_path / "run").exists()


# --- devices, numerics and asynchronous rollouts -----------------------------------------------


def test_the_rollout_trainer_mismatch_is_measured_every_step(straight):
    """Synchronous fp32 rollouts: the trainer's log-probs before its update are the rollout's,
    up to float noise (both come from logprobs.token_logprobs on the same weights)."""
    _, result = straight
    for m in read_jsonl(result.run_dir / "metrics.jsonl"):
        assert 0.0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"] < 1e-4
        assert m["rollout/dropped_stale"] == 0
        assert m["time/data_wait_s"] == pytest.approx(m["rollout/seconds"], rel=0.2, abs=0.05)


def test_scale_metrics_of_one_process(straight):
    """One synchronous process on the CPU: the step's model FLOPs are 6 per parameter per
    trained token (all trained; tied head), MFU is not reported (no peak on a CPU without
    run.peak_flops), no batch waited, no collective ran, no rank straggled; ``batch/ids``
    names exactly the kept episodes of rollouts.jsonl and their sessions that generated."""
    _, result = straight
    per_token = flops_per_token(tiny_model(0)[0])
    episodes = {e.episode_id: e for e in RolloutStore(result.run_dir / "rollouts.jsonl").read()}
    for m in read_jsonl(result.run_dir / "metrics.jsonl"):
        assert m["perf/flops"] == per_token * m["train/tokens"] > 0
        assert m["perf/mfu"] is None and m["perf/mfu_update"] is None
        assert m["rollout/queue_age_s"] == 0.0 and m["time/collective_s"] == 0.0
        assert m["time/straggler_s"] == 0.0
        assert 0.0 < m["time/data_wait_s"] < m["step/seconds"]
        ids = m["batch/ids"]
        kept = {e.episode_id for e in episodes.values()
                if e.group_id.startswith(f"step{m['step']}/") and e.filter["kept"]}
        assert set(ids) == kept
        for episode_id, sessions in ids.items():
            generated = [s.session_id for s in episodes[episode_id].sessions
                         if any(t.token_ids for t in s.turns)]
            assert sessions == sorted(generated)
        assert sum(map(len, ids.values())) == m["train/sequences"] - m["rollout/dropped_stale"]


def test_scale_metrics_of_an_asynchronous_run(tmp_path):
    """max_policy_lag 1 with run.peak_flops: MFU is the logged FLOPs over the step's (and the
    update's) seconds and that peak; each batch either waited for the trainer (queue age) or
    the trainer waited for it (data wait), never both, and no batch waited longer than the
    step before it took."""
    peak = 1e11
    contract = make_contract(tmp_path / "run", "rollout.max_policy_lag=1", "eval.every=0",
                             "optim.max_steps=3", f"run.peak_flops={peak}")
    metrics = read_jsonl(train.run(contract, progress=False).run_dir / "metrics.jsonl")
    assert len(metrics) == 3
    for before, m in zip([None, *metrics[:-1]], metrics, strict=True):
        assert m["perf/mfu"] == pytest.approx(m["perf/flops"] / m["step/seconds"] / peak, rel=1e-3)
        assert m["perf/mfu_update"] == pytest.approx(m["perf/flops"] / m["train/seconds"] / peak)
        assert 0.0 < m["perf/mfu"] < m["perf/mfu_update"] < 1.0
        assert m["rollout/queue_age_s"] >= 0.0 and m["time/data_wait_s"] >= 0.0
        assert min(m["rollout/queue_age_s"], m["time/data_wait_s"]) < 0.05
        if before is not None:
            assert m["rollout/queue_age_s"] < before["step/seconds"] + 0.5


def test_asynchronous_rollouts_train_within_the_lag_bound(tmp_path):
    """max_policy_lag 1: step n+1's batch is generated on a weight copy while step n trains;
    the copy gets the weights after every update, so every trained session is 0 or 1 update
    old, never more, and the lag is measured from the revisions the sessions recorded."""
    contract = make_contract(tmp_path / "run", "rollout.max_policy_lag=1", "eval.every=0")
    result = train.run(contract, progress=False)
    assert result.steps == STEPS
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert all(m["rollout/policy_lag"] <= 1 for m in metrics)
    assert max(m["rollout/policy_lag"] for m in metrics) == 1  # it did run ahead
    assert all(m["rollout/dropped_stale"] == 0 for m in metrics)
    episodes = list(RolloutStore(result.run_dir / "rollouts.jsonl").read())
    steps = sorted({int(e.group_id.split("/")[0][len("step"):]) for e in episodes})
    assert steps == list(range(1, STEPS + 1))  # the store holds each trained step once, in order
    for e in episodes:
        step = int(e.group_id.split("/")[0][len("step"):])
        assert {s.policy_revision for s in e.sessions} <= {step - 2, step - 1}
    # the sampled log-probs were the copy's: off by the lag, but not by numerics at lag 0
    assert metrics[0]["rollout/logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_bfloat16_autocast_with_a_correction(tmp_path, correction):
    """bf16 autocast over fp32 master weights: the run trains, the parameters stay fp32, and
    the correction reports how many tokens it capped."""
    contract = make_contract(tmp_path / "run", "model.dtype=bfloat16", "eval.every=0",
                             f"rollout.correction={correction}", "rollout.correction_cap=1.5",
                             "optim.max_steps=2")
    result = train.run(contract, progress=False)
    metrics = read_jsonl(result.run_dir / "metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        assert 0.0 <= m["rollout/capped_frac"] <= 1.0
        assert m["rollout/logprob_diff_max"] >= m["rollout/logprob_diff_mean"] >= 0.0
        assert math.isfinite(m["loss/policy"])
    latest = checkpoint.latest_complete(result.run_dir / "checkpoints")
    params = safetensors.torch.load_file(latest / "model.safetensors")
    assert {t.dtype for t in params.values()} == {torch.float32}


def test_device_selection_on_this_machine(tmp_path):
    from agent_rl.run.devices import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            resolve_device("cuda:0")
        # refused before the run directory is written
        with pytest.raises(ValueError, match="sees no GPU"):
            train.run(make_contract(tmp_path / "run", "model.device=cuda"), progress=False)
        assert not (tmp_path / "run").exists()
    with pytest.raises(Exception, match="not a device"):
        make_contract(tmp_path / "run", "model.device=gpu0")


@pytest.mark.slow
def test_deepspeed_backend_trains_like_torch_and_resumes_exactly(straight, tmp_path):
    """backend deepspeed, ZeRO-2 with the optimizer offloaded to the CPU, a world of one set
    up by the trainer itself: the same per-step losses as the torch backend (same seed and
    batches; ZeRO-2's partitioned fp32 optimizer differs by round-off only, agent_rl.run.distributed
    measures 5e-8 relative) and a resume from its DeepSpeed bundle equal to the straight run."""
    _, torch_run = straight
    overrides = ["backend.name=deepspeed", "backend.zero_stage=2", "backend.offload=cpu"]
    ds = train.run(make_contract(tmp_path / "ds", *overrides), progress=False)
    assert ds.losses == pytest.approx(torch_run.losses, rel=1e-4, abs=1e-6)
    latest = checkpoint.latest_complete(ds.run_dir / "checkpoints")
    assert json.loads((latest / "backend.json").read_text())["zero_stage"] == 2

    stopped = make_contract(tmp_path / "resumed", *overrides, "optim.max_steps=2")
    train.run(stopped, progress=False)
    resumed = train.run(make_contract(tmp_path / "resumed", *overrides), resume=True,
                        progress=False)
    assert resumed.losses == ds.losses[2:]  # bit for bit from the step-2 bundle
    assert bundle_params_hash(resumed.run_dir) == bundle_params_hash(ds.run_dir)


# --- several ranks: torchrun launching train.run, against the one-process run -----------------

WORKER = Path(__file__).with_name("_train_worker.py")
DS = ["backend.name=deepspeed"]


def launch(run_dir: Path, *overrides: str, nproc: int = 2, resume: bool = False) -> Path:
    """`train.run` under `python -m torch.distributed.run` with `nproc` ranks (gloo on CPU,
    one thread each); returns the run directory. Fails with the ranks' output."""
    from agent_rl.run.distributed import free_port

    contract = make_contract(run_dir, *overrides)
    spec = run_dir.with_suffix(".json")
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(contract.model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(WORKER), str(spec), *(["resume"] if resume else [])]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(digits_env, tmp_path_factory):
    """{ZeRO stage: run directory} of STEPS steps on two ranks, made when first asked for."""
    root, runs = tmp_path_factory.mktemp("two-ranks"), {}

    def get(stage: int) -> Path:
        if stage not in runs:
            runs[stage] = launch(root / f"zero{stage}", *DS, f"backend.zero_stage={stage}")
        return runs[stage]

    return get


def eval_records(run_dir: Path) -> dict[str, list[tuple]]:
    return {path.stem: [(r["episode_id"], r["split"], r["reward"], r["seed"]) for r in read_jsonl(path)]
            for path in sorted((run_dir / "evals").glob("*.jsonl"))}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_sample_and_train_what_one_process_does(straight, two_ranks, stage):
    """Two ranks (ZeRO-2; ZeRO-3, whose rollouts and evaluation run on a full copy refreshed
    after every update) against the torch backend in one process, same contract otherwise.
    Each rank rolls out one of the step's two tasks, seeded by its global job index, so the
    episodes are the same ones, with the same rewards; the ranks' micro-batch losses are
    scaled for the global token count, so the gradient is the one-process gradient: grad
    norms and the step's KL measured 3e-6 and 5e-7 relative apart (summation order), final
    weights within the distributed module's two-rank tolerance. Evaluation, sharded, gives
    the same records; rank 0 alone wrote the run directory."""
    _, one = straight
    two = two_ranks(stage)
    ours, theirs = read_jsonl(two / "metrics.jsonl"), read_jsonl(one.run_dir / "metrics.jsonl")
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, theirs, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["rollout/tokens_generated"] == b["rollout/tokens_generated"]
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
        assert a["kl/update"] == pytest.approx(b["kl/update"], rel=1e-4)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)
        assert a["rollout/logprob_diff_max"] < 1e-5  # rollouts sampled the trained weights
    stored = [(e.episode_id, e.reward.total) for e in RolloutStore(two / "rollouts.jsonl").read()]
    assert stored == [(e.episode_id, e.reward.total)
                      for e in RolloutStore(one.run_dir / "rollouts.jsonl").read()]
    assert eval_records(two) == eval_records(one.run_dir)
    ours_w = safetensors.torch.load_file(checkpoint.latest_complete(two / "checkpoints") / "model.safetensors")
    theirs_w = safetensors.torch.load_file(
        checkpoint.latest_complete(one.run_dir / "checkpoints") / "model.safetensors")
    assert ours_w.keys() == theirs_w.keys()
    assert max(float((ours_w[k] - theirs_w[k]).abs().max()) for k in ours_w) < 1e-4
    backend = json.loads((checkpoint.latest_complete(two / "checkpoints") / "backend.json").read_text())
    assert backend == {"backend": "deepspeed", "world_size": 2, "zero_stage": stage}
    assert not [p for p in two.rglob("*") if ".tmp" in p.name]  # no rank left a staging folder


@pytest.mark.slow
def test_two_ranks_report_collective_and_straggler_time(two_ranks):
    """Two ZeRO-2 ranks: each step spent time in collectives (the batch gathered, the metrics
    summed, kl/update shared), less than the whole step, and the ranks' own work differed by
    less than the step took; the FLOPs count the whole batch, as one process counts them."""
    per_token = flops_per_token(tiny_model(0)[0])
    for m in read_jsonl(two_ranks(2) / "metrics.jsonl"):
        assert 0.0 < m["time/collective_s"] < m["step/seconds"]
        assert 0.0 <= m["time/straggler_s"] < m["step/seconds"]
        assert m["time/straggler_s"] > 0.0  # two processes never work equally long
        assert m["perf/flops"] == per_token * m["train/tokens"]
        assert m["rollout/queue_age_s"] == 0.0


@pytest.mark.slow
def test_two_ranks_resume_exactly(two_ranks, tmp_path):
    """Stopped after step 2 (its bundle holds both ranks' ZeRO-2 optimizer partitions),
    relaunched with resume: steps 3 and 4 and the final weights equal the straight two-rank
    run's, bit for bit."""
    straight_two = two_ranks(2)
    launch(tmp_path / "run", *DS, "backend.zero_stage=2", "optim.max_steps=2")
    resumed = launch(tmp_path / "run", *DS, "backend.zero_stage=2", resume=True)
    keys = ("loss/policy", "optim/grad_norm", "kl/update", "reward/mean")
    assert ([{k: m[k] for k in keys} for m in read_jsonl(resumed / "metrics.jsonl")]
            == [{k: m[k] for k in keys} for m in read_jsonl(straight_two / "metrics.jsonl")])
    assert bundle_params_hash(resumed) == bundle_params_hash(straight_two)


def sampled(run_dir: Path) -> list[tuple]:
    """Every stored episode: its id, task, reward and the token ids its turns sampled."""
    return [(e.episode_id, e.task_id, e.reward.total,
             [t.token_ids for s in e.sessions for t in s.turns if t.token_ids])
            for e in RolloutStore(run_dir / "rollouts.jsonl").read()]


@pytest.mark.slow
def test_a_run_resumes_on_another_number_of_ranks(straight, two_ranks, tmp_path):
    """ZeRO-2, checkpointed after step 2 on two ranks and resumed in one process (2 -> 1),
    and the other way (1 -> 2): steps 3 and 4 continue the run that wrote the bundle. The
    same tasks and the same sampled tokens and rewards as the uninterrupted run (the task
    order and every job's sampling stream are functions of the seed, the step and the job's
    global index; the weights and Adam moments are loaded exactly), so the whole rollout store
    equals it; losses and grad norms computed by the other number of ranks within summation
    round-off (abs 1e-6, rel 1e-5, as two ranks against one), final weights within 1e-4.
    Against the uninterrupted run at the new size the same holds here, but only through it:
    its weights differ from the old size's by round-off from step 1 on. Nothing drew from the
    process-global generators, so which rank restores whose states changes nothing."""
    zero2 = [*DS, "backend.zero_stage=2"]
    keys = ("reward/mean", "rollout/tokens_generated", "groups/dropped", "train/tokens")
    down = launch(tmp_path / "down", *zero2, "optim.max_steps=2")
    train.run(make_contract(down, *zero2), resume=True, progress=False)
    up = tmp_path / "up"
    train.run(make_contract(up, *zero2, "optim.max_steps=2"), progress=False)
    launch(up, *zero2, resume=True)
    for resumed, full in ((down, two_ranks(2)), (up, straight[1].run_dir)):
        ours, theirs = read_jsonl(resumed / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")
        assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
        for a, b in zip(ours[2:], theirs[2:], strict=True):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
            assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)
            assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
        assert sampled(resumed) == sampled(full)
        ours_w, theirs_w = (safetensors.torch.load_file(
            checkpoint.latest_complete(d / "checkpoints") / "model.safetensors") for d in (resumed, full))
        assert max(float((ours_w[k] - theirs_w[k]).abs().max()) for k in ours_w) < 1e-4
        assert not [p for p in resumed.rglob("*") if ".tmp" in p.name]
    assert json.loads((checkpoint.latest_complete(down / "checkpoints") / "backend.json")
                      .read_text())["world_size"] == 1
    # the global generators carry nothing: every rank's, saved after step 4, is the seeded one
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # optim.seed
        seeded = torch.get_rng_state()
    for run_dir in (down, up):
        states = torch.load(checkpoint.latest_complete(run_dir / "checkpoints") / "rng.pt",
                            weights_only=True)
        assert all(torch.equal(r["torch_cpu"], seeded) for r in states.get("ranks", [states]))


@pytest.mark.slow
def test_two_ranks_asynchronous_under_zero3(tmp_path):
    """max_policy_lag 1 on two ZeRO-3 ranks: each rank's rollout copy takes the all-gathered
    weights after every update, so every trained session is at most one update old (none
    dropped) and the lag did reach 1."""
    run = launch(tmp_path / "run", *DS, "backend.zero_stage=3", "rollout.max_policy_lag=1",
                 "eval.every=0")
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert max(m["rollout/policy_lag"] for m in metrics) == 1
    assert all(m["rollout/dropped_stale"] == 0 for m in metrics)
    assert metrics[0]["rollout/logprob_diff_max"] < 1e-5


def test_several_ranks_are_checked_before_anything_is_written(tmp_path, monkeypatch):
    """What a launch with WORLD_SIZE > 1 needs, refused with the fix before the run
    directory is touched (and before any process group is joined)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = {(): "several ranks train through backend.name: deepspeed",
             (*DS, "rollout.tasks_per_step=3"): "does not split over WORLD_SIZE=2 ranks"}
    for overrides, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train.run(make_contract(tmp_path / "run", *overrides), progress=False)
        assert not (tmp_path / "run").exists()
    # vLLM under ZeRO-3 on several ranks: pushed layer by layer, not refused
    check_world(make_contract(tmp_path / "run", *DS, "rollout.backend=vllm",
                              "backend.zero_stage=3"), 2)


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_activation_checkpointing_changes_memory_not_numbers(tmp_path, adapter):
    """optim.activation_checkpointing recomputes the layers in backward: every step's loss and
    gradient norm, and the trained weights, are those of the run that keeps activations."""
    runs = {}
    for flag in ("false", "true"):
        run_dir = tmp_path / flag
        train.run(make_contract(run_dir, f"optim.activation_checkpointing={flag}",
                                f"model.adapter={adapter}", "model.lora_rank=4",
                                "optim.max_steps=2", "eval.every=0", "eval.n=2"), progress=False)
        runs[flag] = (read_jsonl(run_dir / "metrics.jsonl"), bundle_params_hash(run_dir))
    (off, off_weights), (on, on_weights) = runs["false"], runs["true"]
    assert [m["loss/policy"] for m in on] == [m["loss/policy"] for m in off]
    assert [m["optim/grad_norm"] for m in on] == [m["optim/grad_norm"] for m in off]
    assert all(m["optim/grad_norm"] > 0 for m in off)  # a real update was compared
    assert on_weights == off_weights
    # the share of decoder-layer work recomputed: all of it, none (the tiny rows fit in 512)
    assert [m["train/recomputed_frac"] for m in on] == [1.0, 1.0]
    assert [m["train/recomputed_frac"] for m in off] == [0.0, 0.0]


def test_kl_update_measures_the_update_not_the_rollout_mismatch(tmp_path):
    """kl/update compares the trainer's log-probs after the update with its own before it: a
    step that moves no weight (lr 0) reads 0.0 even when the rollout's log-probs are off by
    0.5 nats on every trained token (what rollout/logprob_diff_* reports)."""
    import dataclasses

    from agent_rl.policies.hf import HFPolicy
    from agent_rl.run.distributed import TorchBackend
    from agent_rl.training.rollout import RolloutSettings, rollout_batch
    from envs.runner import Sampling

    contract = make_contract(tmp_path / "r")
    model, tokenizer = tiny_model(0)
    batch = rollout_batch(HFPolicy(model, tokenizer), tokenizer,
                          envs.make(toy_env.ENV_ID).unwrapped.task_pool(2, seed=0),
                          RolloutSettings(toy_env.ENV_ID, group_size=4,
                                          sampling=Sampling(max_new_tokens=6, seed=0),
                                          dynamic_sampling=False, truncation="keep"), seed=0)
    off = [dataclasses.replace(q, advantage=1.0, rendered=dataclasses.replace(
        q.rendered, old_logprobs=q.rendered.old_logprobs - 0.5 * q.rendered.loss_mask))
        for q in batch.sequences]
    params = [p for p in model.parameters() if p.requires_grad]
    backend = TorchBackend(model, torch.optim.SGD(params, lr=0.0), grad_clip=1.0)
    m = update.policy_update(backend, None, off, contract, pad_id=0, prox={})
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert m["kl/update"] == pytest.approx(0.0, abs=1e-9)


def test_update_kl_is_k3_of_old_policy_samples(tmp_path):
    """kl/update estimates KL(old || new) on the old policy's samples: k3(new - old) =
    r - 1 - ln r. With the "old" log-probs 5 nats above the model's own on every token
    (a token whose probability fell by e^5), r = e^-5: 0.006738 - 1 + 5 = 4.006738 (the
    estimator for the new policy's samples, exp(old - new) - 1 - (old - new), would read
    e^5 - 6 = 142.41)."""
    from agent_rl.policies.hf import HFPolicy
    from agent_rl.training.rollout import RolloutSettings, rollout_batch
    from envs.runner import Sampling

    model, tokenizer = tiny_model(0)
    batch = rollout_batch(HFPolicy(model, tokenizer), tokenizer,
                          envs.make(toy_env.ENV_ID).unwrapped.task_pool(2, seed=0),
                          RolloutSettings(toy_env.ENV_ID, group_size=2,
                                          sampling=Sampling(max_new_tokens=6, seed=0),
                                          dynamic_sampling=False, truncation="keep"), seed=0)
    rendered = [q.rendered for q in batch.sequences]
    bins = update.micro_batches(update.pack(update.share_prefixes(rendered)), 512)[0]
    kl = functools.partial(update.update_kl, model, bins, rendered, 0, 1.0)
    tensors = shared.device_batch(bins, rendered, 0, torch.device("cpu"))
    with torch.no_grad():
        own = update.picked_logprobs(update.trained_token_logits(model, tensors), tensors["target"], 1.0)
    assert kl(own) == pytest.approx(0.0, abs=1e-6)
    assert kl(own + 5.0) == pytest.approx(math.exp(-5) - 1 + 5, rel=1e-4)
    assert kl(own - 5.0) == pytest.approx(math.exp(5) - 1 - 5, rel=1e-4)  # probability rose


def test_kl_micro_batch_picks_rank_zeros_densest_micro_batch():
    """update.kl_micro_batch: the micro-batch of rank 0's share with the most trained tokens per
    token computed, padding included (hand-computed: 2/10, 6/12, 5/8, and 2/8 for two bins of
    4 and 3 tokens padded to 2 x 4), only rank 0's (0, k, 2k, ... of k ranks), the earliest of
    a tie."""
    from agent_rl.policies.render import Rendered, SharedRow

    def rendered(trained):
        mask = torch.zeros(12, dtype=torch.bool)
        mask[:trained] = True
        return Rendered(input_ids=torch.zeros(12, dtype=torch.long), loss_mask=mask,
                        old_logprobs=torch.zeros(12), spans=[], session_id="s", episode_id="e")

    def row(length, *members):
        return SharedRow(input_ids=torch.zeros(length, dtype=torch.long),
                         position_ids=torch.arange(length), seq_index=torch.zeros(length, dtype=torch.long),
                         prefix=0, members=list(members), starts=[0] * len(members))

    sessions = [rendered(t) for t in (2, 6, 5, 1, 1)]
    micro = [[[row(10, 0)]], [[row(12, 1)]], [[row(8, 2)]], [[row(4, 3)], [row(3, 4)]]]
    assert update.kl_micro_batch(micro, sessions, 1) == 2  # 5/8 beats 6/12 and 2/8
    assert update.kl_micro_batch(micro, sessions, 2) == 2  # rank 0's: 0 and 2
    assert update.kl_micro_batch(micro, sessions, 3) == 3  # rank 0's: 0 and 3; 2/8 beats 2/10
    assert update.kl_micro_batch(micro[:2] + [[[row(24, 1)]]], sessions, 1) == 1  # 6/12 beats 6/24
    assert update.kl_micro_batch([micro[1], micro[1]], sessions, 1) == 0  # a tie: the earliest

    # render.padded_tokens, which both this and render.micro_batches count with: rows padded to
    # the longest bin; bins of 4, 3 and 5 tokens in micro-batches of at most 10: 2 x 4 = 8
    # fits, 3 x 5 = 15 does not
    from agent_rl.policies.render import micro_batches, padded_tokens

    assert padded_tokens(micro[3]) == 8
    bins = [[row(4, 0)], [row(3, 1)], [row(5, 2)]]
    assert [[bin_[0].members for bin_ in m] for m in micro_batches(bins, 10)] == [[[0], [1]], [[2]]]


def test_recompute_layers_keeps_the_activations_of_micro_batch_tokens_and_the_gradients():
    """update.recompute_layers: for T tokens over a budget of B, ceil(L (1 - B / T)) of the L
    decoder layers recompute in backward (hand-computed for the tiny model's L = 2), all of
    them under optim.activation_checkpointing; the activations kept for backward shrink and
    the gradients stay bit for bit the same."""
    from agent_rl.policies.models import tiny_model

    model, _ = tiny_model(seed=0)
    model.train()
    layers = model.model.layers

    def batch(rows, cols):
        return {"input_ids": torch.randint(3, 60, (rows, cols), generator=torch.Generator().manual_seed(1))}

    assert update.recompute_layers(model, batch(1, 10), 10) == 0  # within the budget
    assert update.recompute_layers(model, batch(1, 15), 10) == 1  # ceil(2 * (1 - 10/15)) = ceil(0.67)
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert update.recompute_layers(model, batch(2, 20), 10) == 2  # ceil(2 * 0.75); padding counts
    assert update.recompute_layers(model, batch(1, 4), 10, every=True) == 2

    ids = batch(1, 15)["input_ids"]
    kept, grads = {}, {}
    for budget in (100, 10):  # no layer recomputed, then one
        update.recompute_layers(model, batch(1, 15), budget)
        model.zero_grad()
        kept[budget] = 0

        def keep(t, budget=budget):
            kept[budget] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(input_ids=ids, use_cache=False).logits.logsumexp(-1).sum().backward()
        grads[budget] = [p.grad.clone() for p in model.parameters()]
    assert kept[10] < 0.8 * kept[100]
    assert all(torch.equal(a, b) for a, b in zip(grads[10], grads[100], strict=True))


def test_recompute_layers_under_bf16_allows_the_tokens_that_keep_as_much_as_float32():
    """Under bf16 autocast the budget is micro_tokens / HALF_ACTIVATIONS tokens (10 / 0.72 =
    13.9: 13 tokens recompute no layer of two where float32 recomputes one, 20 tokens
    ceil(2 (1 - 13.9 / 20)) = 1 where float32 recomputes 1 too, 40 tokens ceil(1.31) = 2). And
    the constant holds on the tiny model: what a token keeps for backward under bf16 autocast
    (the trainer's own contexts, saved-tensor bytes, weights and their casts left out) is at
    most HALF_ACTIVATIONS of what it keeps in float32."""
    model, _ = tiny_model(seed=0)
    model.train()

    def batch(cols):
        return {"input_ids": torch.randint(3, 60, (1, cols), generator=torch.Generator().manual_seed(1))}

    assert update.recompute_layers(model, batch(13), 10) == 1
    assert update.recompute_layers(model, batch(13), 10, dtype="bfloat16") == 0
    assert update.recompute_layers(model, batch(20), 10, dtype="bfloat16") == 1
    assert update.recompute_layers(model, batch(40), 10, dtype="bfloat16") == 2

    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))

    def kept_bytes(dtype, tokens):
        update.recompute_layers(model, batch(tokens), tokens)  # nothing recomputed
        storages = {}

        def keep(t):
            if not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = batch(tokens)["input_ids"]
        with accel_casts.step_cast_cache(backend, getattr(torch, dtype)), patches.kernel_norms(backend, model), \
                update.autocast(torch.device("cpu"), dtype):
            model.model(input_ids=ids, use_cache=False)  # the weights' casts, made and cached
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                model.model(input_ids=ids, use_cache=False)
        return sum(storages.values())

    per_token = {dtype: (kept_bytes(dtype, 400) - kept_bytes(dtype, 200)) / 200
                 for dtype in ("float32", "bfloat16")}
    assert per_token["float32"] > 0
    assert per_token["bfloat16"] <= update.HALF_ACTIVATIONS * per_token["float32"]


def test_half_activations_inside_the_trainers_kernels():
    """Where the trainer's kernels run (a head of 32 on an AVX-512 BF16 CPU), a bf16 token keeps
    at most HALF_ACTIVATIONS_KERNELS of a float32 token's bytes inside the trainer's own
    contexts (saved-tensor bytes through trained_token_logits: the norms' bf16 output kept
    once, attention's bf16 output); elsewhere (the tests' tiny Llama, heads of 16) the share is
    HALF_ACTIVATIONS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent_rl.accel import kernels
    from agent_rl.policies.render import packed_attention_mask

    small, _ = tiny_model(seed=0)
    backend = TorchBackend(small, torch.optim.SGD(small.parameters(), lr=0.0))
    with accel.step(backend, small, torch.bfloat16) as fast:
        assert fast.half_activations is None  # autocast's own share: update.HALF_ACTIVATIONS
    if not kernels.fits_chunks(32):
        pytest.skip("this CPU has no AVX-512 BF16: the kernels' share does not apply")
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).train()
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with accel.step(backend, model, torch.bfloat16) as fast:
        assert fast.half_activations == trainer.HALF_ACTIVATIONS_KERNELS

    def kept_bytes(dtype, tokens):
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 60, (1, tokens), generator=gen)
        batch = {"input_ids": ids, "position_ids": torch.arange(tokens)[None],
                 "attention_mask": packed_attention_mask(torch.zeros(1, tokens, dtype=torch.long), torch.float32),
                 "row": torch.zeros(tokens // 2, dtype=torch.long), "predictor": torch.arange(tokens // 2)}
        update.recompute_layers(model, batch, tokens)  # nothing recomputed
        storages = {}

        def keep(t):
            if not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with accel.step(backend, model, getattr(torch, dtype)) as fast, \
                update.autocast(torch.device("cpu"), dtype):
            update.trained_token_logits(model, batch, fast)  # the weights' casts, made and cached
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                update.trained_token_logits(model, batch, fast)
        return sum(storages.values())

    per_token = {dtype: (kept_bytes(dtype, 512) - kept_bytes(dtype, 256)) / 256
                 for dtype in ("float32", "bfloat16")}
    assert per_token["float32"] > 0
    assert per_token["bfloat16"] <= trainer.HALF_ACTIVATIONS_KERNELS * per_token["float32"]


def graded_sequences(model, tokenizer) -> list:
    """A rolled-out batch of tests/Digits-v0 (4 tasks x 4 samples), advantages +1 / -0.5."""
    from agent_rl.policies.hf import HFPolicy
    from agent_rl.training.rollout import RolloutSettings, rollout_batch
    from envs.runner import Sampling

    batch = rollout_batch(HFPolicy(model, tokenizer), tokenizer,
                          envs.make(toy_env.ENV_ID).unwrapped.task_pool(4, seed=0),
                          RolloutSettings(toy_env.ENV_ID, group_size=4,
                                          sampling=Sampling(max_new_tokens=6, seed=0),
                                          dynamic_sampling=False, truncation="keep"), seed=0)
    return [dataclasses.replace(q, advantage=1.0 if i % 2 else -0.5)
            for i, q in enumerate(batch.sequences)]


class GradCapture(TorchBackend):
    """Keeps the summed gradient of the step (``grads``) before the optimizer takes it."""

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        return super().step()


def step_grads(model, sequences, contract) -> dict[str, torch.Tensor]:
    """policy_update's summed gradient of one step over ``sequences``, in micro-batches of 16
    tokens (several, some rows recomputed in backward)."""
    backend = GradCapture(model, torch.optim.SGD(model.parameters(), lr=0.0))
    update.policy_update(backend, None, sequences, contract, pad_id=0, prox={}, micro_tokens=16)
    return backend.grads


def test_a_tied_lookup_gives_the_same_dense_gradient_without_its_dense_temporary(tmp_path, monkeypatch):
    """accel.sparse_tied_lookup: with the tiny model's tied embeddings, policy_update's summed
    gradient is the same (to float rounding) as with the dense lookup gradient, and it stays
    dense for the clip and the optimizer; the lookup is dense again afterwards, and untied
    weights are left alone."""
    from agent_rl.run.distributed import TorchBackend

    contract = make_contract(tmp_path / "r")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    lookup = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is lookup.weight

    modes = []
    lookup.register_forward_hook(lambda module, args, out: modes.append(module.sparse))

    grads = functools.partial(step_grads, model, sequences, contract)

    sparse = grads()
    assert len(modes) > 2 and all(modes[:-1]) and not lookup.sparse  # the last: update_kl's
    with monkeypatch.context() as m:  # what the lookup did before: a dense [V, H] gradient
        m.setattr(trainer, "sparse_tied_lookup", lambda backend, model: contextlib.nullcontext())
        modes.clear()
        dense = grads()
    assert len(modes) > 2 and not any(modes)
    name = "model.embed_tokens.weight"
    assert sparse[name].layout == torch.strided and sparse[name].abs().sum() > 0
    for key in dense:
        torch.testing.assert_close(sparse[key], dense[key], rtol=1e-5, atol=1e-7)
    seen = []
    with accel_head.sparse_tied_lookup(TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0)), model):
        seen.append(lookup.sparse)
    model.lm_head.weight = torch.nn.Parameter(lookup.weight.detach().clone())  # untied
    with accel_head.sparse_tied_lookup(TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0)), model):
        seen.append(lookup.sparse)
    assert seen == [True, False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_gradient_once_a_step_is_the_same_gradient(tmp_path, monkeypatch, dtype):
    """accel_head.HeadGrads: policy_update's summed gradient with the tied head's weight gradient
    computed once a step equals the per-micro-batch one (float32: to float rounding; bf16: the
    head's products rounded once instead of per micro-batch, every other gradient as before),
    and is dense; a small HEAD_GRAD_BYTES flushes after every micro-batch, the same sum."""
    contract = make_contract(tmp_path / "r", f"model.dtype={dtype}")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    products = []
    flush = accel_head.HeadGrads.flush
    monkeypatch.setattr(accel_head.HeadGrads, "flush",
                        lambda self: products.append(len(self.parts)) or flush(self))

    grads = functools.partial(step_grads, model, sequences, contract)

    once = grads()
    assert len(products) == 1 and products[0] > 1  # all micro-batches' parts in one product
    placed = []
    with monkeypatch.context() as m:  # the next step writes the logits' gradients in place
        m.setattr(accel_head.HeadGrads, "flush", lambda self: placed.append((self.placed, len(self.parts))) or flush(self))
        again = grads()
    assert len(placed) == 1 and placed[0][0] == placed[0][1] > 1  # every part in place
    for key in once:
        assert torch.equal(again[key], once[key]), key
    products.clear()
    monkeypatch.setattr(accel_head, "HEAD_GRAD_BYTES", 1)
    each = grads()
    assert len(products) > 1 and set(products[:-1]) == {1} and products[-1] == 0  # the last: empty
    with monkeypatch.context() as m:
        m.setattr(accel_head.HeadGrads, "of", classmethod(lambda cls, backend, model, dtype: None))
        products.clear()
        plain = grads()
    assert not products
    head = "lm_head.weight" if "lm_head.weight" in plain else "model.embed_tokens.weight"
    assert once[head].layout == torch.strided and once[head].abs().sum() > 0
    for key in plain:
        exact = dtype == "float32" or key != head
        tol = {"rtol": 1e-5, "atol": 1e-7} if exact else {"rtol": 2e-2, "atol": 1e-4}
        torch.testing.assert_close(once[key], plain[key], **tol)
        torch.testing.assert_close(each[key], plain[key], **tol)


def test_linear_casts_give_the_same_gradient_to_the_bit(tmp_path, monkeypatch):
    """accel.linear_casts: under bf16, policy_update's summed gradient with each linear weight
    cast once a step and its gradient added in place is the same to the bit as autocast's
    cast (its float32 gradient cast back, then added); every layer's linears take the new
    path, and afterwards the modules are as they were."""
    contract = make_contract(tmp_path / "r", "model.dtype=bfloat16")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    casts = []
    apply = accel_casts.StepCast.apply
    monkeypatch.setattr(accel_casts.StepCast, "apply", lambda *a: casts.append(a[0]) or apply(*a))

    grads = functools.partial(step_grads, model, sequences, contract)

    once = grads()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    assert {id(w) for w in casts} == {id(m.weight) for m in linears} and len(casts) == len(linears)
    assert all("forward" not in vars(m) and "_step_cast" not in vars(m) for m in linears)
    with monkeypatch.context() as m:
        m.setattr(trainer, "linear_casts", lambda *a: contextlib.nullcontext())
        casts.clear()
        plain = grads()
    assert not casts
    assert once.keys() == plain.keys()
    for key in plain:
        assert torch.equal(once[key], plain[key]), key


def test_the_head_gradient_is_deferred_only_where_nothing_waits_for_it():
    from agent_rl.run.distributed import TorchBackend

    model, _ = tiny_model(0)
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0))
    head = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    assert head is not None and head.cast.dtype == torch.bfloat16
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() == 0
    model.lm_head.weight.requires_grad_(False)  # a frozen head (LoRA)
    assert accel_head.HeadGrads.of(backend, model, torch.float32) is None
    model.lm_head.weight.requires_grad_(True)
    backend.world_size = 2  # another process's hooks wait for each gradient
    assert accel_head.HeadGrads.of(backend, model, torch.float32) is None


def _head_only(weight: list[list[float]]):
    """A model that is only a bias-free output head holding ``weight``; (model, head, backend)."""
    from agent_rl.run.distributed import TorchBackend

    class Model(torch.nn.Module):
        def get_output_embeddings(self):
            return self.lm_head

    model = Model()
    head = model.lm_head = torch.nn.Linear(len(weight[0]), len(weight), bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(weight))
    return model, head, TorchBackend(model, torch.optim.SGD(head.parameters(), lr=0.0))


def test_head_buffers_live_on_from_step_to_step_and_go_with_the_weight():
    """HeadGrads' cast, rows and product buffers are the same tensors the next step (no fresh
    pages), grow when a step has more rows, hold this step's cast, and go when the weight
    does; the product is the one of its parts: by hand, [V=2, N=3] x [3, H=2]."""
    import gc

    model, head, backend = _head_only([[1.0, 2.0], [3.0, 4.0]])
    first = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    assert torch.equal(first.cast, head.weight.detach().bfloat16())
    # grads [N, V] and hidden [N, H]: rows 1 then 2; the product G^T X
    first.add(torch.tensor([[1.0, 0.0]]).bfloat16(), torch.tensor([[1.0, 1.0]]).bfloat16())
    first.add(torch.tensor([[0.0, 1.0], [2.0, 1.0]]).bfloat16(), torch.tensor([[1.0, 2.0], [3.0, 0.0]]).bfloat16())
    first.flush()
    # G^T X = [[1 + 0 + 6, 1 + 0 + 0], [0 + 1 + 3, 0 + 2 + 0]] = [[7, 1], [4, 2]]
    assert head.weight.grad.tolist() == [[7.0, 1.0], [4.0, 2.0]]
    kept = {name: t.data_ptr() for name, t in accel_head.HEAD_BUFFERS[id(head.weight)].items()}
    assert set(kept) == {"cast", "rows", "product"}  # no forward: no logits buffers
    with torch.no_grad():
        head.weight.mul_(2.0)
    second = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    assert torch.equal(second.cast, head.weight.detach().bfloat16())  # this step's weights
    second.add(torch.tensor([[1.0, 1.0]] * 2).bfloat16(), torch.tensor([[1.0, 0.0]] * 2).bfloat16())
    second.flush()
    assert head.weight.grad.tolist() == [[9.0, 1.0], [6.0, 2.0]]  # + [[2, 0], [2, 0]]
    now = accel_head.HEAD_BUFFERS[id(head.weight)]
    assert {name: t.data_ptr() for name, t in now.items()} == kept  # the same memory
    third = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    third.add(torch.ones(5, 2).bfloat16(), torch.ones(5, 2).bfloat16())  # more rows: grown
    third.flush()
    assert accel_head.HEAD_BUFFERS[id(head.weight)]["rows"].shape[0] == 5
    key = id(head.weight)
    del first, second, third, head, model, backend, now
    gc.collect()
    assert key not in accel_head.HEAD_BUFFERS


def test_head_gradient_rows_are_written_in_place_while_they_fit():
    """HeadGrads.grad_rows: the kept rows buffer's next rows, while every part held lies there
    in order and there is room; flush multiplies them where they lie (no copy: the same
    memory) and copies only the rest after them. By hand: V=2, H=2, the product G^T X."""
    model, head, backend = _head_only([[1.0, 2.0], [3.0, 4.0]])
    first = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    assert first.grad_rows(1) is None  # no rows buffer yet: a new tensor
    first.add(torch.ones(3, 2).bfloat16(), torch.zeros(3, 2).bfloat16())
    first.flush()  # the buffer: 3 rows
    rows = accel_head.HEAD_BUFFERS[id(head.weight)]["rows"]
    assert rows.shape == (3, 2)

    second = accel_head.HeadGrads.of(backend, model, torch.bfloat16)
    a = second.grad_rows(2)
    assert a.data_ptr() == rows.data_ptr() and a.shape == (2, 2)
    a.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    second.add(a, torch.tensor([[1.0, 1.0], [1.0, 2.0]]).bfloat16())
    assert second.grad_rows(2) is None  # one row left
    b = second.grad_rows(1)
    assert b.data_ptr() == rows[2].data_ptr()
    b.copy_(torch.tensor([[2.0, 1.0]]))
    second.add(b, torch.tensor([[3.0, 0.0]]).bfloat16())
    assert (second.placed, second.placed_rows) == (2, 3)
    grad0 = head.weight.grad.clone()
    second.flush()
    # G = [[1, 0], [0, 1], [2, 1]], X = [[1, 1], [1, 2], [3, 0]]: G^T X = [[7, 1], [4, 2]]
    assert (head.weight.grad - grad0).tolist() == [[7.0, 1.0], [4.0, 2.0]]
    assert accel_head.HEAD_BUFFERS[id(head.weight)]["rows"] is rows and second.placed == 0

    third = accel_head.HeadGrads.of(backend, model, torch.bfloat16)  # in place, then a new tensor
    c = third.grad_rows(1)
    c.copy_(torch.tensor([[1.0, 0.0]]))
    third.add(c, torch.tensor([[1.0, 1.0]]).bfloat16())
    third.add(torch.tensor([[0.0, 1.0], [2.0, 1.0]]).bfloat16(), torch.tensor([[1.0, 2.0], [3.0, 0.0]]).bfloat16())
    assert third.placed == 1 and third.grad_rows(0) is None  # no longer in order
    grad0 = head.weight.grad.clone()
    third.flush()
    assert (head.weight.grad - grad0).tolist() == [[7.0, 1.0], [4.0, 2.0]]

    fourth = accel_head.HeadGrads.of(backend, model, torch.bfloat16)  # more rows than the buffer: grown
    d = fourth.grad_rows(3)
    d.copy_(torch.ones(3, 2))
    fourth.add(d, torch.ones(3, 2).bfloat16())
    assert fourth.grad_rows(1) is None
    fourth.add(torch.ones(1, 2).bfloat16(), torch.ones(1, 2).bfloat16())
    grad0 = head.weight.grad.clone()
    fourth.flush()
    assert (head.weight.grad - grad0).tolist() == [[4.0, 4.0], [4.0, 4.0]]
    assert accel_head.HEAD_BUFFERS[id(head.weight)]["rows"].shape[0] == 4


def test_head_logits_go_into_kept_buffers_only_when_nothing_holds_them():
    """DeferredHead's logits: hidden @ W^T by hand, written into one of HeadGrads' two kept
    logits buffers that no other tensor uses (the same memory the next micro-batch), and into a
    new tensor while a caller still holds both; never over logits someone holds."""
    model, head, backend = _head_only([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    grads = accel_head.HeadGrads.of(backend, model, torch.bfloat16)

    def logits(rows):
        return accel_head.DeferredHead.apply(torch.tensor(rows), head.weight, grads)

    first = logits([[1.0, 2.0], [0.0, 4.0]])
    assert first.tolist() == [[1.0, 2.0, 3.0], [0.0, 4.0, 4.0]] and first.dtype == torch.bfloat16
    second = logits([[2.0, 0.0]])  # the first is held: the other buffer
    third = logits([[3.0, 3.0]])  # both held: a new tensor
    kept = {name: t.data_ptr() for name, t in accel_head.HEAD_BUFFERS[id(head.weight)].items()
            if name.startswith("logits")}
    assert set(kept) == {"logits", "logits 2"}
    assert first.tolist() == [[1.0, 2.0, 3.0], [0.0, 4.0, 4.0]] and second.tolist() == [[2.0, 0.0, 2.0]]
    assert third.tolist() == [[3.0, 3.0, 6.0]]
    assert (first.data_ptr(), second.data_ptr()) == (kept["logits"], kept["logits 2"])
    assert third.data_ptr() not in kept.values()
    del first
    fourth = logits([[0.0, 1.0]])
    assert fourth.data_ptr() == kept["logits"] and fourth.tolist() == [[0.0, 1.0, 1.0]]
    assert second.tolist() == [[2.0, 0.0, 2.0]] and third.tolist() == [[3.0, 3.0, 6.0]]  # untouched
    more = logits([[1.0, 1.0]] * 3)  # more rows than kept, the other buffer held: grown anew
    assert more.tolist() == [[1.0, 1.0, 2.0]] * 3 and fourth.tolist() == [[0.0, 1.0, 1.0]]


def test_kernel_norms_give_the_modules_gradients_and_leave_them_as_they_were(tmp_path, monkeypatch):
    """accel.kernel_norms: policy_update runs the tiny model's RMSNorms as our kernel (every
    norm, forward and backward) with the gradients of their own forward to float rounding;
    afterwards the modules run their own forward again; rows it does not take (bf16) go
    through the module's forward; a norm whose instance already has a forward keeps it."""
    from agent_rl.accel import kernels

    contract = make_contract(tmp_path / "r")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    norms = [m for m in model.modules() if hasattr(m, "variance_epsilon")]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    calls = []
    apply = kernels.RMSNorm.apply
    monkeypatch.setattr(kernels.RMSNorm, "apply", lambda *a: calls.append(a[1]) or apply(*a))

    grads = functools.partial(step_grads, model, sequences, contract)

    mine = grads()
    assert {id(w) for w in calls} == {id(m.weight) for m in norms}
    assert all("forward" not in vars(m) for m in norms)  # the modules' own forward again
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(patches, "kernel_norms", lambda backend, model: contextlib.nullcontext())
        theirs = grads()
    assert not calls
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-6)
    x = torch.randn(3, norms[0].weight.shape[0]).bfloat16()
    torch.testing.assert_close(patches._kernel_norm_forward(norms[0], x), norms[0](x), rtol=0, atol=0)
    assert not calls
    # a forward something else set on the instance (accelerate's hooks do) is left in place
    wrapped = []
    norms[0].forward = lambda h, own=norms[0]: wrapped.append(1) or type(own).forward(own, h)
    grads()
    assert wrapped and len({id(w) for w in calls}) == len(norms) - 1
    assert "forward" in vars(norms[0])


def assert_the_same_without(monkeypatch, context: str, grads, mine: dict, calls: list, dtype: str) -> None:
    """The step's gradient with ``accel.patches.<context>`` switched off is ``mine`` to float rounding
    (bf16: to its rounding), and the kernel (its calls in ``calls``) was not called."""
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(patches, context, lambda backend, model: contextlib.nullcontext())
        theirs = grads()
    assert not calls
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == "float32" else {"rtol": 0.05, "atol": 1e-3}
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_mlps_give_the_modules_gradients_and_leave_them_as_they_were(tmp_path, monkeypatch, dtype):
    """accel.kernel_mlps: policy_update runs every SwiGLU middle of the tiny model as our
    kernel (recomputed layers included) with the gradients of the modules' own forward (to
    float rounding; bf16: to its rounding); afterwards the modules run their own forward."""
    from agent_rl.accel import kernels

    contract = make_contract(tmp_path / "r", f"model.dtype={dtype}")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    mlps = [layer.mlp for layer in model.model.layers]
    calls = []
    apply = kernels.SiluMul.apply
    monkeypatch.setattr(kernels.SiluMul, "apply", lambda *a: calls.append(a[0].dtype) or apply(*a))
    grads = functools.partial(step_grads, model, sequences, contract)
    mine = grads()
    # a forward pass per layer and micro-batch, plus update_kl's and the recomputed ones
    assert len(calls) > len(mlps) * 2 and set(calls) == {getattr(torch, dtype)}
    assert all("forward" not in vars(m) for m in mlps)
    assert_the_same_without(monkeypatch, "kernel_mlps", grads, mine, calls, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_rotary_gives_the_models_gradients_and_puts_its_function_back(tmp_path, monkeypatch, dtype):
    """accel.kernel_rotary: policy_update runs every layer's rotary embedding of q and k as our
    kernel with the gradients of transformers' own function (to float rounding; bf16: to its
    rounding); afterwards the module's function is its own again, and a call the kernel does
    not take (another unsqueeze_dim) goes to it."""
    from transformers.models.llama import modeling_llama

    from agent_rl.accel import kernels

    contract = make_contract(tmp_path / "r", f"model.dtype={dtype}")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    own = modeling_llama.apply_rotary_pos_emb
    calls = []
    apply = kernels.Rotary.apply
    monkeypatch.setattr(kernels.Rotary, "apply", lambda *a: calls.append(a[0].shape[1]) or apply(*a))
    grads = functools.partial(step_grads, model, sequences, contract)
    mine = grads()
    heads = {model.config.num_attention_heads, model.config.num_key_value_heads}
    assert set(calls) == heads and len(calls) > 2 * 2 * model.config.num_hidden_layers  # q and k, each pass
    assert modeling_llama.apply_rotary_pos_emb is own
    assert_the_same_without(monkeypatch, "kernel_rotary", grads, mine, calls, dtype)
    q, cos = torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4)
    seen = []
    out = patches._kernel_rotary(lambda *a, **k: seen.append(k) or ("theirs", None), q, q, cos, cos, unsqueeze_dim=2)
    assert out[0] == "theirs" and seen == [{"unsqueeze_dim": 2}] and not calls


def test_bf16_weights_are_cast_once_a_step_with_the_same_gradient(tmp_path, monkeypatch):
    """accel.step_cast_cache: under bf16 autocast each trainable weight is cast once for the
    whole step (micro-batches and recomputed layers), not in every forward pass, and the
    gradients are bit for bit those of casting it every time; the cache is gone afterwards.
    With linear_casts and HeadGrads (which cast their weights themselves) still once a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    contract = make_contract(tmp_path / "r", "model.dtype=bfloat16")
    model, tokenizer = tiny_model(0)
    sequences = graded_sequences(model, tokenizer)
    weights = {p.data_ptr(): n for n, p in model.named_parameters()}

    class CountCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                self.casts[weights[args[0].data_ptr()]] += 1
            if func is torch.ops.aten.copy_.default and args[1].data_ptr() in weights:  # into a kept buffer
                self.casts[weights[args[1].data_ptr()]] += 1
            return func(*args, **(kwargs or {}))

    def step():
        backend = GradCapture(model, torch.optim.SGD(model.parameters(), lr=0.0))
        with CountCasts() as counted:
            m = update.policy_update(backend, None, sequences, contract, pad_id=0, prox={},
                                    micro_tokens=16)
        return backend.grads, counted.casts, m

    _, ours, m = step()  # with linear_casts and HeadGrads, which make their own casts once
    assert m["train/recomputed_frac"] > 0  # some layers were recomputed in backward
    assert set(ours.values()) == {2}
    monkeypatch.setattr(trainer, "linear_casts", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(accel_head.HeadGrads, "of", classmethod(lambda cls, *a: None))
    cached, cached_casts, _ = step()
    with monkeypatch.context() as mp:  # what autocast did before: a cast in every pass
        mp.setattr(trainer, "step_cast_cache", lambda backend, dtype: contextlib.nullcontext())
        every, every_casts, _ = step()
    # every trainable weight (the head is tied to the embedding, named by it): cast in each
    # forward pass, recomputed layers and update_kl's (after the optimizer step) included,
    # against once for the step and once for update_kl
    assert set(cached_casts) == set(every_casts) == set(ours) and "model.embed_tokens.weight" in every_casts
    assert min(every_casts.values()) >= 3 and set(cached_casts.values()) == {2}
    for key in every:
        assert torch.equal(cached[key], every[key]), key


# tolerances of the accelerator's equivalence (measured on the tiny model, two updates: float32
# at most 5e-7 relative on every metric and weight; bf16 1.2e-4 on the losses, 1.4e-3 on the
# gradient norm, 2.5e-3 on kl/update and on the weights, from bf16's roundings taken elsewhere:
# the head's product once a step, float32 attention chunks, kernels rounding once)
ACCEL_TOLERANCE = {"float32": {"loss": 1e-5, "grad_norm": 1e-5, "kl": 1e-5, "weights": 1e-5},
                   "bfloat16": {"loss": 1e-3, "grad_norm": 1e-2, "kl": 2e-2, "weights": 1e-2}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loop_gives_the_same_losses_with_the_cpu_accelerator_off(tmp_path, monkeypatch, dtype):
    """Two policy_update steps (SGD, lr 0.5: the second step's ratios move) on a rolled-out
    batch in micro-batches of 16 tokens, with agent_rl.accel on (its kernels, patches, casts
    and head buffers) and off (accel.disabled(): the trainer's plain tensor ops): the same
    losses, gradient norms, kl/update and trained weights, relative to ACCEL_TOLERANCE."""
    contract = make_contract(tmp_path / "r", f"model.dtype={dtype}")
    sequences = graded_sequences(*tiny_model(0))
    scored = []
    token_logprobs = trainer.Step.token_logprobs
    monkeypatch.setattr(trainer.Step, "token_logprobs",
                        lambda self, *a: scored.append(1) or token_logprobs(self, *a))

    def two_steps(context):
        model, _ = tiny_model(0)
        backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.5), grad_clip=1.0)
        prox = {}
        with context:
            metrics = [update.policy_update(backend, None, sequences, contract, pad_id=0, prox=prox,
                                           micro_tokens=16) for _ in range(2)]
        return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}

    on, on_weights = two_steps(contextlib.nullcontext())
    assert scored  # the accelerator scored the tokens
    scored.clear()
    off, off_weights = two_steps(accel.disabled())
    assert not scored
    tol = ACCEL_TOLERANCE[dtype]
    for mine, theirs in zip(on, off, strict=True):
        assert mine["loss/policy"] == pytest.approx(theirs["loss/policy"], rel=tol["loss"])
        assert mine["optim/grad_norm"] == pytest.approx(theirs["optim/grad_norm"], rel=tol["grad_norm"])
        assert mine["kl/update"] == pytest.approx(theirs["kl/update"], rel=tol["kl"])
        assert mine["optim/skipped"] == theirs["optim/skipped"] == 0.0
    assert on[1]["loss/policy"] != pytest.approx(on[0]["loss/policy"], rel=1e-2)  # it trained
    for name, weight in off_weights.items():
        assert float((on_weights[name] - weight).abs().max()) <= tol["weights"] * float(weight.abs().max()), name
