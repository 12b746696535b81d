"""GRPO-family math: group advantages, the clipped policy loss, the behaviour correction.

Pure torch, no other project imports. The log-probs the loss takes (old and new, the
reference's) all come from one rule, ``agent_rl.policies.logprobs``.

Advantages (`group_advantages`), for sample i of group g with G_g members:

    A_i = (r_i - mean_g) / (s + eps),    A_i = 0.0 exactly if the group's rewards are equal

    s = std_g (scale="group": GRPO, DeepSeekMath / DeepSeek-R1), or the std of all rewards
        in the batch (scale="batch": group-mean baseline with batch-level scale, as in
        Lite PPO, Liu et al. 2025, and TRL's `scale_rewards="batch"`),
        population (divide by n) or sample (n - 1; a single-member group has std 0);
    s = 1, eps = 0 for std="none" (Dr. GRPO, Liu et al. 2025: centring only, no std
        normalisation, which otherwise up-weights near-saturated groups).

The baseline (mean_g, s) always comes from the members' rewards; ``GroupBaseline.advantages``
can measure other values against it: ``rollout.session_advantages`` takes a group's G episode
rewards as the members and measures each session's credit, (credit - mean_g) / (s + eps).

A group with equal rewards carries no learning signal; its advantages are set to exactly
0.0 (not r - mean, which can be a rounding residue) and it is counted as zero-contrast.
DAPO's dynamic sampling drops such groups in the rollout; here they are only counted
(`all_correct`: saturated, `all_wrong`: under-explored, `zero_contrast_other`).

Policy loss (`policy_loss`), per valid token t of sequence b (mask m_bt = 1, |y_b| = sum_t
m_bt valid tokens, sg[.] = stop-gradient, clip(x) = clip(x, 1 - clip_low, 1 + clip_high)):

    r_bt = exp(logp_bt - old_logp_bt)                                  the token ratio

The ratio each token uses, q_bt (``ratio``):

    token     q_bt = r_bt                                            (PPO, GRPO, DAPO)
    sequence  s_b    = exp( sum_t m_bt (logp_bt - old_logp_bt) / |y_b| )
              q_bt = sg[s_b] * exp(logp_bt - sg[logp_bt])            (GSPO-token)

s_b is GSPO's length-normalised sequence likelihood ratio (Zheng et al. 2025, "Group Sequence
Policy Optimization"), the geometric mean of the sequence's token ratios. q_bt is GSPO-token's
s_{i,t}: its value is s_b on every token of b, and d q_bt / d logp_bu = s_b [u = t], so the
gradient flows through every token with the sequence's weight. With one advantage per
sequence and ``seq_mean_token_mean`` this is GSPO itself: loss = -mean_b min(s_b A_b,
clip(s_b) A_b) with gradient -mean_b s_b A_b (1/|y_b|) sum_t grad logp_bt over the unclipped
sequences, as in the paper; clipping is a whole-sequence decision.

The per-token loss (``objective``), before the KL term and the aggregation:

    ppo_clip  l_bt = -min(q_bt * A_bt, clip(q_bt) * A_bt)
    cispo     l_bt = -sg[clip(q_bt)] * A_bt * logp_bt

ppo_clip is the PPO clip made asymmetric by DAPO's clip-higher (clip_high > clip_low keeps
low-probability tokens able to rise); a clipped token has zero gradient. cispo is MiniMax-M1's
CISPO (2025): the clipped importance weight is a constant times the log-prob (REINFORCE with a
truncated IS weight), so its gradient is -A_bt clip(q_bt) grad logp_bt and no token ever
loses its gradient, only its weight is bounded. Its loss *value* is that score-function
surrogate, -w A logp: only its gradient means something, and ``loss/policy`` is not comparable
with ppo_clip's (which is -A at ratio 1). Both bounds apply; MiniMax-M1 uses only the upper one
in practice (no lower clip): ``clip_low=1.0`` reproduces that (the bound 0 never binds);
its normalisation is ``token_mean`` (a sum over all tokens of the batch / their count).

Every loss adds the KL to a *fixed reference* policy, beta * kl_bt, with Schulman's estimators
of KL(pi || ref) on d = ref_logp - logp:

    k1 = -d,    k2 = d**2 / 2,    k3 = exp(d) - 1 - d      (k3: GRPO's choice)

Aggregation over tokens, with per-sequence weights w_b (default 1), for every ratio and
objective:

    token_mean              sum_bt w_b l_bt m_bt / sum_bt m_bt               (DAPO)
    seq_mean_token_mean     mean_b w_b sum_t l_bt m_bt / sum_t m_bt          (GRPO, GSPO)
                            (sequences without valid tokens leave the mean)
    seq_mean_token_sum_norm mean_b w_b sum_t l_bt m_bt / max_len             (Dr. GRPO)

Where ``ratio="sequence"`` departs from GSPO: the aggregation still follows the argument
(GSPO's own is ``seq_mean_token_mean``; ``token_mean`` weights each sequence's term by its
length); per-token advantages A_bt, if given, are used per token (GSPO-token's form; GSPO
proper has one A_b per sequence); the clip bounds are the same two arguments, and GSPO's are
hundreds of times narrower than token-level ones (its paper: 3e-4 / 4e-4; the token defaults
0.2 / 0.28 rarely bind on a geometric mean). ``ratio="sequence"`` with ``cispo`` is
defined by the same table: every token of b has the weight sg[clip(s_b)], a sequence-level
truncated IS weight (neither paper runs this pair).

Metrics, over valid tokens: ``ratio/min|mean|max`` of q_bt (sequence: s_b, counted once per
token); ``clip/low_frac`` and ``clip/high_frac`` the share of tokens whose ratio (token: r_bt;
sequence: their sequence's s_b) was clipped at the lower / upper bound: for ppo_clip only where
the clip binds (A < 0 below 1 - clip_low, A > 0 above 1 + clip_high: the tokens without a
gradient), for cispo wherever the weight was bounded, whatever the sign of A; ``kl/approx``
estimates KL(old || new) from the old policy's own samples in every mode: k3 on d = logp -
old_logp, r_bt - 1 - log r_bt (>= 0; unbiased since E_old[r] = 1; a token whose probability
falls adds about -log r, not the 1/r that k3 on old_logp - logp, the estimator for samples of
the *new* policy, would add).

Rollout/trainer mismatch (``behaviour_correction``). The rollout engine (vLLM, a bf16 or a
lagging weight copy) samples token t with log-prob mu_t; the trainer, before its update, gives
the same token prox_t (its own numerics, its current weights). With rho_t = exp(prox_t - mu_t):

    none   the ratio is taken against mu (old_logp = mu): mismatch counts as policy change
    tis    the ratio is taken against prox, and the token's loss is weighted by min(rho_t, C)
           (truncated importance sampling, Yao et al. 2025; decoupled PPO, Hilton et al.)
    mask   the ratio is taken against prox, and tokens with rho_t outside [1/C, C] get
           weight 0 (they stay in token_mean's count, so micro-batches still add up)

The weights are constants and multiply each token's policy term l_bt only (ppo_clip or cispo,
either ratio), never the KL-to-reference term. Under ``ratio="sequence"`` s_b is still taken
over every valid token (against old_logp = prox under tis and mask): a token masked to weight
0 still counts in its sequence's ratio, but adds no term of its own to the loss.
|prox - mu| over trained tokens is reported as ``rollout/logprob_diff_mean|max``.

Departures: advantages may also be given per token ([B, T]); the per-sequence weights
(session weighting) are ours; a batch with no valid token gives loss 0.0 that is still
attached to the graph (zero gradients), so a training step never sees NaN from it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

STD_MODES = ("population", "sample", "none")
SCALE_MODES = ("group", "batch")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIOS = ("token", "sequence")
OBJECTIVES = ("ppo_clip", "cispo")
KL_ESTIMATORS = {
    "k1": lambda d: -d,
    "k2": lambda d: d.pow(2) / 2,
    "k3": lambda d: torch.exp(d) - 1 - d,
}


def _choice(name: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


@dataclass(frozen=True)
class GroupBaseline:
    """Per member of a batch of groups: the group's mean reward, the divisor of the advantage
    (std + eps, or 1.0 for ``std="none"``) and whether the group has no contrast (``flat``);
    ``stats`` counts the zero-contrast groups (see ``group_advantages``)."""

    mean: torch.Tensor  # [N]
    scale: torch.Tensor  # [N]
    flat: torch.Tensor  # [N] bool
    stats: dict[str, int]

    def advantages(self, values: torch.Tensor) -> torch.Tensor:
        """(values - mean) / scale, exactly 0.0 in flat groups: ``[N]``. ``values`` are the
        rewards themselves (GRPO) or per-session credits measured against the same baseline."""
        adv = (values.to(self.mean.dtype) - self.mean) / self.scale  # [N]
        return torch.where(self.flat, torch.zeros_like(adv), adv)  # [N]


def group_baseline(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    std: str = "population",
    scale: str = "group",
    eps: float = 1e-6,
    *,
    correct_threshold: float = 1.0,
    wrong_threshold: float = 0.0,
) -> GroupBaseline:
    """The group baseline and spread of the module docstring, from the members' rewards."""
    _choice("std", std, STD_MODES)
    _choice("scale", scale, SCALE_MODES)
    r = torch.as_tensor(rewards)  # [N]
    if not r.is_floating_point():
        r = r.float()
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {tuple(r.shape)}")
    if len(group_ids) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    bad = (~torch.isfinite(r)).nonzero()
    if bad.numel():
        i = bad[0].item()
        raise ValueError(f"reward at index {i} is {r[i].item()}; rewards must be finite")

    index = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    gid = torch.tensor([index[g] for g in group_ids], device=r.device)  # [N]
    n_groups = len(index)
    count = torch.bincount(gid, minlength=n_groups).to(r.dtype)  # [G]
    mean = r.new_zeros(n_groups).index_add_(0, gid, r) / count  # [G]
    centred = r - mean[gid]  # [N]
    hi = r.new_full((n_groups,), -torch.inf).scatter_reduce(0, gid, r, "amax")  # [G]
    lo = r.new_full((n_groups,), torch.inf).scatter_reduce(0, gid, r, "amin")  # [G]
    flat = hi == lo  # [G] zero-contrast groups

    if std == "none":
        s = torch.ones_like(r)  # [N]
    else:
        ddof = 1 if std == "sample" else 0
        if scale == "group":
            sq = r.new_zeros(n_groups).index_add_(0, gid, centred.pow(2))  # [G]
            s = (sq / (count - ddof).clamp(min=1)).sqrt()[gid] + eps  # [N]
        else:
            batch_std = r.std(correction=ddof) if r.numel() > ddof else r.new_zeros(())  # []
            s = (batch_std + eps).expand_as(r)  # [N]

    common = hi[flat]  # [Z] the shared reward of each zero-contrast group
    correct = common >= correct_threshold  # [Z]
    wrong = ~correct & (common <= wrong_threshold)  # [Z]
    stats = {
        "groups": n_groups,
        "zero_contrast": int(flat.sum()),
        "all_correct": int(correct.sum()),
        "all_wrong": int(wrong.sum()),
        "zero_contrast_other": int((~correct & ~wrong).sum()),
    }
    return GroupBaseline(mean[gid], s, flat[gid], stats)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    std: str = "population",
    scale: str = "group",
    eps: float = 1e-6,
    *,
    correct_threshold: float = 1.0,
    wrong_threshold: float = 0.0,
) -> tuple[torch.Tensor, dict[str, int]]:
    """Group-relative advantages `[N]` and counts of zero-contrast groups.

    `stats` keys: `groups`, `zero_contrast`, and its split into `all_correct` (common
    reward >= correct_threshold), `all_wrong` (<= wrong_threshold), `zero_contrast_other`.
    """
    baseline = group_baseline(rewards, group_ids, std, scale, eps,
                              correct_threshold=correct_threshold, wrong_threshold=wrong_threshold)
    r = torch.as_tensor(rewards)
    return baseline.advantages(r if r.is_floating_point() else r.float()), baseline.stats


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    kl: str = "k3",
    max_len: int | None = None,
    weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    ratio: str = "token",
    objective: str = "ppo_clip",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss (scalar, differentiable in `logprobs`) and float metrics (module docstring).

    Shapes: logprobs, old_logprobs, mask, ref_logprobs, entropy, token_weights `[B, T]`;
    advantages `[B]` or `[B, T]`; weights `[B]`. ``ratio``: token | sequence (GSPO);
    ``objective``: ppo_clip | cispo. ``token_weights`` (from ``behaviour_correction``)
    multiply each token's policy term. With no valid token the loss is 0.0 (graph intact) and
    the metrics are neutral: fractions and KLs 0.0, ratio stats 1.0, tokens 0.0.
    """
    _check_loss_arguments(logprobs, old_logprobs, mask, aggregation, ratio, objective, kl,
                          beta, ref_logprobs, max_len)
    B = logprobs.shape[0]
    valid = mask.bool()  # [B, T]
    m = valid.to(logprobs.dtype)  # [B, T]
    old_logprobs = old_logprobs.detach()  # [B, T] constants of the objective, as are A and ref
    adv = advantages.detach().to(logprobs.dtype)  # [B] or [B, T]
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B, 1]
    adv = adv.expand_as(logprobs)  # [B, T]
    w = logprobs.new_ones(B) if weights is None else weights.to(logprobs.dtype)  # [B]

    # Padding may hold any value; zero it (and its log-ratios) so exp() cannot overflow into NaN.
    logp = torch.where(valid, logprobs, 0.0)  # [B, T]
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)  # [B, T]
    if ratio == "token":
        q = torch.exp(log_ratio)  # [B, T] r_bt
    else:  # GSPO-token: the value s_b on every token, the gradient s_b * grad logp_bt
        log_s = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)  # [B] log s_b (0 for an empty row)
        q = torch.exp(log_s.detach().unsqueeze(-1) + logp - logp.detach())  # [B, T]
    lo, hi = 1 - clip_low, 1 + clip_high
    if objective == "ppo_clip":
        loss_t = -torch.minimum(q * adv, q.clamp(lo, hi) * adv)  # [B, T]
    else:  # cispo: a constant clipped IS weight times the log-prob
        loss_t = -q.detach().clamp(lo, hi) * adv * logp  # [B, T]
    if token_weights is not None:
        loss_t = loss_t * token_weights.detach().to(loss_t.dtype)  # [B, T]
    kl_ref = None
    if ref_logprobs is not None:
        d_ref = torch.where(valid, ref_logprobs.detach() - logprobs, 0.0)  # [B, T]
        kl_ref = KL_ESTIMATORS[kl](d_ref)  # [B, T]
        if beta > 0:
            loss_t = loss_t + beta * kl_ref  # [B, T]
    loss = _aggregate(loss_t, m, w, aggregation, max_len)  # []
    with torch.no_grad():
        metrics = _loss_metrics(q, adv, valid, log_ratio, lo, hi, objective, kl_ref, entropy)
    return loss, metrics


def _check_loss_arguments(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                          aggregation: str, ratio: str, objective: str, kl: str, beta: float,
                          ref_logprobs: torch.Tensor | None, max_len: int | None) -> None:
    """``policy_loss``'s arguments: known names, what beta and seq_mean_token_sum_norm need,
    one ``[B, T]`` shape."""
    _choice("aggregation", aggregation, AGGREGATIONS)
    _choice("ratio", ratio, RATIOS)
    _choice("objective", objective, OBJECTIVES)
    _choice("kl", kl, tuple(KL_ESTIMATORS))
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the fixed reference policy)")
    if aggregation == "seq_mean_token_sum_norm" and not (max_len and max_len > 0):
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_len > 0")
    if not logprobs.shape == old_logprobs.shape == mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must share one [B, T] shape"
        )


def _aggregate(loss_t: torch.Tensor, m: torch.Tensor, w: torch.Tensor, aggregation: str,
               max_len: int | None) -> torch.Tensor:
    """The per-token loss ``[B, T]`` (mask ``m``, sequence weights ``w`` ``[B]``) as one scalar
    under ``aggregation`` (module docstring)."""
    B = loss_t.shape[0]
    seq_sum = (loss_t * m).sum(-1)  # [B]
    seq_len = m.sum(-1)  # [B]
    if aggregation == "token_mean":
        return (w * seq_sum).sum() / seq_len.sum().clamp(min=1)  # []
    if aggregation == "seq_mean_token_mean":
        has_tokens = (seq_len > 0).to(m.dtype)  # [B]
        per_seq = w * seq_sum / seq_len.clamp(min=1)  # [B]
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)  # []
    return (w * seq_sum / max_len).sum() / max(B, 1)  # []


def _loss_metrics(q: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
                  log_ratio: torch.Tensor, lo: float, hi: float, objective: str,
                  kl_ref: torch.Tensor | None, entropy: torch.Tensor | None) -> dict[str, float]:
    """``policy_loss``'s metrics over the valid tokens (all ``[B, T]``): clip fractions, ratio
    statistics, ``kl/approx`` (k3 against the old policy), ``kl/ref``, entropy, tokens."""
    n = int(valid.sum())
    r = q[valid]  # [n] r_bt, or s_b once per token
    a = adv[valid]  # [n]
    denom = max(n, 1)
    low, high = r < lo, r > hi  # [n] clipped weights (cispo)
    if objective == "ppo_clip":  # only where the clip binds (no gradient)
        low, high = low & (a < 0), high & (a > 0)
    metrics = {
        "clip/low_frac": float(low.sum()) / denom,
        "clip/high_frac": float(high.sum()) / denom,
        "ratio/min": float(r.min()) if n else 1.0,
        "ratio/mean": float(r.mean()) if n else 1.0,
        "ratio/max": float(r.max()) if n else 1.0,
        "kl/approx": float(KL_ESTIMATORS["k3"](log_ratio[valid]).sum()) / denom,
        "tokens": float(n),
    }
    if kl_ref is not None:
        metrics["kl/ref"] = float(kl_ref[valid].sum()) / denom
    if entropy is not None:
        metrics["entropy"] = float(entropy[valid].sum()) / denom
    return metrics


CORRECTIONS = ("none", "tis", "mask")


def behaviour_correction(
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "none",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """``(old_logprobs, token_weights, metrics)`` for ``policy_loss`` (module docstring).

    prox_logprobs: the trainer's log-probs before its update; behaviour_logprobs: the rollout
    engine's; mask: trained tokens; all ``[N]`` or ``[B, T]``. ``token_weights`` is None for
    ``none``. Metrics: ``rollout/logprob_diff_mean|max`` (always), ``rollout/capped_frac``
    (tis: share of tokens with rho > C; mask: share outside [1/C, C])."""
    _choice("correction", mode, CORRECTIONS)
    if cap <= 1.0:
        raise ValueError(f"correction cap must be > 1, got {cap}")
    valid = mask.bool()
    prox = prox_logprobs.detach()
    log_rho = torch.where(valid, prox - behaviour_logprobs, 0.0)  # log(pi_prox / mu)
    diff = log_rho.abs()[valid]  # [n]
    n = int(valid.sum())
    metrics = {"rollout/logprob_diff_mean": float(diff.mean()) if n else 0.0,
               "rollout/logprob_diff_max": float(diff.max()) if n else 0.0}
    if mode == "none":
        return behaviour_logprobs, None, metrics
    rho = torch.exp(log_rho)
    if mode == "tis":
        capped = valid & (rho > cap)
        weights = rho.clamp(max=cap)
    else:
        capped = valid & ((rho > cap) | (rho < 1.0 / cap))
        weights = (~capped).to(prox.dtype)
    metrics["rollout/capped_frac"] = float(capped.sum()) / max(n, 1)
    return prox, torch.where(valid, weights, 0.0), metrics
