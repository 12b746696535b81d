"""agent_rl/Agent-v0: its keyword arguments (contract errors naming the key, before any work),
its tasks and splits (Dataset-v0's), its pinned files, and its episodes through the runner
(the agent's tool calls and its own compression inferred as a session tree; each call's random
stream keyed by job and call)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

import envs
from agent_rl.run.contract import ContractError, ExperimentContract
from envs.agent_env import AgentSpecError, check_arguments
from envs.datasets import DEFAULT_PATH, DatasetError
from envs.runner import Completion, Sampling, run_episodes
from evals.splits import default_splits

ENV_ID = "agent_rl/Agent-v0"
HERE = Path(__file__).resolve().parent
ASK_ONCE = f"{HERE / 'agent_scripts.py'}:ask_once"
NOTES = f"{HERE.parent / 'agent_rl' / 'notes_agent.py'}:run"


def contract(**kwargs) -> ExperimentContract:
    return ExperimentContract.from_dict({"env": {"id": ENV_ID, "kwargs": kwargs},
                                         "eval": {"split": "holdout_iid"}})


@pytest.mark.parametrize(("kwargs", "key", "message"), [
    ({}, "agent", "agent names your agent function"),
    ({"agent": "no_colon"}, "agent", "'module:function' or 'path/to/file.py:function'"),
    ({"agent": "missing_dir/agent.py:run"}, "agent", "no file"),
    ({"agent": "no_such_module_xyz:run"}, "agent", "no module 'no_such_module_xyz'"),
    ({"agent": ASK_ONCE}, "tasks", "tasks must be a .jsonl/.csv path or a dataset spec"),
    ({"agent": ASK_ONCE, "tasks": {"prompt": "q"}}, "tasks.path", "tasks needs a path"),
    ({"agent": ASK_ONCE, "tasks": {"path": "t.jsonl", "colums": 1}}, "tasks.colums",
     "tasks has the key 'colums'"),
    ({"agent": ASK_ONCE, "tasks": {"path": "t.jsonl", "meta": ["skills"]}}, "tasks.meta",
     "meta maps TaskMeta fields to column names"),
    ({"agent": ASK_ONCE, "tasks": "t.jsonl", "reward": "fuzzy"}, "reward",
     "reward 'fuzzy' is not one of"),
    ({"agent": ASK_ONCE, "tasks": "t.jsonl", "timeout_s": 0}, "timeout_s",
     "timeout_s must be a number of seconds > 0"),
])
def test_bad_arguments_are_errors_naming_the_key(kwargs, key, message):
    with pytest.raises((AgentSpecError, DatasetError), match=message) as info:
        check_arguments(**kwargs)
    assert info.value.key == key
    with pytest.raises(ContractError, match=f"env.kwargs.{key}: .*{message}"):
        contract(**kwargs)


def test_a_missing_function_or_tasks_file_fails_at_construction(tmp_path):
    with pytest.raises(AgentSpecError, match="has no attribute 'nope'") as info:
        envs.make(ENV_ID, agent=f"{HERE / 'agent_scripts.py'}:nope", tasks=str(DEFAULT_PATH))
    assert info.value.key == "agent"
    with pytest.raises(DatasetError, match="no such file or folder"):
        envs.make(ENV_ID, agent=ASK_ONCE, tasks=str(tmp_path / "none.jsonl"))


def test_an_unknown_keyword_is_a_contract_error():
    with pytest.raises(ContractError, match="env.kwargs.task: agent_rl/Agent-v0 takes no such "
                                            r"argument \(did you mean env.kwargs.tasks\?\)"):
        contract(agent=ASK_ONCE, task="t.jsonl")


def test_tasks_and_splits_are_dataset_v0s():
    """A path or a dataset spec: the same tasks, the same held-out splits as Dataset-v0."""
    dataset = envs.make("agent_rl/Dataset-v0", path=str(DEFAULT_PATH), reward="numeric")
    by_path = envs.make(ENV_ID, agent=ASK_ONCE, tasks=str(DEFAULT_PATH), reward="numeric")
    by_spec = envs.make(ENV_ID, agent=ASK_ONCE, reward="numeric",
                        tasks={"path": str(DEFAULT_PATH), "prompt": "prompt", "answer": "answer"})
    pool = dataset.unwrapped.task_pool(54, seed=0)
    assert by_path.unwrapped.task_pool(54, seed=0) == pool == by_spec.unwrapped.task_pool(54, seed=0)
    want = default_splits(dataset, 54, seed=0)
    got = default_splits(by_path, 54, seed=0)
    assert {name: [t.task_id for t in tasks] for name, tasks in got.items()} == {
        name: [t.task_id for t in tasks] for name, tasks in want.items()}
    assert len(got["holdout"]) > 0  # the sample's metadata gives a compositional holdout


def test_the_agent_and_its_tasks_are_pinned(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "agent.py").write_text("def run(task, base_url, api_key):\n    return '2'\n")
    c = contract(agent="agent.py:run", tasks={"path": "t.jsonl"})
    pins = c.input_pins()
    assert pins == {
        "env.kwargs.agent": {"function": "agent.py:run", "sha256": hashlib.sha256(
            (tmp_path / "agent.py").read_bytes()).hexdigest()},
        "env.kwargs.tasks.path": {"path": "t.jsonl", "sha256": hashlib.sha256(
            (tmp_path / "t.jsonl").read_bytes()).hexdigest()}}
    before = c.contract_hash()
    (tmp_path / "agent.py").write_text("def run(task, base_url, api_key):\n    return '3'\n")
    assert c.contract_hash() != before
    assert [change.split(":")[0] for change in c.pin_changes(pins)] == ["env.kwargs.agent"]
    assert set(contract(agent="agent.py:run", tasks="t.jsonl").input_pins()) == {
        "env.kwargs.agent", "env.kwargs.tasks"}


# --- episodes through the runner ---------------------------------------------------------------

openai = pytest.importorskip("openai")

from tests.envs.test_agent_proxy import ScriptedModel  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from agent_rl.policies.models import tiny_model

    return tiny_model(seed=0)


LOOKUP_CALL = '<tool_call>{"name": "lookup", "arguments": {"word": "seven"}}</tool_call>'


def notes_script(messages):
    """The lookup tool on the first turn, then a plain reply, a note, and the answer."""
    last = messages[-1]
    if last["content"].startswith("Note: "):
        return "It is 8."
    if last["content"].startswith("Write a short note"):
        return "Notes: 7 + 1."
    if last["role"] == "tool":
        return "I looked it up."
    return LOOKUP_CALL


def test_tool_calls_and_the_agents_own_compression_are_a_session_tree(tiny, tmp_path):
    model, tok = tiny
    rows = tmp_path / "t.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 7 + 1?", "answer": "8"}) + "\n")
    kwargs = {"agent": NOTES, "tasks": str(rows), "reward": "numeric"}
    tasks = envs.make(ENV_ID, **kwargs).unwrapped.task_pool(1)
    (episode,) = run_episodes(ENV_ID, tasks, ScriptedModel(model, tok, notes_script),
                              Sampling(temperature=0.7), env_kwargs=kwargs)
    assert episode.reward.total == 1.0 and episode.reward.outcome.value == "correct"
    root, child = episode.sessions
    assert (root.metrics["model_calls"], child.metrics["model_calls"]) == (3, 1)
    roles = [t.role for t in root.turns]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert root.turns[2].content == LOOKUP_CALL  # the policy's own text, as it sampled it
    assert root.turns[3].role == "tool" and root.turns[3].name == "lookup"  # its result
    assert root.turns[3].content == "seven: a word"
    assert (child.parent_id, child.origin) == (root.session_id, "compression")
    assert child.boundary.summary == "Notes: 7 + 1."
    assert child.turns[0].content.startswith("Note: Notes: 7 + 1.")
    assert episode.final_session_id == child.session_id and child.used_by_final
    assert root.used_by_final  # its note reached the answer
    assert all(t.token_ids for s in episode.sessions for t in s.turns if t.role == "assistant")


class StreamRecorder:
    """A Policy that records the random stream of every conversation it is given."""

    def __init__(self):
        self.streams: list[tuple[int, ...]] = []

    def generate(self, batch, sampling):
        self.streams += [sampling.stream(b) for b in range(len(batch))]
        return [Completion("5", token_ids=[1], logprobs=[-0.1]) for _ in batch]


def test_each_call_samples_from_its_jobs_own_stream():
    """Job k's c-th call uses the stream (seed + k, c), as the built-in runner keys it; no
    two calls share one, whatever the batch they land in."""
    kwargs = {"agent": NOTES, "tasks": str(DEFAULT_PATH), "reward": "numeric"}
    tasks = envs.make(ENV_ID, **kwargs).unwrapped.task_pool(2)
    policy = StreamRecorder()
    run_episodes(ENV_ID, tasks, policy, Sampling(seed=3), samples_per_task=2, seed=40,
                 env_kwargs=kwargs)
    assert sorted(policy.streams) == [(40 + k, c) for k in range(4) for c in range(4)]


# --- examples/agents/relay_agent.py -------------------------------------------------------------

EXAMPLES = HERE.parents[1] / "examples"
RELAY_TASKS = EXAMPLES / "agents" / "relay_tasks.jsonl"


def test_the_relay_agent_imports_nothing_from_agent_rl():
    import ast

    tree = ast.parse((EXAMPLES / "agents" / "relay_agent.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"__future__", "argparse", "json", "openai"}


def test_the_relay_tasks_file_is_what_its_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_relay_tasks",
                                                  EXAMPLES / "agents" / "make_relay_tasks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = [json.loads(line) for line in RELAY_TASKS.read_text().splitlines()]
    assert rows == script.rows(384, 0)


class CopyingModel:
    """A Policy that writes correct notes (the lines the request names, copied from the
    message) and then ``answer``."""

    def __init__(self, answer: int):
        self.answer = answer
        self.seen: list[list[dict]] = []  # every message list asked, in order

    def reply(self, text: str) -> str:
        if "Question:" in text:
            return str(self.answer)
        heads = text.rsplit("\n\n", 1)[1].split('"')[1::2]  # the lines to copy
        return " ".join(re.search(re.escape(h) + r" \d+[^.\n]*\.", text).group(0)
                        for h in heads)

    def generate(self, batch, sampling):
        out = []
        for messages in batch:
            self.seen.append([dict(m) for m in messages])
            out.append(Completion(self.reply(messages[-1]["content"]), token_ids=[1, 2],
                                  logprobs=[-0.1, -0.2]))
        return out


def relay_agent_kwargs() -> dict:
    from agent_rl.run.contract import ExperimentContract

    kwargs = ExperimentContract.from_yaml(EXAMPLES / "smollm2_agent.yaml").env.kwargs
    return {**kwargs, "agent": f"{EXAMPLES / 'agents' / 'relay_agent.py'}:run",
            "tasks": {**kwargs["tasks"], "path": str(RELAY_TASKS)}}


def test_the_relay_agent_sends_what_relay_v0_shows():
    """Given the same replies, every message list the agent sends is the observation Relay-v0
    shows for the same task (its worked examples, notes, more facts and question)."""
    from envs.relay import RelayEnv

    relay = RelayEnv()
    by_id = {t.task_id: t for t in relay.task_pool(384, seed=0)}  # the file's tasks
    for task in envs.make(ENV_ID, **relay_agent_kwargs()).unwrapped.task_pool(6, seed=0):
        model = CopyingModel(task.target)
        run_episodes(ENV_ID, [task], model, env_kwargs=relay_agent_kwargs())
        obs, _ = relay.reset(options={"task": by_id[task.task_id]})
        shown = [obs]
        while "Question:" not in obs[-1]["content"]:
            obs, *_ = relay.step(model.reply(obs[-1]["content"]))
            shown.append(obs)
        assert model.seen == [[{"role": m["role"], "content": m["content"]} for m in o]
                              for o in shown], task.task_id


def test_the_relay_agent_relays_its_notes_through_a_chain_of_compressions():
    """With correct notes and answers every task scores 1; each episode is as many sessions
    as the task's length, each a compression of the one before."""
    kwargs = relay_agent_kwargs()
    pool = envs.make(ENV_ID, **kwargs).unwrapped.task_pool(6, seed=0)
    assert {t.meta.length for t in pool} == {2, 3}
    for task in pool:
        (episode,) = run_episodes(ENV_ID, [task], CopyingModel(task.target), env_kwargs=kwargs)
        assert episode.reward.total == 1.0, task.task_id
        sessions = episode.sessions
        assert len(sessions) == task.meta.length
        assert [s.origin for s in sessions] == ["root"] + ["compression"] * (len(sessions) - 1)
        assert all(child.parent_id == parent.session_id
                   for parent, child in zip(sessions, sessions[1:], strict=False))
        assert all(s.used_by_final for s in sessions)
