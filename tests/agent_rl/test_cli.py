"""Every `agent-rl` entry point run as a user runs it (the console script, in a subprocess), on
the tiny random model and a few steps: train, report, eval, canary, envs list|new|check, and the
exit codes of their failures (2 usage / missing input, 1 a failed check or release, 3 a guard
stop, 130 an interrupted run)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import envs
from agent_rl import ExperimentContract
from agent_rl.cli.train import run_trainer
from agent_rl.run import checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
SCRIPT = Path(sys.executable).with_name("agent-rl")
ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


def command(*args: str) -> list[str]:
    exe = str(SCRIPT) if SCRIPT.exists() else shutil.which("agent-rl") or "agent-rl"
    return [exe, *map(str, args)]


def agent_rl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=300)


def train_tiny(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [x for o in (f"run_dir={run_dir}", *overrides) for x in ("--set", o)]
    return agent_rl("train", TINY, *sets, "--no-progress", cwd=run_dir.parent)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("cli") / "tiny-run"
    return run_dir, train_tiny(run_dir)


# --- train ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_prints_before_after_and_writes_the_run(tiny_run):
    run_dir, result = tiny_run
    assert result.returncode == 0, result.stderr
    for name in ("contract.yaml", "metrics.jsonl", "eval.jsonl", "report.html", "result.json"):
        assert (run_dir / name).is_file(), name
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert checkpoint.latest_complete(run_dir / "checkpoints") is not None
    out = result.stdout  # a pipe: the plain layout, every line at most 80 columns
    assert "held-out reward before -> after (greedy, hint-free; 95% intervals)" in out
    assert re.search(r"^held-out all: \d\.\d{3} -> \d\.\d{3}, paired [+-]\d\.\d{3} "
                     r"\[-?\d\.\d{3}, -?\d\.\d{3}\] \(n=4\)$", out, re.M), out
    assert re.search(r"^  reward: before \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] n=4, after ", out, re.M)
    assert "  success: before " in out and "…" not in out and "\x1b" not in out
    assert max(len(line) for line in out.splitlines() if not line.startswith(("report:", "run dir:"))) <= 80
    assert f"run dir: {run_dir}" in out
    assert "<svg" in (run_dir / "report.html").read_text()


@pytest.mark.slow
def test_train_progress_in_a_redirected_log_is_plain_lines(tmp_path):
    run_dir = tmp_path / "run"
    result = agent_rl("train", TINY, "--set", f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stdout.splitlines() if line.startswith("train step")]
    assert len(progress) == 2 and "\r" not in result.stdout and "\x1b" not in result.stdout
    assert re.fullmatch(r"train step 1/2  reward \d\.\d{3}  held-out \d\.\d{3} \(before\)  "
                        r"\d+ tok/s  ETA \d+:\d\d", progress[0]), progress[0]
    assert progress[1].startswith("train step 2/2  ") and progress[1].endswith("ETA 0:00")
    evaluation = [line for line in result.stdout.splitlines() if line.startswith("eval ")]
    # the held-out evaluations before and after, per split, counted in episodes
    assert any(re.match(r"eval before \w+ episode 1?\d+/\d+  ETA", line) for line in evaluation)
    assert any(re.match(r"eval after \w+ episode \d+/\d+  ETA 0:00", line) for line in evaluation)


def test_bad_config_key_exits_2_naming_the_key(tmp_path):
    result = agent_rl("train", TINY, "--set", "optim.lrr=1", "--set", f"run_dir={tmp_path}/r")
    assert result.returncode == 2
    assert "optim.lrr" in result.stderr and "unknown key" in result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, named", [
    ("eval.split=bogus", "eval.split: no split 'bogus'"),
    ("env.split=dropped_duplicates", "env.split: no split 'dropped_duplicates'"),
    ("env.kwargs.bogus=1", "env.kwargs.bogus: agent_rl/Arithmetic-v0 takes no such argument"),
    ("rollout.truncation_penalty=.nan", "rollout.truncation_penalty: Input should be a finite"),
    ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
    ("optim.max_steps=true", "optim.max_steps: got the boolean true"),
    ("=1", "--set '=1': the key has an empty part"),
])
def test_contract_errors_exit_2_naming_the_key_before_the_run_dir(tmp_path, override, named):
    result = agent_rl("train", TINY, "--set", f"run_dir={tmp_path}/r", "--set", override)
    assert result.returncode == 2 and named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "r").exists()


def test_a_run_dir_that_is_a_file_exits_2_untouched(tmp_path):
    (tmp_path / "r").write_text("someone's notes\n")
    result = agent_rl("train", TINY, "--set", f"run_dir={tmp_path}/r")
    assert result.returncode == 2, result.stderr
    assert f"run_dir: {tmp_path}/r is a file, not a directory" in result.stderr
    assert "Traceback" not in result.stderr and (tmp_path / "r").read_text() == "someone's notes\n"


def test_missing_config_file_exits_2(tmp_path):
    result = agent_rl("train", tmp_path / "nope.yaml")
    assert result.returncode == 2 and "not found" in result.stderr


@pytest.mark.slow
def test_missing_model_exits_2_with_a_clear_message(tmp_path):
    result = agent_rl("train", TINY, "--set", f"model.id={tmp_path}/no-such-model",
                      "--set", f"run_dir={tmp_path}/r")
    assert result.returncode == 2
    assert "cannot load model" in result.stderr and "no-such-model" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_guard_stop_exits_3_with_the_rule(tmp_path):
    # the random model always hits the length limit: the default length guard trips at step 2
    result = train_tiny(tmp_path / "r", "guards.max_truncated_frac=0.9", "optim.max_steps=4")
    assert result.returncode == 3, result.stderr
    assert "stopped by guard length_explosion" in result.stderr
    # the message names the measured share, the bound and the keys to change
    for part in ("100% of responses", "guards.max_truncated_frac 90%",
                 "raise rollout.max_response_tokens"):
        assert part in result.stderr, part
    assert (tmp_path / "r" / "guard.json").is_file() and (tmp_path / "r" / "report.html").is_file()
    guard = json.loads((tmp_path / "r" / "guard.json").read_text())
    assert guard["keys"] == ["guards.max_truncated_frac", "rollout.max_response_tokens"]


def run_stopped_by(error: type[Exception] | None, tmp_path, capsys):
    """``run_trainer`` around a run that signals itself SIGTERM; while that interrupt unwinds,
    the run raises ``error`` (None: the plain KeyboardInterrupt). What run_trainer returned and
    printed."""
    def run(contract, resume, progress):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler interrupts this
        except KeyboardInterrupt:
            if error is None:
                raise
            raise error("release unlocked lock") from None  # what tensorboard's queue raised
        raise AssertionError("SIGTERM did not interrupt the run")

    args = argparse.Namespace(resume=False, no_progress=True, config=str(TINY))
    result = run_trainer("train", args, ExperimentContract.from_yaml(TINY), tmp_path,
                         tmp_path / "checkpoints", run, "none yet")
    return result, capsys.readouterr().err


@pytest.mark.parametrize("error", [None, RuntimeError, OSError, ValueError])
def test_an_error_raised_while_sigterm_unwinds_is_still_the_stop(tmp_path, capsys, error):
    before = signal.getsignal(signal.SIGTERM)
    result, err = run_stopped_by(error, tmp_path, capsys)
    assert result is None  # train exits 130
    assert "interrupted" in err and "--resume" in err and "none yet" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_the_same_error_without_a_signal_is_raised(tmp_path):
    def run(contract, resume, progress):
        raise RuntimeError("a real failure")

    args = argparse.Namespace(resume=False, no_progress=True, config=str(TINY))
    with pytest.raises(RuntimeError, match="a real failure"):
        run_trainer("train", args, ExperimentContract.from_yaml(TINY), tmp_path,
                    tmp_path / "checkpoints", run, "none yet")


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_points_at_resume(tmp_path):
    run_dir = tmp_path / "r"
    args = ["train", TINY, "--set", f"run_dir={run_dir}", "--set", "optim.max_steps=500",
            "--set", "checkpoint.every=1", "--no-progress"]
    proc = subprocess.Popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no training steps within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    latest = checkpoint.latest_complete(run_dir / "checkpoints")
    assert latest is not None and str(latest) in err
    checkpoint.verify_bundle(latest)  # the last bundle is whole
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_train_under_torchrun_on_two_ranks(tmp_path):
    """The launch in docs/scale-out.md: `torchrun --nproc-per-node 2 -m agent_rl.cli train ...` with
    ZeRO-3 trains on two ranks (gloo), and only rank 0 reports."""
    from agent_rl.run.distributed import free_port

    run_dir = tmp_path / "r"
    env = {k: v for k, v in ENV.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "agent_rl.cli",
         "train", str(TINY), "--set", "backend.name=deepspeed", "--set", "backend.zero_stage=3",
         "--set", f"run_dir={run_dir}", "--no-progress"],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(f"run dir: {run_dir}") == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    latest = checkpoint.latest_complete(run_dir / "checkpoints")
    assert json.loads((latest / "backend.json").read_text())["world_size"] == 2


# --- report -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_report_writes_the_run_report(tiny_run):
    run_dir, _ = tiny_run
    (run_dir / "report.html").unlink()
    result = agent_rl("report", run_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "report.html")
    html = (run_dir / "report.html").read_text()
    for curve in ("reward/mean", "loss/policy", "response/length_mean", "held-out reward"):
        assert curve in html, curve


def test_report_of_a_missing_dir_exits_2(tmp_path):
    result = agent_rl("report", tmp_path / "missing")
    assert result.returncode == 2 and "no run directory" in result.stderr


# --- eval -------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_eval_base_policy_per_slice(tmp_path):
    result = agent_rl("eval", "--env", "agent_rl/Arithmetic-v0", "--split", "holdout",
                      "--policy", "base", "--model", "tiny", "--n", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out_dir = tmp_path / "runs" / "eval-Arithmetic-v0-holdout"
    records = read_jsonl(out_dir / "records.jsonl")
    assert len(records) == 4 and {r["policy_name"] for r in records} == {"base:tiny"}
    assert "reward/mean per slice" in (out_dir / "report.html").read_text()
    for text in ("all (n=4)", "structure=", "entity_group=integers", "composition=", "95% Wilson"):
        assert text in result.stdout, text


@pytest.mark.slow
def test_eval_a_run_dir_loads_its_latest_bundle(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    result = agent_rl("eval", "--policy", run_dir, "--n", "3", "--out", tmp_path / "ev")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(tmp_path / "ev" / "records.jsonl")
    bundle = checkpoint.latest_complete(run_dir / "checkpoints")
    assert len(records) == 3
    assert {r["bundle_hash"] for r in records} == {checkpoint.bundle_hash(bundle)}
    assert {r["env_id"] for r in records} == {"agent_rl/Arithmetic-v0"}  # from the contract


class AnswersSeven(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions stub that always answers "7"."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "7"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_eval_openai_policy(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), AnswersSeven)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = agent_rl("eval", "--env", "agent_rl/Arithmetic-v0", "--policy", f"openai:{url}",
                          "--model", "stub", "--n", "3", "--out", tmp_path / "ev")
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    records = read_jsonl(tmp_path / "ev" / "records.jsonl")
    assert len(records) == 3 and {r["policy_name"] for r in records} == {f"openai:{url}"}
    assert {r["outcome"] for r in records} <= {"correct", "wrong"}  # a bare number: scored


def test_eval_bad_inputs_exit_2(tmp_path):
    missing = agent_rl("eval", "--policy", tmp_path / "nothing", "--env", "agent_rl/Arithmetic-v0")
    assert missing.returncode == 2 and "no checkpoint bundle" in missing.stderr
    split = agent_rl("eval", "--env", "agent_rl/Arithmetic-v0", "--split", "nope",
                     "--policy", "base", "--model", "tiny", "--n", "2", cwd=tmp_path)
    assert split.returncode == 2 and "unknown split 'nope'" in split.stderr


# --- canary -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_canary_stages_and_exit_codes(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    # the same training under a contract whose acceptance tolerates the random model's errors
    lenient = tmp_path / "lenient"
    assert train_tiny(lenient, "acceptance.max_error_rate=1.0").returncode == 0

    promoted = agent_rl("canary", "--candidate", lenient, "--baseline", run_dir, "--n", "10",
                        "--canary-fraction", "0.5")
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    out = promoted.stdout
    for line in ("offline: PASS", "shadow: PASS", "canary: PASS", "promote: PASS",
                 "result: promoted at promote"):
        assert line in out, line
    assert "live store unchanged by shadow" in out

    # the default acceptance (error rate <= 0.05) stops it at the offline gate
    stopped = agent_rl("canary", "--candidate", run_dir, "--baseline", lenient, "--n", "10")
    assert stopped.returncode == 1, stopped.stderr
    assert "offline: FAIL" in stopped.stdout and "FAIL error rate" in stopped.stdout
    assert "result: stopped at offline" in stopped.stdout


@pytest.mark.slow
def test_canary_refuses_the_same_bundle(tiny_run):
    run_dir, _ = tiny_run
    result = agent_rl("canary", "--candidate", run_dir, "--baseline", run_dir, "--n", "2")
    assert result.returncode == 2 and "same bundle" in result.stderr


# --- envs -------------------------------------------------------------------------------------


def test_envs_list_shows_every_builtin():
    result = agent_rl("envs", "list")
    assert result.returncode == 0, result.stderr
    for env_id in envs.list_envs():
        assert env_id in result.stdout, env_id
    assert "Records-v0: search, read, transform and update records" in result.stdout
    assert "Arithmetic-v0: multi-step integer arithmetic" in result.stdout  # module docstring


def test_envs_check_passes_arithmetic():
    result = agent_rl("envs", "check", "agent_rl/Arithmetic-v0", "--episodes", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "agent_rl/Arithmetic-v0: PASS" in result.stdout
    for check in ("make", "gymnasium_check_env", "reference_solver", "random_actions",
                  "determinism"):
        assert f"[pass] {check}" in result.stdout, check


def test_envs_check_unknown_id_exits_2():
    result = agent_rl("envs", "check", "agent_rl/Arithmetc-v0")
    assert result.returncode == 2 and "Did you mean" in result.stderr


def test_envs_new_scaffolds_a_package(tmp_path):
    result = agent_rl("envs", "new", "letter_count", "--dest", tmp_path)
    assert result.returncode == 0, result.stderr
    root = tmp_path / "agent-rl-env-letter-count"
    assert (root / "pyproject.toml").is_file()
    assert (root / "agent_rl_env_letter_count" / "env.py").is_file()
    assert "letter_count/LetterCount-v0" in result.stdout
    again = agent_rl("envs", "new", "letter_count", "--dest", tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    bad = agent_rl("envs", "new", "Bad-Name", "--dest", tmp_path)
    assert bad.returncode == 2 and "lowercase identifier" in bad.stderr


# --- eval: the episodes behind the records, and inspect ----------------------------------------


@pytest.mark.slow
def test_eval_writes_every_episode_and_inspect_shows_its_transcript(tmp_path):
    from evals.report import episode_anchor
    from trajectories import RolloutStore

    out = tmp_path / "ev"
    args = ("eval", "--env", "agent_rl/Arithmetic-v0", "--policy", "base", "--model", "tiny",
            "--max-new-tokens", "8", "--out", out)
    result = agent_rl(*args, "--n", "4")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out / "records.jsonl")
    episodes = list(RolloutStore(out / "episodes.jsonl").read())
    assert len(episodes) == len(records) == 4
    assert [(e.episode_id, e.task_id, e.reward.outcome.value, e.reward.total) for e in episodes] == [
        (r["episode_id"], r["task_id"], r["outcome"], r["reward"]) for r in records]
    assert {e.split for e in episodes} == {"holdout"}
    assert f"episodes: {out / 'episodes.jsonl'} (4 episodes, 0 infrastructure faults)" in result.stdout

    # the report links the worst slice's episodes to their transcripts on the page
    html = (out / "report.html").read_text()
    worst = html[html.index("<h2>Worst slices</h2>"):html.index("<h2>Transcripts</h2>")]
    first = worst[worst.index("<h3>"):worst.index("</table>")]
    linked = re.findall(r'href="#(ep-[^"]+)"', first)
    assert linked and set(linked) <= {episode_anchor(e.episode_id) for e in episodes}
    assert all(f'id="{anchor}"' in html for anchor in linked)

    # inspect --episode: that held-out task's transcript (the tree alone has no turn text)
    ep = episodes[0]
    prompt = next(t.content for t in ep.sessions[0].turns if t.role == "user")
    shown = agent_rl("inspect", out / "episodes.jsonl", "--episode", ep.episode_id)
    assert shown.returncode == 0, shown.stderr
    assert f"episode {ep.episode_id}" in shown.stdout and prompt in shown.stdout
    assert "[assistant] · finish length · 8 tokens" in shown.stdout
    assert "1 episodes" in shown.stdout and episodes[1].episode_id not in shown.stdout
    trees = agent_rl("inspect", out / "episodes.jsonl")
    assert trees.returncode == 0 and "4 episodes" in trees.stdout and prompt not in trees.stdout

    # an eval into the same folder replaces all three files, as it always replaced records.jsonl
    again = agent_rl(*args, "--n", "2")
    assert again.returncode == 0, again.stderr
    assert len(read_jsonl(out / "records.jsonl")) == 2
    assert RolloutStore(out / "episodes.jsonl").cursor == 2
    assert sorted(p.name for p in out.iterdir()) == ["episodes.jsonl", "records.jsonl",
                                                     "report.html"]


def test_inspect_episode_prints_its_transcript_verbatim(tmp_path):
    from trajectories import RolloutStore
    from trajectories.testing import episode, session

    evil = "[red]<script>alert(1)</script>[/red] is 7"
    store = tmp_path / "episodes.jsonl"
    RolloutStore(store).append([
        episode([session("s0", episode_id="t-0#0@1")], episode_id="t-0#0@1", task_id="t-0"),
        episode([session("s0", episode_id="t-1#0@2", text=evil)], reward=0.0,
                episode_id="t-1#0@2", task_id="t-1")])
    shown = agent_rl("inspect", store, "--episode", "t-1#0@2")
    assert shown.returncode == 0, shown.stderr
    assert evil in shown.stdout and "[user]" in shown.stdout and "t-0#0@1" not in shown.stdout
    every = agent_rl("inspect", store, "--transcript")
    assert every.returncode == 0 and every.stdout.count("[assistant]") == 2
    assert evil not in agent_rl("inspect", store).stdout  # trees only, without --episode
    missing = agent_rl("inspect", store, "--episode", "t-1")
    assert missing.returncode == 2
    assert "no episode 't-1'" in missing.stderr and "its episodes: t-1#0@2" in missing.stderr


@pytest.mark.slow
def test_train_stores_its_held_out_episodes_beside_their_records(tiny_run):
    from trajectories import RolloutStore

    run_dir, result = tiny_run
    assert result.returncode == 0, result.stderr
    for tag in ("before", "after"):
        records = read_jsonl(run_dir / "evals" / f"{tag}.jsonl")
        episodes = list(RolloutStore(run_dir / "evals" / "episodes" / f"{tag}.jsonl").read())
        assert [e.episode_id for e in episodes] == [r["episode_id"] for r in records] != []
    html = (run_dir / "report.html").read_text()
    assert "<h2>Worst slices</h2>" in html and 'class="transcript"' in html


# --- a pool with nothing compositional to hold out, end to end ------------------------------------


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """examples/tiny.yaml, unchanged but for its env: Dataset-v0 on 40 rows of one shape (one
    length, one entity group, no structure), under the run's own assigner terminal_only."""
    root = tmp_path_factory.mktemp("flat")
    rows = root / "flat.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(40)))
    run_dir = root / "run"
    return run_dir, train_tiny(run_dir, "env.id=agent_rl/Dataset-v0", f"env.kwargs.path={rows}",
                               "credit.assigner=terminal_only")


FALLBACK = "split holdout is evaluated as holdout_iid"


def assert_one_plain_notice(stderr: str, command: str) -> None:
    """The fallback notice once, as ``agent-rl COMMAND: warning: ...``, no Python source line."""
    assert stderr.count(FALLBACK) == 1, stderr
    [line] = [ln for ln in stderr.splitlines() if FALLBACK in ln]
    assert line.startswith(f"agent-rl {command}: warning: agent_rl/Dataset-v0: the 40 tasks")
    assert "HoldoutFallbackWarning" not in stderr and "warnings.warn(" not in stderr
    assert ".py:" not in stderr, stderr


@pytest.mark.slow
def test_a_flat_dataset_trains_and_evaluates_under_the_stock_config(flat_run):
    run_dir, result = flat_run
    assert result.returncode == 0, result.stderr
    assert_one_plain_notice(result.stderr, "train")
    before = read_jsonl(run_dir / "eval.jsonl")[0]
    assert before["n_evaluated"] == {"holdout_iid": 4}  # eval.split holdout, as holdout_iid


@pytest.mark.slow
def test_eval_of_a_run_uses_the_runs_eval_split(flat_run, tmp_path):
    run_dir, _ = flat_run
    result = agent_rl("eval", "--policy", run_dir, "--n", "2", "--out", tmp_path / "ev")
    assert result.returncode == 0, result.stderr
    assert_one_plain_notice(result.stderr, "eval")
    records = read_jsonl(tmp_path / "ev" / "records.jsonl")
    assert [r["split"] for r in records] == ["holdout_iid"] * 2
    assert {r["env_id"] for r in records} == {"agent_rl/Dataset-v0"}
    # the tasks are the run's own held-out ones
    held = read_jsonl(run_dir / "eval.jsonl")[0]["task_ids"]
    assert [r["task_id"] for r in records] == held[:2]


@pytest.mark.slow
def test_eval_of_a_run_evaluates_every_split_its_contract_names(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    contract = (run_dir / "contract.yaml").read_text()
    other = tmp_path / "c.yaml"  # the run's env, evaluated on two splits
    other.write_text(contract.replace("iid_fraction: 0.0", "iid_fraction: 0.25")
                     .replace("split: holdout\n", "split: [holdout_iid, holdout]\n"))
    result = agent_rl("eval", "--policy", run_dir, "--config", other, "--n", "2",
                      "--out", tmp_path / "ev")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(tmp_path / "ev" / "records.jsonl")
    assert [r["split"] for r in records] == ["holdout_iid"] * 2 + ["holdout"] * 2
    assert "split=holdout_iid" in result.stdout and "split=holdout " in result.stdout


@pytest.mark.slow
def test_inspect_a_run_directory_under_its_own_assigner(flat_run):
    run_dir, _ = flat_run
    env = {**ENV, "COLUMNS": "80"}
    result = subprocess.run(command("inspect", run_dir, "--limit", "2"), capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"episodes: {run_dir / 'rollouts.jsonl'}" in out
    assert "credit: terminal_only, the run's credit.assigner" in out
    assert "credit: terminal_only (session)" in out and "advantage +0" in out
    assert max(map(len, out.splitlines())) <= 80


def test_version_names_the_package_and_its_libraries():
    result = agent_rl("--version")
    assert result.returncode == 0, result.stderr
    from importlib.metadata import version

    line = result.stdout.strip()
    assert line.startswith(f"agent-rl {version('agent-rl')} (Python ")
    assert f"torch {version('torch')}" in line and f"transformers {version('transformers')}" in line
