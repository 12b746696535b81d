"""Candidates-v0: member parsing, validity x novelty by hand, the clustered interval, the
reward unit and the splits keeping a set whole."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import envs
from envs.candidates import score_members, set_reward, split_members
from evals.candidates import candidate_intervals
from evals.splits import default_splits
from evals.stats import cluster_bootstrap
from trajectories import Outcome
from trajectories.assign import assign
from trajectories.display import episode_tree

WORDS_B4 = {"family": "letter_words", "k": 4, "letter": "b"}
EVEN_3 = {"family": "even_numbers", "k": 3, "lo": 10, "hi": 40}


def scores(task: dict, reply: str) -> list[tuple[float, float]]:
    return [(m.valid, m.novelty) for m in score_members(task, reply)]


def test_valid_set_scores_one():
    reward = set_reward(WORDS_B4, "ball\nbird\nbook\nbread")
    assert reward.total == 1.0 and reward.outcome == Outcome.correct
    assert reward.audit["k"] == 4 and [m["score"] for m in reward.audit["members"]] == [1.0] * 4


def test_validity_words():
    # wrong letter, two words, no vowel, too short, digits: all invalid; case does not matter
    assert scores(WORDS_B4, "cat\nbig dog\nbrrr\nbe") == [(0, 1), (0, 1), (0, 1), (0, 1)]
    assert scores(WORDS_B4, "Banana\nBOAT\nb4ll") == [(1, 1), (1, 1), (0, 1)]


def test_validity_numbers():
    # 10 and 40 are inside (inclusive); 41 odd, 42 out of range, 12.5 and "twelve" no integer
    assert scores(EVEN_3, "10\n40\n41") == [(1, 1), (1, 1), (0, 1)]
    assert scores(EVEN_3, "42\n12.5\ntwelve") == [(0, 1), (0, 1), (0, 1)]
    odd = {**EVEN_3, "family": "odd_numbers"}
    assert scores(odd, "11\n12\n39") == [(1, 1), (0, 1), (1, 1)]


def test_duplicates_after_normalising_case_space_punctuation_score_zero():
    assert scores(WORDS_B4, "Ball\nball\nb-a-l-l\n BALL!") == [(1, 1), (1, 0), (0, 0), (0, 0)]
    assert set_reward(WORDS_B4, "Ball\nball\nball\nball").total == 0.25
    assert scores(EVEN_3, "12\n012\n14") == [(1, 1), (1, 0), (1, 1)]  # same value: duplicate


def test_near_duplicates_score_half():
    # same stem (suffix s / ing), one letter more or less between words of 5+ letters
    assert scores(WORDS_B4, "book\nbooks\nbooking\nbottle") == [(1, 1), (1, 0.5), (1, 0.5), (1, 1)]
    assert scores(WORDS_B4, "balloon\nbaloon\nballoons") == [(1, 1), (1, 0.5), (1, 0.5)]
    # a changed letter is a different word; short words stay distinct; numbers have no near
    # duplicates
    assert scores(WORDS_B4, "bottle\nbattle\nbat\nbag") == [(1, 1)] * 4
    assert scores(WORDS_B4, "bat\nbats\nbeat") == [(1, 1), (1, 0.5), (1, 1)]
    assert scores(EVEN_3, "12\n14\n16") == [(1, 1), (1, 1), (1, 1)]
    # set = (1 + 0.5 + 0.5 + 1) / 4
    assert set_reward(WORDS_B4, "book\nbooks\nbooking\nbottle").total == pytest.approx(0.75)


def test_fewer_and_more_lines_than_asked():
    fewer = set_reward(WORDS_B4, "ball\n\n  \nbird\n")  # blank lines are not members
    assert fewer.total == 0.5 and fewer.components["count"] == 0.5
    assert fewer.outcome == Outcome.wrong
    more = set_reward(WORDS_B4, "ball\nbird\nbook\nbread\ncat\ncat\ncat")
    assert more.total == 1.0 and len(more.audit["members"]) == 4


def test_list_markers_and_trailing_punctuation_are_removed():
    assert split_members("1. ball\n2) bird.\n- book,\n* bread;\n(5) boat", 5) == [
        "ball", "bird", "book", "bread", "boat"]
    assert split_members("12\n14.", 2) == ["12", "14"]  # a bare number is not a marker


def test_commas_and_semicolons_separate_members_too():
    assert split_members("10, 12; 14, 16.", 3) == ["10", "12", "14"]
    assert set_reward(EVEN_3, "The numbers are 12, 14, 16").total == pytest.approx(2 / 3)
    assert set_reward(EVEN_3, "20, 40 and 30.").total == pytest.approx(1 / 3)


def test_empty_reply_is_a_format_error():
    for reply in ("", "\n\n   \n", ". , ;"):
        reward = set_reward(WORDS_B4, reply)
        assert reward.total == 0.0 and reward.outcome == Outcome.format_error
        assert reward.components["novel"] == 0.0 and reward.audit["members"] == []


def test_hostile_text_never_crashes_and_is_escaped_on_display():
    huge = "b" + "a" * 2_000_000
    reward = set_reward(WORDS_B4, f"{huge}\n{huge}s\n\x1b[2J\x1b]0;pwn\x07bell\n\ud800\n")
    assert reward.total == 0.0  # too long, escape codes: invalid
    assert all(len(m["text"]) <= 64 for m in reward.audit["members"])
    env = envs.make("agent_rl/Candidates-v0")
    env.reset(seed=0)
    *_, info = env.step("\x1b[31mball\x1b[0m\nbird\x1b]8;;http://x\x07\n" + "9" * 5000)
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=80).print(episode_tree(info["episode"]))
    assert "\x1b]" not in out.getvalue() and "\x1b[2J" not in out.getvalue()
    assert "\x1b[31mball" not in out.getvalue()


def test_candidate_set_assigner_records_its_unit():
    env = envs.make("agent_rl/Candidates-v0")
    env.reset(seed=3)
    *_, info = env.step(env.unwrapped.reference_action())
    credit = assign(info["episode"], "candidate_set")
    assert credit.unit == "candidate_set" and credit.method == "candidate_set"
    assert list(credit.values()) == [1.0]


def correlated_sets() -> list[dict]:
    """10 sets of 4 members; sets 0-3 all valid, sets 4-9 all invalid."""
    return [{"k": 4, "members": [{"valid": 1.0 if s < 4 else 0.0} for _ in range(4)]}
            for s in range(10)]


def test_the_cluster_interval_is_wider_than_treating_members_as_independent():
    sets = correlated_sets()
    clustered = candidate_intervals(sets)
    assert clustered["mean"] == pytest.approx(0.4)
    assert clustered["n"] == 40 and clustered["n_clusters"] == 10
    values = [m["valid"] for s in sets for m in s["members"]]
    _, lo, hi = cluster_bootstrap(values, range(len(values)))  # members as independent
    assert (hi - lo) / (clustered["hi"] - clustered["lo"]) < 0.7


def test_candidate_intervals_counts_missing_members_and_takes_episodes():
    env = envs.make("agent_rl/Candidates-v0")
    env.reset(options={"task": {"task_id": "t", "prompt": "p", "meta": {"length": 4},
                                "target": WORDS_B4}})
    *_, info = env.step("ball\nbird")  # 2 of 4 slots valid
    assert candidate_intervals([info["episode"]])["mean"] == 0.5
    with pytest.raises(ValueError, match="not a candidate set"):
        candidate_intervals([{"total": 1.0}])
    with pytest.raises(ValueError, match="empty"):
        candidate_intervals([])


def test_splits_hold_out_a_count_and_keep_each_set_one_task():
    env = envs.make("agent_rl/Candidates-v0")
    splits = default_splits(env, 500, 0, holdouts={"min_holdout_length": 5}, iid_fraction=0.3)
    assert splits.train and splits.holdout_iid and splits.holdout
    assert {t.target["k"] for t in splits.train + splits.holdout_iid} == {3, 4}
    assert {t.target["k"] for t in splits.holdout} == {5}
    train_ids = {t.task_id for t in splits.train}
    assert not train_ids & {t.task_id for t in splits.holdout_iid}


def test_bad_kwargs_name_the_problem():
    with pytest.raises(ValueError, match="families must be some of"):
        envs.make("agent_rl/Candidates-v0", families=["colours"])
    with pytest.raises(ValueError, match="counts must each be in 2..8"):
        envs.make("agent_rl/Candidates-v0", counts=[1])
