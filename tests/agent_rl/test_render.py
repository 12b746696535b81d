"""render_session / render_episode / share_prefixes / pack, token by token, with SmolLM2's and the tiny tokenizer."""

import copy

import pytest
import torch

from agent_rl.policies.hf import sequence_logprobs
from agent_rl.policies.models import smollm2_tokenizer, tiny_model, tiny_tokenizer
from agent_rl.policies.render import (
    collate_shared,
    pack,
    packed_attention_mask,
    render_episode,
    render_session,
    share_prefixes,
)
from trajectories import Session, Turn
from trajectories.testing import episode

CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
ANSWER = "The answer is 42."


def _sampled(tok, text, stop=True, lp=-0.25):
    ids = tok.encode(text, add_special_tokens=False)
    if stop:
        ids = ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    logprobs = [lp - 0.01 * k for k in range(len(ids))]  # distinct, to catch misalignment
    return Turn(role="assistant", content=text, token_ids=ids, logprobs=logprobs,
                finish_reason="stop" if stop else "length")


def tool_session(tok, session_id="s0", episode_id="ep-0"):
    return Session(session_id=session_id, episode_id=episode_id, turns=[
        Turn(role="system", content="You can call tools: add(a, b)."),
        Turn(role="user", content="What is 12 + 30?"),
        _sampled(tok, CALL, lp=-0.1),
        Turn(role="tool", name="add", content="42"),
        _sampled(tok, ANSWER, lp=-0.5),
    ])


@pytest.fixture(params=[pytest.param("smollm2", marks=pytest.mark.model), "tiny"])
def tok(request):
    """SmolLM2's tokenizer (parsed from the GGUF once per process) or the tiny one."""
    return smollm2_tokenizer() if request.param == "smollm2" else tiny_tokenizer()


def _pieces(tok, r):
    """(decoded token, mask) pairs, for readable assertions."""
    return [(tok.decode([int(i)]), bool(m)) for i, m in zip(r.input_ids, r.loss_mask, strict=True)]


def test_mask_is_exactly_the_sampled_tokens(tok):
    s = tool_session(tok)
    r = render_session(tok, s)
    T = len(r)
    assert r.input_ids.shape == r.loss_mask.shape == r.old_logprobs.shape == (T,)
    assert r.input_ids.dtype == torch.long and r.loss_mask.dtype == torch.bool
    assert (r.session_id, r.episode_id) == ("s0", "ep-0")

    # The whole sequence is the template's rendering (the sampled ids are canonical here).
    expected = tok.apply_chat_template(s.messages(), tokenize=True, return_dict=False)
    assert r.input_ids.tolist() == list(expected)

    # Trained positions are exactly the two sampled id lists, in place, including <|im_end|>.
    sampled = [t for t in s.turns if t.generated]
    trained = r.loss_mask.nonzero().flatten().tolist()
    assert len(trained) == sum(len(t.token_ids) for t in sampled)
    ids = r.input_ids.tolist()
    runs, start = [], None
    for k in range(T + 1):
        on = k < T and bool(r.loss_mask[k])
        if on and start is None:
            start = k
        if not on and start is not None:
            runs.append((start, k))
            start = None
    assert [ids[a:b] for a, b in runs] == [t.token_ids for t in sampled]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for a, b in runs:
        assert ids[b - 1] == eot and bool(r.loss_mask[b - 1])  # the sampled end of turn is trained
        assert tok.decode(ids[b:b + 1]) == "\n" and not bool(r.loss_mask[b])  # the newline is not
        assert tok.decode(ids[a - 5:a]).endswith("<|im_start|>assistant\n")  # header untrained
        assert not r.loss_mask[a - 5:a].any()

    # No system / user / tool token is trained.
    pieces = _pieces(tok, r)
    text_untrained = "".join(p for p, m in pieces if not m)
    for fragment in ("You can call tools", "What is 12", "<|im_start|>tool\n42<|im_end|>\n",
                     "<|im_start|>assistant\n"):
        assert fragment in text_untrained
    text_trained = "".join(p for p, m in pieces if m)
    assert text_trained == CALL + "<|im_end|>" + ANSWER + "<|im_end|>"

    # Old log-probs: the turn's on masked positions, 0.0 elsewhere.
    expected_old = [lp for t in sampled for lp in t.logprobs]
    assert r.old_logprobs[r.loss_mask].tolist() == pytest.approx(expected_old)
    assert (r.old_logprobs[~r.loss_mask] == 0).all()


def test_spans_partition_the_sequence(tok):
    r = render_session(tok, tool_session(tok))
    assert [(s.kind, s.turn) for s in r.spans] == [
        ("system", 0), ("user", 1), ("prompt", 2), ("generated", 2), ("end", 2),
        ("tool", 3), ("prompt", 4), ("generated", 4), ("end", 4)]
    assert r.spans[0].start == 0 and r.spans[-1].end == len(r)
    assert all(a.end == b.start for a, b in zip(r.spans, r.spans[1:], strict=False))
    for s in r.spans:
        assert r.loss_mask[s.start:s.end].all() == (s.kind == "generated")
        assert r.loss_mask[s.start:s.end].any() == (s.kind == "generated")


def test_length_truncated_turn_trains_nothing_after_the_last_sampled_token(tok):
    cut = _sampled(tok, "<tool_call>{\"name\": \"ad", stop=False)
    s = Session(session_id="s1", episode_id="ep-1", turns=[
        Turn(role="user", content="What is 12 + 30?"), cut,
        Turn(role="user", content="Your reply was cut. Try again."),
        _sampled(tok, ANSWER)])
    r = render_session(tok, s)
    gen = [sp for sp in r.spans if sp.kind == "generated"]
    end = [sp for sp in r.spans if sp.kind == "end"]
    assert r.input_ids[gen[0].start:gen[0].end].tolist() == cut.token_ids
    # The template's <|im_end|>\n after the cut turn is there, untrained.
    assert tok.decode(r.input_ids[end[0].start:end[0].end]) == "<|im_end|>\n"
    assert not r.loss_mask[gen[0].end:gen[1].start].any()
    assert r.num_trained == len(cut.token_ids) + len(s.turns[3].token_ids)
    # SmolLM2's default system turn opens a conversation that has none; it is prompt.
    assert tok.decode(r.input_ids[:r.spans[0].end]).startswith("<|im_start|>system\n")
    assert r.spans[0].kind == "user"


def test_non_canonical_sampled_tokens_are_kept_as_generated(tok):
    # "42" sampled as "4" + "2": the template would tokenize the text differently.
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("4", add_special_tokens=False) + tok.encode("2", add_special_tokens=False) + [eot]
    assert ids[:-1] != tok.encode("42", add_special_tokens=False) or len(ids) == 3
    turn = Turn(role="assistant", content="42", token_ids=ids, logprobs=[-1.0] * len(ids))
    s = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="12 + 30?"), turn, Turn(role="user", content="sure?"),
        _sampled(tok, "yes")])
    r = render_session(tok, s)
    gen = [sp for sp in r.spans if sp.kind == "generated"]
    assert r.input_ids[gen[0].start:gen[0].end].tolist() == ids
    assert r.num_trained == len(ids) + len(s.turns[3].token_ids)


def test_reply_starting_with_whitespace_keeps_the_header_the_policy_saw(tok):
    # Re-tokenized, "\n" + "  The" may merge into "\n  " + "The"; the policy saw a lone "\n".
    reply = _sampled(tok, "  The answer is 42.")
    s = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="q"), reply, Turn(role="user", content="thanks"), _sampled(tok, "ok")])
    r = render_session(tok, s)
    prompt = tok.apply_chat_template(s.messages()[:1], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    assert r.input_ids[:len(prompt)].tolist() == list(prompt)
    assert r.input_ids[len(prompt):len(prompt) + len(reply.token_ids)].tolist() == reply.token_ids
    assert r.num_trained == len(reply.token_ids) + len(s.turns[3].token_ids)


def test_a_reply_needs_a_message_before_it(tok):
    s = Session(session_id="s", episode_id="e", turns=[_sampled(tok, "hello")])
    with pytest.raises(ValueError, match="at least one message"):
        render_session(tok, s)


def test_hand_written_assistant_turns_are_prompt(tok):
    s = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="hi"), Turn(role="assistant", content="hello, how can I help?"),
        Turn(role="user", content="add 1 and 2"), _sampled(tok, "3")])
    r = render_session(tok, s)
    kinds = [sp.kind for sp in r.spans]
    assert kinds == ["user", "assistant", "user", "prompt", "generated", "end"]
    assert r.num_trained == len(s.turns[3].token_ids)


def test_render_episode_gives_one_rendered_per_session(tok):
    from trajectories import Boundary

    root = tool_session(tok, "root", "ep-7")
    child = Session(
        session_id="c1", parent_id="root", episode_id="ep-7", origin="compression",
        boundary=Boundary.compression(root.messages(), [{"role": "user", "content": "summary"}],
                                      summary="summary"),
        turns=[Turn(role="user", content="summary"), _sampled(tok, ANSWER)])
    ep = episode([root, child], episode_id="ep-7")
    rendered = render_episode(tok, ep)
    assert [(r.session_id, r.episode_id) for r in rendered] == [("root", "ep-7"), ("c1", "ep-7")]
    assert rendered[1].num_trained == len(child.turns[1].token_ids)


# ----------------------------------------------------------------------------- errors


def test_template_that_does_not_round_trip_is_refused(tok):
    bad = copy.deepcopy(tok)
    bad.chat_template = (
        "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"episode ep-0, session s0, turn 1 .*does not round-trip"):
        render_session(bad, tool_session(tok))


def test_tokens_that_do_not_match_the_text_are_refused(tok):
    wrong = Turn(role="assistant", content="something else entirely",
                 token_ids=tok.encode(ANSWER, add_special_tokens=False), logprobs=None)
    s = Session(session_id="s9", episode_id="e", turns=[Turn(role="user", content="q"), wrong])
    with pytest.raises(ValueError, match=r"session s9, turn 1 .*decode to"):
        render_session(tok, s, require_logprobs=False)
    # whitespace and special tokens do not count as a mismatch
    ids = tok.encode(ANSWER, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ok = Turn(role="assistant", content=f"  {ANSWER}\n", token_ids=ids, logprobs=[-1.0] * len(ids))
    render_session(tok, Session(session_id="s", episode_id="e", turns=[Turn(role="user", content="q"), ok]))


def test_missing_logprobs_and_bad_ids_are_refused(tok):
    ids = tok.encode(ANSWER, add_special_tokens=False)
    no_lp = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="q"), Turn(role="assistant", content=ANSWER, token_ids=ids)])
    with pytest.raises(ValueError, match="without logprobs"):
        render_session(tok, no_lp)
    r = render_session(tok, no_lp, require_logprobs=False)
    assert r.num_trained == len(ids) and (r.old_logprobs == 0).all()
    oov = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="q"),
        Turn(role="assistant", content=ANSWER, token_ids=[len(tok) + 5], logprobs=[-1.0])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        render_session(tok, oov)


def test_tokenizer_without_chat_template_is_refused(tok):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*Fix"):
        render_session(bare, tool_session(tok))


# ----------------------------------------------------------------------------- packing


def test_packed_attention_mask_blocks_other_sequences():
    seq = torch.tensor([0, 0, 1, 1, 1, -1])
    allowed = packed_attention_mask(seq, torch.bool)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    additive = packed_attention_mask(seq)[0, 0]
    assert (additive[allowed] == 0).all() and (additive[~allowed] == torch.finfo(torch.float32).min).all()


def test_packed_attention_mask_lets_each_rest_see_its_own_prefix_only():
    # two shared rows side by side: [prefix 0, rest 1, rest 2] then [prefix 3, rest 4], padding
    seq = torch.tensor([0, 0, 1, 2, 3, 4, -1])
    prefix = torch.tensor([0, 0, 0, 0, 3, 3, -1])
    allowed = packed_attention_mask(seq, torch.bool, prefix=prefix)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],  # rest 1 sees prefix 0
        [1, 1, 0, 1, 0, 0, 0],  # rest 2 sees prefix 0, not rest 1
        [0, 0, 0, 0, 1, 0, 0],  # the second prefix sees nothing of the first row
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_pack_is_first_fit_decreasing_and_keeps_a_long_row_alone():
    tok = tiny_tokenizer()
    rendered = [render_session(tok, Session(session_id=f"s{k}", episode_id="e", turns=[
        Turn(role="user", content=text), _sampled(tok, "y")]))
        for k, text in enumerate(["a", "a b c d e f g h i j", "a b c d e", "x y"])]
    rows = share_prefixes(rendered, min_shared=10_000)  # nothing shared: one row each
    lengths = {r.members[0]: len(r) for r in rows}
    longest = max(lengths.values())
    bins = pack(rows, max_tokens=longest)
    assert bins[0][0].members == [max(lengths, key=lengths.get)]  # the longest placed first
    assert all(sum(map(len, b)) <= longest for b in bins)
    assert sorted(k for b in bins for r in b for k in r.members) == [0, 1, 2, 3]
    alone = pack(rows, max_tokens=longest - 1)  # the longest row alone, nothing beside it
    assert [len(b) for b in alone if sum(map(len, b)) > longest - 1] == [1]
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        pack(rows, max_tokens=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_rows_give_the_unpacked_log_probs_and_gradients(attn):
    from agent_rl.policies.logprobs import picked_logprobs
    from agent_rl.training.update import trained_token_logits

    model, tok = tiny_model(seed=0)
    model.set_attn_implementation(attn)
    prompt = [Turn(role="system", content="Copy the needed facts exactly."),
              Turn(role="user", content="The red box has code 47. Copy the red box line.")]
    group = [render_session(tok, Session(session_id=f"s{k}", episode_id="e",
                                         turns=[*prompt, _sampled(tok, text)]))
             for k, text in enumerate(["The red box has code 47.", "47", "The red box"])]
    other = render_session(tok, tool_session(tok, "a"))
    rendered = [group[0], other, group[1], group[2]]
    rows = share_prefixes(rendered, min_shared=4)
    assert sorted(sorted(r.members) for r in rows) == [[0, 2, 3], [1]]
    shared = next(r for r in rows if len(r.members) == 3)
    first_trained = int(group[0].loss_mask.nonzero()[0])
    assert shared.prefix == first_trained  # the whole prompt, up to the first sampled token
    assert len(shared) == shared.prefix + sum(len(r) - shared.prefix for r in group)
    bins = pack(rows)  # both rows side by side in one batch row
    assert len(bins) == 1 and len(bins[0]) == 2
    batch = collate_shared(bins, rendered, tok.pad_token_id)
    assert batch["input_ids"].shape == (1, sum(map(len, rows)))
    assert len(batch["target"]) == sum(int(r.loss_mask.sum()) for r in rendered)

    def per_sequence(logprobs):
        return [logprobs[batch["seq"] == k][batch["rank"][batch["seq"] == k].argsort()]
                for k in range(len(rendered))]

    packed = per_sequence(picked_logprobs(trained_token_logits(model, batch), batch["target"]))
    alone = [sequence_logprobs(model, r.input_ids[None])[0][r.loss_mask] for r in rendered]
    for got, ref in zip(packed, alone, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the gradient through the shared prefix is the sum over its members
    weight = model.model.layers[0].self_attn.q_proj.weight
    torch.stack([g.sum() for g in packed]).sum().backward()
    grad_packed, weight.grad = weight.grad.clone(), None
    torch.stack([g.sum() for g in alone]).sum().backward()
    torch.testing.assert_close(grad_packed, weight.grad, atol=1e-5, rtol=1e-4)



def _with_ids(turns):
    """The messages an environment shows the policy: sampled turns carry their token ids."""
    return [t.message() | ({"token_ids": t.token_ids} if t.generated else {}) for t in turns]


def _non_canonical(tok, text):
    """``text`` sampled one character at a time, then the end of turn: a tokenization the
    template would not produce from the text (asserted)."""
    ids = [i for c in text for i in tok.encode(c, add_special_tokens=False)]
    assert ids != tok.encode(text, add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    return Turn(role="assistant", content=text, token_ids=ids + [eot],
                logprobs=[-1.0] * (len(ids) + 1), finish_reason="stop")


def test_conversation_ids_show_the_policy_the_context_the_trainer_scores(tok):
    """The prompt of every generated turn (what the rollout policy is shown) is, token for
    token, the trainer's rendering up to that turn's first sampled token, with a
    non-canonically sampled earlier turn and one that starts with whitespace; re-rendering
    the text (the chat template alone) would show another context."""
    from agent_rl.policies.render import chat_ids, conversation_ids

    s = Session(session_id="s", episode_id="e", turns=[
        Turn(role="system", content="You can call tools."),
        Turn(role="user", content="What is the record value?"),
        _non_canonical(tok, "the record value"),
        Turn(role="tool", name="get", content="42"),
        _sampled(tok, "  The answer is 42."),
        Turn(role="user", content="sure?"),
        _sampled(tok, "yes")])
    r = render_session(tok, s)
    starts = {sp.turn: sp.start for sp in r.spans if sp.kind == "generated"}
    assert sorted(starts) == [2, 4, 6]
    for i, start in starts.items():
        shown = conversation_ids(tok, _with_ids(s.turns[:i]))
        assert shown == r.input_ids[:start].tolist(), i
    # without the sampled ids the later turns see the re-tokenized text: another context
    text_only = chat_ids(tok, s.messages()[:6], add_generation_prompt=True)
    assert text_only != r.input_ids[:starts[6]].tolist()
    # a conversation with no sampled turn is the chat template's rendering
    assert conversation_ids(tok, _with_ids(s.turns[:2])) == chat_ids(tok, s.messages()[:2], True)


def test_rollout_log_probs_match_the_trainer_after_a_non_canonical_turn():
    """HFPolicy sampling the next turn of a conversation whose earlier reply was sampled as a
    non-canonical tokenization: the trainer's log-probs of the new tokens, scored on
    render_session's sequence, equal the rollout's (they differ by far more when the policy
    is shown the re-tokenized text)."""
    from agent_rl.policies.hf import HFPolicy
    from envs.runner import Sampling

    model, tok = tiny_model(0)
    turns = [Turn(role="user", content="What is the record value?"),
             _non_canonical(tok, "the record value"), Turn(role="user", content="sure?")]
    policy = HFPolicy(model, tok)
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=0)

    def next_turn(messages):
        c = policy.generate([messages], sampling)[0]
        return Turn(role="assistant", content=c.text, token_ids=c.token_ids, logprobs=c.logprobs,
                    finish_reason=c.finish_reason)

    def gap(reply):
        r = render_session(tok, Session(session_id="s", episode_id="e", turns=turns + [reply]))
        with torch.no_grad():
            lp = sequence_logprobs(model, r.input_ids[None])[0]
        (last,) = [sp for sp in r.spans if sp.kind == "generated" and sp.turn == 3]
        return float((lp[last.start:last.end] - r.old_logprobs[last.start:last.end]).abs().max())

    assert gap(next_turn(_with_ids(turns))) < 1e-4
    assert gap(next_turn([t.message() for t in turns])) > 1e-2  # the text re-tokenized


def test_conversation_ids_memo_renders_only_the_new_turns(tok, monkeypatch):
    """With a memo, a conversation that grew by a generated turn renders that turn (two
    template calls) and the generation prompt (one), not every earlier turn again, and gives
    the same ids as without it."""
    from agent_rl.policies import render

    s = Session(session_id="s", episode_id="e", turns=[
        Turn(role="user", content="What is the record value?"), _non_canonical(tok, "the record value"),
        Turn(role="user", content="and?"), _sampled(tok, "42"),
        Turn(role="user", content="sure?"), _sampled(tok, "yes"), Turn(role="user", content="ok")])
    calls = []
    real = render.chat_ids
    monkeypatch.setattr(render, "chat_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
    memo = {}
    render.conversation_ids(tok, _with_ids(s.turns[:5]), memo)
    assert len(calls) == 2 * 2 + 1 and len(memo) == 2
    calls.clear()
    grown = render.conversation_ids(tok, _with_ids(s.turns), memo)
    assert len(calls) == 2 + 1 and len(memo) == 3
    calls.clear()
    assert grown == render.conversation_ids(tok, _with_ids(s.turns)) and len(calls) == 3 * 2 + 1


def test_a_batch_memo_renders_each_message_list_once(tok, monkeypatch):
    """Two samples of one prompt (system, user, then different turns): each session takes 7
    template calls without a memo (system, user, the third message; per generated turn its
    prompt and its rendering, two generated turns); with one memo over both, the second
    session's system, user and first generation prompt come from the memo, so it renders 4
    (its first reply, the user message after it, its second prompt and reply): 7 + 4 calls,
    11 renderings kept, the same tensors."""
    from agent_rl.policies import render

    other = Session(session_id="s1", episode_id="ep-1", turns=[
        *tool_session(tok).turns[:2], _sampled(tok, "I think 42.", lp=-0.3),
        Turn(role="user", content="Sure?"), _sampled(tok, "Yes.", lp=-0.2)])
    sessions = [tool_session(tok), other]
    calls = []
    real = render.chat_ids
    monkeypatch.setattr(render, "chat_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = [render.render_session(tok, s) for s in sessions]
    assert len(calls) == 2 * 7
    calls.clear()
    memo = {}
    shared = [render.render_session(tok, s, memo=memo) for s in sessions]
    assert len(calls) == 7 + 4 and len(memo) == 11
    for a, b in zip(plain, shared, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.old_logprobs, b.old_logprobs) and a.spans == b.spans
