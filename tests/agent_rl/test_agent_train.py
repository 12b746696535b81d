"""`agent-rl train` and `agent-rl eval` on agent_rl/Agent-v0, as a user runs them: an agent
script written with the official `openai` package (tests/agent_rl/notes_agent.py: two turns
offering a tool, then a compression it does itself) trained two steps on the tiny model, its
rollouts multi-session trees; the run evaluated; an agent that raises or hangs counted as an
infrastructure fault by reason in the step metrics, never trained on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.agent_rl.test_cli import ROOT, agent_rl, read_jsonl

pytest.importorskip("openai")

AGENT = Path(__file__).resolve().parent / "notes_agent.py"


def train_agent(root: Path, agent: str, *overrides: str) -> tuple[Path, subprocess.CompletedProcess]:
    """examples/tiny.yaml with its env replaced by Agent-v0 on 40 flat question rows."""
    rows = root / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(40)))
    run_dir = root / "run"
    sets = [f"run_dir={run_dir}", "env.id=agent_rl/Agent-v0", f"env.kwargs.agent={AGENT}:{agent}",
            f"env.kwargs.tasks={rows}", "env.kwargs.reward=numeric", "eval.split=holdout_iid",
            *overrides]
    result = agent_rl("train", ROOT / "examples" / "tiny.yaml", *[x for s in sets for x in ("--set", s)],
                      "--no-progress", cwd=root)
    return run_dir, result


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    return train_agent(tmp_path_factory.mktemp("agent"), "run")


@pytest.mark.slow
def test_an_agent_script_trains_and_its_rollouts_are_session_trees(agent_run):
    run_dir, result = agent_run
    assert result.returncode == 0, result.stderr
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert len(steps) == 2 and all(m["train/tokens"] > 0 for m in steps)
    assert all(m["sessions/per_episode"] == 2.0 and m["reward/infra_error_rate"] == 0.0
               for m in steps)
    episodes = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(episodes) == 8 and {e["env_id"] for e in episodes} == {"agent_rl/Agent-v0"}
    for e in episodes:
        root, child = e["sessions"]
        assert root["origin"] == "root" and root["metrics"]["model_calls"] == 3
        assert (child["parent_id"], child["origin"]) == (root["session_id"], "compression")
        assert child["boundary"]["summary"] == root["turns"][-1]["content"]
        assert child["turns"][0]["content"].startswith("Note: ")
        assert all(t["token_ids"] for s in e["sessions"] for t in s["turns"]
                   if t["role"] == "assistant")
    assert "held-out reward before -> after" in result.stdout


@pytest.mark.slow
def test_eval_of_an_agent_run(agent_run, tmp_path):
    run_dir, _ = agent_run
    result = agent_rl("eval", "--policy", run_dir, "--n", "2", "--out", tmp_path / "ev")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(tmp_path / "ev" / "records.jsonl")
    assert len(records) == 2 and {r["env_id"] for r in records} == {"agent_rl/Agent-v0"}
    assert [r["split"] for r in records] == ["holdout_iid"] * 2
    assert all(r["sessions"] == 2 and r["compressions"] == 1 for r in records)
    held = read_jsonl(run_dir / "eval.jsonl")[0]["task_ids"]
    assert [r["task_id"] for r in records] == held[:2]  # the run's own held-out tasks


@pytest.mark.slow
def test_agent_faults_are_infrastructure_faults_counted_by_reason(tmp_path):
    """notes_agent.flaky raises on one episode in three and hangs on another (past
    timeout_s=2): masked, counted by reason, warned with the task id; the run goes on."""
    run_dir, result = train_agent(tmp_path, "flaky", "env.kwargs.timeout_s=2",
                                  "guards.max_verifier_error_rate=1.0")
    assert result.returncode == 0, result.stderr
    steps = read_jsonl(run_dir / "metrics.jsonl")
    raised = sum(m.get("faults/agent_raised", 0) for m in steps)
    hung = sum(m.get("faults/agent_timeout", 0) for m in steps)
    assert raised > 0 and hung > 0
    for m in steps:  # every fault is an infrastructure fault, and nothing else is
        faults = m.get("faults/agent_raised", 0) + m.get("faults/agent_timeout", 0)
        assert m["reward/infra_error_rate"] == faults / 4
    episodes = read_jsonl(run_dir / "rollouts.jsonl")
    faulty = [e for e in episodes if e["reward"]["outcome"] == "sandbox_error"]
    assert len(faulty) == raised + hung
    assert all(not e["filter"]["kept"] and e["filter"]["reason"] == "infrastructure_fault"
               for e in faulty)
    assert {e["reward"]["audit"]["agent_fault"] for e in faulty} == {"raised", "timeout"}
    task = next(e for e in faulty if e["reward"]["audit"]["agent_fault"] == "raised")["task_id"]
    assert (f"agent-rl train: warning: agent_rl/Agent-v0 task {task}: agent fault raised "
            f"(RuntimeError: the agent's own bug on {task})") in result.stderr
