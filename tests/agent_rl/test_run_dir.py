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

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_rl import cli
from agent_rl.policies import load, models
from agent_rl.policies.models import tiny_model
from agent_rl.run import checkpoint, rundir
from agent_rl.run.rundir import RunDirError
from agent_rl.training import train
from tests.agent_rl import toy_env
from tests.agent_rl.test_train import BASE, REPO, make_contract, read_jsonl

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
    monkeypatch.setattr(rundir.os, "fsync", synced.append)
    rundir.log_json(tmp_path / "metrics.jsonl", {"step": 1})
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


# --- one process per run directory (runlock) -----------------------------------------------

CLI = """
import sys, time
from agent_rl.run import checkpoint
from agent_rl.cli import main
from tests.agent_rl import toy_env

if sys.argv[1] == "hang":  # hangs before writing checkpoint 2 (after logging step 2)
    save_bundle = checkpoint.save_bundle
    def save_slowly(root, step, **kwargs):
        if step == 2:
            open(sys.argv[2], "w").close()
            time.sleep(600)
        return save_bundle(root, step, **kwargs)
    checkpoint.save_bundle = save_slowly
toy_env.register()
sys.exit(main(sys.argv[3:]))
"""


def cli_process(tmp_path: Path, *args: str, hang: bool = False) -> subprocess.Popen:
    """`agent-rl ARGS` in a new process with tests/Digits-v0 registered; ``hang``: it stops
    for good before writing checkpoint 2, once ``tmp_path/hanging`` exists."""
    script = tmp_path / "cli.py"
    script.write_text(CLI)
    return subprocess.Popen([sys.executable, str(script), "hang" if hang else "run",
                             str(tmp_path / "hanging"), *args], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_process_is_refused_at_once_and_a_killed_holders_lock_is_taken_over(tmp_path):
    """Two real processes on one run directory: while `agent-rl train` runs (held at its
    second checkpoint), `agent-rl train --resume` exits 2 at once, naming the folder and the
    holder's pid, before loading a model, writing nothing. kill -9 of the holder releases the
    lock (the kernel drops a flock with its process): `--resume` then takes the lock file it
    left over, naming that pid, and finishes every step once."""
    contract = make_contract(tmp_path / "run", "optim.max_steps=3", "checkpoint.every=1",
                             "eval.every=0")
    config = tmp_path / "contract.yaml"
    config.write_text(contract.to_yaml())
    run_dir = contract.resolved_run_dir
    holder = cli_process(tmp_path, "train", str(config), "--no-progress", hang=True)
    try:
        wait_for(tmp_path / "hanging", holder)
        before = snapshot(run_dir)
        second = cli_process(tmp_path, "train", str(config), "--resume", "--no-progress")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert f"run_dir {run_dir} is in use by another agent-rl process (pid {holder.pid} " in err
        assert snapshot(run_dir) == before  # the loser wrote nothing
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.communicate()
    assert holder.returncode == -signal.SIGKILL
    assert (run_dir / rundir.LOCK_FILE).exists()  # left by the killed process, no lock held
    with pytest.warns(UserWarning, match=rf"taking over the lock of pid {holder.pid} on host"):
        result = train.run(contract, resume=True, progress=False)
    assert result.steps == 3
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not (run_dir / rundir.LOCK_FILE).exists()  # released at the end


def test_the_lock_is_released_on_any_exit_and_held_by_rank_0_only(tmp_path, monkeypatch):
    """A refused run leaves the folder as it found it (lock file and created folders gone);
    the lock nests within a process; a second holder in another process is refused; a rank
    other than 0 takes no lock (rank 0 of its launch holds it for the job)."""
    from agent_rl.run import runlock

    run_dir = tmp_path / "new" / "run"
    with runlock.hold_run_dir(run_dir) as lock:
        assert lock == run_dir / rundir.LOCK_FILE
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with runlock.hold_run_dir(run_dir):  # nested: the CLI's hold, then train.run's
            pass
        assert lock.exists()
        other = subprocess.run([sys.executable, "-c", "import sys; from agent_rl.run import runlock\n"
                                f"with runlock.hold_run_dir({str(run_dir)!r}): pass"],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=120)
        assert "RunDirBusy" in other.stderr and f"(pid {os.getpid()} on host" in other.stderr
    assert not (tmp_path / "new").exists()  # it created both folders, and removed them

    with pytest.raises(RunDirError, match="already holds a run"):
        with runlock.hold_run_dir(run_dir):
            (run_dir / "metrics.jsonl").write_text("")
            raise RunDirError("already holds a run")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]

    # a holder killed while a process it forked lives on: the lock is still held, and the
    # message says by whom
    forked = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               "from agent_rl.run import runlock\n"
                               f"with runlock.hold_run_dir({str(run_dir)!r}):\n"
                               "    if os.fork() == 0:\n"
                               "        print(os.getpid(), flush=True); time.sleep(120)\n"
                               "    os._exit(0)"],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(forked.stdout.readline())
        forked.wait(timeout=60)
        with pytest.raises(runlock.RunDirBusy, match=rf"pid {forked.pid} on host .*; that "
                                                     "process is gone, but one it forked still "
                                                     "holds the lock: `fuser -v"):
            runlock.hold_run_dir(run_dir).__enter__()
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with open(run_dir / rundir.LOCK_FILE) as fh:  # the kernel drops the lock as the child ends
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed child still holds the lock"
                time.sleep(0.05)
    with pytest.warns(UserWarning, match=f"taking over the lock of pid {forked.pid}"):
        with runlock.hold_run_dir(run_dir):
            pass

    monkeypatch.setenv("RANK", "1")
    with runlock.hold_if_main(run_dir) as lock:
        assert not lock.exists()


# --- a full disk, a read-only folder ---------------------------------------------------------


def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (test_checkpoint.py's disk-full test "
                    "injects the error instead)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs (as root): what a full disk does, for real."""
    mount_tmpfs(tmp_path / "disk", "16m")
    yield tmp_path / "disk"
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=True)


def fill(folder: Path) -> None:
    """Write zeros into ``folder/filler`` until the disk is full."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(bytes(1 << 16))


def test_a_full_disk_names_the_last_complete_checkpoint_and_keeps_it(small_disk, tmp_path,
                                                                     monkeypatch, capsys):
    """The disk fills up before checkpoint 2: `agent-rl train` exits 2 saying "no space left
    on <the bundle>, the last complete checkpoint is step 1", no traceback (torch.save given a
    path said "unexpected pos" and lost the errno); checkpoint 1 loads; with space freed,
    --resume finishes every step once."""
    contract = make_contract(small_disk / "run", "optim.max_steps=3", "checkpoint.every=1",
                             "eval.every=0")
    config = tmp_path / "contract.yaml"
    config.write_text(contract.to_yaml())
    write_bundle = train.write_bundle

    def fill_before_checkpoint_2(backend, root, step, **kwargs):
        if step == 2:
            fill(small_disk)
        return write_bundle(backend, root, step, **kwargs)

    monkeypatch.setattr(train, "write_bundle", fill_before_checkpoint_2)
    assert cli.main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    checkpoints = small_disk / "run" / "checkpoints"
    assert (f"no space left on {checkpoints / 'step-000002'} (No space left on device), the last "
            f"complete checkpoint is step 1 ({checkpoints / 'step-000001'})") in err
    assert "Traceback" not in err and "unexpected pos" not in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"]  # no partial folder
    model, _ = tiny_model(0)
    assert checkpoint.load_bundle(checkpoints / "step-000001", model)["step"] == 1

    (small_disk / "filler").unlink()
    monkeypatch.setattr(train, "write_bundle", write_bundle)
    assert cli.main(["train", str(config), "--resume", "--no-progress"]) == 0
    assert [m["step"] for m in read_jsonl(small_disk / "run" / "metrics.jsonl")] == [1, 2, 3]


@pytest.fixture
def read_only(tmp_path):
    """A folder holding a finished run (./run, the `finished` fixture's contract) that nothing
    can write: a tmpfs remounted read-only (as root, whom chmod does not stop)."""
    folder = tmp_path / "ro"
    mount_tmpfs(folder, "16m")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_read_only_run_dir_exits_2_naming_it_before_loading_a_model(finished, read_only,
                                                                       tmp_path, monkeypatch,
                                                                       capsys):
    shutil.copytree(finished[0], read_only / "run")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    monkeypatch.chdir(read_only)
    config = tmp_path / "contract.yaml"
    config.write_text(make_contract(Path("run"), *SHORT).to_yaml())
    loaded = []
    monkeypatch.setattr(load, "load_base_model", lambda *a: loaded.append(a))
    before = snapshot(read_only / "run")
    for extra, folder in (("--resume", "run"), ("--set=run_dir=run/new", "run/new")):
        assert cli.main(["train", str(config), extra, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"run_dir {folder} cannot be written (Read-only file system)" in err, err[-2000:]
    assert loaded == []  # refused before any model was loaded
    assert snapshot(read_only / "run") == before


# --- a kill during the first curriculum estimate, eval.n larger than a split -------------

KILLED_IN_ESTIMATE = """
import sys, time
from agent_rl.training import train
from agent_rl.run.contract import ExperimentContract
from tests.agent_rl import toy_env

def hang(*args, **kwargs):
    open(sys.argv[2], "w").close()
    time.sleep(600)
train.estimate_band = hang
toy_env.register()
train.run(ExperimentContract.from_yaml(sys.argv[1]), progress=False)
"""


@pytest.mark.slow
def test_a_kill_during_the_first_curriculum_estimate_resumes(tmp_path):
    """kill -9 while the first difficulty band is estimated: the run directory already holds
    its contract, so `--resume` (what a job script relaunches with) starts the run and
    finishes it, instead of exiting 2 on "no run to resume" forever."""
    contract = make_contract(tmp_path / "run", "optim.max_steps=2", "eval.every=0",
                             "curriculum.filter=pass_rate", "curriculum.k=2", "curriculum.min=0.0",
                             "curriculum.pool=3")
    config = tmp_path / "contract.yaml"
    config.write_text(contract.to_yaml())
    (tmp_path / "killed.py").write_text(KILLED_IN_ESTIMATE)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "killed.py"), str(config),
                             str(tmp_path / "estimating")], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(tmp_path / "estimating", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    run_dir = contract.resolved_run_dir
    assert (run_dir / "contract.sha256").read_text().strip() == contract.contract_hash()
    with pytest.warns(UserWarning, match=f"taking over the lock of pid {proc.pid}"):
        result = train.run(contract, resume=True, progress=False)
    assert result.steps == 2
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert [r["round"] for r in read_jsonl(run_dir / "curriculum.jsonl")] == [0]


def test_eval_n_beyond_a_split_says_how_many_were_evaluated(tmp_path):
    contract = make_contract(tmp_path / "run", "optim.max_steps=1", "eval.every=0", "eval.n=1000")
    import envs

    held = len(contract.env.splits(envs.make(toy_env.ENV_ID))["holdout"])
    assert held < 1000
    with pytest.warns(UserWarning, match=rf"eval.n is 1000, but held-out split 'holdout' holds "
                                         rf"{held} tasks: those are evaluated"):
        train.run(contract, progress=False)
    records = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert [(r["tag"], r["n_requested"], r["n_evaluated"]) for r in records] == [
        ("before", 1000, {"holdout": held}), ("after", 1000, {"holdout": held})]
