"""The session tree inferred from an agent's model calls (trajectories.calls), on hand-built
call logs. Token ids are the characters of ``role:content|`` per message, so a prompt that
repeats an earlier prompt and its reply starts with that call's ids, as the server's are."""

import pytest

from trajectories import Continuation, ModelCall, StatedPlace, sessions_from_calls
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


# --- without token ids: the same rules on messages -------------------------------------------


def bare(calls):
    """The log as an endpoint that reports no ids leaves it (an OpenAI-compatible server
    under evaluation): no prompt ids, no sampled ids, no log-probs."""
    return [c.model_copy(update={"prompt_ids": [], "completion_ids": [], "logprobs": []})
            for c in calls]


def shape(tree):
    """Everything the tree says but the turns' ids."""
    return ([(s.session_id, s.parent_id, s.origin, s.boundary, [t.message() for t in s.turns],
              s.metrics) for s in tree.sessions], tree.session_of)


def tool_loop_log():
    m1 = [SYS, TASK]
    m2 = [*m1, said("lookup(PRD-7)"), tool("code 42")]
    return [call(0, 0, 1, m1, "lookup(PRD-7)"), call(1, 2, 3, m2, "42")]


def compression_log():
    m1 = [SYS, TASK]
    m2 = [*m1, said("lookup(PRD-7)"), tool("code 42"), user("Summarize what you know.")]
    m3 = [SYS, TASK, user("Notes: PRD-7 has code 42.")]
    return [call(0, 0, 1, m1, "lookup(PRD-7)"), call(1, 2, 3, m2, "PRD-7 has code 42."),
            call(2, 4, 5, m3, "42")]


def sequential_log():
    m1 = [SYS, TASK]
    a1 = [user("Sub-task: find PRD-7's owner.")]
    a2 = [*a1, said("lookup(owner)"), tool("Ann")]
    b1 = [user("Sub-task: find PRD-7's code.")]
    m2 = [*m1, said("spawn(owner); spawn(code)"), tool("Ann"), tool("code 42")]
    return [call(0, 0, 1, m1, "spawn(owner); spawn(code)"), call(1, 2, 3, a1, "lookup(owner)"),
            call(2, 4, 5, a2, "Ann"), call(3, 6, 7, b1, "code 42"), call(4, 8, 9, m2, "Ann, 42")]


def parallel_log():
    m1 = [SYS, TASK]
    a1, b1 = [user("Sub-task A")], [user("Sub-task B")]
    a2 = [*a1, said("lookup(a)"), tool("x")]
    m2 = [*m1, said("spawn(a); spawn(b)"), tool("x"), tool("y")]
    return [call(0, 0, 1, m1, "spawn(a); spawn(b)"), call(1, 2.0, 3.0, a1, "lookup(a)"),
            call(2, 2.01, 3.0, b1, "y"), call(3, 3.5, 4, a2, "x"), call(4, 5, 6, m2, "x, y")]


def nested_log():
    m1 = [SYS, TASK]
    a1 = [user("Sub-task A")]
    a2 = [*a1, said("lookup(a)"), tool("x"), user("Summarize.")]
    a3 = [user("Sub-task A"), user("Notes: a is x.")]
    m2 = [*m1, said("spawn(a)"), tool("x")]
    return [call(0, 0, 1, m1, "spawn(a)"), call(1, 2, 3, a1, "lookup(a)"),
            call(2, 4, 5, a2, "a is x."), call(3, 6, 7, a3, "x"), call(4, 8, 9, m2, "x")]


@pytest.mark.parametrize("log", [tool_loop_log, compression_log, sequential_log, parallel_log,
                                 nested_log])
def test_without_ids_the_message_test_infers_the_same_tree(log):
    calls = log()
    by_tokens = sessions_from_calls(calls, "e")
    by_messages = sessions_from_calls(bare(calls), "e")
    assert (by_tokens.by, by_messages.by) == (Continuation.tokens, Continuation.messages)
    assert shape(by_messages) == shape(by_tokens)
    assert shape(sessions_from_calls(calls, "e", by=Continuation.messages)) == shape(by_tokens)
    turns = [t for s in by_messages.sessions for t in s.turns]
    assert not any(t.generated for t in turns)  # nothing to train on: no ids were reported
    episode(by_messages)  # a valid episode record


def test_without_ids_a_tool_loop_continues_on_messages_as_the_server_parses_them():
    """The agent sends back the reply it got with another tool-call id, the arguments
    re-serialised, its content as text parts and the system message as ``developer``: the
    same messages, so the same session."""
    lookup = {"id": "call_0_0", "type": "function",
              "function": {"name": "lookup", "arguments": '{"code": "PRD-7", "n": 1}'}}
    m1 = [SYS, TASK]
    resent = {"id": "call_abc", "type": "function",
              "function": {"name": "lookup", "arguments": '{"n":1,"code":"PRD-7"}'}}
    m2 = [{"role": "developer", "content": SYS["content"]},
          {"role": "user", "content": [{"type": "text", "text": TASK["content"]}]},
          {"role": "assistant", "content": None, "tool_calls": [resent]},
          {"role": "tool", "tool_call_id": "call_abc", "content": "code 42"}]
    calls = bare([call(0, 0, 1, m1, "", tool_calls=[lookup]), call(1, 2, 3, m2, "42")])
    tree = sessions_from_calls(calls, "e")
    assert tree.by is Continuation.messages and tree.session_of == {0: "e/s0", 1: "e/s0"}
    (session,) = tree.sessions
    assert [t.role for t in session.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert session.turns[2].tool_calls == [lookup]  # the reply as it was sent
    assert session.turns[2].token_ids is None and session.turns[4].content == "42"
    other = {**resent, "function": {"name": "lookup", "arguments": '{"code": "PRD-8", "n": 1}'}}
    edited = [*m2[:2], {**m2[2], "tool_calls": [other]}, m2[3]]  # another call: not the reply
    calls = bare([call(0, 0, 1, m1, "", tool_calls=[lookup]), call(1, 2, 3, edited, "42")])
    assert sessions_from_calls(calls, "e").session_of == {0: "e/s0", 1: "e/s1"}


def test_without_ids_a_compression_keeps_its_boundary():
    tree = sessions_from_calls(bare(compression_log()), "e")
    root, child = tree.sessions
    assert (child.parent_id, child.origin) == ("e/s0", "compression")
    assert child.boundary.summary == "PRD-7 has code 42."
    assert child.boundary.before == [SYS, TASK, said("lookup(PRD-7)"), tool("code 42"),
                                     user("Summarize what you know."), said("PRD-7 has code 42.")]
    assert child.boundary.after == [SYS, TASK, user("Notes: PRD-7 has code 42.")]
    assert child.boundary.parent_turn == 5
    assert tree.session_of == {0: "e/s0", 1: "e/s0", 2: "e/s1"}


def test_without_ids_sequential_and_parallel_sub_agents_are_branches():
    tree = sessions_from_calls(bare(sequential_log()), "e")
    assert [(s.parent_id, s.origin) for s in tree.sessions] == [
        (None, "root"), ("e/s0", "branch"), ("e/s0", "branch")]
    assert [s.boundary.returned for s in tree.sessions[1:]] == ["Ann", "code 42"]
    assert tree.session_of == {0: "e/s0", 1: "e/s1", 2: "e/s1", 3: "e/s2", 4: "e/s0"}
    tree = sessions_from_calls(bare(parallel_log()), "e")
    assert [(s.parent_id, s.origin) for s in tree.sessions] == [
        (None, "root"), ("e/s0", "branch"), ("e/s0", "branch")]
    assert tree.session_of == {0: "e/s0", 1: "e/s1", 2: "e/s2", 3: "e/s1", 4: "e/s0"}


def test_without_ids_a_stated_place_is_checked_message_for_message():
    rewritten = bare([call(0, 0, 1, [SYS], "a", stated=StatedPlace(session="main")),
                      call(1, 2, 3, [TASK], "b", stated=StatedPlace(session="main"))])
    with pytest.raises(ValueError, match=r"reply, message for message\)"):
        sessions_from_calls(rewritten, "e")
    one_bare = [*compression_log()[:2], *bare(compression_log()[2:])]  # one call without ids
    assert sessions_from_calls(one_bare, "e").by is Continuation.messages
    with pytest.raises(ValueError, match=r"calls \[2\] carry no prompt ids"):
        sessions_from_calls(one_bare, "e", by=Continuation.tokens)
