"""Nothing the agent writes raises inside ``env.step``: the hostile corpus of ``envs.checks``
(deep nesting, numbers over Python's 4,300-digit limit, lone surrogates) over every registered
environment, plain and branching, and the parser and bad task data on their own."""

from __future__ import annotations

import json

import pytest

import envs
from envs.checks import check_env_id, hostile_actions
from envs.tools import MAX_JSON_DEPTH, HermesParser, ParseError, ToolCall, clean_text
from trajectories import Episode

# the stepped envs: one that runs whole episodes (Agent-v0) has no step for hostile actions;
# its server refuses bad requests with a 400 (tests/envs/test_agent_proxy.py)
ENV_IDS = [env_id for env_id in envs.list_envs() if not envs.registry.runs_whole_episodes(env_id)]
KWARGS = pytest.mark.parametrize("kwargs", [{}, {"branching": True}], ids=["plain", "branching"])
PARSE = HermesParser().parse


def final_episode(env, action: str) -> Episode:
    """Send ``action`` twice, then "42" until the episode ends."""
    env.reset(seed=0)
    for turn in range(64):
        *_, terminated, truncated, info = env.step(action if turn < 2 else "42")
        if terminated or truncated:
            return info["episode"]
    raise AssertionError("episode never ended")


@pytest.mark.parametrize("env_id", ENV_IDS)
@KWARGS
def test_contract_checks_pass_with_the_hostile_corpus(env_id, kwargs):
    report = check_env_id(env_id, episodes=3, env_kwargs=kwargs)
    assert report.passed, str(report)
    assert "hostile_actions" in {r.name for r in report.results}


@pytest.mark.parametrize("env_id", ENV_IDS)
@KWARGS
def test_step_before_reset_and_after_the_end_is_a_runtime_error(env_id, kwargs):
    env = envs.make(env_id, **kwargs)
    with pytest.raises(RuntimeError, match=r"before reset\(\)"):
        env.step("hello")
    final_episode(env, "hello")
    with pytest.raises(RuntimeError, match=r"after the episode ended"):
        env.step("hello")


@pytest.mark.parametrize("env_id", ENV_IDS)
@pytest.mark.parametrize("action", [
    "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>",
    "9" * 4301,
    "\ud800",
    '<tool_call>{"name": "get", "arguments": {"collection": "people", "id": "\\ud800"}}'
    "</tool_call>",
], ids=["nesting", "digits", "surrogate", "escaped-surrogate"])
def test_the_issue_probes_end_in_a_valid_utf8_episode(env_id, action):
    episode = final_episode(envs.make(env_id), action)
    text = episode.to_json()
    text.encode("utf-8")  # no lone surrogate left
    assert Episode.model_validate_json(text).content_hash == episode.content_hash


def test_parser_refuses_deep_nesting_and_huge_numbers_as_parse_errors():
    for depth in (MAX_JSON_DEPTH + 1, 1000, 100_000):
        (call,) = PARSE("<tool_call>" + "[" * depth + "]" * depth + "</tool_call>")
        assert isinstance(call, ParseError) and "not valid JSON" in call.message
    def parse_argument(value: str):
        (call,) = PARSE('<tool_call>{"name": "x", "arguments": {"a": ' + value + "}}</tool_call>")
        return call

    for extra, parsed in ((0, ToolCall), (1, ParseError)):  # the call's two objects + lists
        lists = "[" * (MAX_JSON_DEPTH - 2 + extra) + "]" * (MAX_JSON_DEPTH - 2 + extra)
        assert isinstance(parse_argument(lists), parsed)  # the same whatever the stack depth
    assert isinstance(parse_argument("9" * 4301), ParseError)


def test_parser_and_turns_replace_lone_surrogates():
    (call,) = PARSE('<tool_call>{"name": "get\\ud800", "arguments": {"id": ["\\udfff"], '
                    '"\\ud800": "\\ud83d\\ude00"}}</tool_call>')
    assert call == ToolCall("get\ufffd", {"id": ["\ufffd"], "\ufffd": "\U0001f600"})
    assert clean_text("ok") == "ok" and clean_text("a\ud800b") == "a\ufffdb"
    assert clean_text("\ud83d\ude00") == "\U0001f600"  # a split pair is joined
    env = envs.make("agent_rl/Records-v0")
    episode = final_episode(env, {"text": "PER-\ud800", "token_ids": [1]})
    assert episode.sessions[0].turns[-1].content == "PER-\ufffd"


def test_the_corpus_holds_the_issue_probes_for_every_tool():
    tools = envs.make("agent_rl/Records-v0").unwrapped.tool_schemas()
    actions = hostile_actions(tools)
    assert "9" * 4301 in actions and "\ud800" in actions
    assert any("[" * 1000 in a for a in actions)
    for name in ("search", "get", "transform", "update"):
        calls = [PARSE(a) for a in actions if f'"name": "{name}"' in a]
        assert any(c and isinstance(c[0], ToolCall) and "\ufffd" in json.dumps(
            c[0].arguments, ensure_ascii=False) for c in calls), name


def test_a_records_task_without_a_target_is_a_clear_error():
    env = envs.make("agent_rl/Records-v0")
    task = env.unwrapped.task_pool(1, seed=0)[0].model_dump()
    for target in (None, {"answer": "x"}, "Lyon"):
        with pytest.raises(ValueError, match=r"Records task 'records-0-0' has no valid target"):
            env.reset(options={"task": {**task, "target": target}})
