"""What a user owns in a run directory is never overwritten or dropped.

A refused run leaves the folder byte for byte as it was; a folder that is no agent-rl run is
refused, with or without --resume; --resume needs a run; a log that lost what its checkpoint
committed is refused naming the file and the record or step, a torn last line after the
checkpoint is set aside with a warning; a finished run resumed again writes nothing; a base
model whose files changed is refused naming them.

One finished 2-step run (a module fixture, with a relative run_dir so that copies of it are
the same contract) is copied and damaged per test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from agent_rl import models, runlog, train
from agent_rl.models import tiny_model
from agent_rl.runlog import RunDirError
from tests.agent_rl import toy_env
from tests.agent_rl.test_train import BASE, make_contract, read_jsonl

SHORT = ("optim.max_steps=2", "checkpoint.every=1", "eval.every=0")
RECORDS = 2 * 2 * 4  # steps x tasks_per_step x group_size


@pytest.fixture(scope="module", autouse=True)
def digits_env():
    yield toy_env.register()
    toy_env.unregister()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        result = train.run(make_contract(Path("run"), *SHORT), progress=False)
    return root / "run", result


@pytest.fixture
def run_copy(finished, tmp_path, monkeypatch):
    """A copy of the finished run at ./run (the same contract as the original)."""
    shutil.copytree(finished[0], tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    return Path("run")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_a_refused_resume_writes_nothing_and_the_old_config_still_resumes(run_copy):
    (run_copy / "contract.sha256").unlink()  # the pin is then read from contract.yaml
    before = snapshot(run_copy)
    changed = make_contract(run_copy, *SHORT, "optim.lr=0.002")
    with pytest.raises(ValueError, match=r"another contract.*optim\.lr: 0\.001 -> 0\.002"):
        train.run(changed, resume=True, progress=False)
    assert snapshot(run_copy) == before
    assert train.run(make_contract(run_copy, *SHORT), resume=True, progress=False).steps == 2


def test_a_finished_run_resumed_again_re_reports_and_writes_nothing(finished, run_copy):
    before = snapshot(run_copy)
    result = train.run(make_contract(run_copy, *SHORT), resume=True, progress=False)
    assert snapshot(run_copy) == before
    assert (result.steps, result.after, result.comparison) == (
        finished[1].steps, finished[1].after, finished[1].comparison)
    assert [e["tag"] for e in read_jsonl(run_copy / "eval.jsonl")] == ["before", "after"]


@pytest.mark.parametrize("name, lost", [
    ("rollouts.jsonl", f"record {RECORDS}, which the checkpoint of step 2 committed"),
    ("metrics.jsonl", "the metrics of step 2, which the checkpoint of step 2 committed"),
])
def test_a_committed_record_in_a_torn_tail_is_refused_naming_it(run_copy, name, lost):
    path = run_copy / name
    path.write_bytes(path.read_bytes()[:-20])  # the last line loses its end
    before = snapshot(run_copy)
    with pytest.raises(RunDirError, match=rf"{name}: {lost}, cannot be found; its last line is torn"):
        train.run(make_contract(run_copy, *SHORT), resume=True, progress=False)
    assert snapshot(run_copy) == before


def test_a_corrupt_line_before_the_last_is_refused_naming_it(run_copy):
    path = run_copy / "metrics.jsonl"
    path.write_bytes(b"{not json\n" + path.read_bytes().split(b"\n", 1)[1])
    before = snapshot(run_copy)
    with pytest.raises(RunDirError, match=r"metrics.jsonl: line 1 is not a JSON record"):
        train.run(make_contract(run_copy, *SHORT), resume=True, progress=False)
    assert snapshot(run_copy) == before


def test_a_torn_line_after_the_checkpoint_is_set_aside_with_a_warning(run_copy):
    shutil.rmtree(run_copy / "checkpoints" / "step-000002")  # resume from step 1
    path = run_copy / "metrics.jsonl"
    step2 = path.read_bytes().split(b"\n")[1]
    with open(path, "ab") as fh:
        fh.write(b'{"step": 3, "loss/po')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: its last line \(of step 3, 20 bytes\)"):
        result = train.run(make_contract(run_copy, *SHORT), resume=True, progress=False)
    assert result.steps == 2
    assert [m["step"] for m in read_jsonl(path)] == [1, 2]
    assert (run_copy / "metrics.jsonl.rewound").read_bytes() == step2 + b'\n{"step": 3, "loss/po\n'


@pytest.mark.parametrize("resume", [True, False])
def test_a_folder_that_is_no_run_is_refused_untouched(tmp_path, resume):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    (run_dir / "rollouts.jsonl").write_text('{"mine": true}\n')
    before = snapshot(run_dir)
    with pytest.raises(RunDirError, match="is not an agent-rl run directory"):
        train.run(make_contract(run_dir, *SHORT), resume=resume, progress=False)
    assert snapshot(run_dir) == before and sorted(p.name for p in run_dir.iterdir()) == [
        "metrics.jsonl", "rollouts.jsonl"]


@pytest.mark.parametrize("exists, says", [(False, "does not exist"), (True, "is empty")])
def test_resume_needs_a_run_to_resume(tmp_path, exists, says):
    run_dir = tmp_path / "run"
    if exists:
        run_dir.mkdir()
    with pytest.raises(RunDirError, match=f"--resume: .*run {says}, so there is no run to resume"):
        train.run(make_contract(run_dir, *SHORT), resume=True, progress=False)
    assert run_dir.exists() == exists and not (exists and any(run_dir.iterdir()))


def test_resume_refuses_a_base_model_whose_files_changed(tmp_path):
    base = tmp_path / "base"

    def save_base(seed: int) -> None:
        model, tokenizer = tiny_model(seed)
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)

    save_base(0)
    contract = make_contract(tmp_path / "run", "optim.max_steps=1", "eval.every=0",
                             f"model.id={base}")
    result = train.run(contract, progress=False)
    before = snapshot(result.run_dir)

    save_base(1)
    with pytest.raises(RunDirError, match=rf"base model changed .*model {base}: weights: "
                                          "model.safetensors changed"):
        train.run(contract, resume=True, progress=False)
    save_base(0)  # the same bytes again: accepted
    assert train.run(contract, resume=True, progress=False).steps == 1
    config = base / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 7}))
    with pytest.raises(RunDirError, match="tokenizer: tokenizer_config.json changed"):
        train.run(contract, resume=True, progress=False)
    assert snapshot(result.run_dir) == before
    pinned = json.loads((result.run_dir / "base_model.json").read_text())["model"]
    assert pinned["id"] == str(base) and "model.safetensors" in pinned["weights"]
    assert "tokenizer.json" in pinned["tokenizer"]


def test_the_embedded_gguf_is_pinned_by_its_file_hash(tmp_path, monkeypatch):
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.write_bytes(b"GGUF weights and vocabulary")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    digest = {gguf.name: hashlib.sha256(gguf.read_bytes()).hexdigest()}
    assert models.model_fingerprint("smollm2-135m") == {
        "id": "smollm2-135m", "weights": digest, "tokenizer": digest}


def test_log_lines_are_fsynced(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(runlog.os, "fsync", synced.append)
    runlog.log_json(tmp_path / "metrics.jsonl", {"step": 1})
    assert len(synced) == 1



def test_resume_refuses_a_reward_function_whose_source_changed(tmp_path, monkeypatch):
    """``reward: rewards.py:score`` is pinned by the file's content: after an edit of the
    function's body, --resume is refused naming env.kwargs.reward, writing nothing."""
    monkeypatch.chdir(tmp_path)
    Path("qa.jsonl").write_text("".join(f'{{"prompt": "{i}+1?", "answer": "{i + 1}"}}\n'
                                        for i in range(8)))
    Path("rewards.py").write_text("def score(answer, task):\n    return float(answer == task.target)\n")
    base = {**BASE, "name": "qa", "eval": {"split": "holdout_iid", "n": 2, "every": 0},
            "env": {"id": "agent_rl/Dataset-v0", "iid_fraction": 0.5, "pool_size": 8,
                    "kwargs": {"path": "qa.jsonl", "reward": "rewards.py:score"}}}
    contract = make_contract(Path("run"), "optim.max_steps=1", "checkpoint.every=1", base=base)
    train.run(contract, progress=False)
    before = snapshot(Path("run"))
    Path("rewards.py").write_text("def score(answer, task):\n    return 1.0\n")
    with pytest.raises(RunDirError, match=r"another contract .*changed: env.kwargs.reward: "
                                          r"content changed \(rewards.py:score sha256 \w{12} -> "
                                          r"rewards.py:score sha256 \w{12}\)"):
        train.run(contract, resume=True, progress=False)
    assert snapshot(Path("run")) == before
