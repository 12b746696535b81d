"""PIIMask-v0: reward components against hand-computed values, generation invariants,
determinism and outcome mapping."""

from __future__ import annotations

import re

import numpy as np
import pytest

import envs
from envs.core import TaskMeta, TaskSpec
from envs.piimask import (
    FAMILIES,
    KINDS,
    WEIGHTS,
    PIIMaskEnv,
    make_text,
    masked_spans,
    normalize,
    pii_mask_outcome,
    pii_mask_reward,
)
from trajectories import Outcome

GOLD = "Call [NAME] at [PHONE] tomorrow morning about order #48213."
VALUES = ["Ava Okafor", "(555) 014-2231"]
TEXT = "Call Ava Okafor at (555) 014-2231 tomorrow morning about order #48213."


def total(components: dict[str, float]) -> float:
    return sum(WEIGHTS[k] * v for k, v in components.items())


# Span windows in GOLD (16 characters each side, stopping at the neighbouring tag):
#   [NAME]:  "Call " + "[NAME]" + " at "
#   [PHONE]: " at " + "[PHONE]" + " tomorrow mornin"
@pytest.mark.parametrize(("reply", "components", "reward", "outcome"), [
    # exact: 1 + 0.2 + 0.2 weights -> 0.6 + 0.2 + 0.2
    (f"<masked>{GOLD}</masked>", (1.0, 1.0, 1.0), 1.0, Outcome.correct),
    # exact after whitespace normalisation, text outside the tag allowed
    ("Sure!\n<masked>\n  Call [NAME]  at\n[PHONE] tomorrow morning about order #48213.\n</masked>",
     (1.0, 1.0, 1.0), 1.0, Outcome.correct),
    # phone left in: NAME masked (1 of 2) -> accuracy 0.5 * 1/2 = 0.25; 1 tag vs 2 -> count 0;
    # 0.6 * 0.25 + 0.2 = 0.35
    ("<masked>Call [NAME] at (555) 014-2231 tomorrow morning about order #48213.</masked>",
     (0.25, 1.0, 0.0), 0.35, Outcome.wrong),
    # missing tag: nothing counts
    (TEXT.replace("Ava Okafor", "[NAME]").replace("(555) 014-2231", "[PHONE]"),
     (0.0, 0.0, 0.0), 0.0, Outcome.format_error),
    # over-masking a distractor: both spans masked -> accuracy 0.5; 3 tags vs 2 -> count 0;
    # 0.6 * 0.5 + 0.2 = 0.5
    ("<masked>Call [NAME] at [PHONE] tomorrow morning about order [PHONE].</masked>",
     (0.5, 1.0, 0.0), 0.5, Outcome.wrong),
    # PII left in elsewhere: the NAME tag is in place but "Ava Okafor" is still there -> 1 of 2
    # spans -> 0.25; 2 tags, but a value is left -> count 0; 0.15 + 0.2 = 0.35
    (f"<masked>{GOLD} (Ava Okafor)</masked>", (0.25, 1.0, 0.0), 0.35, Outcome.wrong),
    # every value left unmasked, the right number of tags added: the tags mask nothing ->
    # format only, 0.2 (v0: count 1, 0.4)
    (f"<masked>{TEXT} [NAME] [PHONE]</masked>", (0.0, 1.0, 0.0), 0.2, Outcome.wrong),
    (f"<masked>[NAME] [PHONE] {TEXT}</masked>", (0.0, 1.0, 0.0), 0.2, Outcome.wrong),
    # wrong kind: PHONE window fails, count still 2 -> 0.15 + 0.2 + 0.2 = 0.55
    ("<masked>Call [NAME] at [EMAIL] tomorrow morning about order #48213.</masked>",
     (0.25, 1.0, 1.0), 0.55, Outcome.wrong),
    # two tags: the last one is the answer (exact) but format fails -> 0.6 + 0 + 0.2 = 0.8
    (f"<masked>draft</masked> <masked>{GOLD}</masked>", (1.0, 0.0, 1.0), 0.8, Outcome.correct),
    # empty answer: only the format holds -> 0.2
    ("<masked></masked>", (0.0, 1.0, 0.0), 0.2, Outcome.wrong),
    # placeholders are case-sensitive: "[name]" is not a tag -> 1 tag vs 2; NAME window fails
    ("<masked>Call [name] at [PHONE] tomorrow morning about order #48213.</masked>",
     (0.25, 1.0, 0.0), 0.35, Outcome.wrong),
])
def test_reward_hand_computed(reply, components, reward, outcome):
    got = pii_mask_reward(reply, GOLD, VALUES)
    assert got == dict(zip(("accuracy", "format", "pii_count"), components, strict=True))
    assert total(got) == pytest.approx(reward)
    assert pii_mask_outcome(reply, got) == outcome


def test_tags_that_mask_nothing_earn_nothing():
    env = envs.make("agent_rl/PIIMask-v0").unwrapped
    for task in env.task_pool(30, seed=0):
        tags = " ".join(f"[{kind}]" for kind in task.data["kinds"])
        for reply in (f"<masked>{task.data['text']} {tags}</masked>",
                      f"<masked>{tags} {task.data['text']}</masked>"):
            env.reset(seed=0, options={"task": task})
            _, reward, *_ = env.step(reply)
            assert reward == pytest.approx(WEIGHTS["format"]), task.task_id  # v0: 0.4


def test_masked_spans_counts_each_span():
    assert masked_spans(GOLD, GOLD, VALUES) == 2
    assert masked_spans(TEXT, GOLD, VALUES) == 0
    # adjacent tags: each window stops at its neighbour
    gold = "From [NAME] <[EMAIL]>."
    assert masked_spans("From [NAME] <ava@example.com>.", gold, ["Ava Okafor", "ava@example.com"]) == 1
    assert masked_spans(gold, gold, ["Ava Okafor", "ava@example.com"]) == 2


def test_env_scores_and_maps_outcomes():
    env = envs.make("agent_rl/PIIMask-v0").unwrapped
    task = TaskSpec(task_id="hand", prompt=f"Mask the personal data in this text:\n\n{TEXT}",
                    meta=TaskMeta(skills=["name", "phone"], structure="name>phone",
                                  entity_group="hand", length=2, difficulty=2),
                    target=GOLD, data={"text": TEXT, "values": VALUES, "kinds": ["NAME", "PHONE"]})
    reference = f"<masked>{GOLD}</masked>"
    cases = [(reference, 1.0, Outcome.correct),
             ("no tag here", 0.0, Outcome.format_error),
             (f"<masked>{TEXT}</masked>", 0.2, Outcome.wrong)]  # unmasked: format only
    for reply, reward, outcome in cases:
        obs, info = env.reset(seed=0, options={"task": task})
        assert obs[1]["content"].endswith(TEXT) and GOLD not in obs[1]["content"]
        if reply == reference:
            assert env.reference_action() == reply
        _, got, terminated, truncated, info = env.step(reply)
        assert terminated and not truncated
        assert got == pytest.approx(reward)
        assert info["episode"].reward.outcome == outcome
        assert info["episode"].reward.verifier == "agent_rl/PIIMask-v0@1"
    assert PIIMaskEnv.reward_weights == WEIGHTS == {"accuracy": 0.6, "format": 0.2, "pii_count": 0.2}


def test_generated_tasks_are_consistent():
    env = envs.make("agent_rl/PIIMask-v0").unwrapped
    tags = re.compile(r"\[(NAME|EMAIL|PHONE|ADDRESS)\]")
    for task in env.task_pool(500, seed=0):
        text, gold = task.data["text"], task.target
        kinds, values = task.data["kinds"], task.data["values"]
        assert 1 <= len(values) <= 4 and len(values) == len(kinds) == task.meta.length
        assert tags.findall(gold) == kinds
        assert task.meta.structure == ">".join(k.lower() for k in kinds)
        assert task.meta.skills == sorted({k.lower() for k in kinds})
        assert task.meta.entity_group in FAMILIES
        assert task.meta.difficulty in (len(values), len(values) + 1)
        assert text in task.prompt and gold not in task.prompt
        # putting the values back, in order, gives the original text
        segments = re.split(r"\[(?:NAME|EMAIL|PHONE|ADDRESS)\]", gold)
        assert "".join(s + v for s, v in zip(segments, [*values, ""], strict=True)) == text
        assert all(v in text and v not in gold for v in values)
        assert masked_spans(normalize(gold), normalize(gold), values) == len(values)
        assert pii_mask_reward(f"<masked>{gold}</masked>", gold, values) == {
            "accuracy": 1.0, "format": 1.0, "pii_count": 1.0}


def test_every_kind_family_and_length_occurs():
    pool = envs.make("agent_rl/PIIMask-v0").unwrapped.task_pool(300, seed=1)
    assert {k for t in pool for k in t.data["kinds"]} == set(KINDS)
    assert {t.meta.entity_group for t in pool} == set(FAMILIES)
    assert {t.meta.length for t in pool} == {1, 2, 3, 4}


def test_determinism():
    a = make_text(np.random.default_rng(5), "hr_record", ["NAME", "PHONE", "NAME"], True)
    b = make_text(np.random.default_rng(5), "hr_record", ["NAME", "PHONE", "NAME"], True)
    assert a == b and len(set(a.values)) == 3
    env = PIIMaskEnv()
    assert env.task_pool(10, seed=3) == PIIMaskEnv().task_pool(10, seed=3)
    assert env.task_pool(10, seed=3)[:5] == env.task_pool(5, seed=3)
    first, _ = env.reset(seed=9)
    again, _ = PIIMaskEnv().reset(seed=9)
    assert first == again
    test_split, _ = PIIMaskEnv(split="test").reset(seed=9)
    assert test_split[1] != first[1]
