"""The session tree inferred from an agent's model calls (trajectories.calls), on hand-built
call logs. Token ids are the characters of ``role:content|`` per message, so a prompt that
repeats an earlier prompt and its reply starts with that call's ids, as the server's are."""

import pytest

from trajectories import ModelCall, StatedPlace, sessions_from_calls
from trajectories.models import Episode, RewardBreakdown


def render(messages):
    return [ord(ch) for m in messages for ch in f"{m['role']}:{m['content']}|"]


def call(index, started, ended, messages, reply, stated=None, tool_calls=None):
    completion = render([{"role": "assistant", "content": reply}])
    return ModelCall(index=index, started=started, ended=ended, messages=messages,
                     prompt_ids=render(messages),
                     reply={"role": "assistant", "content": reply, "tool_calls": tool_calls},
                     completion_ids=completion, logprobs=[-0.25] * len(completion),
                     finish_reason="stop", revision=7, stated=stated)


SYS = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Find the code of PRD-7."}


def said(text):
    return {"role": "assistant", "content": text}


def tool(text):
    return {"role": "tool", "content": text}


def user(text):
    return {"role": "user", "content": text}


def episode(tree):
    reward = RewardBreakdown.from_components({"correct": 1.0}, {"correct": 1.0}, "correct", "t@1")
    return Episode(episode_id="e", env_id="agent_rl/Agent-v0", env_version=1, task_id="t",
                   group_id="g", sessions=tree.sessions, reward=reward)


def test_a_tool_loop_is_one_session_with_every_generated_turn_carrying_its_ids():
    m1 = [SYS, TASK]
    m2 = [*m1, said("lookup(PRD-7)"), tool("code 42")]
    m3 = [*m2, said("lookup(done)"), tool("ok")]
    calls = [call(0, 0, 1, m1, "lookup(PRD-7)"), call(1, 2, 3, m2, "lookup(done)"),
             call(2, 4, 5, m3, "42")]
    tree = sessions_from_calls(calls, "e")
    assert [s.session_id for s in tree.sessions] == ["e/s0"]
    assert tree.session_of == {0: "e/s0", 1: "e/s0", 2: "e/s0"}
    turns = tree.sessions[0].turns
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "assistant",
                                       "tool", "assistant"]
    assert [t.generated for t in turns] == [False, False, True, False, True, False, True]
    assert turns[2].token_ids == calls[0].completion_ids
    assert turns[4].logprobs == calls[1].logprobs
    assert tree.sessions[0].policy_revision == 7
    assert tree.sessions[0].metrics == {"model_calls": 3}
    episode(tree)  # a valid episode record


def test_worked_examples_in_the_first_prompt_stay_prompt_turns():
    m1 = [SYS, user("2+2?"), said("4"), TASK]  # a worked example before the task
    m2 = [*m1, said("lookup(PRD-7)"), tool("code 42")]
    tree = sessions_from_calls([call(0, 0, 1, m1, "lookup(PRD-7)"),
                                call(1, 2, 3, m2, "42")], "e")
    turns = tree.sessions[0].turns
    assert [t.generated for t in turns] == [False, False, False, False, True, False, True]
    assert turns[2].content == "4" and turns[2].token_ids is None


def test_a_compression_the_agent_does_itself():
    m1 = [SYS, TASK]
    m2 = [*m1, said("lookup(PRD-7)"), tool("code 42"), user("Summarize what you know.")]
    m3 = [SYS, TASK, user("Notes: PRD-7 has code 42.")]  # a fresh list carrying the summary
    calls = [call(0, 0, 1, m1, "lookup(PRD-7)"), call(1, 2, 3, m2, "PRD-7 has code 42."),
             call(2, 4, 5, m3, "42")]
    tree = sessions_from_calls(calls, "e")
    root, child = tree.sessions
    assert (child.parent_id, child.origin) == ("e/s0", "compression")
    assert child.boundary.summary == "PRD-7 has code 42."
    assert child.boundary.before == [*m2, said("PRD-7 has code 42.")]
    assert child.boundary.after == m3
    assert child.boundary.parent_turn == 5  # the summary is the root's sixth turn
    assert episode(tree).final_session.session_id == "e/s1"


def test_sequential_sub_agents_are_siblings_and_return_their_last_reply():
    m1 = [SYS, TASK]
    a1 = [user("Sub-task: find PRD-7's owner.")]
    a2 = [*a1, said("lookup(owner)"), tool("Ann")]
    b1 = [user("Sub-task: find PRD-7's code.")]
    m2 = [*m1, said("spawn(owner); spawn(code)"), tool("Ann"), tool("code 42")]
    calls = [call(0, 0, 1, m1, "spawn(owner); spawn(code)"),
             call(1, 2, 3, a1, "lookup(owner)"), call(2, 4, 5, a2, "Ann"),
             call(3, 6, 7, b1, "code 42"),  # B starts after A's last call: A is done
             call(4, 8, 9, m2, "Ann, 42")]
    tree = sessions_from_calls(calls, "e")
    root, a, b = tree.sessions
    assert [(s.parent_id, s.origin) for s in (a, b)] == [("e/s0", "branch")] * 2
    assert (a.boundary.returned, b.boundary.returned) == ("Ann", "code 42")
    assert a.boundary.parent_turn == b.boundary.parent_turn == 2
    assert tree.session_of == {0: "e/s0", 1: "e/s1", 2: "e/s1", 3: "e/s2", 4: "e/s0"}


def test_parallel_sub_agents_whose_first_calls_overlap():
    m1 = [SYS, TASK]
    a1, b1 = [user("Sub-task A")], [user("Sub-task B")]
    a2 = [*a1, said("lookup(a)"), tool("x")]
    m2 = [*m1, said("spawn(a); spawn(b)"), tool("x"), tool("y")]
    calls = [call(0, 0, 1, m1, "spawn(a); spawn(b)"),
             call(1, 2.0, 3.0, a1, "lookup(a)"), call(2, 2.01, 3.0, b1, "y"),  # batched together
             call(3, 3.5, 4, a2, "x"), call(4, 5, 6, m2, "x, y")]
    tree = sessions_from_calls(calls, "e")
    assert [(s.session_id, s.parent_id, s.origin) for s in tree.sessions] == [
        ("e/s0", None, "root"), ("e/s1", "e/s0", "branch"), ("e/s2", "e/s0", "branch")]
    assert tree.session_of[3] == "e/s1"


def test_a_sub_agent_that_compresses_keeps_its_compression_under_it():
    m1 = [SYS, TASK]
    a1 = [user("Sub-task A")]
    a2 = [*a1, said("lookup(a)"), tool("x"), user("Summarize.")]
    a3 = [user("Sub-task A"), user("Notes: a is x.")]
    m2 = [*m1, said("spawn(a)"), tool("x")]
    calls = [call(0, 0, 1, m1, "spawn(a)"), call(1, 2, 3, a1, "lookup(a)"),
             call(2, 4, 5, a2, "a is x."), call(3, 6, 7, a3, "x"), call(4, 8, 9, m2, "x")]
    tree = sessions_from_calls(calls, "e")
    assert [(s.parent_id, s.origin) for s in tree.sessions] == [
        (None, "root"), ("e/s0", "branch"), ("e/s1", "compression")]
    assert tree.sessions[1].boundary.returned == "a is x."  # the sub-agent's last reply


def test_a_stated_place_wins_over_inference():
    m1 = [SYS, TASK]
    a1 = [user("Sub-task A")]
    calls = [call(0, 0, 1, m1, "spawn(a)", stated=StatedPlace(session="main")),
             call(1, 2, 3, a1, "x", stated=StatedPlace(session="helper", parent="main",
                                                       origin="branch")),
             # states 'helper' and continues it, though the prompt also extends 'main'
             call(2, 4, 5, [*a1, said("x"), *m1[1:]], "y", stated=StatedPlace(session="helper"))]
    tree = sessions_from_calls(calls, "e")
    assert [(s.session_id, s.parent_id, s.origin) for s in tree.sessions] == [
        ("main", None, "root"), ("helper", "main", "branch")]
    assert tree.session_of == {0: "main", 1: "helper", 2: "helper"}  # parent never continues


def test_bad_logs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="no model call"):
        sessions_from_calls([], "e")
    calls = [call(0, 0, 1, [SYS, TASK], "a"),
             call(1, 2, 3, [TASK], "b", stated=StatedPlace(parent="nobody"))]
    with pytest.raises(ValueError, match="states parent 'nobody'"):
        sessions_from_calls(calls, "e")
    with pytest.raises(ValueError, match="log-probs"):
        ModelCall(index=0, started=0, ended=1, messages=[], prompt_ids=[1], reply={},
                  completion_ids=[1, 2], logprobs=[-1.0], finish_reason="stop")
    rewritten = [call(0, 0, 1, [SYS], "a", stated=StatedPlace(session="main")),
                 call(1, 2, 3, [TASK], "b", stated=StatedPlace(session="main"))]
    with pytest.raises(ValueError, match="does not continue that session's last call"):
        sessions_from_calls(rewritten, "e")
    with pytest.raises(ValueError, match="indices repeat"):
        sessions_from_calls([call(0, 0, 1, [TASK], "a"), call(0, 2, 3, [SYS], "b")], "e")
