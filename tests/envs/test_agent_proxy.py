"""The policy server (envs.agent_proxy) with real agents written with the `openai` package,
served by the tiny model: tool calls over several turns, a compression the agent does itself,
sub-agents (two in parallel threads), the inferred session tree, and token ids and log-probs
equal to what the trainer scores (render_session + the model's log-probs); bad requests."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

openai = pytest.importorskip("openai")

from agent_rl.policies.hf import HFPolicy, sequence_logprobs  # noqa: E402
from agent_rl.policies.models import tiny_model  # noqa: E402
from agent_rl.policies.render import conversation_ids, end_of_turn_id, render_session  # noqa: E402
from envs.agent_proxy import PolicyServer  # noqa: E402
from envs.proxy_replies import token_pieces  # noqa: E402
from envs.runner import Completion, Sampling  # noqa: E402
from trajectories import sessions_from_calls  # noqa: E402

TEMPERATURE = 0.7
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


class ScriptedModel:
    """A Policy whose replies are scripted text, with the ids the tokenizer gives them plus
    <|im_end|>, scored by the tiny model (teacher forcing): the log-probs the model gives those
    tokens after the prompt, as a sampling policy reports them."""

    def __init__(self, model, tok, script, revision=3):
        self.model, self.tok, self.script, self.revision = model, tok, script, revision
        self.tokenizer = tok  # what the server decodes the ids with (stop strings, streaming)
        self.batches: list[int] = []

    def generate(self, batch, sampling):
        self.batches.append(len(batch))
        out = []
        for messages in batch:
            prompt = conversation_ids(self.tok, messages)
            text = self.script(messages)
            ids = self.tok.encode(text, add_special_tokens=False) + [end_of_turn_id(self.tok)]
            with torch.no_grad():
                lp = sequence_logprobs(self.model, torch.tensor([prompt + ids]),
                                       temperature=sampling.temperature)[0, len(prompt):]
            out.append(Completion(self.tok.decode(ids, skip_special_tokens=True), ids,
                                  lp.tolist(), "stop", len(prompt), self.revision, prompt))
        return out


def scored_difference(model, tok, tree, calls) -> float:
    """Check that every session renders to its calls' prompt + completion ids, and return the
    largest |log-prob the trainer computes - log-prob recorded| over the trained tokens."""
    worst = 0.0
    for session in tree.sessions:
        rendered = render_session(tok, session)
        ids = rendered.input_ids.tolist()
        own = [c for c in calls if tree.session_of[c.index] == session.session_id]
        assert own
        for call in own:
            assert ids[:len(call.context_ids)] == call.context_ids, session.session_id
        trained = rendered.input_ids[rendered.loss_mask].tolist()
        assert trained == [t for c in own for t in c.completion_ids]
        with torch.no_grad():
            lp = sequence_logprobs(model, rendered.input_ids[None], temperature=TEMPERATURE)[0]
        recorded = torch.tensor([x for c in own for x in c.logprobs])
        assert torch.equal(rendered.old_logprobs[rendered.loss_mask], recorded)
        worst = max(worst, float((lp[rendered.loss_mask] - recorded).abs().max()))
    return worst


def client(link):
    return openai.OpenAI(base_url=link.base_url, api_key=link.api_key, max_retries=0)


# --- agents: ordinary code over the openai client ----------------------------------------------


def tool_agent(link, stream=False) -> str:
    """Adds three numbers with the add tool, one call per turn."""
    api = client(link)
    messages = [{"role": "system", "content": "You add numbers with tools."},
                {"role": "user", "content": "What is 12 + 30 + 8?"}]
    for _ in range(6):
        if stream:
            content, calls = "", {}
            for chunk in api.chat.completions.create(model="m", messages=messages, tools=[ADD],
                                                     temperature=TEMPERATURE, stream=True):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for c in delta.tool_calls or []:  # OpenAI's deltas: id and name, then arguments
                    call = calls.setdefault(c.index, {"type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                    call["id"] = c.id or call.get("id")
                    call["function"]["name"] += c.function.name or ""
                    call["function"]["arguments"] += c.function.arguments or ""
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [calls[k] for k in sorted(calls)]
        else:
            reply = api.chat.completions.create(model="m", messages=messages, tools=[ADD],
                                                temperature=TEMPERATURE)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return message["content"]
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": str(args["a"] + args["b"])})
    raise AssertionError("the agent did not finish")


def tool_script(messages):
    last = messages[-1]
    if last["role"] == "user":
        return '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    if last["content"] == "42":
        return 'Next: <tool_call>{"name": "add", "arguments": {"a": 42, "b": 8}}</tool_call>'
    return f"The answer is {last['content']}."


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_calls_over_several_turns(tiny, stream):
    model, tok = tiny
    policy = ScriptedModel(model, tok, tool_script)
    with PolicyServer(policy, Sampling(temperature=TEMPERATURE)) as server:
        link = server.open_episode()
        assert tool_agent(link, stream=stream) == "The answer is 50."
        calls = link.calls()
    assert [c.index for c in calls] == [0, 1, 2]
    # the policy was shown the tools as Hermes instructions in the system message
    assert "add" in calls[0].messages[0]["content"] and "<tool_call>" in calls[0].messages[0]["content"]
    # the reply is recorded as the policy's own text, tool-call block included
    assert calls[1].reply["content"].startswith("Next: <tool_call>")
    assert [m["role"] for m in calls[2].messages] == ["system", "user", "assistant", "tool",
                                                      "assistant", "tool"]
    assert calls[2].messages[3] == {"role": "tool", "content": "42", "name": "add"}
    assert all(c.revision == 3 for c in calls)
    tree = sessions_from_calls(calls, "ep")
    assert len(tree.sessions) == 1 and tree.sessions[0].origin == "root"
    assert scored_difference(model, tok, tree, calls) < 1e-5


def compression_agent(link) -> str:
    """Answers, asks itself for a summary, and starts a new message list from it."""
    api = client(link)
    task = "Remember: the code is 7. Then say the code."
    messages = [{"role": "user", "content": task}]
    first = api.chat.completions.create(model="m", messages=messages).choices[0].message
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": "Summarize what you know."}]
    summary = api.chat.completions.create(model="m", messages=messages).choices[0].message.content
    fresh = [{"role": "user", "content": f"{task}\nNotes: {summary}"}]
    return api.chat.completions.create(model="m", messages=fresh).choices[0].message.content


def compression_script(messages):
    last = messages[-1]["content"]
    if last.startswith("Summarize"):
        return "Notes: code 7."
    if "Notes:" in last:
        return "7"
    return "I will remember."


def test_compression_the_agent_does_itself(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, compression_script),
                      Sampling(temperature=TEMPERATURE)) as server:
        link = server.open_episode()
        assert compression_agent(link) == "7"
        calls = link.calls()
    tree = sessions_from_calls(calls, "ep")
    root, child = tree.sessions
    assert tree.session_of == {0: root.session_id, 1: root.session_id, 2: child.session_id}
    assert (child.parent_id, child.origin) == (root.session_id, "compression")
    assert child.boundary.summary == "Notes: code 7."
    assert child.boundary.before[-1]["content"] == "Notes: code 7."
    assert child.boundary.after == calls[2].messages
    assert scored_difference(model, tok, tree, calls) < 1e-5


def subagent_agent(link, parallel: bool) -> str:
    """Plans, runs two sub-agents (each its own message list; in threads when ``parallel``),
    then answers from their results."""
    api = client(link)
    messages = [{"role": "user", "content": "Find the two halves."}]
    plan = api.chat.completions.create(model="m", messages=messages).choices[0].message
    messages.append({"role": "assistant", "content": plan.content})
    results = {}

    def sub(name):
        own = [{"role": "user", "content": f"Sub-task: find half {name}."}]
        first = api.chat.completions.create(model="m", messages=own).choices[0].message
        own += [{"role": "assistant", "content": first.content},
                {"role": "user", "content": "Now return it."}]
        results[name] = api.chat.completions.create(model="m", messages=own).choices[0].message.content

    if parallel:
        threads = [threading.Thread(target=sub, args=(n,)) for n in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        sub("A")
        sub("B")
    messages.append({"role": "user", "content": f"Results: {results['A']} {results['B']}"})
    return api.chat.completions.create(model="m", messages=messages).choices[0].message.content


def subagent_script(messages):
    last = messages[-1]["content"]
    if last.startswith("Sub-task"):
        return "Looking."
    if last == "Now return it.":
        return "half-" + messages[0]["content"][-2]
    if last.startswith("Results"):
        return "Both: " + last[len("Results: "):]
    return "I will ask two helpers."


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_subagents_with_their_own_message_lists(tiny, parallel):
    model, tok = tiny
    policy = ScriptedModel(model, tok, subagent_script)
    with PolicyServer(policy, Sampling(temperature=TEMPERATURE), window_s=0.2) as server:
        link = server.open_episode()
        assert subagent_agent(link, parallel) == "Both: half-A half-B"
        calls = link.calls()
        batches = server.batches
    tree = sessions_from_calls(calls, "ep")
    root, *subs = tree.sessions
    assert len(subs) == 2 and root.origin == "root"
    assert all((s.parent_id, s.origin) == (root.session_id, "branch") for s in subs)
    assert sorted(s.boundary.returned for s in subs) == ["half-A", "half-B"]
    assert all(len(s.turns) == 4 and s.metrics["model_calls"] == 2 for s in subs)
    assert root.metrics["model_calls"] == 2
    if parallel:  # the sub-agents' calls met in the batching window: two per generate
        assert max(batches) == 2 and max(policy.batches) == 2
    assert scored_difference(model, tok, tree, calls) < 1e-5


# --- tool_choice ---------------------------------------------------------------------------------

MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
CALL_MUL = '<tool_call>{"name": "mul", "arguments": {"a": 1, "b": 2}}</tool_call>'


def ask(link, **request):
    """One call through the openai client, with the add and mul tools."""
    return client(link).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], tools=[ADD, MUL], **request)


def test_tool_choice_none_returns_the_text_unparsed(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: "Sure: " + CALL_ADD)) as server:
        link = server.open_episode()
        reply = ask(link, tool_choice="none")
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].message.content == "Sure: " + CALL_ADD
        assert reply.choices[0].finish_reason == "stop" and reply.model_extra == {}
        # the tools are still listed in the prompt, so the session's prompts stay one prefix
        assert '"name": "add"' in link.calls()[0].messages[0]["content"]
        assert ask(link, tool_choice="auto").choices[0].message.tool_calls[0].function.name == "add"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_required_says_when_the_reply_did_not_comply(tiny, stream):
    model, tok = tiny
    replies = iter(["I would rather not.", CALL_ADD, CALL_MUL, CALL_ADD])
    with PolicyServer(ScriptedModel(model, tok, lambda m: next(replies))) as server:
        link = server.open_episode()
        named = {"type": "function", "function": {"name": "add"}}
        seen = []
        for choice in ("required", "required", named, named):
            if stream:
                chunks = list(ask(link, tool_choice=choice, stream=True))
                last = chunks[-1]
                calls = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
                seen.append((last.choices[0].finish_reason, len(calls) > 0,
                             last.model_extra["agent_rl"]["tool_choice_met"]))
            else:
                reply = ask(link, tool_choice=choice, parallel_tool_calls=False)
                seen.append((reply.choices[0].finish_reason,
                             reply.choices[0].message.tool_calls is not None,
                             reply.model_extra["agent_rl"]["tool_choice_met"]))
        unmet = link.unmet_tool_choice
    # a text reply to "required" is returned as text with finish "stop", flagged unmet; a
    # call to mul when add was named is returned as the call it is, flagged unmet
    assert seen == [("stop", False, False), ("tool_calls", True, True),
                    ("tool_calls", True, False), ("tool_calls", True, True)]
    assert unmet == [{"index": 0, "tool_choice": "required"}, {"index": 2, "tool_choice": "add"}]


def test_parallel_tool_calls_is_accepted_and_every_call_returned(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: CALL_ADD + CALL_MUL)) as server:
        link = server.open_episode()
        for parallel in (True, False):
            calls = ask(link, parallel_tool_calls=parallel).choices[0].message.tool_calls
            assert [c.function.name for c in calls] == ["add", "mul"]


# --- stop strings ---------------------------------------------------------------------------------

CAFE = "Café 🙂 done. STOP and more"


def test_token_pieces_decode_incrementally(tiny):
    _, tok = tiny
    ids = tok.encode(CAFE, add_special_tokens=False)
    pieces = token_pieces(lambda i: tok.decode(i, skip_special_tokens=True), ids)
    # é is two byte tokens and 🙂 four: the bytes before the last add nothing
    assert pieces == ["C", "a", "f", "", "é", " ", "", "", "", "🙂", " d", "one", ".", " S", "T",
                      "O", "P", " and", " m", "o", "re"]


def test_stop_cuts_the_reply_and_the_recorded_ids_alike(tiny):
    model, tok = tiny
    full = tok.encode(CAFE, add_special_tokens=False) + [end_of_turn_id(tok)]
    with PolicyServer(ScriptedModel(model, tok, lambda m: CAFE if m[-1]["content"] == "go" else "ok"),
                      Sampling(temperature=TEMPERATURE)) as server:
        link = server.open_episode()
        api, seen = client(link), []
        for stop in (None, "🙂", ["and", ". S"], "nowhere"):
            reply = api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "go"}], stop=stop)
            seen.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        # the agent goes on after a cut reply: its next prompt follows the recorded ids
        messages = [{"role": "user", "content": "go"},
                    {"role": "assistant", "content": seen[2][0]},
                    {"role": "user", "content": "more"}]
        api.chat.completions.create(model="m", messages=messages)
        calls = link.calls()
    assert seen == [(CAFE, "stop"), ("Café ", "stop"), ("Café 🙂 done", "stop"), (CAFE, "stop")]
    assert calls[0].completion_ids == full and calls[3].completion_ids == full
    # cut at the token that completes the stop string (🙂's fourth byte; " S" after ".")
    assert calls[1].completion_ids == full[:10] and calls[2].completion_ids == full[:14]
    assert calls[1].logprobs == calls[0].logprobs[:10] and calls[2].logprobs == calls[0].logprobs[:14]
    # recorded ids decode to the returned text + the stop string (+ that token's rest: none here)
    assert [tok.decode(c.completion_ids, skip_special_tokens=True) for c in calls[1:3]] == [
        "Café 🙂", "Café 🙂 done. S"]
    assert [c.reply["content"] for c in calls[1:3]] == ["Café 🙂", "Café 🙂 done. S"]
    assert calls[4].prompt_ids[:len(calls[2].context_ids)] == calls[2].context_ids
    tree = sessions_from_calls([calls[2], calls[4]], "ep")
    assert len(tree.sessions) == 1
    assert scored_difference(model, tok, tree, [calls[2], calls[4]]) < 1e-5


def test_stop_with_the_sampling_policy(tiny):
    """HFPolicy at T=0.7: the same call with a stop string taken from the middle of the
    unstopped reply returns the text before it; the recorded ids are the shortest prefix of
    the unstopped ones whose decoding holds the stop string; the session then renders to the
    recorded prompts, and the trainer's log-probs equal the recorded ones."""
    model, tok = tiny
    policy = HFPolicy(model, tok)
    with PolicyServer(policy, Sampling(temperature=TEMPERATURE, max_new_tokens=16, seed=0)) as server:
        first = [{"role": "user", "content": "Talk to me."}]
        free = server.open_episode()
        whole = client(free).chat.completions.create(model="m", messages=first)
        text = whole.choices[0].message.content
        assert len(text) >= 8
        stop = text[len(text) // 2:len(text) // 2 + 2]
        link = server.open_episode()
        api = client(link)
        reply = api.chat.completions.create(model="m", messages=first, stop=[stop])
        api.chat.completions.create(model="m", messages=[
            *first, reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Go on."}])
        unstopped, calls = free.calls()[0], link.calls()
    assert reply.choices[0].message.content == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    ids = calls[0].completion_ids
    assert ids == unstopped.completion_ids[:len(ids)]
    assert calls[0].logprobs == unstopped.logprobs[:len(ids)]
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded.startswith(text[:text.index(stop)] + stop)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)
    tree = sessions_from_calls(calls, "ep")
    assert len(tree.sessions) == 1
    assert scored_difference(model, tok, tree, calls) < 1e-4


def test_stop_without_a_tokenizer_is_a_400(tiny):
    class TextOnly:  # an endpoint-like policy: text, no tokenizer to cut ids with
        def generate(self, batch, sampling):
            return [Completion("ok") for _ in batch]

    with PolicyServer(TextOnly()) as server:
        link = server.open_episode()
        with pytest.raises(openai.BadRequestError) as caught:
            client(link).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stop="k")
        assert caught.value.body["param"] == "stop"
        assert client(link).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "ok"


# --- streaming ------------------------------------------------------------------------------------


def streamed(link, **request):
    """The chunks of one streamed call through the openai client."""
    return list(client(link).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], stream=True, **request))


def contents(chunks) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_streaming_sends_one_delta_per_token(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: CAFE)) as server:
        link = server.open_episode()
        whole = client(link).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}])
        plain, stopped = streamed(link), streamed(link, stop="and")
    assert "".join(contents(plain)) == whole.choices[0].message.content == CAFE
    # é's and 🙂's bytes arrive whole, with the token that completes them
    assert contents(plain) == ["C", "a", "f", "é", " ", "🙂", " d", "one", ".", " S", "T", "O",
                               "P", " and", " m", "o", "re"]
    assert contents(stopped) == ["C", "a", "f", "é", " ", "🙂", " d", "one", ".", " S", "T", "O",
                                 "P", " "]
    assert [c.choices[0].finish_reason for c in (plain[-1], stopped[-1])] == ["stop", "stop"]


def test_streamed_tool_calls_come_as_openai_deltas(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: "Both: " + CALL_ADD + CALL_MUL)) as server:
        chunks = streamed(server.open_episode(), tools=[ADD, MUL])
    assert "".join(contents(chunks)) == "Both:" and len(contents(chunks)) > 1
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.id, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "call_0_0", "add", ""), (0, None, None, '{"a": 1, "b": 2}'),
        (1, "call_0_1", "mul", ""), (1, None, None, '{"a": 1, "b": 2}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streaming_the_sampling_policy_matches_its_reply(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    with PolicyServer(policy, Sampling(temperature=TEMPERATURE, max_new_tokens=16, seed=0)) as server:
        link = server.open_episode()
        whole = client(link).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}])
        chunks = streamed(link, stream_options={"include_usage": True})
        calls = link.calls()
    assert calls[0].completion_ids == calls[1].completion_ids  # the same draws (row 0, seed 0)
    assert "".join(contents(chunks)) == whole.choices[0].message.content
    assert 1 < len(contents(chunks)) <= len(calls[1].completion_ids)
    assert chunks[-1].usage.completion_tokens == len(calls[1].completion_ids)


def test_stated_place_wins_over_inference(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: "ok")) as server:
        link = server.open_episode()
        api = client(link)
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}],
                                    extra_body={"agent_rl": {"session": "helper",
                                                             "origin": "branch"}})
        calls = link.calls()
    tree = sessions_from_calls(calls, "ep")
    # without the statement the root never calls again: a compression
    assert [(s.session_id, s.origin) for s in tree.sessions] == [("ep/s0", "root"),
                                                                ("helper", "branch")]


def test_sampled_replies_are_never_retokenized(tiny):
    """The real HFPolicy sampling at T=0.7 over four turns: every later prompt carries the
    sampled ids, so rendering the session gives the prompts the policy saw, and the trainer's
    log-probs equal the recorded ones to float noise."""
    model, tok = tiny
    policy = HFPolicy(model, tok)
    with PolicyServer(policy, Sampling(temperature=TEMPERATURE, max_new_tokens=12, seed=0)) as server:
        link = server.open_episode()
        api = client(link)
        messages = [{"role": "user", "content": "Talk to me."}]
        for turn in range(4):
            reply = api.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"Go on ({turn})."}]
        calls = link.calls()
    tree = sessions_from_calls(calls, "ep")
    assert len(tree.sessions) == 1 and tree.sessions[0].metrics["model_calls"] == 4
    assert all(c.revision == 0 and len(c.completion_ids) >= 1 for c in calls)
    assert scored_difference(model, tok, tree, calls) < 1e-4


# --- bad requests, unknown episodes, faults -----------------------------------------------------


def post(link, body: bytes, path="/chat/completions"):
    host, port = "127.0.0.1", int(link.base_url.split(":")[2].split("/")[0])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    prefix = link.base_url.split(f":{port}", 1)[1]
    conn.request("POST", prefix + path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "tool_choice": "always"},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD],
      "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD],
      "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD],
      "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "agent_rl": {"origin": "root"}}, "agent_rl"),
])
def test_bad_requests_get_a_400_naming_the_field(tiny, body, param):
    model, tok = tiny
    policy = ScriptedModel(model, tok, lambda m: "ok")
    with PolicyServer(policy) as server:
        link = server.open_episode()
        status, error = post(link, json.dumps(body).encode())
        assert status == 400 and error["error"]["param"] == param, error
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
        # the server still serves, and nothing was generated or recorded
        reply = client(link).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "ok"
    assert policy.batches == [1] and len(link.calls()) == 1


def test_bad_json_and_the_openai_client_error(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: "ok")) as server:
        link = server.open_episode()
        for raw in (b"{not json", b"[1, 2]", "\"\udc80\"".encode("utf-8", "surrogatepass")):
            status, error = post(link, raw)
            assert status == 400 and "error" in error
        with pytest.raises(openai.BadRequestError) as caught:
            client(link).chat.completions.create(model="m", n=3,
                                                 messages=[{"role": "user", "content": "x"}])
        assert caught.value.body["param"] == "n"


def test_episode_urls_are_per_episode_and_end(tiny):
    model, tok = tiny
    with PolicyServer(ScriptedModel(model, tok, lambda m: "ok")) as server:
        one, two = server.open_episode(), server.open_episode()
        assert one.base_url != two.base_url and len(one.token) >= 32
        assert [m.id for m in client(one).models.list()] == ["agent-rl-policy"]
        one.close()
        with pytest.raises(openai.NotFoundError) as caught:
            client(one).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert caught.value.body["code"] == "episode_not_found"
        status, error = post(two, b"{}", path="/../../e/guess/v1/chat/completions")
        assert status == 404
        client(two).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert len(two.calls()) == 1 and one.calls() == []


def test_a_prompt_over_the_limit_is_a_400_the_agent_can_react_to(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    with PolicyServer(policy, Sampling(max_new_tokens=4, max_prompt_tokens=40)) as server:
        link = server.open_episode()
        with pytest.raises(openai.BadRequestError) as caught:
            client(link).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "long " * 100}])
        assert caught.value.body["code"] == "context_length_exceeded"
        assert caught.value.body["param"] == "messages"
        client(link).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert [r["reason"] for r in link.refused] == ["prompt_too_long"]
    assert link.refused[0]["prompt_tokens"] > 40 and len(link.calls()) == 1


def test_a_failing_policy_is_a_500_and_the_server_goes_on(tiny):
    model, tok = tiny
    state = {"fail": True}

    def script(messages):
        if state.pop("fail", False):
            raise RuntimeError("boom")
        return "ok"

    with PolicyServer(ScriptedModel(model, tok, script)) as server:
        link = server.open_episode()
        with pytest.raises(openai.InternalServerError):
            client(link).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        reply = client(link).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "ok"


# --- whole episodes of an agent function (envs.agents) ------------------------------------------

from envs.agents import AgentFault, AgentFaultWarning, run_agent_episodes  # noqa: E402
from envs.datasets import DatasetEnv  # noqa: E402
from trajectories import Outcome  # noqa: E402


@pytest.fixture
def adding_tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "t1", "prompt": "What is 12 + 30 + 8?", "answer": "50"}) + "\n"
                    + json.dumps({"id": "t2", "prompt": "What is 12 + 30 + 8 again?",
                                  "answer": "51"}) + "\n")
    return DatasetEnv(path=path, reward="numeric", task_id="id")


def run_tool_agent(task, base_url, api_key):
    from types import SimpleNamespace
    return tool_agent(SimpleNamespace(base_url=base_url, api_key=api_key))


def test_agent_episodes_are_scored_trees(tiny, adding_tasks):
    model, tok = tiny
    policy = ScriptedModel(model, tok, tool_script)
    episodes = run_agent_episodes(run_tool_agent, adding_tasks.tasks, policy, adding_tasks,
                                  Sampling(temperature=TEMPERATURE), samples_per_task=2, seed=5,
                                  group_prefix="g/")
    assert [(e.task_id, e.sample_id) for e in episodes] == [("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1)]
    assert [e.reward.outcome for e in episodes] == [Outcome.correct] * 2 + [Outcome.wrong] * 2
    assert [e.reward.total for e in episodes] == [1.0, 1.0, 0.0, 0.0]
    assert max(policy.batches) > 1  # four agents at once: their calls were batched
    for e in episodes:
        assert e.env_id == "agent_rl/Agent-v0" and e.group_id == f"g/{e.task_id}"
        assert e.episode_id.startswith(f"g/{e.task_id}#{e.sample_id}@")
        (session,) = e.sessions
        assert session.used_by_final is True and e.final_session_id == session.session_id
        assert e.generation["temperature"] == TEMPERATURE
        assert e.reward.audit["assistant_turns"] == 3 and e.hash_ok()
        assert sum(len(t.token_ids or []) for t in session.turns) > 0


def test_agent_faults_are_infrastructure_faults(tiny, adding_tasks):
    model, tok = tiny
    policy = ScriptedModel(model, tok, lambda m: "50")
    release = threading.Event()

    def raises(task, base_url, api_key):
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": task["prompt"]}])
        raise KeyError("my bug")

    def hangs(task, base_url, api_key):
        release.wait(30)
        return "50"

    def silent(task, base_url, api_key):
        return "50"

    async def returns_int(task, base_url, api_key):
        return 50

    task = adding_tasks.tasks[0]
    expected = {raises: AgentFault.raised, hangs: AgentFault.timeout,
                silent: AgentFault.no_model_call, returns_int: AgentFault.bad_return}
    for agent, fault in expected.items():
        with pytest.warns(AgentFaultWarning, match="task t1"):
            (episode,) = run_agent_episodes(agent, [task], policy, adding_tasks, timeout_s=5.0)
        assert episode.reward.outcome == Outcome.sandbox_error and episode.reward.total == 0.0
        assert episode.reward.audit["agent_fault"] == fault.value
        assert episode.reward.audit["task_id"] == "t1"
        assert episode.final_session_id is None and episode.hash_ok()
        if agent is raises:  # its one call is recorded; the reason names the agent's error
            assert episode.reward.audit["agent_error"] == "KeyError: 'my bug'"
            assert episode.sessions[0].metrics["model_calls"] == 1
    release.set()


async def async_agent(task, base_url, api_key):
    api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["prompt"]}])
    return reply.choices[0].message.content


def test_async_agents_and_agents_named_by_file(tiny, adding_tasks, tmp_path):
    model, tok = tiny
    policy = ScriptedModel(model, tok, lambda m: "It is 50.")
    (episode,) = run_agent_episodes(async_agent, adding_tasks.tasks[:1], policy, adding_tasks)
    assert episode.reward.outcome == Outcome.correct
    agent_file = tmp_path / "my_agent.py"
    agent_file.write_text("import json, urllib.request\n"
                          "def run(task, base_url, api_key):\n"
                          "    body = json.dumps({'model': 'm', 'messages': [{'role': 'user', "
                          "'content': task['prompt']}]}).encode()\n"
                          "    req = urllib.request.Request(base_url + '/chat/completions', body,"
                          " {'Content-Type': 'application/json'})\n"
                          "    reply = json.load(urllib.request.urlopen(req))\n"
                          "    return reply['choices'][0]['message']['content']\n")
    (episode,) = run_agent_episodes(f"{agent_file}:run", adding_tasks.tasks[:1], policy, adding_tasks)
    assert episode.reward.outcome == Outcome.correct and len(episode.sessions) == 1
