"""Guards on hand-made metric dicts: each rule fires at its bound and not short of it."""

from __future__ import annotations

import math

import pytest

from agent_rl.run.contract import GuardSection
from agent_rl.run.guards import (
    Guards,
    GuardTrip,
    NothingTrained,
    holdout_train_reward,
    limit_clauses,
)

NAN, INF = math.nan, math.inf


def healthy(**overrides) -> dict[str, float]:
    """Metrics of an unremarkable step, as the trainer logs them."""
    return {"step": 1, "loss/policy": 0.01, "optim/grad_norm": 0.5, "policy/entropy": 2.0,
            "kl/approx": 0.001, "kl/ref": None, "response/truncated_frac": 0.0,
            "response/length_mean": 40.0, "rollout/policy_lag": 0,
            "reward/infra_error_rate": 0.0, **overrides}


def trips(guards: Guards, *steps: dict) -> list[str | None]:
    """The rule tripped after each step (None: no trip)."""
    return [(trip.rule if (trip := guards.after_step(m)) else None) for m in steps]


def test_contract_section_builds_the_guards():
    guards = Guards(**GuardSection().model_dump())
    assert trips(guards, healthy(), healthy()) == [None, None]


# --- nonfinite ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"loss/policy": NAN}, {"optim/grad_norm": INF},
                                 {"loss/policy": -INF}, {"optim/grad_norm": NAN}])
def test_nonfinite_fires_on_the_nth_consecutive_step(bad):
    guards = Guards(max_nonfinite_steps=3)
    assert trips(guards, healthy(**bad), healthy(**bad)) == [None, None]
    trip = guards.after_step(healthy(**bad))
    assert trip.rule == "nonfinite" and trip.action == "abort"
    assert trip.evidence["streak"] == 3


def test_nonfinite_streak_resets_on_a_finite_step():
    guards = Guards(max_nonfinite_steps=2)
    nan = healthy(**{"loss/policy": NAN})
    assert trips(guards, nan, healthy(), nan, healthy(), nan) == [None] * 5
    assert trips(guards, nan) == ["nonfinite"]


def test_one_nonfinite_step_is_enough_when_the_bound_is_one():
    assert trips(Guards(max_nonfinite_steps=1), healthy(**{"optim/grad_norm": NAN})) == ["nonfinite"]


def test_a_nonfinite_step_hides_the_other_rules_until_the_streak_trips():
    guards = Guards(max_nonfinite_steps=2)
    assert trips(guards, healthy(**{"loss/policy": NAN, "policy/entropy": 0.0})) == [None]


# --- single-step bounds -------------------------------------------------------------------------


@pytest.mark.parametrize("rule, action, key, bound, below, at, beyond", [
    # entropy must stay >= min_entropy: fires strictly below it
    ("entropy_collapse", "abort", "policy/entropy", {"min_entropy": 0.05}, 0.06, 0.05, 0.0499),
    # the others must stay <= their bound: fire strictly above it
    ("kl_explosion", "abort", "kl/approx", {"max_kl": 1.0}, 0.5, 1.0, 1.0001),
    ("kl_explosion", "abort", "kl/ref", {"max_kl": 0.2}, 0.1, 0.2, 0.21),
    ("policy_lag", "abort", "rollout/policy_lag", {"max_policy_lag": 2}, 1, 2, 3),
    ("verifier_errors", "pause", "reward/infra_error_rate", {"max_verifier_error_rate": 0.1},
     0.05, 0.1, 0.11),
])
def test_single_step_rules_fire_past_their_bound(rule, action, key, bound, below, at, beyond):
    guards = Guards(**bound)
    assert trips(guards, healthy(**{key: below}), healthy(**{key: at})) == [None, None]
    trip = guards.after_step(healthy(**{key: beyond}))
    assert isinstance(trip, GuardTrip)
    assert (trip.rule, trip.action) == (rule, action)
    assert trip.evidence[key] == beyond and trip.message


@pytest.mark.parametrize("rule, key", [
    ("entropy_collapse", "policy/entropy"), ("kl_explosion", "kl/approx"),
    ("kl_explosion", "kl/ref"), ("kl_explosion", "kl/update"), ("policy_lag", "rollout/policy_lag"),
    ("verifier_errors", "reward/infra_error_rate"),
])
def test_a_nan_metric_trips_its_rule(rule, key):
    """Every comparison with NaN is false: a rule written as `value > bound` would pass it."""
    trip = Guards().after_step(healthy(**{key: NAN}))
    assert trip.rule == rule and math.isnan(trip.evidence[key])


def test_nan_truncation_and_nan_rewards_trip_too():
    guards = Guards(max_truncated_frac=0.9)
    assert trips(guards, *[healthy(**{"response/truncated_frac": NAN})] * 2) == [None, "length_explosion"]
    holdout = Guards(holdout_patience=1)
    assert holdout.after_eval(0.0, 0.5) is None
    assert holdout.after_eval(0.5, NAN).rule == "reward_not_holdout"  # a NaN holdout is no gain
    train = Guards(holdout_patience=1)
    assert train.after_eval(0.0, 0.5) is None
    assert train.after_eval(NAN, 0.5).rule == "reward_not_holdout"


def test_missing_optional_metrics_do_not_fire():
    """A step with nothing trained logs entropy and KL as None."""
    guards = Guards()
    assert trips(guards, healthy(**{"policy/entropy": None, "kl/approx": None})) == [None]
    assert trips(guards, {"step": 3}) == [None]


# --- length explosion (two steps running) ------------------------------------------------------


def test_length_explosion_fires_at_the_bound_on_two_consecutive_steps():
    guards = Guards(max_truncated_frac=0.9)
    at, below = healthy(**{"response/truncated_frac": 0.9}), healthy(**{"response/truncated_frac": 0.89})
    assert trips(guards, at, below, at, below) == [None] * 4  # never two running
    trip = [guards.after_step(m) for m in (at, at)][-1]
    assert (trip.rule, trip.action) == ("length_explosion", "pause")
    assert trip.evidence["response/truncated_frac"] == 0.9


def test_length_guard_is_off_above_one():
    guards = Guards(max_truncated_frac=1.01)
    assert trips(guards, *[healthy(**{"response/truncated_frac": 1.0})] * 5) == [None] * 5


# --- reward rising while the holdout does not ---------------------------------------------------


def test_holdout_rule_needs_patience_plus_one_evaluations():
    guards = Guards(holdout_patience=3)
    assert [guards.after_eval(0.1 * k, 0.5) for k in range(3)] == [None] * 3
    trip = guards.after_eval(0.3 + 0.01, 0.5)  # 4th evaluation: train +0.31, holdout flat
    assert (trip.rule, trip.action) == ("reward_not_holdout", "pause")
    assert trip.evidence == {"train": [0.0, 0.1, 0.2, 0.31], "holdout": [0.5] * 4}


def test_holdout_rule_quiet_when_the_holdout_improves_or_train_is_flat():
    improving = Guards(holdout_patience=2)
    rewards = [(0.0, 0.5), (0.2, 0.5), (0.4, 0.52), (0.6, 0.54), (0.8, 0.56)]
    assert [improving.after_eval(t, h) for t, h in rewards] == [None] * 5
    flat = Guards(holdout_patience=2)
    assert [flat.after_eval(0.5 + 0.01 * k, 0.5) for k in range(5)] == [None] * 5  # gain <= 0.05


def test_holdout_rule_looks_at_a_sliding_window():
    guards = Guards(holdout_patience=2)
    # the holdout's early gain leaves the window; inside it, train rises while holdout falls
    rewards = [(0.0, 0.2), (0.1, 0.6), (0.2, 0.5)]
    assert [guards.after_eval(t, h) for t, h in rewards] == [None] * 3
    trip = guards.after_eval(0.3, 0.45)
    assert trip.evidence == {"train": [0.1, 0.2, 0.3], "holdout": [0.6, 0.5, 0.45]}


# --- state across a resume ----------------------------------------------------------------------


def test_state_round_trip_keeps_streaks_and_history():
    guards = Guards(max_nonfinite_steps=2, max_truncated_frac=0.9, holdout_patience=2)
    guards.after_step(healthy(**{"loss/policy": NAN}))
    guards.after_eval(0.0, 0.5)
    guards.after_eval(0.1, 0.5)
    resumed = Guards(max_nonfinite_steps=2, max_truncated_frac=0.9, holdout_patience=2)
    resumed.load_state(guards.state())
    assert resumed.state() == guards.state()
    assert resumed.after_eval(0.2, 0.5).rule == "reward_not_holdout"
    assert trips(resumed, healthy(**{"loss/policy": NAN})) == ["nonfinite"]
    fresh = Guards()
    fresh.load_state({})  # a checkpoint written before guards had state
    assert fresh.state() == Guards().state()


def test_holdout_rule_compares_the_unhinted_reward_under_annealed_hints():
    """The hinted episodes lift reward/mean by 0.6 over three evaluations; the unhinted reward
    and the holdout stay flat. Only the unhinted reward is compared once hints are annealed."""
    steps = [{"reward/mean": 0.2 * k, "reward/unhinted_mean": 0.1} for k in range(4)]
    annealed, plain = Guards(holdout_patience=3), Guards(holdout_patience=3)
    assert [holdout_train_reward(m, True) for m in steps] == [0.1] * 4
    assert [annealed.after_eval(holdout_train_reward(m, True), 0.1) for m in steps] == [None] * 4
    trips = [plain.after_eval(holdout_train_reward(m, False), 0.1) for m in steps]
    assert trips[:3] == [None] * 3 and trips[3].rule == "reward_not_holdout"
    assert trips[3].evidence["train"] == pytest.approx([0.0, 0.2, 0.4, 0.6])

    # hinted-only gains with no unhinted gain do not fire; an unhinted gain of 0.3 does
    rising = Guards(holdout_patience=3)
    unhinted = [0.1, 0.2, 0.3, 0.4]
    out = [rising.after_eval(holdout_train_reward({"reward/mean": 0.9, "reward/unhinted_mean": u},
                                                  True), 0.1) for u in unhinted]
    assert out[:3] == [None] * 3 and out[3].evidence["train"] == pytest.approx(unhinted)


def test_a_step_without_unhinted_episodes_is_left_out_of_the_holdout_history():
    guards = Guards(holdout_patience=2)
    all_hinted = {"reward/mean": 0.9, "reward/unhinted_mean": None}
    assert holdout_train_reward(all_hinted, True) is None
    assert holdout_train_reward(all_hinted, False) == 0.9
    assert guards.after_eval(None, 0.5) is None and guards.state()["evals"] == []
    assert [guards.after_eval(t, 0.5) for t in (0.0, 0.1)] == [None, None]
    assert guards.after_eval(None, 0.5) is None  # not a third evaluation
    assert guards.after_eval(0.2, 0.5).rule == "reward_not_holdout"  # the third one


# --- nothing_trained ----------------------------------------------------------------------------


def starved(step: int, too_long: int = 0, masked: int = 0, longest: int | None = None) -> dict:
    """A step that trained on no token because a limit blocked every episode."""
    reason = "prompt_too_long" if too_long >= masked else "overlong_masked"
    return healthy(**{"step": step, "loss/policy": 0.0, "optim/grad_norm": 0.0,
                      "train/tokens": 0, "train/empty_reason": reason,
                      "rollout/prompt_too_long": too_long, "rollout/overlong_masked": masked,
                      "rollout/prompt_too_long_tokens": longest})


def trained(step: int) -> dict:
    return healthy(**{"step": step, "train/tokens": 40, "train/empty_reason": None})


def test_nothing_trained_fires_on_the_second_starved_step_naming_the_key():
    guards = Guards()
    assert trips(guards, starved(1, too_long=4, longest=1092)) == [None]
    trip = guards.after_step(starved(2, too_long=4, longest=1050))
    assert isinstance(trip, NothingTrained) and trip.action == "abort"
    assert trip.evidence["rollout/prompt_too_long"] == 8  # 4 + 4 episodes
    assert trip.evidence["rollout/prompt_too_long_tokens"] == 1092  # the longest of both steps
    assert trip.message == ("no token trained in steps 1-2: 8 episodes ended before generating a "
                            "token, their first prompt (up to 1092 tokens) longer than "
                            "rollout.max_prompt_tokens: raise rollout.max_prompt_tokens (the "
                            "contract changes: start a new run_dir)")


def test_nothing_trained_names_both_limits_when_both_blocked():
    guards = Guards()
    trips(guards, starved(1, masked=4))
    trip = guards.after_step(starved(2, too_long=1, masked=3))
    assert trip.message == ("no token trained in steps 1-2: 1 episodes ended before generating a "
                            "token, their first prompt longer than rollout.max_prompt_tokens: "
                            "raise rollout.max_prompt_tokens; 7 episodes hit "
                            "rollout.max_response_tokens under rollout.truncation: mask, which "
                            "keeps them out of the loss: raise rollout.max_response_tokens, or set "
                            "rollout.truncation to keep or penalize (the contract changes: start a "
                            "new run_dir)")


def test_limit_clauses_name_the_values_where_given():
    record = {"rollout/prompt_too_long": 2, "rollout/prompt_too_long_tokens": 90,
              "rollout/overlong_masked": 0}
    assert limit_clauses(record, 64, 8) == [
        "2 episodes ended before generating a token, their first prompt (up to 90 tokens) longer "
        "than rollout.max_prompt_tokens (64): raise rollout.max_prompt_tokens"]
    assert limit_clauses({"rollout/overlong_masked": 3}, 64, 8)[0].startswith(
        "3 episodes hit rollout.max_response_tokens (8) under rollout.truncation: mask")
    assert limit_clauses({"rollout/prompt_too_long": 0, "rollout/overlong_masked": 0}) == []


def test_nothing_trained_decides_at_the_last_step_of_a_shorter_run():
    trip = Guards().after_step(starved(1, masked=2), last=True)
    assert isinstance(trip, NothingTrained) and trip.message.startswith("no token trained in step 1:")


def test_nothing_trained_is_off_once_a_step_trains_or_trains_nothing_for_another_reason():
    """One trained step, or a zero-contrast one (normal on hard tasks), ends the watch: later
    starved steps are warned by the trainer, never an error."""
    assert trips(Guards(), starved(1, too_long=2), trained(2), starved(3, too_long=2),
                 starved(4, too_long=2)) == [None] * 4
    zero = healthy(**{"step": 1, "train/tokens": 0, "train/empty_reason": "zero_contrast"})
    assert trips(Guards(), zero, starved(2, too_long=2), starved(3, too_long=2)) == [None] * 3
    assert trips(Guards(), *[trained(s) for s in range(1, 5)]) == [None] * 4


def test_nothing_trained_resumes_where_it_was():
    """A run killed after its first starved step trips at the same step once resumed."""
    first = Guards()
    trips(first, starved(1, too_long=2))
    resumed = Guards()
    resumed.load_state(first.state())
    assert isinstance(resumed.after_step(starved(2, too_long=2)), NothingTrained)
    done = Guards()
    trips(done, trained(1))
    after = Guards()
    after.load_state(done.state())
    assert trips(after, starved(2, too_long=2), starved(3, too_long=2)) == [None, None]


# --- every trip names the value, the bound and the keys to change --------------------------------


@pytest.mark.parametrize("guards, steps, rule, value, bound, keys", [
    (Guards(max_nonfinite_steps=1), [healthy(**{"loss/policy": NAN})], "nonfinite",
     "loss/policy nan", "guards.max_nonfinite_steps is 1",
     ("guards.max_nonfinite_steps", "optim.lr", "optim.grad_clip")),
    (Guards(min_entropy=0.05), [healthy(**{"policy/entropy": 0.0123})], "entropy_collapse",
     "0.0123", "guards.min_entropy 0.05", ("guards.min_entropy", "rollout.temperature")),
    (Guards(max_kl=0.2), [healthy(**{"kl/ref": 0.5})], "kl_explosion", "kl/ref 0.5000",
     "guards.max_kl 0.2", ("guards.max_kl", "optim.lr", "loss.kl.beta")),
    (Guards(max_truncated_frac=0.9), [healthy(**{"response/truncated_frac": 0.95})] * 2,
     "length_explosion", "95% of responses", "guards.max_truncated_frac 90%",
     ("guards.max_truncated_frac", "rollout.max_response_tokens")),
    (Guards(max_policy_lag=2), [healthy(**{"rollout/policy_lag": 3})], "policy_lag", "lag) 3",
     "guards.max_policy_lag 2", ("guards.max_policy_lag", "rollout.max_policy_lag")),
    (Guards(max_verifier_error_rate=0.1), [healthy(**{"reward/infra_error_rate": 0.25})],
     "verifier_errors", "25.0%", "guards.max_verifier_error_rate 10.0%",
     ("guards.max_verifier_error_rate",)),
])
def test_a_trip_names_the_measured_value_the_bound_and_the_keys(guards, steps, rule, value,
                                                                 bound, keys):
    *before, last = steps
    assert trips(guards, *before) == [None] * len(before)
    trip = guards.after_step(last)
    assert trip.rule == rule
    assert value in trip.message and bound in trip.message, trip.message
    assert trip.keys[:len(keys)] == keys
    assert all(key in trip.message for key in trip.keys), trip.message


def test_reward_not_holdout_names_its_patience_and_the_gain():
    guards = Guards(holdout_patience=2)
    for train, held in [(0.1, 0.3), (0.2, 0.3)]:
        assert guards.after_eval(train, held) is None
    trip = guards.after_eval(0.4, 0.2)
    assert trip.rule == "reward_not_holdout"
    for part in ("rose by 0.300 (more than 0.05)", "guards.holdout_patience 2",
                 "its best change +0.000", "eval.every"):
        assert part in trip.message, part
    assert trip.keys == ("guards.holdout_patience", "eval.every")


def test_nothing_trained_keys_are_the_limits_that_blocked():
    guards = Guards(nothing_trained_steps=1)
    trip = guards.after_step(healthy(**{"train/empty_reason": "overlong_masked",
                                        "rollout/overlong_masked": 4}))
    assert isinstance(trip, NothingTrained) and trip.keys == ("rollout.max_response_tokens",)
