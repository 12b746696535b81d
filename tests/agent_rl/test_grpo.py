"""GRPO math against hand-computed numbers (arithmetic in the comments)."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from agent_rl.policies.logprobs import (
    picked_logprobs,
    picked_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
)
from agent_rl.training.grpo import behaviour_correction, group_advantages, policy_loss

LN2 = math.log(2)

# Group a = [0, 2] (mean 1), group c = [1, 1, 4] (mean 2), interleaved.
REWARDS = [0.0, 1.0, 2.0, 1.0, 4.0]
IDS = ["a", "c", "a", "c", "c"]
# centred by group mean: a -> [-1, 1], c -> [-1, -1, 2]
CENTRED = [-1.0, -1.0, 1.0, -1.0, 2.0]


def close(x, expected, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(x, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=tol,
    )


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize(
    ("std", "scale", "divisor"),
    [
        # no normalisation: centred only
        ("none", "group", [1, 1, 1, 1, 1]),
        ("none", "batch", [1, 1, 1, 1, 1]),
        # population std: a: var (1 + 1) / 2 = 1 -> 1;  c: var (1 + 1 + 4) / 3 = 2 -> sqrt 2
        ("population", "group", [1, math.sqrt(2), 1, math.sqrt(2), math.sqrt(2)]),
        # sample std: a: var 2 / 1 = 2 -> sqrt 2;  c: var 6 / 2 = 3 -> sqrt 3
        ("sample", "group", [math.sqrt(2), math.sqrt(3), math.sqrt(2), math.sqrt(3), math.sqrt(3)]),
        # batch: mean 8 / 5 = 1.6, deviations [-1.6, -0.6, 0.4, -0.6, 2.4],
        # squares 2.56 + 0.36 + 0.16 + 0.36 + 5.76 = 9.2
        # population: var 9.2 / 5 = 1.84;  sample: var 9.2 / 4 = 2.3
        ("population", "batch", [math.sqrt(1.84)] * 5),
        ("sample", "batch", [math.sqrt(2.3)] * 5),
    ],
)
def test_advantages_each_mode(std, scale, divisor):
    adv, stats = group_advantages(REWARDS, IDS, std=std, scale=scale, eps=0.0)
    assert close(adv, [c / d for c, d in zip(CENTRED, divisor, strict=True)])
    assert stats == {
        "groups": 2,
        "zero_contrast": 0,
        "all_correct": 0,
        "all_wrong": 0,
        "zero_contrast_other": 0,
    }


def test_advantages_eps_added_to_std():
    # group [0, 2]: centred [-1, 1], population std 1 -> [-1, 1] / (1 + 0.5)
    adv, _ = group_advantages(torch.tensor([0.0, 2.0]), [0, 0], eps=0.5)
    assert close(adv, [-1 / 1.5, 1 / 1.5])


@pytest.mark.parametrize("std", ["population", "sample", "none"])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_zero_contrast_groups_are_exactly_zero_and_counted(std, scale):
    # a: all 1 (correct), b: all 0 (wrong), c: all 0.9 (other; in float32 0.9 - (3 * 0.9) / 3
    # = 6e-8, which / (std + eps) would give advantages near 0.06),
    # d: [0, 1] has contrast
    rewards = [1.0, 1.0, 0.0, 0.0, 0.9, 0.9, 0.9, 0.0, 1.0]
    ids = ["a", "a", "b", "b", "c", "c", "c", "d", "d"]
    adv, stats = group_advantages(rewards, ids, std=std, scale=scale)
    assert adv[:7].tolist() == [0.0] * 7
    assert (adv[7] < 0) and (adv[8] > 0)
    assert stats == {
        "groups": 4,
        "zero_contrast": 3,
        "all_correct": 1,
        "all_wrong": 1,
        "zero_contrast_other": 1,
    }


def test_zero_contrast_thresholds_and_singletons():
    # singleton groups are zero-contrast; 0.5 >= correct_threshold 0.5; -1 <= wrong_threshold 0
    adv, stats = group_advantages(
        [0.5, -1.0, 0.3], ["x", "y", "z"], std="sample", correct_threshold=0.5
    )
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert stats == {
        "groups": 3,
        "zero_contrast": 3,
        "all_correct": 1,
        "all_wrong": 1,
        "zero_contrast_other": 1,
    }


def test_advantages_errors():
    with pytest.raises(ValueError, match="index 2"):
        group_advantages([0.0, 1.0, float("nan")], [0, 0, 0])
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([], [])
    with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
        group_advantages([0.0, 1.0, 1.0], [0, 0])
    with pytest.raises(ValueError, match="population, sample, none"):
        group_advantages([0.0, 1.0], [0, 0], std="mad")
    with pytest.raises(ValueError, match="group, batch"):
        group_advantages([0.0, 1.0], [0, 0], scale="global")


@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False)),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["none", "population", "sample"]),
    st.sampled_from(["group", "batch"]),
)
def test_advantages_sum_to_zero_per_group(samples, std, scale):
    ids = [g for g, _ in samples]
    rewards = torch.tensor([r for _, r in samples], dtype=torch.float64)
    adv, _ = group_advantages(rewards, ids, std=std, scale=scale)
    for g in set(ids):
        members = torch.tensor([i == g for i in ids])
        assert abs(adv[members].sum().item()) < 1e-6


# ----------------------------------------------------------------------------- policy loss

# 2 x 3 batch, ratio 1 on valid tokens; padding holds values that would overflow exp().
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
OLD = torch.tensor([[-1.0, -2.0, -100.0], [-0.5, -100.0, -100.0]])
NEW = torch.tensor([[-1.0, -2.0, 100.0], [-0.5, 100.0, 100.0]])
ADV = torch.tensor([1.0, 4.0])  # per-token loss -A: row 0 -> [-1, -1], row 1 -> [-4]


@pytest.mark.parametrize(
    ("aggregation", "weights", "expected"),
    [
        # (-1 - 1 - 4) / 3 tokens
        ("token_mean", None, -2.0),
        # mean(-2 / 2, -4 / 1) = (-1 - 4) / 2
        ("seq_mean_token_mean", None, -2.5),
        # mean(-2 / 4, -4 / 4) with max_len 4 = (-0.5 - 1) / 2
        ("seq_mean_token_sum_norm", None, -0.75),
        # weights [2, 1]: (2 * (-2) + 1 * (-4)) / 3
        ("token_mean", [2.0, 1.0], -8 / 3),
        # (2 * (-1) + 1 * (-4)) / 2
        ("seq_mean_token_mean", [2.0, 1.0], -3.0),
        # (2 * (-2) / 4 + (-4) / 4) / 2
        ("seq_mean_token_sum_norm", [2.0, 1.0], -1.0),
    ],
)
def test_aggregations(aggregation, weights, expected):
    w = None if weights is None else torch.tensor(weights)
    loss, metrics = policy_loss(NEW, OLD, ADV, MASK, aggregation=aggregation, max_len=4, weights=w)
    assert loss.item() == pytest.approx(expected)
    assert metrics["tokens"] == 3.0
    assert metrics["ratio/min"] == metrics["ratio/max"] == 1.0


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", -2.0),  # unchanged: the empty row adds no token
        ("seq_mean_token_mean", -2.5),  # unchanged: the empty row leaves the mean
        ("seq_mean_token_sum_norm", -0.5),  # (-0.5 - 1 + 0) / 3 rows
    ],
)
def test_empty_sequence(aggregation, expected):
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    new, old = torch.cat([NEW, torch.zeros(1, 3)]), torch.cat([OLD, torch.zeros(1, 3)])
    loss, _ = policy_loss(
        new, old, torch.tensor([1.0, 4.0, 9.0]), mask, aggregation=aggregation, max_len=4
    )
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_no_valid_tokens_gives_zero_loss_with_graph(aggregation):
    new = NEW.clone().requires_grad_()
    loss, metrics = policy_loss(
        new, OLD, ADV, torch.zeros_like(MASK), aggregation=aggregation, max_len=4
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert new.grad.abs().sum().item() == 0.0
    assert (
        metrics["tokens"] == 0.0
        and metrics["ratio/mean"] == 1.0
        and metrics["clip/low_frac"] == 0.0
    )


def test_ratio_one_gives_minus_mean_advantage():
    torch.manual_seed(0)
    logp = -torch.rand(4, 5)  # [B, T]
    adv = torch.randn(4)  # [B]
    loss, metrics = policy_loss(logp, logp, adv, torch.ones(4, 5))
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert metrics["kl/approx"] == 0.0 and metrics["ratio/mean"] == 1.0
    # per-token advantages: -mean over valid tokens
    adv_t = torch.randn(4, 5)  # [B, T]
    mask = torch.ones(4, 5)
    mask[:, 3:] = 0
    loss, _ = policy_loss(logp, logp, adv_t, mask)
    assert loss.item() == pytest.approx(-adv_t[:, :3].mean().item(), abs=1e-6)


def _clip_batch():
    # row 0: A = +1, ratios [1.5, 1.1];  row 1: A = -1, ratios [0.5, 1.5]
    ratios = torch.tensor([[1.5, 1.1], [0.5, 1.5]])
    old = torch.tensor([[-1.0, -2.0], [-0.3, -0.7]])
    new = (old + ratios.log()).requires_grad_()
    return new, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2)


def test_asymmetric_clipping_and_clip_fractions():
    new, old, adv, mask = _clip_batch()
    loss, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # row 0 tok 0: -min(1.5, clip 1.28)           = -1.28  (high side clipped)
    # row 0 tok 1: -min(1.1, 1.1)                 = -1.1
    # row 1 tok 0: -min(-0.5, -clip 0.8)          =  0.8   (low side clipped)
    # row 1 tok 1: -min(-1.5, -1.28)              =  1.5   (ratio above 1.28 but A < 0: unclipped)
    # token_mean: (-1.28 - 1.1 + 0.8 + 1.5) / 4 = -0.08 / 4
    assert loss.item() == pytest.approx(-0.02, abs=1e-6)
    assert m["clip/high_frac"] == 0.25 and m["clip/low_frac"] == 0.25
    assert m["ratio/min"] == pytest.approx(0.5) and m["ratio/max"] == pytest.approx(1.5)
    assert m["ratio/mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.5) / 4)
    # KL(old || new) from old's samples: k3(new - old) = r - 1 - ln r per token
    # r = 1.5: 0.5 - 0.405465 = 0.094535; 1.1: 0.1 - 0.095310 = 0.004690;
    # r = 0.5: -0.5 + 0.693147 = 0.193147; sum 0.386907, mean 0.096727
    assert m["kl/approx"] == pytest.approx(0.096727, abs=1e-5)
    # symmetric 0.2: row 0 tok 0 becomes -1.2 -> (-1.2 - 1.1 + 0.8 + 1.5) / 4 = 0
    loss_sym, _ = policy_loss(new, old, adv, mask)
    assert loss_sym.item() == pytest.approx(0.0, abs=1e-6)


def test_clipped_side_has_zero_gradient():
    new, old, adv, mask = _clip_batch()
    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # d/dlogp of -r A / 4 is -A r / 4: row 0 tok 1 -> -1.1 / 4;  row 1 tok 1 -> 1.5 / 4
    assert close(new.grad, [[0.0, -0.275], [0.0, 0.375]])


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        # d = ref - logp = [ln 2, -ln 2]
        ("k1", 0.0),  # mean(-ln 2, ln 2)
        ("k2", LN2**2 / 2),  # mean(ln2^2 / 2, ln2^2 / 2) = 0.2402
        ("k3", 0.25),  # mean(2 - 1 - ln 2, 0.5 - 1 + ln 2) = mean(0.3069, 0.1931)
    ],
)
def test_kl_estimators(kl, expected):
    logp = torch.tensor([[-1.0, -1.0]])
    ref = logp + torch.tensor([[LN2, -LN2]])
    zero_adv = torch.zeros(1)
    loss, m = policy_loss(logp, logp, zero_adv, torch.ones(1, 2), ref_logprobs=ref, beta=0.5, kl=kl)
    assert loss.item() == pytest.approx(0.5 * expected, abs=1e-6)
    assert m["kl/ref"] == pytest.approx(expected, abs=1e-6)
    # beta 0 still reports the KL but leaves it out of the loss
    loss, m = policy_loss(logp, logp, zero_adv, torch.ones(1, 2), ref_logprobs=ref, kl=kl)
    assert loss.item() == 0.0 and m["kl/ref"] == pytest.approx(expected, abs=1e-6)


def test_entropy_metric_over_valid_tokens():
    ent = torch.tensor([[1.0, 3.0, 50.0], [2.0, 50.0, 50.0]])
    _, m = policy_loss(NEW, OLD, ADV, MASK, entropy=ent)
    assert m["entropy"] == pytest.approx(2.0)  # (1 + 3 + 2) / 3
    assert "kl/ref" not in m


def test_policy_loss_errors():
    args = (NEW, OLD, ADV, MASK)
    with pytest.raises(
        ValueError, match="token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"
    ):
        policy_loss(*args, aggregation="sum")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        policy_loss(*args, kl="k4")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(*args, aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="shape"):
        policy_loss(NEW, OLD[:, :2], ADV, MASK)


# ----------------------------------------------------------------------------- token log-probs


def _logits():
    # position 0 predicts token 1 with probs [0.5, 0.5]; position 1 predicts token 2 with
    # probs [0.75, 0.25]; position 2 predicts nothing inside the sequence.
    return torch.tensor([[[0.0, 0.0], [math.log(3), 0.0], [9.0, -9.0]]])  # [1, 3, 2]


def test_token_logprobs_alignment_and_temperature():
    ids = torch.tensor([[1, 0, 1]])
    assert close(token_logprobs(_logits(), ids), [[0.0, math.log(0.5), math.log(0.25)]])
    # temperature 2: [ln 3 / 2, 0] -> probs [sqrt 3, 1] / (sqrt 3 + 1)
    expected = [[0.0, math.log(0.5), math.log(1 / (math.sqrt(3) + 1))]]
    assert close(token_logprobs(_logits(), ids, temperature=2.0), expected)
    out = token_logprobs(_logits().bfloat16(), ids)
    assert out.dtype == torch.float32 and out.shape == (1, 3)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(_logits(), ids, temperature=0.0)


def test_token_entropy_alignment():
    # [0, ln 2, -(0.75 ln 0.75 + 0.25 ln 0.25)] = [0, 0.6931, 0.5623]
    expected = [[0.0, LN2, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]]
    assert close(token_entropy(_logits()), expected)


def test_picked_logprobs_and_entropy_by_hand():
    """logits [0, ln 3] -> probabilities [1/4, 3/4]: target 1 has ln 0.75 = -0.2877, the
    entropy is -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623; at temperature 2 the logits halve,
    [0, ln sqrt 3] -> [0.3660, 0.6340]. The same numbers as picked_logprobs to the bit, and the
    entropy carries no gradient; a temperature of 0 is refused. (Our kernel's version, the
    CPU accelerator's: tests/agent_rl/test_kernels.py.)"""
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]], requires_grad=True)
    targets = torch.tensor([1, 0])
    logp, entropy = picked_logprobs_and_entropy(logits, targets)
    assert close(logp, [math.log(0.75), math.log(0.25)])
    assert close(entropy, [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))] * 2)
    assert logp.requires_grad and not entropy.requires_grad
    p = 1 / (1 + math.sqrt(3.0))  # softmax([0, ln sqrt 3])[0]
    logp2, entropy2 = picked_logprobs_and_entropy(logits, targets, temperature=2.0)
    assert close(logp2, [math.log(1 - p), math.log(p)])
    assert close(entropy2, [-(p * math.log(p) + (1 - p) * math.log(1 - p))] * 2)
    assert torch.equal(logp2, picked_logprobs(logits, targets, 2.0))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        picked_logprobs_and_entropy(logits, targets, temperature=0.0)


# --- rollout/trainer mismatch: behaviour_correction -------------------------------------------


def test_behaviour_correction_by_hand():
    # rho = exp(prox - mu) = [1, e, 1/e] ; cap 2
    prox = torch.tensor([0.0, -1.0, -2.0])
    mu = torch.tensor([0.0, -2.0, -1.0])
    valid = torch.tensor([True, True, True])
    old, w, m = behaviour_correction(prox, mu, valid, "none", 2.0)
    assert w is None and torch.equal(old, mu)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(2 / 3)
    assert m["rollout/logprob_diff_max"] == pytest.approx(1.0)
    assert "rollout/capped_frac" not in m

    old, w, m = behaviour_correction(prox, mu, valid, "tis", 2.0)
    assert torch.equal(old, prox)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-1)]))
    assert m["rollout/capped_frac"] == pytest.approx(1 / 3)

    old, w, m = behaviour_correction(prox, mu, valid, "mask", 2.0)
    assert torch.equal(w, torch.tensor([1.0, 0.0, 0.0]))  # e > 2 and 1/e < 1/2 both leave
    assert m["rollout/capped_frac"] == pytest.approx(2 / 3)


def test_behaviour_correction_ignores_invalid_tokens_and_checks_its_arguments():
    prox, mu = torch.tensor([0.0, 5.0]), torch.tensor([0.0, -5.0])
    valid = torch.tensor([True, False])
    _, w, m = behaviour_correction(prox, mu, valid, "tis", 2.0)
    assert torch.equal(w, torch.tensor([1.0, 0.0]))
    assert m["rollout/logprob_diff_max"] == 0.0 and m["rollout/capped_frac"] == 0.0
    with pytest.raises(ValueError, match="correction"):
        behaviour_correction(prox, mu, valid, "clip", 2.0)
    with pytest.raises(ValueError, match="cap"):
        behaviour_correction(prox, mu, valid, "tis", 1.0)


def test_token_weights_scale_each_tokens_surrogate_by_hand():
    # one sequence, two tokens, ratio 1 (logp == old), A = 1: l_t = -1 * w_t; token_mean
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                          token_weights=torch.tensor([[2.0, 0.5]]))
    assert float(loss.detach()) == pytest.approx(-(2.0 + 0.5) / 2)
    loss.backward()  # d l_t / d logp_t = -A * w_t / 2 at ratio 1
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -0.25]]))


# --- recipes: ratio="sequence" (GSPO) and objective="cispo" (MiniMax-M1) -------------------

E01 = math.exp(0.1)  # 1.105171


def _recipe_batch():
    """Two sequences: row 0 has 2 valid tokens (and padding that would overflow exp()), A = +1,
    log-ratios [ln 2, 0] (token ratios [2, 1]); row 1 has 3, A = -2, log-ratios [0.3, -0.1, 0.1]
    (token ratios [1.349859, 0.904837, 1.105171]). Sequence ratios: s_0 = exp((ln 2 + 0) / 2)
    = sqrt 2 = 1.414214, s_1 = exp((0.3 - 0.1 + 0.1) / 3) = exp(0.1) = 1.105171."""
    old = torch.tensor([[-1.0, -2.0, -100.0], [-0.5, -1.5, -1.0]])
    new = torch.tensor([[-1.0 + LN2, -2.0, 100.0], [-0.2, -1.6, -0.9]]).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return new, old, torch.tensor([1.0, -2.0]), mask


def test_sequence_ratio_by_hand():
    new, old, adv, mask = _recipe_batch()
    loss, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio="sequence")
    # row 0: s_0 = 1.414214 > 1.28 with A > 0: clipped, l = -min(1.414214, 1.28) = -1.28 per token
    # row 1: s_1 = 1.105171 in [0.8, 1.28]: l = -(1.105171 * -2) = 2.210342 per token
    # token_mean: (2 * -1.28 + 3 * 2.210342) / 5 = (-2.56 + 6.631026) / 5 = 0.814205
    assert loss.item() == pytest.approx((2 * -1.28 + 3 * 2 * E01) / 5, rel=1e-6)
    assert loss.item() == pytest.approx(0.814205, abs=1e-6)
    loss.backward()
    # row 0 clipped: no gradient. row 1: d/dlogp_t of -s_tok A / 5 = -A s_1 / 5 = 2 * 1.105171 / 5
    # = 0.442068 on *every* token, whatever its own ratio (token-level would give -A r_t / 5)
    assert close(new.grad, [[0.0, 0.0, 0.0], [0.442068, 0.442068, 0.442068]])
    # the clip is decided per sequence: row 0's 2 tokens of 5 clipped high; ratio stats of s_b
    assert m["clip/high_frac"] == pytest.approx(2 / 5) and m["clip/low_frac"] == 0.0
    assert m["ratio/min"] == pytest.approx(E01) and m["ratio/max"] == pytest.approx(math.sqrt(2))
    assert m["ratio/mean"] == pytest.approx((2 * math.sqrt(2) + 3 * E01) / 5)  # 1.228788
    # token ratios for contrast: row 0 tok 0 (2 > 1.28, A > 0) is the only binding clip: 1 of 5
    _, m_tok = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert m_tok["clip/high_frac"] == pytest.approx(1 / 5)


def test_sequence_ratio_with_seq_mean_token_mean_is_gspo():
    new, old, adv, mask = _recipe_batch()
    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio="sequence",
                          aggregation="seq_mean_token_mean")
    # GSPO: -mean_b min(s_b A_b, clip(s_b) A_b) = mean(-1.28, 2.210342) = 0.465171
    assert loss.item() == pytest.approx(0.465171, abs=1e-6)
    loss.backward()
    # GSPO's gradient: -(1/G) s_1 A_1 (1/|y_1|) per token = 2 * 1.105171 / (2 * 3) = 0.368390
    assert close(new.grad, [[0.0, 0.0, 0.0], [0.368390, 0.368390, 0.368390]])


@pytest.mark.parametrize("objective", ["ppo_clip", "cispo"])
@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_sequence_ratio_equals_token_ratio_when_the_log_ratios_are_equal(aggregation, objective):
    """Every token of sequence b has log-ratio c_b: s_b = exp(c_b) = r_bt, so loss and gradient
    are the token-level ones (some c_b clip, some do not)."""
    torch.manual_seed(0)
    old = -torch.rand(4, 5)  # [B, T]
    c = torch.tensor([0.5, -0.4, 0.1, -0.05])  # [B] ratios 1.65, 0.67, 1.11, 0.95
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    results = []
    for ratio in ("token", "sequence"):
        new = (old + c.unsqueeze(-1)).requires_grad_()
        loss, m = policy_loss(new, old, adv, mask, clip_high=0.28, aggregation=aggregation,
                              max_len=5, ratio=ratio, objective=objective)
        loss.backward()
        results.append((loss.detach(), new.grad, m))
    (loss_t, grad_t, m_t), (loss_s, grad_s, m_s) = results
    assert torch.allclose(loss_t, loss_s, atol=1e-6) and torch.allclose(grad_t, grad_s, atol=1e-6)
    assert m_t == pytest.approx(m_s)


def test_cispo_by_hand():
    new, old, adv, mask = _recipe_batch()
    loss, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, objective="cispo")
    # weights w = sg[clip(r, 0.8, 1.28)]: row 0 [2 -> 1.28, 1], row 1 [1.349859 -> 1.28,
    # 0.904837, 1.105171]; logp: row 0 [-1 + ln 2 = -0.306853, -2], row 1 [-0.2, -1.6, -0.9]
    # l = -w A logp: row 0 [-1.28 * 1 * -0.306853 = 0.392772, -1 * 1 * -2 = 2.0]
    #                row 1 [-1.28 * -2 * -0.2 = -0.512, -0.904837 * -2 * -1.6 = -2.895480,
    #                       -1.105171 * -2 * -0.9 = -1.989308]
    # token_mean: (0.392772 + 2.0 - 0.512 - 2.895480 - 1.989308) / 5 = -3.004016 / 5
    assert loss.item() == pytest.approx(-0.600803, abs=1e-6)
    loss.backward()
    # gradient -A clip(r) / N per token, clipped tokens included:
    # row 0 [-1.28 / 5, -1 / 5] = [-0.256, -0.2]
    # row 1 [2 * 1.28 / 5, 2 * 0.904837 / 5, 2 * 1.105171 / 5] = [0.512, 0.361935, 0.442068]
    assert close(new.grad, [[-0.256, -0.2, 0.0], [0.512, 0.361935, 0.442068]])
    # the weight was bounded above for r = 2 and r = 1.349859 (whatever the sign of A): 2 of 5
    assert m["clip/high_frac"] == pytest.approx(2 / 5) and m["clip/low_frac"] == 0.0


def test_cispo_gradient_is_minus_advantage_times_clipped_ratio_over_n():
    torch.manual_seed(1)
    old = -torch.rand(3, 6)  # [B, T]
    new = (old + 0.6 * torch.randn(3, 6)).requires_grad_()  # ratios well outside [0.8, 1.28]
    mask = (torch.rand(3, 6) > 0.3).float()
    adv = torch.tensor([1.5, -0.7, 0.4])
    loss, _ = policy_loss(new, old, adv, mask, clip_high=0.28, objective="cispo")
    loss.backward()
    r = torch.exp(new.detach() - old)  # [B, T]
    expected = -adv.unsqueeze(-1) * r.clamp(0.8, 1.28) * mask / mask.sum()  # [B, T]
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_cispo_clip_low_one_is_an_upper_bound_only():
    # one token, r = 0.5, A = -1: clip_low 1.0 puts the lower bound at 0, so w = 0.5 (unclipped);
    # l = -0.5 * -1 * logp, d l / d logp = 0.5
    new = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, m = policy_loss(new, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                          clip_low=1.0, objective="cispo")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * math.log(0.5)) and new.grad.item() == pytest.approx(0.5)
    assert m["clip/low_frac"] == 0.0
    _, m = policy_loss(new, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                       clip_low=0.2, objective="cispo")
    assert m["clip/low_frac"] == 1.0  # 0.5 < 0.8: bounded below


def test_sequence_ratio_with_cispo_by_hand():
    new, old, adv, mask = _recipe_batch()
    loss, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio="sequence",
                          objective="cispo")
    # w = sg[clip(s_b)]: row 0 sqrt 2 -> 1.28 on both tokens, row 1 1.105171 on all three
    # l = -w A logp: row 0 [1.28 * 0.306853 = 0.392772, 1.28 * 2 = 2.56]
    #                row 1 2.210342 * [-0.2, -1.6, -0.9] = [-0.442068, -3.536547, -1.989308]
    # token_mean: (0.392772 + 2.56 - 0.442068 - 3.536547 - 1.989308) / 5 = -3.015151 / 5
    assert loss.item() == pytest.approx(-0.603030, abs=1e-6)
    loss.backward()
    # -A w / 5: row 0 -1.28 / 5 = -0.256; row 1 2 * 1.105171 / 5 = 0.442068
    assert close(new.grad, [[-0.256, -0.256, 0.0], [0.442068, 0.442068, 0.442068]])
    assert m["clip/high_frac"] == pytest.approx(2 / 5) and m["clip/low_frac"] == 0.0


def test_token_weights_under_the_sequence_ratio_leave_the_ratio_alone():
    """A token weighted 0 (behaviour_correction's mask) still counts in its sequence's ratio but
    adds no term: row 0 keeps s_0 = sqrt 2 (not 2, its first token's ratio alone)."""
    new, old, adv, mask = _recipe_batch()
    tw = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = policy_loss(new, old, adv, mask, clip_high=0.5, ratio="sequence", token_weights=tw)
    # clip_high 0.5: s_0 = 1.414214 unclipped; row 0: -1.414214 on token 0 only
    # (-1.414214 + 3 * 2.210342) / 5 = 5.216813 / 5 (the weighted-out token stays in the count)
    assert loss.item() == pytest.approx(1.043362, abs=1e-6)
    loss.backward()
    # row 0: [-A s_0 / 5 = -0.282843, 0]; row 1 unchanged: 0.442068
    assert close(new.grad, [[-0.282843, 0.0, 0.0], [0.442068, 0.442068, 0.442068]])


@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("objective", ["ppo_clip", "cispo"])
def test_kl_term_is_added_unweighted_in_every_mode(ratio, objective):
    new, old, adv, mask = _recipe_batch()
    ref = new.detach() + 0.3  # d = ref - logp = 0.3: k3 = e^0.3 - 1 - 0.3 = 0.049859 per token
    tw = torch.tensor([[0.5, 2.0, 0.0], [1.0, 0.0, 1.0]])
    kwargs = dict(ratio=ratio, objective=objective, ref_logprobs=ref, token_weights=tw)
    without, _ = policy_loss(new, old, adv, mask, **kwargs)
    with_kl, m = policy_loss(new, old, adv, mask, beta=0.5, **kwargs)
    assert m["kl/ref"] == pytest.approx(math.exp(0.3) - 1.3, rel=1e-5)
    # token_mean: + beta * (5 * 0.049859) / 5, the token weights not applied to it
    assert (with_kl - without).item() == pytest.approx(0.5 * (math.exp(0.3) - 1.3), rel=1e-5)


def test_recipe_arguments_are_checked():
    args = (NEW, OLD, ADV, MASK)
    with pytest.raises(ValueError, match="unknown ratio 'seq'; valid: token, sequence"):
        policy_loss(*args, ratio="seq")
    with pytest.raises(ValueError, match="unknown objective 'gspo'; valid: ppo_clip, cispo"):
        policy_loss(*args, objective="gspo")


def test_padding_cannot_leak_into_the_sequence_ratio_or_cispo():
    # NEW/OLD hold +-100 in padding: a sequence ratio or a logp term that read it would be inf/NaN
    for ratio, objective in [("sequence", "ppo_clip"), ("token", "cispo"), ("sequence", "cispo")]:
        new = NEW.clone().requires_grad_()
        loss, m = policy_loss(new, OLD, ADV, MASK, ratio=ratio, objective=objective)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
        assert new.grad[MASK == 0].abs().sum() == 0.0 and m["ratio/max"] == 1.0


# --- the recipes through the trainer --------------------------------------------------------


@pytest.mark.parametrize(("ratio", "objective"),
                         [("sequence", "ppo_clip"), ("token", "cispo"), ("sequence", "cispo")])
def test_train_run_takes_the_recipe_keys_for_one_step(tmp_path, monkeypatch, ratio, objective):
    """One step of the tiny model on tests/Digits-v0 (reward contrast, so a real gradient): the
    contract keys reach policy_update, the first update sees ratio 1 and the step is taken."""
    from agent_rl.run.contract import ExperimentContract
    from agent_rl.training import train, update
    from tests.agent_rl import toy_env

    seen = []

    def recording_loss(*args, **kwargs):
        seen.append((kwargs["ratio"], kwargs["objective"]))
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(update, "policy_loss", recording_loss)
    toy_env.register()
    try:
        contract = ExperimentContract.from_dict({
            "env": {"id": toy_env.ENV_ID, "pool_size": 64},
            "eval": {"n": 1, "every": 0},
            "model": {"id": "tiny", "adapter": "none"},
            "rollout": {"group_size": 4, "tasks_per_step": 2, "max_response_tokens": 8,
                        "truncation": "keep"},
            "loss": {"ratio": ratio, "objective": objective, "clip_low": 3e-4, "clip_high": 4e-4},
            "optim": {"lr": 1e-3, "max_steps": 1},
            "checkpoint": {"every": 0},
            "guards": {"max_truncated_frac": 1.01},
            "run_dir": str(tmp_path / "run"),
        })
        result = train.run(contract, progress=False)
    finally:
        toy_env.unregister()
    (m,) = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert seen and set(seen) == {(ratio, objective)}
    assert m["optim/skipped"] == 0.0 and m["optim/grad_norm"] > 0.0, m
    assert abs(m["ratio/min"] - 1.0) < 1e-4 and abs(m["ratio/max"] - 1.0) < 1e-4, m
    assert m["clip/low_frac"] == 0.0 and m["clip/high_frac"] == 0.0
    assert math.isfinite(m["loss/policy"])
