"""agent_rl.training.rollout: truncation, dynamic sampling, acceptance, the budget report, credit ->
advantages -> sequences (hand-computed), a real multi-session LongRecords-v0 episode rendered
token by token, and rollout_batch end to end with the tiny model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import envs
from agent_rl.policies.hf import HFPolicy, sequence_logprobs
from agent_rl.policies.models import tiny_model, tiny_tokenizer
from agent_rl.policies.render import chat_ids, end_of_turn_id, render_episode, render_session
from agent_rl.run.guards import EmptyStep
from agent_rl.training.metrics import step_metrics
from agent_rl.training.rollout import (
    LENGTH,
    RolloutBatch,
    RolloutSettings,
    apply_length_reward,
    apply_truncation,
    budget_report,
    build_sequences,
    contrast_stats,
    empty_reason,
    filter_groups,
    generated_tokens,
    hint_share,
    hinted_jobs,
    length_lambdas,
    length_reward,
    rollout_batch,
    session_advantages,
    task_total,
    too_long_prompts,
    zero_contrast_step,
)
from envs.runner import Sampling
from trajectories import (
    Boundary,
    Episode,
    Outcome,
    RewardBreakdown,
    RolloutStore,
    Session,
    Turn,
    assign,
    testing,
)

EPS = 1e-6
BUILD = {"assigner": "broadcast", "assigner_params": {}, "session_weighting": "per_episode",
         "std": "population", "scale": "group", "eps": EPS}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to share: with several threads on a busy CPU a
    forward pass over a 2,400-token session takes ~0.8 s instead of ~0.05 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# --- hand-built episodes with genuine token ids ------------------------------------------------


def sampled(tok, text: str, finish: str = "stop", lp: float = -0.3) -> Turn:
    """An assistant turn as a policy would leave it: the text's ids (+ <|im_end|> if stopped)."""
    ids = tok.encode(text, add_special_tokens=False)
    if finish == "stop":
        ids = ids + [end_of_turn_id(tok)]
    return Turn(role="assistant", content=text, token_ids=ids,
                logprobs=[lp - 0.01 * k for k in range(len(ids))], finish_reason=finish)


def turns(tok, text: str, finish: str = "stop") -> list[Turn]:
    return [Turn(role="system", content="You are a careful calculator."),
            Turn(role="user", content="What is 12 + 30?"), sampled(tok, text, finish)]


def make_episode(tok, episode_id: str, group_id: str, reward: float, *, sessions: int = 1,
                 outcome: Outcome | None = None, finish: str = "stop", env_id: str = "agent_rl/Hand-v0",
                 skills: tuple[str, ...] = ("add",), difficulty: int = 1) -> Episode:
    """An episode whose root is followed by ``sessions - 1`` compression continuations."""
    chain: list[Session] = []
    for k in range(sessions):
        text = f"The answer is {k + 40}." if k < sessions - 1 or finish == "stop" else "The answer is"
        parent = chain[-1] if chain else None
        boundary = None
        if parent is not None:
            summary = parent.turns[-1].content
            boundary = Boundary.compression(parent.messages(),
                                            [{"role": "user", "content": f"task\n{summary}"}], summary)
        chain.append(Session(
            session_id=f"{episode_id}/s{k}", episode_id=episode_id,
            parent_id=parent.session_id if parent else None,
            origin="compression" if parent else "root", boundary=boundary,
            turns=turns(tok, text, finish if k == sessions - 1 else "stop"), used_by_final=True))
    if outcome is None:
        outcome = Outcome.correct if reward >= 1.0 else Outcome.wrong
    return Episode(
        episode_id=episode_id, env_id=env_id, env_version=0, task_id=group_id, group_id=group_id,
        task_meta={"skills": list(skills), "difficulty": difficulty}, sessions=chain,
        reward=RewardBreakdown.from_components({"accuracy": reward}, {"accuracy": 1.0}, outcome, "hand@1"),
    )


def tokens_of(episode: Episode) -> int:
    """Generated tokens, counted straight from the turns."""
    return sum(len(t.token_ids) for s in episode.sessions for t in s.turns if t.token_ids is not None)


def groups_of_every_kind(tok) -> list[Episode]:
    """all_correct, all_wrong, zero_contrast, mixed, mixed plus a fault, one valid plus a fault."""
    spec = {"g-correct": [1.0, 1.0], "g-wrong": [0.0, 0.0], "g-half": [0.5, 0.5],
            "g-mixed": [1.0, 0.0], "g-fault": [1.0, 0.0, None], "g-lonely": [1.0, None]}
    episodes = []
    for group, rewards in spec.items():
        for j, r in enumerate(rewards):
            fault = r is None
            episodes.append(make_episode(tok, f"{group}#{j}", group, 0.0 if fault else r,
                                         outcome=Outcome.sandbox_error if fault else None))
    return episodes


def by_id(episodes: list[Episode]) -> dict[str, Episode]:
    return {e.episode_id: e for e in episodes}


# --- dynamic sampling --------------------------------------------------------------------------


def test_dynamic_sampling_drops_groups_without_contrast_and_says_why(tok):
    episodes = groups_of_every_kind(tok)
    decided, drops = filter_groups(episodes, dynamic_sampling=True)
    assert [e.episode_id for e in decided] == [e.episode_id for e in episodes]  # order kept
    assert all(e.hash_ok() for e in decided)

    reasons = {d["group_id"]: d["reason"] for d in drops}
    assert reasons == {"g-correct": "all_correct", "g-wrong": "all_wrong", "g-half": "zero_contrast",
                       "g-lonely": "too_few_valid"}
    d = next(d for d in drops if d["group_id"] == "g-correct")
    assert d["env"] == "agent_rl/Hand-v0" and d["skills"] == ["add"] and d["difficulty"] == 1
    assert d["episodes"] == 2
    assert d["tokens"] == sum(tokens_of(e) for e in episodes if e.group_id == "g-correct")

    f = {e.episode_id: (e.filter["kept"], e.filter["reason"]) for e in decided}
    assert f["g-correct#0"] == (False, "all_correct") and f["g-half#1"] == (False, "zero_contrast")
    assert f["g-mixed#0"] == f["g-mixed#1"] == (True, "kept")
    # The fault leaves its group: the two valid members still have contrast and are kept.
    assert f["g-fault#0"] == f["g-fault#1"] == (True, "kept")
    assert f["g-fault#2"] == (False, "infrastructure_fault")
    assert f["g-lonely#0"] == (False, "too_few_valid")
    assert f["g-lonely#1"] == (False, "infrastructure_fault")


def test_infrastructure_faults_leave_the_baseline_and_the_loss_and_are_counted(tok):
    episodes = [make_episode(tok, f"g#{j}", "g", r) for j, r in enumerate([1.0, 0.0])]
    # A fault scored 1.0 would pull the baseline up if it were counted.
    episodes.append(make_episode(tok, "g#2", "g", 1.0, outcome=Outcome.sandbox_error))
    decided, drops = filter_groups(episodes, dynamic_sampling=True)
    assert drops == []
    sequences, stats = build_sequences(tok, decided, **BUILD)
    assert [q.episode_id for q in sequences] == ["g#0", "g#1"]
    a = 0.5 / (0.5 + EPS)  # mean 0.5, population std 0.5
    assert [q.advantage for q in sequences] == pytest.approx([a, -a], abs=1e-12)
    assert stats["groups"] == 1

    report = budget_report(decided, drops, "mask")
    assert report["infrastructure_faults"] == 1
    assert report["episodes"] == 3 and report["episodes_kept"] == 2
    assert report["tokens_generated"] == sum(tokens_of(e) for e in episodes)
    assert report["tokens_discarded"] == tokens_of(episodes[2])


def test_without_dynamic_sampling_zero_contrast_groups_train_with_zero_advantage(tok):
    episodes = groups_of_every_kind(tok)
    decided, drops = filter_groups(episodes, dynamic_sampling=False)
    assert drops == []  # g-lonely has one valid member: enough without dynamic sampling
    kept = [e.episode_id for e in decided if e.filter["kept"]]
    assert kept == [e.episode_id for e in episodes if not e.reward.is_infrastructure_fault]
    sequences, stats = build_sequences(tok, decided, **BUILD)
    adv = {q.episode_id: q.advantage for q in sequences}
    for group in ("g-correct", "g-wrong", "g-half", "g-lonely"):
        members = [v for k, v in adv.items() if k.startswith(group + "#")]
        assert members and all(v == 0.0 for v in members), group  # exactly 0, not a residue
    assert adv["g-mixed#0"] > 0 > adv["g-mixed#1"]
    assert stats["zero_contrast"] == 4
    assert stats["all_correct"] == 2 and stats["all_wrong"] == 1  # g-lonely's lone 1.0 counts


# --- acceptance --------------------------------------------------------------------------------


def test_acceptance_rates_per_env_skill_and_difficulty(tok):
    spec = [  # (group, env, skills, difficulty, rewards)
        ("G1", "env/A-v0", ("search", "get"), 2, [1.0, 0.0]),  # kept
        ("G2", "env/A-v0", ("search",), 1, [1.0, 1.0]),  # dropped
        ("G3", "env/B-v0", ("get",), 1, [0.0, 0.5]),  # kept
        ("G4", "env/B-v0", ("get", "transform"), 2, [0.0, 0.0]),  # dropped
        ("G5", "env/A-v0", ("update",), 3, [0.5, 1.0]),  # kept
    ]
    episodes = [make_episode(tok, f"{g}#{j}", g, r, env_id=env, skills=skills, difficulty=diff)
                for g, env, skills, diff, rewards in spec for j, r in enumerate(rewards)]
    decided, drops = filter_groups(episodes, dynamic_sampling=True)
    assert sorted(d["group_id"] for d in drops) == ["G2", "G4"]
    report = budget_report(decided, drops, "mask")
    assert report["acceptance"] == {
        "env": {"env/A-v0": pytest.approx(2 / 3), "env/B-v0": 0.5},
        "skill": {"search": 0.5, "get": pytest.approx(2 / 3), "transform": 0.0, "update": 1.0},
        "difficulty": {"2": 0.5, "1": 0.5, "3": 1.0},
    }
    assert report["groups"] == 5 and report["groups_dropped"] == 2
    assert report["drop_reasons"] == {"all_correct": 1, "all_wrong": 1}


# --- budget report -----------------------------------------------------------------------------


def test_budget_report_counts_every_generated_token(tok):
    episodes = groups_of_every_kind(tok)
    episodes.append(make_episode(tok, "g-long#0", "g-long", 1.0, sessions=3))
    episodes.append(make_episode(tok, "g-long#1", "g-long", 0.0, finish="length"))
    decided, drops = filter_groups([apply_truncation(e, "mask", 0.0) for e in episodes], True)
    report = budget_report(decided, drops, "mask")

    every = sum(tokens_of(e) for e in episodes)
    kept = sum(tokens_of(e) for e in decided if e.filter["kept"])
    assert every == sum(generated_tokens(e) for e in episodes) > 0
    assert report["tokens_generated"] == every
    assert report["tokens_kept"] == kept
    assert report["tokens_discarded"] == every - kept
    faults = sum(tokens_of(e) for e in decided if e.reward.is_infrastructure_fault
                 and e.group_id not in {d["group_id"] for d in drops})
    assert report["tokens_discarded"] == sum(d["tokens"] for d in drops) + faults
    assert report["episodes"] == len(episodes) == 15
    assert report["episodes_kept"] == 6  # g-mixed 2, g-fault 2, g-long 2
    assert report["overlong"] == 1 and report["truncation"] == "mask"
    assert report["infrastructure_faults"] == 2
    assert report["drop_reasons"] == {"all_correct": 1, "all_wrong": 1, "zero_contrast": 1,
                                      "too_few_valid": 1}
    assert report["overlong_masked"] == 1  # g-long#1, in its group's baseline, out of the loss
    assert report["prompt_too_long"] == 0 and report["prompt_too_long_tokens"] is None
    assert set(report) == {"episodes", "episodes_kept", "groups", "groups_dropped", "drop_reasons",
                           "tokens_generated", "tokens_kept", "tokens_discarded", "overlong",
                           "overlong_masked", "prompt_too_long", "prompt_too_long_tokens",
                           "truncation", "infrastructure_faults", "agent_faults", "acceptance"}
    assert report["agent_faults"] == {}  # no agent written as code here


# --- truncation --------------------------------------------------------------------------------


def overlong_group(tok) -> list[Episode]:
    """[overlong 1.0, 0.0, 1.0]: the overlong one is cut by length in its only session."""
    return [make_episode(tok, "t#0", "t", 1.0, finish="length"),
            make_episode(tok, "t#1", "t", 0.0), make_episode(tok, "t#2", "t", 1.0)]


def test_mask_keeps_an_overlong_episode_in_the_baseline_but_out_of_the_loss(tok):
    group = overlong_group(tok)
    assert group[0].sessions[0].turns[-1].token_ids[-1] != end_of_turn_id(tok)
    truncated = [apply_truncation(e, "mask", -1.0) for e in group]
    assert truncated[0].reward == group[0].reward
    assert truncated[0].filter == {"overlong": True, "truncation": "mask"}
    assert truncated[1].filter == {"overlong": False, "truncation": "mask"}
    decided, drops = filter_groups(truncated, dynamic_sampling=True)
    assert drops == [] and all(e.filter["kept"] for e in decided)
    assert decided[0].filter == {"overlong": True, "truncation": "mask", "kept": True, "reason": "kept"}

    sequences, _ = build_sequences(tok, decided, **BUILD)
    assert [q.episode_id for q in sequences] == ["t#1", "t#2"]  # t#0 has weight 0: not returned
    mean = 2 / 3  # the overlong 1.0 is in the baseline
    std = math.sqrt(((1 - mean) ** 2 * 2 + mean ** 2) / 3)
    assert [q.advantage for q in sequences] == pytest.approx(
        [(0 - mean) / (std + EPS), (1 - mean) / (std + EPS)], abs=1e-12)
    assert all(q.weight == 1.0 for q in sequences)
    report = budget_report(decided, drops, "mask")
    assert report["overlong"] == 1 and report["truncation"] == "mask"


def test_penalize_replaces_the_reward_and_keeps_the_original_in_audit(tok):
    group = overlong_group(tok)
    penalized = apply_truncation(group[0], "penalize", -0.5)
    assert penalized.hash_ok() and penalized.filter == {"overlong": True, "truncation": "penalize"}
    r = penalized.reward
    assert r.total == -0.5 and r.components == {"overlong": 1.0} and r.weights == {"overlong": -0.5}
    assert r.outcome == Outcome.truncated and r.verifier == "hand@1"
    assert r.audit["unpenalized"] == group[0].reward.model_dump(mode="json")
    assert r.audit["unpenalized"]["total"] == 1.0
    # An episode that was not cut is left alone.
    assert apply_truncation(group[1], "penalize", -0.5).reward == group[1].reward

    decided, _ = filter_groups([penalized, *group[1:]], dynamic_sampling=True)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    rewards = [-0.5, 0.0, 1.0]
    mean = sum(rewards) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / 3)
    assert [q.episode_id for q in sequences] == ["t#0", "t#1", "t#2"]
    assert [q.advantage for q in sequences] == pytest.approx([(x - mean) / (std + EPS) for x in rewards])


def test_a_group_of_penalized_episodes_is_all_wrong_not_all_correct(tok):
    # penalty 0 and -1: the penalty's weight sum is not the verifier's maximum (bug fixed).
    for penalty in (0.0, -1.0):
        group = [apply_truncation(make_episode(tok, f"p#{j}", "p", 1.0, finish="length"),
                                  "penalize", penalty) for j in range(2)]
        _, drops = filter_groups(group, dynamic_sampling=True)
        assert [d["reason"] for d in drops] == ["all_wrong"]
    # One penalized (0) and one wrong (0): all wrong too, whichever comes first.
    group = [apply_truncation(make_episode(tok, "q#0", "q", 1.0, finish="length"), "penalize", 0.0),
             make_episode(tok, "q#1", "q", 0.0)]
    _, drops = filter_groups(group, dynamic_sampling=True)
    assert [d["reason"] for d in drops] == ["all_wrong"]


def test_keep_leaves_an_overlong_episode_alone_and_unknown_policies_fail(tok):
    group = overlong_group(tok)
    kept = apply_truncation(group[0], "keep", -1.0)
    assert kept.reward == group[0].reward
    assert kept.filter == {"overlong": True, "truncation": "keep"}
    decided, _ = filter_groups([kept, *group[1:]], dynamic_sampling=True)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    assert [q.episode_id for q in sequences] == ["t#0", "t#1", "t#2"]
    assert sequences[0].weight == 1.0 and sequences[0].advantage > 0
    # The cut turn renders: its sampled tokens are trained, the closing <|im_end|> is not.
    r = sequences[0].rendered
    assert r.num_trained == tokens_of(group[0])
    assert r.spans[-1].kind == "end" and not r.loss_mask[r.spans[-1].start:].any()
    for e in group:  # a typo fails even when nothing is overlong (bug fixed)
        with pytest.raises(ValueError, match="unknown truncation policy 'maks'"):
            apply_truncation(e, "maks", 0.0)


# --- build_sequences ---------------------------------------------------------------------------


def test_build_sequences_advantages_and_weights_by_hand(tok):
    episodes = [
        make_episode(tok, "A#0", "A", 1.0), make_episode(tok, "A#1", "A", 0.0),
        make_episode(tok, "A#2", "A", 0.5),
        make_episode(tok, "B#0", "B", 0.2, sessions=3), make_episode(tok, "B#1", "B", 0.8),
    ]
    decided, drops = filter_groups(episodes, dynamic_sampling=True)
    assert drops == []
    sequences, stats = build_sequences(tok, decided, **BUILD)
    # The baseline is over episodes: A: [1, 0, 0.5], mean 0.5, population std sqrt(1/6);
    # B: [0.2, 0.8] (B#0 has 3 sessions, which do not count thrice), mean 0.5, std 0.3.
    sa, sb = math.sqrt(1 / 6), 0.3
    expected = [0.5 / (sa + EPS), -0.5 / (sa + EPS), 0.0,
                -0.3 / (sb + EPS), -0.3 / (sb + EPS), -0.3 / (sb + EPS), 0.3 / (sb + EPS)]
    assert [q.advantage for q in sequences] == pytest.approx(expected, abs=1e-9)
    assert sequences[2].advantage == 0.0  # the group mean exactly
    assert [q.session_id for q in sequences] == [s.session_id for e in episodes for s in e.sessions]
    assert [q.group_id for q in sequences] == ["A"] * 3 + ["B"] * 4
    # per_episode: the 3-session episode's sequences share weight 1.
    assert [q.weight for q in sequences] == pytest.approx([1, 1, 1, 1 / 3, 1 / 3, 1 / 3, 1])
    assert stats == {"groups": 2, "zero_contrast": 0, "all_correct": 0, "all_wrong": 0,
                     "zero_contrast_other": 0}
    for q, s in zip(sequences, (s for e in episodes for s in e.sessions), strict=True):
        ref = render_session(tok, s)
        assert torch.equal(q.rendered.input_ids, ref.input_ids)
        assert torch.equal(q.rendered.loss_mask, ref.loss_mask)
        assert q.rendered.num_trained == s.generated_tokens

    per_session, _ = build_sequences(tok, decided, **{**BUILD, "session_weighting": "per_session"})
    assert [q.weight for q in per_session] == [1.0] * 7
    uniform, _ = build_sequences(tok, decided, **{**BUILD, "assigner": "uniform_split", "std": "none"})
    # uniform_split: B#0's sessions get credit 0.2 / 3 each, measured against the episode
    # baseline 0.5; std none: advantage = credit - group mean.
    assert [q.advantage for q in uniform[3:]] == pytest.approx(
        [0.2 / 3 - 0.5] * 3 + [0.8 - 0.5], abs=1e-12)


def branching_episode(tok, episode_id: str, reward: float, branch_used: bool) -> Episode:
    """root -> (branch, compression continuation that answers)."""
    root = Session(session_id=f"{episode_id}/s0", episode_id=episode_id, used_by_final=True,
                   turns=[Turn(role="system", content="Solve it."), Turn(role="user", content="task"),
                          sampled(tok, '<tool_call>{"name": "spawn", "arguments": {"task": "find 7"}}'
                                       '</tool_call>'),
                          Turn(role="tool", name="spawn", content="3.25"),
                          sampled(tok, "Summary: record 7 is 3.25.")])
    branch = Session(
        session_id=f"{episode_id}/s1", parent_id=root.session_id, episode_id=episode_id,
        origin="branch", used_by_final=branch_used,
        boundary=Boundary(kind="branch", parent_turn=2, returned="3.25",
                          after=[{"role": "user", "content": "find 7"}]),
        turns=[Turn(role="system", content="You are a sub-agent."), Turn(role="user", content="find 7"),
               sampled(tok, "3.25")])
    child = Session(
        session_id=f"{episode_id}/s2", parent_id=root.session_id, episode_id=episode_id,
        origin="compression", used_by_final=True,
        boundary=Boundary.compression(root.messages(), [{"role": "user", "content": "task"}],
                                      "Summary: record 7 is 3.25."),
        turns=[Turn(role="system", content="Solve it."), Turn(role="user", content="task"),
               sampled(tok, "Final answer: 3.25")])
    return Episode(episode_id=episode_id, env_id="agent_rl/Hand-v0", env_version=0, task_id="u",
                   group_id="u", sessions=[root, branch, child],
                   reward=RewardBreakdown.from_components({"accuracy": reward}, {"accuracy": 1.0},
                                                          Outcome.correct if reward else Outcome.wrong,
                                                          "hand@1"))


def test_usage_weighted_credits_an_unused_branch_with_zero(tok):
    good = branching_episode(tok, "u#0", 1.0, branch_used=False)
    bad = make_episode(tok, "u#1", "u", 0.0)
    assert good.final_session.session_id == "u#0/s2"
    assert dict(assign(good, "usage_weighted")) == {"u#0/s0": 1.0, "u#0/s1": 0.0, "u#0/s2": 1.0}
    decided, _ = filter_groups([good, bad], dynamic_sampling=True)
    sequences, _ = build_sequences(tok, decided, **{**BUILD, "assigner": "usage_weighted"})
    # episode rewards [1 | 0]: mean 0.5, std 0.5; credits [1, 0, 1 | 0]
    a = 0.5 / (0.5 + EPS)
    assert [(q.session_id, q.advantage) for q in sequences] == [
        ("u#0/s0", pytest.approx(a)), ("u#0/s1", pytest.approx(-a)),
        ("u#0/s2", pytest.approx(a)), ("u#1/s0", pytest.approx(-a))]
    assert [q.weight for q in sequences] == pytest.approx([1 / 3] * 3 + [1])
    # Under broadcast the unused branch gets the episode reward like the others.
    broad, _ = build_sequences(tok, decided, **BUILD)
    assert broad[0].advantage > 0 and broad[1].advantage == pytest.approx(broad[0].advantage)
    # unused_value is passed through.
    custom, _ = build_sequences(tok, decided, **{**BUILD, "assigner": "usage_weighted",
                                                 "assigner_params": {"unused_value": -1.0},
                                                 "std": "none"})
    mean = (1.0 + 0.0) / 2  # the episodes' rewards, not the credits
    assert [q.advantage for q in custom] == pytest.approx([1 - mean, -1 - mean, 1 - mean, 0 - mean])


# --- session_advantages: the group baseline is over episodes ------------------------------------


def chain(episode_id: str, n: int, reward: float, group: str = "G") -> Episode:
    """An episode of ``n`` sessions (root, then n - 1 compressions); the last answers."""
    sessions = [testing.session(f"{episode_id}/s0", episode_id=episode_id)]
    for k in range(1, n):
        sessions.append(testing.session(f"{episode_id}/s{k}", f"{episode_id}/s{k - 1}",
                                        "compression", episode_id=episode_id))
    return testing.episode(sessions, reward, episode_id=episode_id, group_id=group,
                           final_session_id=sessions[-1].session_id)


@pytest.fixture
def one_two_three():
    # rewards [1, 0, 0.5]: mean 0.5, population std sqrt(((0.5)^2 + (0.5)^2 + 0) / 3) = sqrt(1/6)
    return [chain("e1", 1, 1.0), chain("e2", 2, 0.0), chain("e3", 3, 0.5)]


def test_session_advantages_broadcast_is_grpo_per_episode_whatever_the_session_count(one_two_three):
    s = math.sqrt(1 / 6)
    adv = session_advantages(one_two_three, "broadcast", std="population", eps=0.0)
    assert adv == pytest.approx({("e1", "e1/s0"): 0.5 / s,
                                 ("e2", "e2/s0"): -0.5 / s, ("e2", "e2/s1"): -0.5 / s,
                                 ("e3", "e3/s0"): 0.0, ("e3", "e3/s1"): 0.0, ("e3", "e3/s2"): 0.0})
    assert adv.stats["groups"] == 1 and adv.stats["zero_contrast"] == 0
    # The old, wrong rule (every session a group member) would have had mean 1.5 / 6 = 0.25.
    none = session_advantages(one_two_three, "broadcast", std="none")
    assert none == pytest.approx({("e1", "e1/s0"): 0.5, ("e2", "e2/s0"): -0.5,
                                  ("e2", "e2/s1"): -0.5, ("e3", "e3/s0"): 0.0,
                                  ("e3", "e3/s1"): 0.0, ("e3", "e3/s2"): 0.0})


def test_session_advantages_terminal_only_and_discounted_by_hand(one_two_three):
    s = math.sqrt(1 / 6)
    term = session_advantages(one_two_three, "terminal_only", eps=0.0)
    # credits: e1 [1]; e2 [0, 0]; e3 [0, 0, 0.5]; baseline 0.5 for all
    assert term == pytest.approx({("e1", "e1/s0"): 0.5 / s,
                                  ("e2", "e2/s0"): -0.5 / s, ("e2", "e2/s1"): -0.5 / s,
                                  ("e3", "e3/s0"): -0.5 / s, ("e3", "e3/s1"): -0.5 / s,
                                  ("e3", "e3/s2"): 0.0})
    disc = session_advantages(one_two_three, "discounted", {"gamma": 0.5}, std="none")
    # e3: 0.5 * 0.5**d for d = 2, 1, 0 -> [0.125, 0.25, 0.5]; e2: 0; e1: 1
    assert disc == pytest.approx({("e1", "e1/s0"): 0.5, ("e2", "e2/s0"): -0.5,
                                  ("e2", "e2/s1"): -0.5, ("e3", "e3/s0"): 0.125 - 0.5,
                                  ("e3", "e3/s1"): 0.25 - 0.5, ("e3", "e3/s2"): 0.0})


def test_session_advantages_zero_contrast_groups_are_zero_everywhere():
    group = [chain("a", 1, 1.0), chain("b", 3, 1.0)]
    adv = session_advantages(group, "terminal_only")  # credits 1 | 0, 0, 1 but no contrast
    assert set(adv.values()) == {0.0} and len(adv) == 4
    assert adv.stats == {"groups": 1, "zero_contrast": 1, "all_correct": 1, "all_wrong": 0,
                         "zero_contrast_other": 0}
    two = session_advantages([chain("a", 1, 1.0, "x"), chain("b", 2, 0.0, "x"),
                              chain("c", 1, 0.0, "y"), chain("d", 2, 0.0, "y")], eps=0.0)
    # group x: rewards [1, 0], mean 0.5, std 0.5; group y has no contrast
    assert two == pytest.approx({("a", "a/s0"): 1.0, ("b", "b/s0"): -1.0, ("b", "b/s1"): -1.0,
                                 ("c", "c/s0"): 0.0, ("d", "d/s0"): 0.0, ("d", "d/s1"): 0.0})
    assert two.stats["all_wrong"] == 1


def test_group_stats_are_counted_with_and_without_dynamic_sampling(tok):
    episodes = groups_of_every_kind(tok)
    for dynamic in (True, False):
        decided, _ = filter_groups(episodes, dynamic_sampling=dynamic)
        stats = contrast_stats(decided)
        # g-correct, g-wrong, g-half flat; g-lonely has one valid episode (flat, correct)
        assert stats == {"groups": 6, "zero_contrast": 4, "all_correct": 2, "all_wrong": 1,
                         "zero_contrast_other": 1}, dynamic


# --- a real multi-session LongRecords-v0 episode --------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_model(seed=0)
    return model, tokenizer


def scripted_episode(model, tok, task, episode_id: str, final_answer: str | None = None,
                     sample_id: int = 0) -> Episode:
    """Drive LongRecords-v0 with its scripted solver, each action as tiny-tokenizer token ids
    (+ <|im_end|>) scored by the tiny model in the context the env showed."""
    env = envs.make("agent_rl/LongRecords-v0")  # branching on, default context budget
    obs, _ = env.reset(seed=0, options={"task": task, "episode_id": episode_id, "group_id": "lr",
                                        "sample_id": sample_id})
    eot = end_of_turn_id(tok)
    for _ in range(100):
        text = env.unwrapped.reference_action()
        assert text
        last = not env.unwrapped.in_branch and not env.unwrapped.awaiting_summary \
            and "<tool_call>" not in text
        if last and final_answer is not None:
            text = final_answer
        ids = tok.encode(text, add_special_tokens=False)
        # The tiny byte-level tokenizer gives the solver's text back (render checks it).
        assert tok.decode(ids, skip_special_tokens=True) == text
        ids.append(eot)
        prompt = chat_ids(tok, obs, add_generation_prompt=True)
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor([prompt + ids]))[0, len(prompt):]  # [n]
        obs, _, terminated, truncated, info = env.step(
            {"text": text, "token_ids": ids, "logprobs": lp.tolist(), "finish_reason": "stop"})
        if terminated or truncated:
            return info["episode"]
    raise AssertionError("the scripted solver did not finish")


@pytest.fixture(scope="module")
def long_episodes(tiny):
    model, tok = tiny
    pool = envs.make("agent_rl/LongRecords-v0").unwrapped.task_pool(12, seed=1)
    task = min(pool, key=lambda t: t.meta.length)  # 10 steps: still compresses and branches
    solved = scripted_episode(model, tok, task, "lr#0")
    wrong = scripted_episode(model, tok, task, "lr#1", final_answer="I do not know.", sample_id=1)
    return task, solved, wrong


def test_a_scripted_long_records_episode_renders_every_session(tiny, long_episodes):
    model, tok = tiny
    task, episode, _ = long_episodes
    assert episode.reward.outcome == Outcome.correct and episode.reward.total == pytest.approx(1.0)
    origins = [s.origin for s in episode.sessions]
    assert origins[0] == "root" and "compression" in origins and "branch" in origins

    rendered = render_episode(tok, episode)
    assert [r.session_id for r in rendered] == [s.session_id for s in episode.sessions]
    for s, r in zip(episode.sessions, rendered, strict=True):
        generated = [t for t in s.turns if t.generated]
        assert generated, s.session_id
        # Loss mask 1 exactly on the sampled ids (im_end included), with their log-probs.
        ids = r.input_ids[r.loss_mask].tolist()
        assert ids == [i for t in generated for i in t.token_ids]
        assert r.num_trained == s.generated_tokens == s.metrics["generated_tokens"]
        assert r.old_logprobs[r.loss_mask].tolist() == pytest.approx(
            [lp for t in generated for lp in t.logprobs], abs=1e-6)
        assert not r.old_logprobs[~r.loss_mask].any()
        # The rendered sequence is what the policy saw: rescoring it gives the old log-probs.
        with torch.no_grad():
            new = sequence_logprobs(model, r.input_ids[None])[0]  # [T]
        assert torch.allclose(new[r.loss_mask], r.old_logprobs[r.loss_mask], atol=1e-4)

    sessions = {s.session_id: s for s in episode.sessions}
    for s in episode.sessions:
        if s.origin == "compression":
            b = s.boundary
            parent = sessions[s.parent_id]
            assert b.before_hash and b.summary
            assert b.summary == [t for t in parent.turns if t.generated][-1].content
            assert b.summary in s.turns[1].content  # the child's opening carries it
            assert b.after == [t.message() for t in s.turns[:2]]
        if s.origin == "branch":
            assert s.boundary.returned == task.target["solution"][0]["returns"]
            spawn_result = [t for t in sessions[s.parent_id].turns if t.role == "tool" and t.name == "spawn"]
            assert spawn_result and spawn_result[0].content == s.boundary.returned

    assert all(s.used_by_final for s in episode.sessions)
    R = episode.reward.total
    assert dict(assign(episode, "broadcast")) == {s.session_id: R for s in episode.sessions}
    assert dict(assign(episode, "usage_weighted")) == {s.session_id: R for s in episode.sessions}


def test_scripted_long_records_group_builds_sequences_by_hand(tiny, long_episodes):
    _, tok = tiny
    _, solved, wrong = long_episodes
    assert wrong.reward.outcome == Outcome.wrong
    assert wrong.reward.total == pytest.approx(0.3)  # the writes were right, the answer not
    decided, drops = filter_groups([solved, wrong], dynamic_sampling=True)
    assert drops == [] and all(e.filter["kept"] for e in decided)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    n0, n1 = len(solved.sessions), len(wrong.sessions)
    # broadcast with an episode baseline: plain GRPO on the two episodes, whatever their
    # session counts: rewards [1.0, 0.3], mean 0.65, std 0.35 -> +1 and -1 on every session
    a = 0.35 / (0.35 + EPS)
    assert [q.advantage for q in sequences] == pytest.approx([a] * n0 + [-a] * n1)
    assert [q.weight for q in sequences] == pytest.approx([1 / n0] * n0 + [1 / n1] * n1)
    report = budget_report(decided, drops, "mask")
    assert report["tokens_generated"] == tokens_of(solved) + tokens_of(wrong) == report["tokens_kept"]


# --- rollout_batch end to end ------------------------------------------------------------------


def test_rollout_settings_from_a_contract_carry_every_section_that_shapes_the_batch():
    """RolloutSettings.from_contract: one key of each section that shapes a batch (env,
    rollout, reward_shaping, credit, advantage) reaches its field; the sampling seed is unset
    until ``seeded`` gives the step's, leaving the rest alone."""
    from agent_rl.run.contract import ExperimentContract

    contract = ExperimentContract.model_validate({
        "env": {"id": "agent_rl/Arithmetic-v0", "kwargs": {"hints": True}},
        "rollout": {"group_size": 3, "temperature": 0.7, "top_p": 0.9, "max_prompt_tokens": 300,
                    "max_response_tokens": 40, "truncation": "penalize",
                    "truncation_penalty": -0.5, "dynamic_sampling": False},
        "reward_shaping": {"length": 0.1},
        "credit": {"assigner": "discounted", "params": {"gamma": 0.5},
                   "session_weighting": "per_session"},
        "advantage": {"std": "none", "scale": "batch", "eps": 0.01}})
    settings = RolloutSettings.from_contract(contract)
    assert settings == RolloutSettings(
        "agent_rl/Arithmetic-v0", group_size=3,
        sampling=Sampling(temperature=0.7, top_p=0.9, max_new_tokens=40, max_prompt_tokens=300),
        env_kwargs={"hints": True}, truncation="penalize", truncation_penalty=-0.5,
        length_weight=0.1, dynamic_sampling=False, assigner="discounted",
        assigner_params={"gamma": 0.5}, session_weighting="per_session", std="none",
        scale="batch", eps=0.01)
    assert settings.sampling.seed is None
    step = settings.seeded(17)
    assert step.sampling.seed == 17 and settings.sampling.seed is None
    assert step == RolloutSettings(**{**settings.__dict__,
                                      "sampling": Sampling(**{**settings.sampling.__dict__, "seed": 17})})


def test_rollout_batch_end_to_end_with_the_tiny_model(tiny, tmp_path):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(2, seed=0)
    store = RolloutStore(tmp_path / "rollouts.jsonl")
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=0)
    batch = rollout_batch(policy, tok, tasks, RolloutSettings(
        "agent_rl/Arithmetic-v0", group_size=2, sampling=sampling), seed=5, group_prefix="step0/")
    store.append(batch.episodes)  # as the trainer does when it takes the batch

    assert len(batch.episodes) == 4
    assert sorted({e.group_id for e in batch.episodes}) == sorted(f"step0/{t.task_id}" for t in tasks)
    for e in batch.episodes:
        assert {"kept", "reason", "overlong", "truncation"} <= set(e.filter)
        assert e.filter["truncation"] == "mask"
        assert 1 <= generated_tokens(e) <= 8
        assert e.filter["overlong"] == (e.sessions[0].turns[-1].finish_reason == "length")
    r = batch.report
    assert r["episodes"] == 4 and r["groups"] == 2
    assert r["tokens_generated"] == sum(tokens_of(e) for e in batch.episodes)
    assert r["tokens_discarded"] == r["tokens_generated"] - sum(
        tokens_of(e) for e in batch.kept)
    assert set(r["acceptance"]) == {"env", "skill", "difficulty"}
    assert r["acceptance"]["env"]["agent_rl/Arithmetic-v0"] == (2 - r["groups_dropped"]) / 2
    trained = {e.episode_id for e in batch.kept if not e.filter["overlong"]}
    assert {q.episode_id for q in batch.sequences} == trained

    # The store holds every episode, kept or dropped, exactly as returned, and verifies.
    assert store.cursor == 4
    assert [e.content_hash for e in store.read()] == [e.content_hash for e in batch.episodes]
    assert [e.filter for e in store.read()] == [e.filter for e in batch.episodes]
    assert store.verify().ok

    # Without dynamic sampling and with keep, every episode trains; the rollout's log-probs are
    # the trainer's (ratio 1 on the rendered sequences).
    batch = rollout_batch(policy, tok, tasks, RolloutSettings(
        "agent_rl/Arithmetic-v0", group_size=2, sampling=sampling, truncation="keep",
        dynamic_sampling=False), seed=5)
    assert len(batch.sequences) == 4 and all(q.weight == 1.0 for q in batch.sequences)
    for q in batch.sequences:
        with torch.no_grad():
            new = policy.logprobs(q.rendered.input_ids[None])[0]  # [T]
        mask = q.rendered.loss_mask
        assert torch.allclose(new[mask], q.rendered.old_logprobs[mask], atol=1e-4)


# --- the length reward (Kimi k1.5's length penalty, step 4) -------------------------------------


def episode_of_length(tok, episode_id: str, group_id: str, n: int, outcome: Outcome) -> Episode:
    """One session whose single assistant turn generated exactly ``n`` tokens (<|im_end|> last)."""
    ids = tok.encode("The answer is 42. " * n, add_special_tokens=False)[: n - 1] + [end_of_turn_id(tok)]
    reply = Turn(role="assistant", content=tok.decode(ids[:-1]), token_ids=ids,
                 logprobs=[-0.3] * n, finish_reason="stop")
    session = Session(session_id=f"{episode_id}/s0", episode_id=episode_id, used_by_final=True,
                      turns=[*turns(tok, "")[:2], reply])
    reward = RewardBreakdown.from_components({"accuracy": float(outcome == Outcome.correct)},
                                             {"accuracy": 1.0}, outcome, "hand@1")
    return Episode(episode_id=episode_id, env_id="agent_rl/Hand-v0", env_version=0,
                   task_id=group_id, group_id=group_id, sessions=[session], reward=reward)


def kimi_group(tok) -> list[Episode]:
    """Lengths [10, 20, 30, 10], outcomes [correct, correct, wrong, wrong]."""
    spec = [(10, Outcome.correct), (20, Outcome.correct), (30, Outcome.wrong), (10, Outcome.wrong)]
    return [episode_of_length(tok, f"k#{j}", "k", n, o) for j, (n, o) in enumerate(spec)]


def test_length_reward_by_hand(tok):
    group = kimi_group(tok)
    assert [generated_tokens(e) for e in group] == [10, 20, 30, 10]
    # min_len 10, max_len 30, span 20: lambda = 0.5 - (len - 10) / 20
    #   = [0.5 - 0/20, 0.5 - 10/20, 0.5 - 20/20, 0.5 - 0/20] = [0.5, 0.0, -0.5, 0.5]
    assert length_lambdas([10, 20, 30, 10]) == [0.5, 0.0, -0.5, 0.5]
    # correct keep lambda, wrong get min(0, lambda): [0.5, 0.0, min(0, -0.5), min(0, 0.5)]
    #   = [0.5, 0.0, -0.5, 0.0]: the short wrong answer (k#3) is not rewarded for being short
    assert [length_reward(lam, ok) for lam, ok in
            zip([0.5, 0.0, -0.5, 0.5], [True, True, False, False], strict=True)] == [0.5, 0.0, -0.5, 0.0]

    shaped = apply_length_reward(group, 0.1)
    assert all(e.hash_ok() for e in shaped)
    assert [e.reward.components[LENGTH] for e in shaped] == [0.5, 0.0, -0.5, 0.0]
    for before, after in zip(group, shaped, strict=True):  # the verifier's components stay
        r = after.reward
        assert r.components == {**before.reward.components, LENGTH: r.components[LENGTH]}
        assert r.weights == {"accuracy": 1.0, LENGTH: 0.1}
        assert r.outcome == before.reward.outcome and r.verifier == "hand@1"
        assert task_total(r) == r.audit["length_shaping"]["unshaped_total"] == before.reward.total
        assert r.audit["length_shaping"]["min_tokens"] == 10
        assert r.audit["length_shaping"]["max_tokens"] == 30
    # total = accuracy + 0.1 x length = [1 + 0.05, 1 + 0, 0 - 0.05, 0 + 0]
    totals = [1.05, 1.0, -0.05, 0.0]
    assert [e.reward.total for e in shaped] == pytest.approx(totals, abs=1e-12)
    assert [e.reward.audit["length_shaping"]["lambda"] for e in shaped] == [0.5, 0.0, -0.5, 0.5]

    # Advantages from the shaped totals: mean (1.05 + 1 - 0.05 + 0) / 4 = 0.5, deviations
    # [0.55, 0.5, -0.55, -0.5], population variance (2 x 0.3025 + 2 x 0.25) / 4 = 0.27625.
    decided, drops = filter_groups(shaped, dynamic_sampling=True)
    assert drops == []
    sequences, _ = build_sequences(tok, decided, **BUILD)
    std = math.sqrt(0.27625)
    assert [q.advantage for q in sequences] == pytest.approx(
        [0.55 / (std + EPS), 0.5 / (std + EPS), -0.55 / (std + EPS), -0.5 / (std + EPS)], abs=1e-12)
    # Unshaped the two correct answers tie at +1 and the two wrong ones at -1; shaped, the
    # shorter of each pair is preferred.
    sequences, _ = build_sequences(tok, decided, **{**BUILD, "std": "none"})
    assert [q.advantage for q in sequences] == pytest.approx([0.55, 0.5, -0.55, -0.5], abs=1e-12)


def test_equal_lengths_give_no_length_reward(tok):
    group = [episode_of_length(tok, f"e#{j}", "e", 12, o)
             for j, o in enumerate([Outcome.correct, Outcome.wrong, Outcome.format_error])]
    shaped = apply_length_reward(group, 0.5)
    assert length_lambdas([12, 12, 12]) == [0.0, 0.0, 0.0]
    assert [e.reward.components[LENGTH] for e in shaped] == [0.0, 0.0, 0.0]
    assert [e.reward.total for e in shaped] == [e.reward.total for e in group]
    assert length_lambdas([7]) == [0.0]  # a group of one has no extremes either


def test_length_reward_off_changes_nothing(tok):
    episodes = [*kimi_group(tok), *groups_of_every_kind(tok)]
    assert [e.content_hash for e in apply_length_reward(episodes, 0.0)] == \
        [e.content_hash for e in episodes]
    assert all(task_total(e.reward) == e.reward.total for e in episodes)


def test_dynamic_sampling_and_group_stats_judge_the_task_reward(tok):
    """Length contrast alone never keeps a group; faults neither set nor get a length."""
    spec = {"all-right": [(10, Outcome.correct), (30, Outcome.correct)],
            "all-wrong": [(10, Outcome.wrong), (30, Outcome.wrong)],
            "mixed": [(10, Outcome.correct), (30, Outcome.wrong), (90, Outcome.sandbox_error)]}
    episodes = [episode_of_length(tok, f"{g}#{j}", g, n, o)
                for g, members in spec.items() for j, (n, o) in enumerate(members)]
    shaped = apply_length_reward(episodes, 0.1)
    # all-right: lambda [0.5, -0.5], both correct: totals 1.05 and 0.95, yet all correct
    assert [e.reward.total for e in shaped[:2]] == pytest.approx([1.05, 0.95])
    for dynamic in (True, False):
        _, drops = filter_groups(shaped, dynamic_sampling=dynamic)
        _, plain = filter_groups(episodes, dynamic_sampling=dynamic)
        assert drops == plain
        assert contrast_stats(shaped) == contrast_stats(episodes)
    _, drops = filter_groups(shaped, dynamic_sampling=True)
    assert {d["group_id"]: d["reason"] for d in drops} == {"all-right": "all_correct",
                                                         "all-wrong": "all_wrong"}
    # the fault (90 tokens) is not the group's max_len and carries no length component
    fault = shaped[-1]
    assert LENGTH not in fault.reward.components and fault.reward == episodes[-1].reward
    assert shaped[4].reward.audit["length_shaping"]["max_tokens"] == 30
    assert [e.reward.components[LENGTH] for e in shaped[4:6]] == [0.5, -0.5]
    assert [e.reward.components[LENGTH] for e in shaped[2:4]] == [0.0, -0.5]  # all-wrong


def test_length_reward_metrics_and_a_clashing_component(tok):
    extra = [episode_of_length(tok, "h#0", "h", 10, Outcome.wrong),
             episode_of_length(tok, "h#1", "h", 30, Outcome.correct)]
    shaped = apply_length_reward([*kimi_group(tok), *extra], 0.1)
    decided, drops = filter_groups(shaped, dynamic_sampling=True)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    batch = RolloutBatch(decided, sequences, budget_report(decided, drops, "mask"),
                         contrast_stats(decided), drops)
    m = step_metrics(1, batch, {}, 1.0, 1.0, Counter(), {"max": 0.0, "mean": 0.0})
    # length: k [0.5, 0, -0.5, 0], h [min(0, 0.5), -0.5] = [0, -0.5]: mean -0.5 / 6
    assert m["reward/length"] == pytest.approx(-0.5 / 6)
    assert m["reward/accuracy"] == pytest.approx(3 / 6)
    # reward/mean is the shaped total: (1.05 + 1 - 0.05 + 0 + 0 + 0.95) / 6
    assert m["reward/mean"] == pytest.approx(2.95 / 6)

    with pytest.raises(ValueError, match="already has a 'length' component"):
        apply_length_reward(shaped, 0.1)  # shaping twice would overwrite the first


def test_a_multi_session_length_is_every_generated_token_of_every_session(tok, long_episodes):
    _, solved, wrong = long_episodes
    assert {s.origin for s in solved.sessions} >= {"root", "compression", "branch"}
    shaped = apply_length_reward([solved, wrong], 0.1)
    lengths = [tokens_of(solved), tokens_of(wrong)]
    assert lengths[0] != lengths[1]
    assert lengths[0] > max(s.generated_tokens for s in solved.sessions)  # not one session's
    assert [e.reward.audit["length_shaping"]["tokens"] for e in shaped] == lengths
    lams = length_lambdas(lengths)
    assert [e.reward.components[LENGTH] for e in shaped] == [
        length_reward(lams[0], solved.reward.outcome == Outcome.correct),
        length_reward(lams[1], False)]


def test_rollout_batch_with_the_length_reward(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(2, seed=0)
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=0)
    common = {"group_size": 3, "sampling": sampling, "truncation": "keep",
              "dynamic_sampling": False}
    plain = rollout_batch(policy, tok, tasks, RolloutSettings("agent_rl/Arithmetic-v0", **common),
                          seed=7)
    off = rollout_batch(policy, tok, tasks, RolloutSettings(
        "agent_rl/Arithmetic-v0", length_weight=0.0, **common), seed=7)
    on = rollout_batch(policy, tok, tasks, RolloutSettings(
        "agent_rl/Arithmetic-v0", length_weight=0.1, **common), seed=7)
    # off: the very same batch as before the length reward existed
    assert [e.content_hash for e in off.episodes] == [e.content_hash for e in plain.episodes]
    assert [q.advantage for q in off.sequences] == [q.advantage for q in plain.sequences]
    assert off.report == plain.report and off.advantage_stats == plain.advantage_stats
    # on: the same samples (seeded), each reward the verifier's plus 0.1 x the group's rule
    assert [generated_tokens(e) for e in on.episodes] == [generated_tokens(e) for e in plain.episodes]
    for group in {e.group_id for e in on.episodes}:
        members = [(a, b) for a, b in zip(plain.episodes, on.episodes, strict=True)
                   if a.group_id == group]
        lams = length_lambdas([generated_tokens(a) for a, _ in members])
        for (a, b), lam in zip(members, lams, strict=True):
            value = length_reward(lam, a.reward.outcome == Outcome.correct)
            assert b.reward.components == {**a.reward.components, LENGTH: value}
            assert b.reward.total == pytest.approx(a.reward.total + 0.1 * value, abs=1e-12)
            assert task_total(b.reward) == a.reward.total
    assert on.advantage_stats == plain.advantage_stats  # counted on the task reward


# --- annealed hints (step 0) -------------------------------------------------------------------


@pytest.mark.parametrize("schedule, start, end, over, expected", [
    # linear: (1 - t) * start + t * end, t = min(s - 1, over) / over
    ("linear", 1.0, 0.0, 10, {1: 1.0, 2: 0.9, 6: 0.5, 10: 0.1, 11: 0.0, 50: 0.0}),
    ("linear", 0.2, 0.8, 4, {1: 0.2, 2: 0.35, 3: 0.5, 5: 0.8, 9: 0.8}),
    ("linear", 1.0, 0.0, 2, {1: 1.0, 2: 0.5, 3: 0.0}),  # the 2-step tiny run: 1.0, then 0.5
    ("linear", 1.0, 0.0, 1, {1: 1.0, 2: 0.0}),
    # step: start while s <= over, then end
    ("step", 0.8, 0.2, 3, {1: 0.8, 3: 0.8, 4: 0.2, 100: 0.2}),
    ("constant", 0.3, 0.9, 5, {1: 0.3, 6: 0.3, 1000: 0.3}),
])
def test_hint_share_at_hand_computed_steps(schedule, start, end, over, expected):
    assert {s: hint_share(s, schedule, start, end, over) for s in expected} == pytest.approx(expected)


def test_hint_share_refuses_what_the_contract_refuses():
    with pytest.raises(ValueError, match="unknown hint schedule 'cosine'"):
        hint_share(1, "cosine", 1.0, 0.0, 10)
    with pytest.raises(ValueError, match="count from 1"):
        hint_share(0, "linear", 1.0, 0.0, 10)


def test_hinted_jobs_counts_are_exact_and_a_pure_function_of_seed_and_step():
    # linear 1.0 -> 0.0 over 10, 8 jobs: n = floor(share * 8 + 1/2)
    shares = {s: hint_share(s, "linear", 1.0, 0.0, 10) for s in (1, 2, 3, 6, 10, 11)}
    counts = {s: sum(hinted_jobs(share, 8, 0, s)) for s, share in shares.items()}
    assert counts == {1: 8, 2: 7, 3: 6, 6: 4, 10: 1, 11: 0}  # 8, 7.2, 6.4, 4, 0.8, 0
    assert sum(hinted_jobs(0.5, 3, 0, 1)) == 2  # half rounds up (1.5 -> 2), not to even
    assert sum(hinted_jobs(0.5, 5, 0, 1)) == 3  # 2.5 -> 3
    assert shares[10] != 0.1 and sum(hinted_jobs(shares[10], 5, 0, 10)) == 1  # 0.4999... -> 1
    for s in range(1, 12):  # the same draw every time (a resumed run shows what the killed one would)
        assert hinted_jobs(0.5, 8, 3, s) == hinted_jobs(0.5, 8, 3, s)
    draws = {tuple(hinted_jobs(0.5, 8, 3, s)) for s in range(1, 12)}
    assert len(draws) > 1 and all(sum(d) == 4 for d in draws)  # a fresh choice per step
    assert hinted_jobs(0.5, 8, 3, 1) != hinted_jobs(0.5, 8, 4, 1)  # and per seed


def test_rollout_batch_shows_hints_on_the_chosen_jobs_with_their_provenance(tiny):
    model, tok = tiny
    policy = HFPolicy(model, tok)
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(3, seed=0)
    tasks[2] = tasks[2].model_copy(update={"hint": None})  # a task with no hint
    note = {"schedule": "linear", "step": 3, "share": 0.5}
    shown = [True, False, False, True, True, True]
    settings = RolloutSettings("agent_rl/Arithmetic-v0", group_size=2,
                               sampling=Sampling(temperature=1.0, max_new_tokens=4, seed=0),
                               truncation="keep", dynamic_sampling=False)
    batch = rollout_batch(policy, tok, tasks, settings, seed=5, hints=shown, hint_note=note)
    # job i * 2 + j is task i's sample j; task 2 has no hint, so its jobs are unhinted anyway
    assert [e.hint is not None for e in batch.episodes] == [True, False, False, True, False, False]
    for e, task in zip(batch.episodes, [t for t in tasks for _ in range(2)], strict=True):
        if e.hint is not None:
            assert e.hint == {"text": task.hint["text"], "provenance": "solution-derived",
                              "shown": True, "schedule": note}
            assert f"Hint: {task.hint['text']}" in e.sessions[0].turns[1].content
        assert e.hash_ok()
    m = step_metrics(3, batch, {}, 1.0, 1.0, Counter(), {"max": 0.0, "mean": 0.0}, hint_share=0.5)
    assert m["hint/used_frac"] == m["hint/share"] == pytest.approx(2 / 6)  # task 2 has none
    assert m["hint/scheduled_share"] == 0.5
    rewards = [e.reward.total for e in batch.episodes]
    assert m["reward/hinted_mean"] == pytest.approx((rewards[0] + rewards[3]) / 2)
    assert m["reward/unhinted_mean"] == pytest.approx((sum(rewards) - rewards[0] - rewards[3]) / 4)

    plain = rollout_batch(policy, tok, tasks, settings, seed=5)
    assert not any(e.hint for e in plain.episodes)  # no hints given: as the envs are built


def test_reward_split_by_hint_on_a_hand_made_batch(tok):
    hint = {"text": "6 * 7 = 42", "provenance": "solution-derived", "shown": True}
    rewards = {"a#0": (1.0, True), "a#1": (0.5, True), "a#2": (0.0, False), "b#0": (0.25, False),
               "b#1": (0.5, False)}
    episodes = [make_episode(tok, eid, eid[0], r).evolve(hint=hint if hinted else None)
                for eid, (r, hinted) in rewards.items()]
    batch = RolloutBatch(episodes, [], budget_report(episodes, [], "mask"), {}, [])
    lag = {"max": 0.0, "mean": 0.0}
    m = step_metrics(1, batch, {}, 1.0, 1.0, Counter(), lag, hint_share=0.4)
    assert m["reward/hinted_mean"] == pytest.approx(0.75)  # (1.0 + 0.5) / 2
    assert m["reward/unhinted_mean"] == pytest.approx(0.25)  # (0.0 + 0.25 + 0.5) / 3
    assert m["reward/mean"] == pytest.approx(0.45)  # 2.25 / 5
    assert m["hint/used_frac"] == m["hint/share"] == pytest.approx(0.4)
    assert m["hint/scheduled_share"] == 0.4
    everyone = [e.evolve(hint=hint) for e in episodes]
    all_hinted = step_metrics(1, RolloutBatch(everyone, [], batch.report, {}, []), {}, 1.0, 1.0,
                              Counter(), lag)
    assert all_hinted["reward/unhinted_mean"] is None and all_hinted["hint/used_frac"] == 1.0
    assert "hint/share" not in all_hinted and "hint/scheduled_share" not in all_hinted  # no schedule


# --- steps that train on no token ------------------------------------------------------------


def test_a_prompt_over_the_limit_is_recorded_with_its_length(tiny):
    """Nothing is generated for a first prompt over max_prompt_tokens: the episode records how
    long the prompt was (the policy's count), the report counts it, and the step's cause is
    the prompt limit."""
    model, tok = tiny
    policy = HFPolicy(model, tok)
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(2, seed=0)
    batch = rollout_batch(policy, tok, tasks, RolloutSettings(
        "agent_rl/Arithmetic-v0", group_size=2,
        sampling=Sampling(max_new_tokens=4, seed=0, max_prompt_tokens=8), truncation="keep",
        dynamic_sampling=False), seed=0)
    env = envs.make("agent_rl/Arithmetic-v0")
    lengths = {t.task_id: policy.count_tokens(env.reset(options={"task": t})[0]) for t in tasks}
    assert all(n > 8 for n in lengths.values())
    assert too_long_prompts(batch.episodes) == [(t.task_id, lengths[t.task_id])
                                                for t in tasks for _ in range(2)]
    assert batch.report["prompt_too_long"] == 4 and batch.report["tokens_generated"] == 0
    assert batch.report["prompt_too_long_tokens"] == max(lengths.values())
    assert batch.sequences == []
    assert empty_reason(batch.report, 0, 0) == EmptyStep.prompt_too_long
    m = step_metrics(1, batch, {"tokens": 0}, 1.0, 1.0, Counter(), {"max": 0.0, "mean": 0.0})
    assert m["train/empty_step"] == 1 and m["train/empty_reason"] == "prompt_too_long"
    assert m["rollout/prompt_too_long"] == 4


def test_empty_reason_by_hand(tok):
    """Why a step trained nothing: the limits when they blocked every episode (the one that
    blocked more), else the dropped groups (no contrast), faults, stale sessions."""
    report = {"episodes": 4, "prompt_too_long": 1, "overlong_masked": 3, "groups_dropped": 0,
              "infrastructure_faults": 0}
    assert empty_reason(report, 0, 0) == EmptyStep.overlong_masked
    assert empty_reason({**report, "prompt_too_long": 2, "overlong_masked": 2}, 0, 0) == \
        EmptyStep.prompt_too_long
    assert empty_reason(report, 12, 0) is None  # it trained
    assert empty_reason(report, 0, 3) == EmptyStep.stale
    some = {**report, "overlong_masked": 1, "groups_dropped": 1}  # 2 of 4 blocked, 1 group dropped
    assert empty_reason(some, 0, 0) == EmptyStep.zero_contrast
    assert empty_reason({**some, "groups_dropped": 0, "infrastructure_faults": 2}, 0, 0) == \
        EmptyStep.infrastructure_faults
    # every reply overlong under mask, as a real batch: nothing rendered, the response limit named
    episodes = [apply_truncation(make_episode(tok, f"g#{k}", "g", float(k), finish="length"),
                                 "mask", 0.0) for k in range(2)]
    decided, drops = filter_groups(episodes, True)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    report = budget_report(decided, drops, "mask")
    assert sequences == [] and report["overlong_masked"] == 2
    assert empty_reason(report, 0, 0) == EmptyStep.overlong_masked


def test_zero_contrast_step_is_every_group_without_contrast():
    assert zero_contrast_step({"groups": 2, "zero_contrast": 2, "all_wrong": 2})
    assert not zero_contrast_step({"groups": 2, "zero_contrast": 1})
    assert not zero_contrast_step({"groups": 0, "zero_contrast": 0})


def test_hint_share_is_what_the_episodes_showed_not_the_schedule(tok):
    """A schedule of 1.0 over episodes none of which showed a hint logs hint/share 0 (the
    schedule is hint/scheduled_share)."""
    episodes = [make_episode(tok, f"a#{k}", "a", 0.0) for k in range(4)]
    batch = RolloutBatch(episodes, [], budget_report(episodes, [], "keep"), {}, [])
    lag = {"max": 0.0, "mean": 0.0}
    m = step_metrics(1, batch, {}, 1.0, 1.0, Counter(), lag, hint_share=1.0)
    assert m["hint/share"] == 0.0 and m["hint/scheduled_share"] == 1.0
    hint = {"text": "6 * 7 = 42", "provenance": "solution-derived", "shown": True}
    shown = RolloutBatch([e.evolve(hint=hint) if k < 3 else e for k, e in enumerate(episodes)],
                         [], batch.report, {}, [])
    assert step_metrics(1, shown, {}, 1.0, 1.0, Counter(), lag, hint_share=1.0)["hint/share"] == 0.75


def test_an_empty_step_that_is_not_zero_contrast_is_warned_every_time(tok, recwarn):
    """Group a has contrast but both its replies are overlong under mask; group b has none and
    is dropped: no token is trained, yet not every group lacked contrast, so the step is warned
    (every such step), not counted as a zero-contrast step."""
    from agent_rl.training.metrics import note_untrained

    episodes = [make_episode(tok, "a#0", "a", 1.0, finish="length"),
                make_episode(tok, "a#1", "a", 0.0, finish="length"),
                make_episode(tok, "b#0", "b", 0.0), make_episode(tok, "b#1", "b", 0.0)]
    decided, drops = filter_groups([apply_truncation(e, "mask", 0.0) for e in episodes], True)
    sequences, _ = build_sequences(tok, decided, **BUILD)
    batch = RolloutBatch(decided, sequences, budget_report(decided, drops, "mask"),
                         contrast_stats(decided), drops)
    assert sequences == [] and not zero_contrast_step(batch.advantage_stats)
    counters = Counter()
    for step in (1, 2):
        m = step_metrics(step, batch, {"tokens": 0}, 1.0, 1.0, counters, {"max": 0.0, "mean": 0.0})
        assert m["train/empty_reason"] == "zero_contrast"
        totals = note_untrained(m, batch, counters, 64, 8)
    assert totals == {"total/empty_steps": 2, "total/zero_contrast_steps": 0, "total/prompt_too_long": 0}
    assert [str(w.message) for w in recwarn] == [
        f"step {s} trained on no token: no group had both reward contrast and a token to train "
        "(dynamic sampling dropped those without contrast)" for s in (1, 2)]
