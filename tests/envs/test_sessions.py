"""envs.sessions and the ToolEnv loop around it: control actions are their own types, usage
(``used_by_final``) is data flow on hand-built episodes, the loop's guard rails (step before
reset, a prompt the policy refused, compression at reset) and the token counter hand-off."""

from __future__ import annotations

import json

import pytest

import envs
from envs.core import PROMPT_TOO_LONG, TaskSpec, ToolEnv
from envs.sessions import (
    Return,
    SessionRecorder,
    Spawn,
    Summary,
    content_tokens,
    control_action,
    used_by_data_flow,
)
from envs.tools import HermesParser, ParseError, ToolCall, ToolResult
from trajectories import Boundary, Episode, Outcome, RewardBreakdown, Session, Turn

PARSE = HermesParser().parse


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def me(text: str) -> Turn:
    return Turn(role="assistant", content=text, token_ids=[1, 2], logprobs=[-0.1, -0.2])


def branch_episode(returned: str, later: list[Turn], final: str | None = "The code is 42.",
                   before: list[Turn] = ()) -> Episode:
    """root s0 spawns sub-agent s1 (which returns ``returned``), then writes ``later`` and
    answers ``final`` (None: the episode ended without an answer)."""
    spawn = me(call("spawn", task="find the code"))
    root_turns = [Turn(role="system", content="Solve it."), Turn(role="user", content="task"),
                  *before, spawn, Turn(role="tool", name="spawn", content=returned), *later]
    if final is not None:
        root_turns.append(me(final))
    root = Session(session_id="e/s0", episode_id="e", turns=root_turns)
    branch = Session(session_id="e/s1", parent_id="e/s0", episode_id="e", origin="branch",
                     boundary=Boundary(kind="branch", parent_turn=2 + len(before), returned=returned),
                     turns=[Turn(role="system", content="sub-agent"),
                            Turn(role="user", content="find the code"), me(returned)])
    return Episode(episode_id="e", env_id="agent_rl/Hand-v0", env_version=0, task_id="t",
                   group_id="t", sessions=[root, branch],
                   final_session_id="e/s0" if final is not None else None,
                   reward=RewardBreakdown.from_components({"a": 1.0}, {"a": 1.0}, Outcome.correct,
                                                          "hand@1"))


def test_recorded_messages_are_copies_a_caller_may_change():
    """SessionRecorder.messages: the policy's own tokens ride on its messages, tool calls
    included; changing what it returned (nested lists too) leaves the record alone."""
    calls = [{"type": "function", "function": {"name": "spawn", "arguments": {"task": "x"}}}]
    rec = SessionRecorder("e", [Turn(role="system", content="Solve it."), Turn(role="user", content="task")])
    rec.add(Turn(role="assistant", content="<tool_call>", token_ids=[5, 6], logprobs=[-0.1, -0.2],
                 tool_calls=calls))
    first = rec.messages()
    assert first[2] == {"role": "assistant", "content": "<tool_call>", "tool_calls": calls,
                        "token_ids": [5, 6]}
    assert "token_ids" not in first[0]
    first[2]["token_ids"].append(7)
    first[2]["tool_calls"][0]["function"]["arguments"]["task"] = "changed"
    first[0]["content"] = "changed"
    again = rec.messages()
    assert again[2]["token_ids"] == [5, 6] and again[0]["content"] == "Solve it."
    assert again[2]["tool_calls"][0]["function"]["arguments"] == {"task": "x"}
    assert rec.turns()[2].token_ids == [5, 6]


# --- control actions ---------------------------------------------------------------------------


def test_control_actions_are_types_not_tools():
    assert control_action(ToolCall("spawn", {"task": "find it"}), True, False) == Spawn("find it")
    assert control_action(ToolCall("return", {"value": 7}), False, True) == Return("7")
    assert control_action(ToolCall("return", {}), False, True) == Return("")
    bad = control_action(ToolCall("spawn", {"task": "  "}), True, False)
    assert isinstance(bad, ToolResult) and bad.error == "format" and "non-empty" in bad.content
    # not available here: an ordinary (unknown) tool call for dispatch to report
    assert control_action(ToolCall("spawn", {"task": "x"}), False, False) is None
    assert control_action(ToolCall("return", {"value": "x"}), False, False) is None
    assert control_action(ParseError("broken"), True, True) is None
    assert Summary("notes").text == "notes"
    # a plain env has no spawn/return tool methods any more; the schemas come from sessions
    env = envs.make("agent_rl/Records-v0", branching=True).unwrapped
    assert "spawn" not in env._tools and "return" not in env._tools
    env.reset(seed=0)
    assert [t["function"]["name"] for t in env.tool_schemas()][-1] == "spawn"


# --- usage by data flow ------------------------------------------------------------------------


def test_content_tokens_drop_stop_words_and_placeholders():
    assert content_tokens("The answer is unknown.") == set()
    assert content_tokens("I could not find it, sorry") == set()
    assert content_tokens("PRD-0042: 40") == {"prd-0042", "40"}
    assert content_tokens("ana@mail.test lives in Lyon") == {"ana@mail.test", "lives", "lyon"}


def test_a_branch_that_returned_nothing_of_content_is_not_used():
    episode = branch_episode("the answer is unknown", later=[])
    assert used_by_data_flow(episode, PARSE) == {"e/s0": True, "e/s1": False}
    # the final answer contains "answer" and "is": still no content crossed
    episode = branch_episode("the answer is unknown", later=[], final="The answer is 42.")
    assert used_by_data_flow(episode, PARSE)["e/s1"] is False


def test_a_branch_is_used_when_a_later_tool_argument_or_the_answer_consumes_its_value():
    by_argument = branch_episode("PRD-0042", later=[me(call("get", collection="products",
                                                              id="PRD-0042"))],
                                 final="done")
    assert used_by_data_flow(by_argument, PARSE) == {"e/s0": True, "e/s1": True}
    by_answer = branch_episode("42", later=[])
    assert used_by_data_flow(by_answer, PARSE)["e/s1"] is True
    # mentioned only in prose, not consumed: not used
    prose = branch_episode("PRD-0042", later=[me("Interesting, PRD-0042.")], final="done")
    assert used_by_data_flow(prose, PARSE)["e/s1"] is False
    # mentioned before the spawn only: not used
    earlier = branch_episode("PRD-0042", later=[], final="done",
                             before=[me(call("get", collection="products", id="PRD-0042")),
                                     Turn(role="tool", name="get", content="{}")])
    assert used_by_data_flow(earlier, PARSE)["e/s1"] is False


def test_no_answer_means_no_session_was_used():
    episode = branch_episode("42", later=[me("42")], final=None)
    assert used_by_data_flow(episode, PARSE) == {"e/s0": False, "e/s1": False}


def test_consumption_in_a_later_compression_of_the_parent_counts():
    root = Session(session_id="e/s0", episode_id="e", turns=[
        Turn(role="user", content="task"), me(call("spawn", task="city of PER-1")),
        Turn(role="tool", name="spawn", content="Lyon"), me("Summary: PER-1 lives in Lyon.")])
    branch = Session(session_id="e/s1", parent_id="e/s0", episode_id="e", origin="branch",
                     boundary=Boundary(kind="branch", parent_turn=1, returned="Lyon"),
                     turns=[Turn(role="user", content="city of PER-1"), me("Lyon")])
    child = Session(session_id="e/s2", parent_id="e/s0", episode_id="e", origin="compression",
                    boundary=Boundary.compression(root.messages(), [{"role": "user", "content": "t"}],
                                                  "Summary: PER-1 lives in Lyon."),
                    turns=[Turn(role="user", content="task + summary"), me("Lyon")])
    reward = RewardBreakdown.from_components({"a": 1.0}, {"a": 1.0}, Outcome.correct, "hand@1")
    episode = Episode(episode_id="e", env_id="x/Hand-v0", env_version=0, task_id="t",
                      group_id="t", sessions=[root, branch, child], final_session_id="e/s2",
                      reward=reward)
    assert used_by_data_flow(episode, PARSE) == {"e/s0": True, "e/s1": True, "e/s2": True}
    ignored = episode.evolve(sessions=[root, branch, child.model_copy(update={"turns": [
        Turn(role="user", content="task + summary"), me("Paris")]})])
    assert used_by_data_flow(ignored, PARSE) == {"e/s0": True, "e/s1": False, "e/s2": True}


def drive_long_records(branch_reply: str | None):
    """LongRecords-v0 by its scripted solver; the sub-agent's final reply replaced."""
    env = envs.make("agent_rl/LongRecords-v0")
    task = min(env.unwrapped.task_pool(12, seed=1), key=lambda t: t.meta.length)
    env.reset(seed=0, options={"task": task})
    for _ in range(100):
        text = env.unwrapped.reference_action()
        if env.unwrapped.in_branch and "<tool_call>" not in text and branch_reply is not None:
            text = branch_reply
        *_, terminated, truncated, info = env.step(text)
        if terminated or truncated:
            return info["episode"]
    raise AssertionError("did not finish")


def test_records_counts_only_record_ids_and_values_as_what_a_branch_carries():
    solved = drive_long_records(None)
    assert all(s.used_by_final for s in solved.sessions)
    # The scripted parent goes on as if it had the value (it knows the answer), but nothing
    # of the store crossed back: the sub-agent is not used; the root thread still is.
    ignored = drive_long_records("I searched people, products and orders")
    used = {s.origin: s.used_by_final for s in ignored.sessions if s.origin != "compression"}
    assert used == {"root": True, "branch": False}
    assert all(s.used_by_final for s in ignored.sessions if s.origin != "branch")
    # the generic rule alone calls it used: the collection's name is a later tool argument
    generic = used_by_data_flow(ignored, PARSE)
    branch = next(s.session_id for s in ignored.sessions if s.origin == "branch")
    assert generic[branch] is True


# --- the loop's guard rails --------------------------------------------------------------------


def test_step_before_reset_and_after_the_end_are_clear_errors():
    env = envs.make("agent_rl/Arithmetic-v0")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("42")
    env.reset(seed=0)
    *_, terminated, _, _ = env.step("42")
    assert terminated
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("42")


def test_a_prompt_the_policy_refused_ends_the_episode_truncated():
    env = envs.make("agent_rl/Arithmetic-v0")
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(
        {"text": "", "finish_reason": PROMPT_TOO_LONG, "policy_revision": 3})
    episode = info["episode"]
    assert truncated and not terminated and reward == 0.0
    assert episode.reward.outcome == Outcome.truncated
    assert episode.reward.audit["truncated_by"] == "max_prompt_tokens"
    assert not any(t.role == "assistant" for t in episode.sessions[0].turns)  # nothing generated


class TinyBudget(ToolEnv):
    env_id = "tests/TinyBudget-v0"

    def task_pool(self, n, seed=0):
        return [TaskSpec(task_id=f"t{i}", prompt="a long task " * 20) for i in range(n)]

    def score(self, task, answer, state):
        return RewardBreakdown.from_components({"accuracy": 1.0}, {"accuracy": 1.0},
                                               Outcome.correct, "tiny@0")


def test_a_context_over_budget_at_reset_asks_for_a_summary_at_once():
    env = TinyBudget(context_budget=10)
    obs, info = env.reset(seed=0)
    assert info["awaiting_summary"] and obs[-1]["role"] == "user" and "summary" in obs[-1]["content"]
    env.context_budget = 10_000  # the continuation fits
    obs, _, _, _, info = env.step({"text": "my note", "token_ids": [5], "logprobs": [-0.5],
                                   "policy_revision": 2})
    assert not info["awaiting_summary"] and "my note" in obs[1]["content"]
    *_, info = env.step("done")
    root, child = info["episode"].sessions
    assert child.origin == "compression" and child.boundary.summary == "my note"
    assert root.policy_revision == 2 and child.policy_revision is None


def test_the_driver_can_count_the_budget_with_the_policy_tokenizer():
    env = TinyBudget(context_budget=10)
    counted = []
    env.use_token_counter(lambda messages: counted.append(len(messages)) or 0)
    _, info = env.reset(seed=0)
    assert counted and not info["awaiting_summary"]  # the installed counter decided
    mine = TinyBudget(context_budget=10, token_counter=lambda messages: 10_000)
    mine.use_token_counter(lambda messages: 0)  # a counter given at construction stays
    _, info = mine.reset(seed=0)
    assert info["awaiting_summary"]


class Coached(TinyBudget):
    """A branching env whose sub-agents open with a worked example and whose root is asked
    to answer after each sub-agent's result."""

    env_id = "tests/Coached-v0"

    def branch_examples(self, compressions):
        return [("example sub-task", "example result")] if compressions == 0 else [
            ("example after a summary", "example continued")]

    def return_request(self, value):
        return f"It said {value}. Answer now."


def test_branch_examples_open_a_sub_agent_and_return_request_follows_its_result():
    env = Coached(branching=True, context_budget=None)
    env.reset(seed=0)
    obs, *_ = env.step(call("spawn", task="find the code"))
    assert [(m["role"], m["content"]) for m in obs[1:]] == [
        ("user", "example sub-task"), ("assistant", "example result"),
        ("user", "find the code")]
    obs, *_ = env.step("42")  # the sub-agent returns
    assert [(m["role"], m.get("name"), m["content"]) for m in obs[-2:]] == [
        ("tool", "spawn", "42"), ("user", None, "It said 42. Answer now.")]
    *_, info = env.step("42")
    root, branch = info["episode"].sessions
    assert branch.metrics["opening_turns"] == 4  # system, the example pair, the task
    assert root.turns[-1].content == "42" and branch.used_by_final


def test_a_compressed_sub_agent_continues_from_its_task_not_its_example():
    env = Coached(branching=True, context_budget=10_000)
    env.reset(seed=0)
    env.context_budget = 10  # the sub-agent's context is over budget once it opens
    obs, *_ = env.step(call("spawn", task="find the code"))
    assert "summary" in obs[-1]["content"]
    env.context_budget = 10_000
    obs, *_ = env.step("code starts with 4")
    assert [m["content"] for m in obs[1:3]] == ["example after a summary", "example continued"]
    assert obs[3]["content"].startswith("find the code\n\n")  # the task, not the example
    assert obs[3]["content"].endswith("Summary of your progress so far:\ncode starts with 4")


def test_without_the_hooks_sub_agents_open_bare_and_results_stand_alone():
    env = TinyBudget(branching=True)
    env.reset(seed=0)
    obs, *_ = env.step(call("spawn", task="find the code"))
    assert [m["role"] for m in obs] == ["system", "user"]
    obs, *_ = env.step("42")
    assert [m["role"] for m in obs][-2:] == ["assistant", "tool"]
