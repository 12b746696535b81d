"""agent-rl sft: solver episodes rendered with RL's masks, the NLL by hand, the bundle, model.init."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import envs
from agent_rl.policies.logprobs import picked_logprobs
from agent_rl.policies.models import initial_model, load_model, model_fingerprint
from agent_rl.policies.render import end_of_turn_id
from agent_rl.run import checkpoint
from agent_rl.run.contract import ContractError, ExperimentContract, SFTContract, read_contract
from agent_rl.run.distributed import TorchBackend
from agent_rl.training import sft
from trajectories import RewardBreakdown, RolloutStore

RECORDS = "agent_rl/Records-v0"


def contract(tmp_path, **over) -> SFTContract:
    data = {"name": "t", "env": {"id": RECORDS, "pool_size": 64, "pool_seed": 0},
            "eval": {"split": "holdout", "n": 2, "seed": 1, "temperature": 0.0},
            "model": {"id": "tiny", "adapter": "none"},
            "data": {"source": "solver", "max_episodes": 6},
            "optim": {"lr": 1e-3, "epochs": 2, "batch_sessions": 3, "micro_batch_tokens": 2048},
            "limits": {"max_prompt_tokens": 2048, "max_response_tokens": 16},
            "run_dir": str(tmp_path / "sft")}
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        if leaf:
            data[section][leaf] = value
        else:
            data[section] = value
    return SFTContract.from_dict(data)


def records_tasks(n: int):
    return envs.make(RECORDS).unwrapped.task_pool(n, seed=0)[:n]


def test_solver_episodes_train_exactly_the_solvers_replies():
    _, tokenizer = load_model("tiny")
    tasks = records_tasks(3)
    episodes = sft.solver_episodes(RECORDS, tasks, tokenizer, 1, {}, seed=0)
    assert [e.task_id for e in episodes] == [t.task_id for t in tasks]
    assert all(e.reward.total == pytest.approx(1.0) for e in episodes)  # the solver solves
    rendered = sft.render_sessions(tokenizer, episodes, 10_000)
    eot = end_of_turn_id(tokenizer)
    for e, r in zip(episodes, rendered, strict=True):
        replies = [t.content for t in e.sessions[0].turns if t.role == "assistant"]
        expected = [i for text in replies
                    for i in tokenizer.encode(text, add_special_tokens=False) + [eot]]
        assert r.input_ids[r.loss_mask].tolist() == expected  # nothing else is trained
        assert r.num_trained == sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1
                                    for t in replies)


def test_sft_update_is_the_mean_nll_of_the_trained_tokens():
    model, tokenizer = load_model("tiny")
    episodes = sft.solver_episodes(RECORDS, records_tasks(3), tokenizer, 1, {}, seed=0)
    batch = sft.render_sessions(tokenizer, episodes, 10_000)
    # by hand: each sequence on its own, log p(token t | tokens < t) at the trained positions
    nll, count = 0.0, 0
    with torch.no_grad():
        for r in batch:
            logits = model(input_ids=r.input_ids[None]).logits[0, :-1]  # predicts tokens 1..T-1
            lp = picked_logprobs(logits, r.input_ids[1:])
            nll -= float(lp[r.loss_mask[1:]].sum())
            count += int(r.loss_mask[1:].sum())
    assert count == sum(r.num_trained for r in batch)
    params = [p for p in model.parameters() if p.requires_grad]
    backend = TorchBackend(model, torch.optim.SGD(params, lr=0.0))  # the weights stay
    # micro-batches of 700 tokens: the sessions spread over several, their sums add up
    m = sft.sft_update(backend, batch, 0, 700, torch.device("cpu"), "float32")
    assert m["micro_batches"] > 1
    assert m["tokens"] == count
    assert m["loss/sft"] == pytest.approx(nll / count, rel=1e-5)
    # bf16 autocast: the same loss to bf16's rounding; from the second step on, the logits'
    # gradients go straight into the head's kept rows (accel's HeadGrads.grad_rows)
    from agent_rl.accel import head as accel_head

    placed, flush = [], accel_head.HeadGrads.flush
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accel_head.HeadGrads, "flush", lambda self: placed.append((self.placed, len(self.parts))) or flush(self))
        for _ in range(2):
            m = sft.sft_update(backend, batch, 0, 700, torch.device("cpu"), "bfloat16")
            assert m["loss/sft"] == pytest.approx(nll / count, rel=2e-2)
    assert placed[0][0] == 0 and placed[1][0] == placed[1][1] == m["micro_batches"]


def test_select_episodes_counts_every_dropped_episode(tmp_path):
    _, tokenizer = load_model("tiny")
    tasks = records_tasks(4)
    episodes = sft.solver_episodes(RECORDS, tasks, tokenizer, 1, {}, seed=0)
    r = episodes[1].reward
    low = episodes[1].evolve(reward=RewardBreakdown.from_components(
        {"answer": 0.0, "state": 1.0}, r.weights, "wrong", r.verifier))  # total 0.3
    other = episodes[2].evolve(env_id="agent_rl/Arithmetic-v0")
    mixed = [episodes[0], low, other, episodes[3], episodes[0]]
    kept, data = sft.select_episodes(mixed, RECORDS, held_out={tasks[3].task_id}, min_reward=1.0,
                                     max_episodes=1)
    assert [e.task_id for e in kept] == [tasks[0].task_id]
    assert data["dropped"] == {"below_min_reward": 1, "other_env": 1, "held_out_task": 1,
                               "over_max_episodes": 1}
    assert data["episodes_read"] == 5 and data["episodes_kept"] == 1


def test_sft_run_writes_a_full_weight_bundle_that_train_starts_from(tmp_path):
    c = contract(tmp_path)
    result = sft.run(c, progress=False)
    assert result.steps == 2 * 2  # 6 sessions in batches of 3, two epochs
    assert result.losses[-1] < result.losses[0]  # it learns the solver's replies
    assert result.data["episodes_kept"] == 6 and result.data["dropped"]["over_max_episodes"] > 0
    meta = json.loads((result.bundle / checkpoint.META_FILE).read_text())
    assert meta["kind"] == "sft" and meta["trainable_only"] is False
    assert meta["base_model"]["model"] == model_fingerprint("tiny")
    assert checkpoint.verify_bundle(result.bundle) == result.bundle_hash
    for name in ("contract.yaml", "data.json", "metrics.jsonl", "eval.jsonl", "result.json",
                 "episodes.jsonl", "evals/before.jsonl", "evals/after.jsonl"):
        assert (result.run_dir / name).is_file(), name
    assert len(list(RolloutStore(result.run_dir / "episodes.jsonl").read())) == 6
    assert isinstance(read_contract(result.run_dir / "contract.yaml"), SFTContract)

    # model.init: the trained weights replace the base's, whether named as bundle or run dir
    trained = checkpoint.safetensors.torch.load_file(result.bundle / checkpoint.MODEL_FILE)
    for where in (result.bundle, result.run_dir):
        rl = ExperimentContract.from_dict({"model": {"id": "tiny", "init": str(where)}})
        model, _ = initial_model(rl.model)
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in trained.items())
        base, _ = load_model("tiny")
        assert not torch.equal(base.state_dict()["model.layers.0.mlp.up_proj.weight"],
                               state["model.layers.0.mlp.up_proj.weight"])
    pinned = rl.hashed_fields()["model"]["init"]
    assert pinned == {"path": str(result.run_dir), "bundle": result.bundle_hash}

    # a second sft run into the same folder is refused, the first one left whole
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        sft.run(c, progress=False)
    assert checkpoint.verify_bundle(result.bundle) == result.bundle_hash


def test_lora_sft_merges_its_adapter_into_the_bundle(tmp_path):
    c = contract(tmp_path, model={"id": "tiny", "adapter": "lora", "lora_rank": 4},
                 optim={"lr": 5e-2, "epochs": 1, "batch_sessions": 6})
    result = sft.run(c, progress=False)
    names = json.loads((result.bundle / checkpoint.META_FILE).read_text())["parameter_names"]
    assert not any("lora_" in n for n in names)  # plain names: it loads onto the base model
    model, _ = initial_model(ExperimentContract.from_dict(
        {"model": {"id": "tiny", "init": str(result.bundle)}}).model)
    base, _ = load_model("tiny")
    moved = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert any("q_proj" in k for k in moved)  # the merged adapter changed the attention weights
    assert not any("embed_tokens" in k for k in moved)  # all-linear LoRA leaves embeddings alone


def test_model_init_errors_name_the_key(tmp_path):
    bad = ExperimentContract.from_dict({"model": {"id": "tiny", "init": str(tmp_path / "nope")}})
    with pytest.raises(ContractError, match="model.init: no checkpoint bundle"):
        bad.contract_hash()
    # null leaves the hash as it was before model.init existed
    assert "init" not in ExperimentContract.from_dict({}).hashed_fields()["model"]

    model, _ = load_model("tiny")
    full = checkpoint.save_bundle(tmp_path / "ck2", 1, model=model, trainable_only=False,
                                  meta={"base_model": {"model": {"id": "x", "weights": {"w": "1"},
                                                                 "tokenizer": {}}}})
    with pytest.raises(checkpoint.BundleError, match="trained from 'x'"):
        checkpoint.load_init(full, model, model_fingerprint("tiny"))


def test_lora_training_checkpoint_is_refused_as_init(tmp_path):
    from agent_rl.policies.models import add_lora

    model, _ = load_model("tiny")
    peft_model = add_lora(model, 4, 8)
    bundle = checkpoint.save_bundle(tmp_path / "ck", 3, model=peft_model, meta={})
    plain, _ = load_model("tiny")
    with pytest.raises(checkpoint.BundleError, match="LoRA adapters only"):
        checkpoint.load_init(bundle, plain)


def test_store_source_needs_a_store_and_pins_its_content(tmp_path):
    with pytest.raises(ContractError, match="data.store"):
        contract(tmp_path, data={"source": "store"})
    _, tokenizer = load_model("tiny")
    store = RolloutStore(tmp_path / "rollouts.jsonl")
    store.append(sft.solver_episodes(RECORDS, records_tasks(2), tokenizer, 1, {}, seed=0))
    c = contract(tmp_path, data={"source": "store", "store": str(store.path), "min_reward": 1.0})
    first = c.contract_hash()
    assert c.hashed_fields()["data"]["store"]["path"] == str(store.path)
    store.append(sft.solver_episodes(RECORDS, records_tasks(3)[2:], tokenizer, 1, {}, seed=5))
    assert c.contract_hash() != first  # new episodes in the file: another contract


def test_store_source_drops_held_out_tasks(tmp_path):
    c = contract(tmp_path)
    splits = c.env.splits(envs.make(RECORDS))
    _, tokenizer = load_model("tiny")
    train_task, held_task = splits["train"][0], splits["holdout"][0]
    store = RolloutStore(tmp_path / "rollouts.jsonl")
    store.append(sft.solver_episodes(RECORDS, [train_task, held_task], tokenizer, 1, {}, seed=0))
    c = contract(tmp_path, data={"source": "store", "store": str(store.path)},
                 optim={"epochs": 1, "batch_sessions": 4})
    result = sft.run(c, progress=False)
    assert result.data["episodes_kept"] == 1
    assert result.data["dropped"] == {"held_out_task": 1}


def test_cli_sft_refuses_a_broken_contract_before_any_work(tmp_path, capsys):
    from agent_rl.cli import main

    config = tmp_path / "sft.yaml"
    config.write_text("model: {id: tiny}\noptim: {epochs: -1}\nrun_dir: " + str(tmp_path / "r"))
    assert main(["sft", str(config)]) == 2
    assert "optim.epochs" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_train_from_an_sft_bundle_pins_it(tmp_path):
    from agent_rl.policies.load import load_bundle_policy
    from agent_rl.training import train

    warm = sft.run(contract(tmp_path, optim={"epochs": 1, "batch_sessions": 6}), progress=False)
    loaded = load_bundle_policy(warm.run_dir, None, "cpu")  # `agent-rl eval --policy SFT_RUN`
    assert loaded.bundle == warm.bundle
    rl = ExperimentContract.from_yaml("examples/tiny_records.yaml", [
        f"model.init={warm.run_dir}", f"run_dir={tmp_path / 'rl'}", "optim.max_steps=1"])
    result = train.run(rl, progress=False)
    assert result.steps == 1
    pinned = (tmp_path / "rl" / "contract.sha256").read_text().strip()
    assert pinned == rl.contract_hash()
    # the run dir's newest bundle changes (a second warm start into it): another contract
    plain, _ = load_model("tiny")
    checkpoint.save_bundle(warm.run_dir / "checkpoints", 99, model=plain, trainable_only=False,
                           meta={})
    assert rl.contract_hash() != pinned
    with pytest.raises(ValueError, match="belongs to another contract"):
        train.run(rl.model_copy(update={"optim": rl.optim.model_copy(update={"max_steps": 2})}),
                  resume=True, progress=False)


def test_contract_hash_pins_the_contents_of_task_and_dataset_files(tmp_path):
    ids = tmp_path / "held.txt"
    ids.write_text("records-0-1\n")
    c = ExperimentContract.from_dict({"env": {"id": RECORDS, "holdout": {
        "task_ids_file": str(ids)}}, "eval": {"split": "holdout_iid"}})
    first = c.contract_hash()
    ids.write_text("records-0-2\n")
    assert c.contract_hash() != first
    ids.unlink()
    with pytest.raises(ContractError, match="env.holdout.task_ids_file: cannot read"):
        c.contract_hash()

    data = tmp_path / "qa.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    d = ExperimentContract.from_dict({"env": {"id": "agent_rl/Dataset-v0", "kwargs": {
        "path": str(data)}, "iid_fraction": 0.5}, "eval": {"split": "holdout_iid"}})
    before = d.contract_hash()
    assert d.hashed_fields()["env"]["kwargs"]["path"]["path"] == str(data)
    data.write_text('{"prompt": "1+1?", "answer": "3"}\n{"prompt": "2+2?", "answer": "4"}\n')
    assert d.contract_hash() != before


def test_cli_sft_prints_the_bundle_and_the_train_command(tmp_path, capsys):
    from agent_rl.cli import main

    run_dir = tmp_path / "warm"
    assert main(["sft", "examples/tiny_sft.yaml", "--no-progress", "--set", f"run_dir={run_dir}",
                 "--set", "data.max_episodes=4", "--set", "eval.n=2"]) == 0
    out = capsys.readouterr().out
    bundle = checkpoint.resolve_bundle(run_dir)
    assert "trained on 4 sessions of 4 episodes" in out
    assert f"agent-rl train CONFIG --set model.init={bundle}\n" in out  # whole, to be copied
    # captured (no terminal): the summary as plain lines of at most 80 columns, every digit
    assert re.search(r"^held-out all: \d\.\d{3} -> \d\.\d{3}, paired [+-]\d\.\d{3} "
                     r"\[-?\d\.\d{3}, -?\d\.\d{3}\] \(n=\d+\)$", out, re.M), out
    assert all(len(line) <= 80 for line in out.splitlines()
               if not line.startswith(("bundle:", "start RL from it:"))), out
    assert main(["sft", "examples/tiny_sft.yaml", "--set", f"run_dir={run_dir}"]) == 2  # not empty
    capsys.readouterr()
    assert main(["sft", "examples/tiny_sft.yaml", "--no-progress", "--resume", "--set",
                 f"run_dir={run_dir}", "--set", "data.max_episodes=4", "--set", "eval.n=2"]) == 0
    assert f"bundle: {bundle} " in capsys.readouterr().out  # finished: re-reported


# --- resume --------------------------------------------------------------------------------

KILLED_SFT = """
import sys, time
from agent_rl.training import sft
from agent_rl.run.contract import SFTContract

update, calls = sft.sft_update, []
def hang_in_step_4(*args, **kwargs):  # step 3 logged, resume bundle 2 written: killed here
    calls.append(1)
    if len(calls) == 4:
        open(sys.argv[2], "w").close()
        time.sleep(600)
    return update(*args, **kwargs)
sft.sft_update = hang_in_step_4
sft.run(SFTContract.from_yaml(sys.argv[1]), progress=False)
"""


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_sft_resumes_after_sigkill_to_the_uninterrupted_weights(tmp_path):
    """4 steps (6 sessions in batches of 3, two epochs), a resume bundle every 2. kill -9
    during step 4, with step 3 logged: --resume continues from bundle 2 (weights, optimizer,
    RNG; step 3's batch is ``batch_of_step(3)``) and ends on the uninterrupted run's weights
    and losses exactly (torch.equal, ==: the same operations in the same order), every step
    logged once, step 3's first try set aside. Resumed again, the finished run re-reports
    and writes nothing; a changed contract is refused, writing nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    straight = sft.run(contract(tmp_path, run_dir=str(tmp_path / "straight"),
                                checkpoint={"every": 2, "keep": 2}), progress=False)
    c = contract(tmp_path, checkpoint={"every": 2, "keep": 2})
    (tmp_path / "sft.yaml").write_text(c.to_yaml())
    (tmp_path / "killed.py").write_text(KILLED_SFT)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(tmp_path / "killed.py"), str(tmp_path / "sft.yaml"),
                             str(tmp_path / "step4")], cwd=repo, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "step4").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    run_dir = c.resolved_run_dir
    assert checkpoint.latest_complete(run_dir / sft.RESUME_DIR).name == "step-000002"
    assert not (run_dir / "checkpoints").exists()  # no final bundle from a killed run

    with pytest.warns(UserWarning, match=f"taking over the lock of pid {proc.pid}"):
        resumed = sft.run(c, resume=True, progress=False)
    assert resumed.steps == 4 and resumed.before == straight.before
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["loss/sft"] for m in metrics] == straight.losses
    assert [json.loads(line)["step"] for line in
            (run_dir / "metrics.jsonl.rewound").read_text().splitlines()] == [3]
    ours = checkpoint.safetensors.torch.load_file(resumed.bundle / checkpoint.MODEL_FILE)
    theirs = checkpoint.safetensors.torch.load_file(straight.bundle / checkpoint.MODEL_FILE)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [json.loads(line)["tag"] for line in
            (run_dir / "eval.jsonl").read_text().splitlines()] == ["before", "after"]

    before = snapshot(run_dir)
    again = sft.run(c, resume=True, progress=False)
    assert snapshot(run_dir) == before
    assert (again.after, again.bundle, again.bundle_hash) == (
        resumed.after, resumed.bundle, resumed.bundle_hash)
    changed = contract(tmp_path, checkpoint={"every": 2, "keep": 2}, optim={
        "lr": 2e-3, "epochs": 2, "batch_sessions": 3, "micro_batch_tokens": 2048})
    with pytest.raises(ValueError, match=r"another contract.*optim\.lr: 0\.001 -> 0\.002"):
        sft.run(changed, resume=True, progress=False)
    assert snapshot(run_dir) == before


def test_batch_of_step_is_the_epochs_seeded_order_in_batches():
    orders = [np.random.default_rng([7, epoch]).permutation(5) for epoch in range(2)]
    expected = [(1, orders[0][:2]), (1, orders[0][2:4]), (1, orders[0][4:]),
                (2, orders[1][:2]), (2, orders[1][2:4]), (2, orders[1][4:])]
    for step, (epoch, sessions) in enumerate(expected, start=1):
        assert sft.batch_of_step(step, 5, 2, seed=7) == (epoch, [int(i) for i in sessions])


def test_a_store_whose_episodes_generated_nothing_names_the_skipped_sessions(tmp_path, capsys):
    """Episodes that ended before the policy generated a token (their prompts over the limit of
    the run that sampled them) leave no session to train on: the error counts the skipped
    sessions by reason, and the CLI prints it (exit 2)."""
    from agent_rl.cli import main
    from agent_rl.policies.hf import HFPolicy
    from envs.runner import Sampling, run_episodes

    c = contract(tmp_path)
    train_tasks = c.env.splits(envs.make(RECORDS))["train"][:2]
    model, tokenizer = load_model("tiny")
    episodes = run_episodes(RECORDS, train_tasks, HFPolicy(model, tokenizer),
                            sampling=Sampling(max_new_tokens=4, seed=0, max_prompt_tokens=64),
                            samples_per_task=2, seed=0)
    assert all(e.reward.audit["truncated_by"] == "max_prompt_tokens" for e in episodes)
    store = RolloutStore(tmp_path / "rollouts.jsonl")
    store.append(episodes)
    c = contract(tmp_path, data={"source": "store", "store": str(store.path)})
    expected = ("no session to train on: 4 episodes read, 4 kept (dropped: none); their sessions "
                "skipped: prompt_too_long 4 (episodes that generated no token: their prompts were "
                "longer than the prompt limit of the run that recorded them)")
    with pytest.raises(ValueError) as raised:
        sft.run(c, progress=False)
    assert str(raised.value) == expected
    assert sft.skipped_sessions(episodes) == {"prompt_too_long": 4}
    config = tmp_path / "sft.yaml"
    config.write_text(json.dumps({**c.model_dump(mode="json"), "run_dir": str(tmp_path / "cli")}))
    assert main(["sft", str(config), "--no-progress"]) == 2
    assert f"agent-rl sft: error: {expected}" in capsys.readouterr().err


def test_skipped_sessions_by_reason():
    """A session with no assistant turn in an episode that ended for another reason, and one
    whose assistant turn carries no sampled token ids, are counted apart."""

    _, tokenizer = load_model("tiny")
    (episode,) = sft.solver_episodes(RECORDS, records_tasks(1), tokenizer, 1, {}, seed=0)
    root = episode.sessions[0]
    typed = root.model_copy(update={"turns": [t.model_copy(update={"token_ids": None})
                                              if t.role == "assistant" else t for t in root.turns]})
    bare = root.model_copy(update={"turns": [t for t in root.turns if t.role != "assistant"]})
    assert sft.untrainable(episode, root) is None
    assert sft.untrainable(episode, typed) == "no_token_ids"
    assert sft.untrainable(episode, bare) == "no_assistant_turn"
