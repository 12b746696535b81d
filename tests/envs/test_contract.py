"""The environment contract, checked over every registered id (Gymnasium's ``check_env`` over
the registry, plus what agent-rl adds): scripted episodes reach the maximum reward, nothing the
agent sends raises, seeds repeat, budgets truncate, and the runner returns one episode per job.

New environments are picked up from ``envs.list_envs()`` without editing this file. An
environment that is not stepped (its class has ``run_whole_episodes``: ``agent_rl/Agent-v0``
runs a user's agent, which makes its own calls; ``envs.runner``) has no actions to send: its
contract is tests/envs/test_contract_whole_episodes.py, which fails for any such id it does not
cover.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.checks import hostile_actions
from envs.core import ChatSpace, TaskSpec
from envs.runner import Completion, Sampling, run_episodes
from envs.tools import ToolCall
from trajectories import Episode, Outcome

ENV_IDS = [env_id for env_id in envs.list_envs() if not envs.registry.runs_whole_episodes(env_id)]
REFERENCE_SEEDS = range(30)
MAX_REFERENCE_STEPS = 200

pytestmark = pytest.mark.parametrize("env_id", ENV_IDS)


# --- helpers ----------------------------------------------------------------------------------


def assert_valid_episode(episode: Episode, env_id: str) -> None:
    """What every consumer of an episode relies on."""
    assert isinstance(episode, Episode)
    assert episode.env_id == env_id
    tree = episode.tree.validate()
    assert episode.sessions[0].origin == "root" and tree.root is episode.sessions[0]
    assert all(s.episode_id == episode.episode_id for s in episode.sessions)
    assert episode.final_session_id is None or episode.final_session_id in tree
    assert episode.hash_ok()
    assert Episode.model_validate_json(episode.to_json()).content_hash == episode.content_hash
    reward = episode.reward
    assert math.isclose(reward.total, sum(reward.weights.get(k, 0.0) * v
                                          for k, v in reward.components.items()), abs_tol=1e-9)
    assistant_turns = sum(t.role == "assistant" for s in episode.sessions  # the agent's own,
                          for t in s.turns[s.metrics["opening_turns"]:])  # not worked examples
    assert assistant_turns == reward.audit["assistant_turns"]
    assert episode.task_meta and episode.task_meta["length"] >= 1


def max_reward(env) -> float:
    return sum(env.unwrapped.reward_weights.values())


def run_reference(env, **reset_kwargs) -> tuple[Episode, bool, bool]:
    """Drive one episode with the scripted solver; (episode, terminated, truncated)."""
    env.reset(**reset_kwargs)
    for _ in range(MAX_REFERENCE_STEPS):
        action = env.unwrapped.reference_action()
        if action is None:
            pytest.skip(f"{env.unwrapped.env_id} has no scripted solver")
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return info["episode"], terminated, truncated
    raise AssertionError(f"reference episode did not end in {MAX_REFERENCE_STEPS} steps")


def run_actions(env, actions: list[str], **reset_kwargs) -> tuple[Episode, bool, bool]:
    """Send `actions` (cycled) until the episode ends; (episode, terminated, truncated)."""
    obs, info = env.reset(**reset_kwargs)
    for k in range(10_000):
        assert env.observation_space.contains(obs)
        obs, reward, terminated, truncated, info = env.step(actions[k % len(actions)])
        assert isinstance(reward, float) and math.isfinite(reward)
        if terminated or truncated:
            return info["episode"], terminated, truncated
        assert reward == 0.0
    raise AssertionError("episode never ended")


def tool_call(name, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def adversarial_actions(tools: list[dict], rng: np.random.Generator) -> list[str]:
    """Texts a bad or untrained policy sends, built for this env's tool schemas."""
    alphabet = list("abcxyz019 {}[]<>/\"':,.\n\t") + ["é", "中", "🙂", "\x00", "\u202e"]
    actions = [
        "",
        "   \n ",
        "x" * 1_000_000,
        "<tool_call>",
        "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"a\"}}",  # no closing tag
        "<tool_call>{not json}</tool_call>",
        "<tool_call>{\"name\": \"search\", \"arguments\": {</tool_call>",
        "<tool_call>[1, 2, 3]</tool_call>",
        "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": \"not json\"}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": NaN, \"b\": Infinity}}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": 1e999}}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": %s}}</tool_call>" % ("9" * 5000),
        "</tool_call><tool_call></tool_call>",
        tool_call("no_such_tool", {}),
        tool_call("spawn", {"task": "do the whole thing"}),
        tool_call("spawn", {"task": ""}),
        tool_call("return", {"value": "done"}),
        tool_call("return", {"value": 7}),
        tool_call("no_such_tool", {}) * 20,  # over the per-turn call limit
        "<masked></masked><masked>[NAME]</masked>",
        "The answer is 42.",
    ]
    actions += ["".join(rng.choice(alphabet, size=int(rng.integers(1, 200)))) for _ in range(6)]
    actions += hostile_actions(tools)  # deep nesting, > 4,300 digits, lone surrogates
    wrong_values = [None, 1, -1, 2**70, 1.5, "x", [], [1, "a"], {"nested": {"deep": None}}, True]
    for schema in tools:
        fn = schema["function"]
        props = fn.get("parameters", {}).get("properties", {})
        actions.append(tool_call(fn["name"], {}))  # missing arguments
        actions.append(tool_call(fn["name"], {"unexpected_argument": 1}))
        for value in wrong_values:  # wrong types (and, by chance, some right ones)
            actions.append(tool_call(fn["name"], dict.fromkeys(props, value)))
        for variant in range(2):  # right types, made-up values (unknown ids, out-of-scope writes)
            actions.append(tool_call(fn["name"], {
                p: _typed_value(spec.get("type"), variant) for p, spec in props.items()}))
        # NaN / Infinity (plain json.loads accepts them) must not poison the episode record
        nan_args = ", ".join(f'"{p}": NaN' for p in props)
        actions.append(f'<tool_call>{{"name": "{fn["name"]}", "arguments": {{{nan_args}}}}}</tool_call>')
    return actions


def _typed_value(json_type, variant: int):
    return {"string": ["x", "1"], "integer": [0, -1], "number": [1e308, -0.5],
            "boolean": [True, False], "array": [[], ["x"]], "object": [{}, {"x": 1}],
            }.get(json_type, ["x", None])[variant]


def first_tool_call(env) -> str | None:
    """The reference's first action when it calls the env's own tools (else None)."""
    env.reset(seed=0)
    action = env.unwrapped.reference_action()
    if action is None:
        return None
    calls = env.unwrapped.parser.parse(action)
    ok = calls and all(isinstance(c, ToolCall) and c.name not in ("spawn", "return") for c in calls)
    return action if ok else None


# --- the contract -----------------------------------------------------------------------------


def test_gymnasium_check_env(env_id):
    env = envs.make(env_id)
    check_env(env.unwrapped)
    assert isinstance(env.observation_space, ChatSpace)


def test_task_pool_is_deterministic_and_meta_is_filled(env_id):
    env = envs.make(env_id).unwrapped
    pool = env.task_pool(20, seed=7)
    assert len(pool) == 20 and all(isinstance(t, TaskSpec) for t in pool)
    assert pool == env.task_pool(20, seed=7)
    assert envs.make(env_id).unwrapped.task_pool(20, seed=7) == pool
    assert pool != env.task_pool(20, seed=8)
    assert len({t.task_id for t in pool}) == len(pool)
    for task in pool:
        assert task.prompt.strip()
        meta = task.meta
        assert meta.skills and all(isinstance(s, str) and s for s in meta.skills)
        assert meta.structure and meta.entity_group
        assert meta.length >= 1 and meta.difficulty >= 0


def test_reference_episodes_reach_max_reward(env_id):
    env = envs.make(env_id)
    best = max_reward(env)
    for seed in REFERENCE_SEEDS:
        episode, terminated, truncated = run_reference(env, seed=seed)
        assert terminated and not truncated, f"seed {seed}: {episode.reward.audit}"
        assert episode.reward.outcome == Outcome.correct, f"seed {seed}: {episode.reward}"
        assert episode.reward.total == pytest.approx(best), f"seed {seed}: {episode.reward}"
        assert_valid_episode(episode, env_id)


def test_reference_solves_pool_tasks(env_id):
    env = envs.make(env_id)
    for task in env.unwrapped.task_pool(5, seed=123):
        episode, terminated, _ = run_reference(env, seed=0, options={"task": task})
        assert terminated and episode.task_id == task.task_id
        assert episode.reward.total == pytest.approx(max_reward(env))


def test_same_seed_same_episode(env_id):
    first, second = envs.make(env_id), envs.make(env_id)
    for seed in (0, 1, 17):
        a, _, _ = run_reference(first, seed=seed)
        b, _, _ = run_reference(second, seed=seed)
        assert a.content_hash == b.content_hash
    actions = adversarial_actions(first.unwrapped.tool_schemas(), np.random.default_rng(0))[:8]
    a, _, _ = run_actions(first, actions, seed=5)
    b, _, _ = run_actions(second, actions, seed=5)
    assert a.content_hash == b.content_hash


@pytest.mark.parametrize("kwargs", [{"max_turns": 6},
                                    {"max_turns": 6, "branching": True, "context_budget": 400}],
                         ids=["plain", "branching+compression"])
def test_adversarial_actions_never_raise(env_id, kwargs):
    env = envs.make(env_id, **kwargs)
    env.reset(seed=0)
    actions = adversarial_actions(env.unwrapped.tool_schemas(), np.random.default_rng(1))
    rng = np.random.default_rng(2)
    for k, action in enumerate(actions):  # each action once, then a plain answer ...
        episode, _, _ = run_actions(env, [action, "The answer is 42."], seed=k)
        assert_valid_episode(episode, env_id)
    for k in range(15):  # ... and in random sequences
        seq = [actions[i] for i in rng.integers(len(actions), size=kwargs["max_turns"])]
        episode, _, _ = run_actions(env, seq, seed=100 + k)
        assert_valid_episode(episode, env_id)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hypothesis_actions_never_raise(env_id, data):
    env = envs.make(env_id, max_turns=4, branching=True)
    env.reset(seed=0)
    names = [t["function"]["name"] for t in env.unwrapped.tool_schemas()] + ["nope", "spawn"]
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                               lambda inner: st.lists(inner, max_size=3)
                               | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                               max_leaves=6)
    call = st.builds(tool_call, st.sampled_from(names),
                     st.dictionaries(st.text(max_size=8), json_values, max_size=3))
    action = st.one_of(st.text(max_size=300), call, call.map(lambda s: s[:-len("</tool_call>")]))
    actions = data.draw(st.lists(action, min_size=1, max_size=4))
    episode, _, _ = run_actions(env, actions, seed=data.draw(st.integers(0, 2**31 - 1)))
    assert_valid_episode(episode, env_id)


def test_out_of_budget_episodes_truncate(env_id):
    malformed = "<tool_call>{\"name\": oops}</tool_call>"
    env = envs.make(env_id, max_turns=3)
    episode, terminated, truncated = run_actions(env, [malformed], seed=0)
    assert truncated and not terminated
    assert episode.reward.outcome == Outcome.format_error and episode.reward.total == 0.0
    assert episode.final_session_id is None
    assert_valid_episode(episode, env_id)

    env = envs.make(env_id, max_turns=3, branching=False)  # a valid call stays valid at the root
    call = first_tool_call(env)
    if call is None:  # an env without tools: every call names an unknown tool
        call, expected = tool_call("no_such_tool", {}), Outcome.format_error
    else:
        expected = Outcome.truncated
    episode, terminated, truncated = run_actions(env, [call], seed=0)
    assert truncated and not terminated
    assert episode.reward.outcome == expected and episode.reward.total == 0.0
    assert episode.reward.audit["truncated_by"] == "max_turns"
    assert_valid_episode(episode, env_id)


class ReplayPolicy:
    """A Policy that answers every conversation with the same text (and fake tokens)."""

    def __init__(self, text: str):
        self.text = text
        self.batches: list[int] = []

    def generate(self, batch, sampling):
        assert all(ChatSpace().contains(messages) for messages in batch)
        self.batches.append(len(batch))
        return [Completion(self.text, token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
                for _ in batch]


def test_runner_returns_one_episode_per_job(env_id):
    tasks = envs.make(env_id).unwrapped.task_pool(4, seed=3)
    policy = ReplayPolicy("I am not sure.")
    episodes = run_episodes(env_id, tasks, policy, sampling=Sampling(temperature=0.0),
                            samples_per_task=2, num_envs=3, seed=11,
                            env_kwargs={"max_turns": 4}, group_prefix="g/")
    assert len(episodes) == 8
    assert max(policy.batches) == 3
    jobs = [(task.task_id, j) for task in tasks for j in range(2)]
    assert [(e.task_id, e.sample_id) for e in episodes] == jobs
    assert [e.group_id for e in episodes] == [f"g/{task_id}" for task_id, _ in jobs]
    assert len({e.episode_id for e in episodes}) == 8
    for episode in episodes:
        assert_valid_episode(episode, env_id)
        assert episode.generation["temperature"] == 0.0
        generated = [t for s in episode.sessions for t in s.turns[s.metrics["opening_turns"]:]
                     if t.role == "assistant"]
        assert generated and all(t.token_ids == [1, 2, 3] for t in generated)
    again = run_episodes(env_id, tasks, ReplayPolicy("I am not sure."), samples_per_task=2,
                         num_envs=3, seed=11, env_kwargs={"max_turns": 4}, group_prefix="g/",
                         sampling=Sampling(temperature=0.0))
    assert [e.content_hash for e in again] == [e.content_hash for e in episodes]
