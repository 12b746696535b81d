"""Pause/abort rules, checked after every step (and after every held-out evaluation).

A triggered guard stops the run cleanly: the trainer writes a checkpoint and ``guard.json``
(the rule, the action, the evidence, the message and ``keys``: the contract keys to change). The
message names the measured value, the bound and those keys (``guards.<bound>`` first, then what
the run would change instead, e.g. ``rollout.max_response_tokens`` for ``length_explosion``). ``pause`` means "look before resuming" (``--resume``
continues); ``abort`` means the run is not worth resuming as is.

=====================  ==========================================================  ======
rule                   fires when                                                  action
=====================  ==========================================================  ======
nonfinite              loss or grad norm non-finite for ``max_nonfinite_steps``     abort
                       consecutive steps (one such step only skips its update)
entropy_collapse       mean token entropy < ``min_entropy``                         abort
kl_explosion           KL to the reference, or of one update, > ``max_kl``          abort
length_explosion       truncated fraction of responses >= ``max_truncated_frac``    pause
                       on two consecutive steps
policy_lag             rollout policy lags the trained one by > ``max_policy_lag``  abort
verifier_errors        infrastructure-fault rate > ``max_verifier_error_rate``      pause
reward_not_holdout     train reward rose over the last ``holdout_patience``         pause
                       evaluations while the hint-free holdout did not
nothing_trained        the run's first ``nothing_trained_steps`` steps (or all of   abort
                       them, in a shorter run) trained on no token, each because
                       of a limit (``LIMITS``: every first prompt over
                       ``rollout.max_prompt_tokens``, every reply overlong under
                       ``rollout.truncation: mask``)
=====================  ==========================================================  ======

``nothing_trained`` watches a run's start only: one step that trains a token, or that trains
none for another reason (no reward contrast is normal on hard tasks: counted and warned, never
an error), turns it off for good. Two steps rather than one, because one step's few tasks may
all be long where the pool is not; no more than two, because a limit that blocks every episode
of two steps blocks the run (``mask`` pays for the longest replies there are, to train none of
them), and ``length_explosion`` would pause that run at its second step with less to say.
A run of zero steps (``optim.max_steps: 0``, a baseline) trains nothing by design and never
trips it. Its trip is a ``NothingTrained``: the CLI exits 4 on it, not 3.

The train reward of ``reward_not_holdout`` is ``reward/mean``, or ``reward/unhinted_mean``
when the contract anneals hints (``holdout_train_reward``): a rise that only the hints bring
must not count, nor a fall that only their removal brings. A step with no unhinted episode
(a share of 1.0) gives no train reward and its evaluation is left out of the history.

A NaN metric trips its rule (``_above``/``_below``): a comparison with NaN is false, so a plain
``kl > max_kl`` would let the broken step pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class EmptyStep(str, Enum):
    """Why a training step trained on no token (``training.rollout.empty_reason``). The
    ``LIMITS`` are decided by a contract key, not by the data: a run all of whose first steps
    train nothing because of them is stopped (rule ``nothing_trained``)."""

    prompt_too_long = "prompt_too_long"  # every episode's first prompt over the prompt limit
    overlong_masked = "overlong_masked"  # every episode masked overlong (or prompt_too_long, fewer)
    zero_contrast = "zero_contrast"  # dynamic sampling dropped every group that could train
    stale = "stale"  # every trained session was older than rollout.max_policy_lag allows
    infrastructure_faults = "infrastructure_faults"  # every other episode was a fault (masked)
    nothing_generated = "nothing_generated"  # none of the above: no episode generated a token


LIMITS = frozenset({EmptyStep.prompt_too_long, EmptyStep.overlong_masked})


def holdout_train_reward(metrics: dict[str, Any], annealed_hints: bool) -> float | None:
    """The training reward ``Guards.after_eval`` compares with the holdout: ``reward/mean``,
    or ``reward/unhinted_mean`` (None when no episode was unhinted) under annealed hints."""
    return metrics.get("reward/unhinted_mean") if annealed_hints else metrics["reward/mean"]


def _above(value: float, limit: float) -> bool:
    """``value > limit``, or NaN."""
    return not value <= limit


def _below(value: float, limit: float) -> bool:
    """``value < limit``, or NaN."""
    return not value >= limit


@dataclass(frozen=True)
class GuardTrip:
    """A rule that fired: ``message`` names the measured value, the bound and the contract
    keys (``keys``) that change the outcome: the rule's own ``guards.*`` bound first, then
    what the run would change instead."""

    rule: str
    action: str  # pause | abort
    message: str
    evidence: dict[str, Any]
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class NothingTrained(GuardTrip):
    """Rule ``nothing_trained``: the run trained nothing, because of a limit the contract sets."""


TRAIN_GAIN = 0.05  # rule reward_not_holdout: a train-reward rise above this counts as rising
NOTHING_TRAINED_STEPS = 2  # the first steps the rule nothing_trained watches (module docstring)
LIMIT_COUNTS = ("rollout/prompt_too_long", "rollout/overlong_masked")  # a step's record: episodes


def limit_clauses(record: dict[str, Any], max_prompt_tokens: int | None = None,
                  max_response_tokens: int | None = None) -> list[str]:
    """What the limits kept out of the loss in ``record`` (a step's metrics, or the evidence of
    ``nothing_trained``), one clause per limit that blocked an episode, each naming the key to
    change (and its value, where given)."""
    def value(n: int | None) -> str:
        return "" if n is None else f" ({n})"

    clauses = []
    if record.get("rollout/prompt_too_long"):
        longest = record.get("rollout/prompt_too_long_tokens")
        clauses.append(
            f"{record['rollout/prompt_too_long']} episodes ended before generating a token, their "
            f"first prompt{f' (up to {longest} tokens)' if longest else ''} longer than "
            f"rollout.max_prompt_tokens{value(max_prompt_tokens)}: raise rollout.max_prompt_tokens")
    if record.get("rollout/overlong_masked"):
        clauses.append(
            f"{record['rollout/overlong_masked']} episodes hit rollout.max_response_tokens"
            f"{value(max_response_tokens)} under rollout.truncation: mask, which keeps them out "
            "of the loss: raise rollout.max_response_tokens, or set rollout.truncation to keep "
            "or penalize")
    return clauses


def nothing_trained_message(evidence: dict[str, Any]) -> str:
    """Rule ``nothing_trained``'s message: the steps, what blocked how many episodes, the key."""
    first, last = evidence["first_step"], evidence["last_step"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return (f"no token trained in {steps}: " + "; ".join(limit_clauses(evidence))
            + " (the contract changes: start a new run_dir)")


@dataclass
class Guards:
    max_nonfinite_steps: int = 2
    min_entropy: float = 0.05
    max_kl: float = 1.0
    max_policy_lag: int = 2
    max_verifier_error_rate: float = 0.1
    holdout_patience: int = 5
    max_truncated_frac: float = 0.9
    nothing_trained_steps: int = NOTHING_TRAINED_STEPS
    _nonfinite_streak: int = 0
    # rule nothing_trained: what the limits blocked over the run's steps so far, while no step
    # trained a token (or trained none for another reason); None once one did
    _starved: dict[str, Any] | None = field(default_factory=dict)
    _long_streak: int = 0
    _evals: list[tuple[float, float]] = field(default_factory=list)  # (train reward, holdout)

    def after_step(self, m: dict[str, Any], last: bool = False) -> GuardTrip | None:
        """Check one step's metrics (namespaced keys as the trainer logs them); ``last``: the
        run's last step (``nothing_trained`` decides there in a run shorter than its watch)."""
        starved = self._nothing_trained(m, last)
        if starved is not None:
            return starved
        loss, grad = m.get("loss/policy", 0.0), m.get("optim/grad_norm", 0.0)
        if not (math.isfinite(loss) and math.isfinite(grad)):
            self._nonfinite_streak += 1
            if self._nonfinite_streak >= self.max_nonfinite_steps:
                return GuardTrip(
                    "nonfinite", "abort",
                    f"loss/policy {loss} and optim/grad_norm {grad}: non-finite on "
                    f"{self._nonfinite_streak} consecutive steps, guards.max_nonfinite_steps is "
                    f"{self.max_nonfinite_steps}: lower optim.lr or optim.grad_clip (or raise "
                    "guards.max_nonfinite_steps to skip more such steps)",
                    {"loss/policy": loss, "optim/grad_norm": grad,
                     "streak": self._nonfinite_streak},
                    ("guards.max_nonfinite_steps", "optim.lr", "optim.grad_clip"))
            return None
        self._nonfinite_streak = 0
        entropy = m.get("policy/entropy")
        if entropy is not None and _below(entropy, self.min_entropy):
            return GuardTrip(
                "entropy_collapse", "abort",
                f"token entropy (policy/entropy) {entropy:.4f} fell below guards.min_entropy "
                f"{self.min_entropy}: lower guards.min_entropy to let it run, or keep the policy "
                "exploring (raise rollout.temperature, lower optim.lr, raise loss.clip_high)",
                {"policy/entropy": entropy},
                ("guards.min_entropy", "rollout.temperature", "optim.lr", "loss.clip_high"))
        for key in ("kl/ref", "kl/update", "kl/approx"):
            kl = m.get(key)
            if kl is not None and _above(kl, self.max_kl):
                return GuardTrip(
                    "kl_explosion", "abort",
                    f"{key} {kl:.4f} exceeds guards.max_kl {self.max_kl}: raise guards.max_kl, "
                    "or take smaller steps (lower optim.lr; raise loss.kl.beta to pull towards "
                    "the reference)", {key: kl}, ("guards.max_kl", "optim.lr", "loss.kl.beta"))
        truncated = m.get("response/truncated_frac", 0.0)  # NaN counts as long
        self._long_streak = 0 if truncated < self.max_truncated_frac else self._long_streak + 1
        if self._long_streak >= 2:
            return GuardTrip(
                "length_explosion", "pause",
                f"{truncated:.0%} of responses (response/truncated_frac) hit "
                "rollout.max_response_tokens two steps running, at or above "
                f"guards.max_truncated_frac {self.max_truncated_frac:.0%}: raise "
                "rollout.max_response_tokens, or raise guards.max_truncated_frac (above 1 turns "
                "the rule off), then --resume",
                {"response/truncated_frac": truncated,
                 "response/length_mean": m.get("response/length_mean")},
                ("guards.max_truncated_frac", "rollout.max_response_tokens"))
        lag = m.get("rollout/policy_lag", 0)
        if _above(lag, self.max_policy_lag):
            return GuardTrip(
                "policy_lag", "abort",
                f"policy lag (rollout/policy_lag) {lag} exceeds guards.max_policy_lag "
                f"{self.max_policy_lag}: lower rollout.max_policy_lag (samples older than it are "
                "dropped), or raise guards.max_policy_lag",
                {"rollout/policy_lag": lag}, ("guards.max_policy_lag", "rollout.max_policy_lag"))
        errors = m.get("reward/infra_error_rate", 0.0)
        if _above(errors, self.max_verifier_error_rate):
            return GuardTrip(
                "verifier_errors", "pause",
                f"verifier/sandbox error rate (reward/infra_error_rate) {errors:.1%} exceeds "
                f"guards.max_verifier_error_rate {self.max_verifier_error_rate:.1%}: fix the "
                "verifier or sandbox (the faulted episodes are in rollouts.jsonl), or raise "
                "guards.max_verifier_error_rate, then --resume",
                {"reward/infra_error_rate": errors}, ("guards.max_verifier_error_rate",))
        return None

    def _nothing_trained(self, m: dict[str, Any], last: bool) -> NothingTrained | None:
        """Rule ``nothing_trained`` (module docstring) on one step's record."""
        if self._starved is None:
            return None
        reason = m.get("train/empty_reason")
        if reason is None or EmptyStep(reason) not in LIMITS:
            self._starved = None  # this step trained, or trained nothing for another reason
            return None
        ev = self._starved
        ev.setdefault("first_step", m["step"])
        ev["last_step"], ev["steps"] = m["step"], ev.get("steps", 0) + 1
        for key in LIMIT_COUNTS:
            ev[key] = ev.get(key, 0) + m.get(key, 0)
        longest = [n for n in (ev.get("rollout/prompt_too_long_tokens"),
                               m.get("rollout/prompt_too_long_tokens")) if n is not None]
        ev["rollout/prompt_too_long_tokens"] = max(longest, default=None)
        if ev["steps"] < self.nothing_trained_steps and not last:
            return None
        keys = tuple(key for count, key in (("rollout/prompt_too_long", "rollout.max_prompt_tokens"),
                                            ("rollout/overlong_masked", "rollout.max_response_tokens"))
                     if ev.get(count))
        return NothingTrained("nothing_trained", "abort", nothing_trained_message(ev), dict(ev),
                              keys)

    def state(self) -> dict[str, Any]:
        """The streaks and evaluation history, for checkpoints: a resumed run then trips
        exactly where the uninterrupted one would."""
        return {"nonfinite_streak": self._nonfinite_streak, "long_streak": self._long_streak,
                "evals": [list(e) for e in self._evals],
                "starved": None if self._starved is None else dict(self._starved)}

    def load_state(self, state: dict[str, Any]) -> None:
        self._nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self._long_streak = int(state.get("long_streak", 0))
        self._evals = [(float(t), float(h)) for t, h in state.get("evals", [])]
        starved = state.get("starved", {})  # a checkpoint from before the rule: watching
        self._starved = None if starved is None else dict(starved)

    def after_eval(self, train_reward: float | None, holdout_reward: float) -> GuardTrip | None:
        """Reward rising while the hint-free holdout does not is a warning sign (hacking, hints).
        ``train_reward`` None (no unhinted episode that step): nothing to compare, not recorded."""
        if train_reward is None:
            return None
        self._evals.append((train_reward, holdout_reward))
        window = self._evals[-(self.holdout_patience + 1):]
        if len(window) <= self.holdout_patience:
            return None
        train_gain = window[-1][0] - window[0][0]
        holdout_gain = max(h for _, h in window[1:]) - window[0][1]
        if _above(train_gain, TRAIN_GAIN) and not holdout_gain > 0.0:  # a NaN gain is no gain
            return GuardTrip(
                "reward_not_holdout", "pause",
                f"train reward rose by {train_gain:.3f} (more than {TRAIN_GAIN}) over "
                f"guards.holdout_patience {self.holdout_patience} evaluations while the "
                f"held-out reward did not improve (its best change {holdout_gain:+.3f}): look for "
                "reward hacking or hints the holdout lacks, or raise guards.holdout_patience to wait "
                "longer (eval.every sets how often it is measured), then --resume",
                {"train": [t for t, _ in window], "holdout": [h for _, h in window]},
                ("guards.holdout_patience", "eval.every"))
        return None
