"""Policy-gradient losses (GRPO / PPO-clip, GSPO, GSPO-token, SAPO) with KL, entropy bonus and
rollout importance correction. Plain torch; `policy_loss` is the one public entry point.

Tensors are [batch, tokens] over response tokens; `mask` is 1 on valid tokens. Each row holds one
sequence (a sequence never spans micro-batches), so per-sequence quantities such as GSPO's
length-normalised ratio use only the row's own tokens - unless the row holds only part of its sequence
(context parallelism): then `row_sum` adds each per-row sum over the ranks holding the other parts.

Clip-boundary convention: a token counts as clipped only when strictly outside the trust region
(r > 1 + clip_high with A > 0, r < 1 - clip_low with A < 0, r > dual_clip with A < 0); exactly on the
boundary the unclipped gradient flows. (The loss is continuous there; this picks the one-sided
derivative from inside the region.)
"""

from __future__ import annotations

from typing import Callable, get_args

import torch

from mcore_rl.algo_config import LOSSES, AlgoConfig, RolloutCorrection
from mcore_rl.algos.aggregation import GlobalCounts, aggregate, sequence_lengths
from mcore_rl.algos.kl import LOG_RATIO_CLAMP, kl_estimate

ROLLOUT_IS_MODES = (None, *get_args(RolloutCorrection))


RowSum = Callable[[torch.Tensor], torch.Tensor]


def _own(t: torch.Tensor) -> torch.Tensor:
    return t


def _masked_seq_mean(values: torch.Tensor, mask: torch.Tensor, row_sum: RowSum = _own) -> torch.Tensor:
    """Per-row mean over valid tokens, [batch, 1]; all-masked rows give 0."""
    n = row_sum(sequence_lengths(mask)).to(values.dtype).clamp(min=1)
    return (row_sum((values * mask).sum(dim=-1)) / n).unsqueeze(-1)


def ppo_clip_token_loss(ratio: torch.Tensor, adv: torch.Tensor, algo: AlgoConfig):
    """PPO-clip with separate low/high clip and optional dual clip; returns (loss, clipped_upper, clipped_lower, dual_clipped)."""
    upper = (adv > 0) & (ratio > 1.0 + algo.clip_high)
    lower = (adv < 0) & (ratio < 1.0 - algo.clip_low)
    clipped_ratio = ratio.clamp(1.0 - algo.clip_low, 1.0 + algo.clip_high).detach()
    loss = torch.where(upper | lower, -adv * clipped_ratio, -adv * ratio)
    dual = torch.zeros_like(upper)
    if algo.dual_clip is not None:
        # for A < 0 a huge ratio would give an unbounded loss: cap it at -c A (no gradient)
        dual = (adv < 0) & (ratio > algo.dual_clip)
        loss = torch.where(dual, -adv * algo.dual_clip, loss)
    return loss, upper, lower, dual


def _token_log_ratio(log_prob, old_log_prob):
    return (log_prob - old_log_prob.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_log_ratio(log_prob, old_log_prob, mask, row_sum: RowSum = _own):
    """log s_i = (1/n_i) sum_t m d_{i,t}: GSPO's length-normalised sequence log-ratio, [batch, 1]."""
    log_ratio = _masked_seq_mean(log_prob - old_log_prob.detach(), mask, row_sum)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def pg_token_loss(log_prob, old_log_prob, advantages, mask, algo: AlgoConfig, row_sum: RowSum = _own):
    """Per-token policy-gradient loss for algo.loss; returns (loss, ratio, flags dict of bool tensors)."""
    if algo.loss == "grpo":
        ratio = torch.exp(_token_log_ratio(log_prob, old_log_prob))
        loss, up, lo, dual = ppo_clip_token_loss(ratio, advantages, algo)
        return loss, ratio, {"clipfrac_upper": up, "clipfrac_lower": lo, "dual_clipfrac": dual}
    if algo.loss == "gspo":
        # one ratio and one (masked-mean) advantage per sequence, broadcast to its tokens
        seq_ratio = torch.exp(_sequence_log_ratio(log_prob, old_log_prob, mask, row_sum))
        seq_adv = _masked_seq_mean(advantages, mask, row_sum)
        loss, up, lo, dual = ppo_clip_token_loss(seq_ratio, seq_adv, algo)
        shape = log_prob.shape
        return (
            loss.expand(shape),
            seq_ratio.expand(shape),
            {
                "clipfrac_upper": up.expand(shape),
                "clipfrac_lower": lo.expand(shape),
                "dual_clipfrac": dual.expand(shape),
            },
        )
    if algo.loss == "gspo_token":
        # value s_i, gradient through each token: lp - sg(lp) + sg(log s_i)
        log_s = _sequence_log_ratio(log_prob, old_log_prob, mask, row_sum).detach()
        ratio = torch.exp(log_prob - log_prob.detach() + log_s)
        loss, up, lo, dual = ppo_clip_token_loss(ratio, advantages, algo)
        return loss, ratio, {"clipfrac_upper": up, "clipfrac_lower": lo, "dual_clipfrac": dual}
    if algo.loss == "sapo":
        ratio = torch.exp(_token_log_ratio(log_prob, old_log_prob))
        tau_pos, tau_neg = (torch.tensor(t, dtype=ratio.dtype) for t in (algo.tau_pos, algo.tau_neg))
        tau = torch.where(advantages > 0, tau_pos, tau_neg)  # built in ratio's dtype: no float32 rounding
        # soft gate instead of a hard clip: gradient weight sech^2(tau (r - 1) / 2)
        gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
        return -gate * advantages, ratio, {}
    raise ValueError(f"unknown loss {algo.loss!r}; use one of {tuple(LOSSES)}")


def rollout_is_weight(old_log_prob, rollout_log_prob, mask, algo: AlgoConfig, row_sum: RowSum = _own) -> torch.Tensor:
    """Detached train/inference importance weight per token (see AlgoConfig.rollout_is)."""
    log_w = (old_log_prob - rollout_log_prob).detach() * mask
    if algo.rollout_is == "token":
        return torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=algo.rollout_is_cap)
    if algo.rollout_is == "sequence":
        seq = row_sum(log_w.sum(dim=-1)).unsqueeze(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(seq).clamp(max=algo.rollout_is_cap).expand_as(log_w)
    if algo.rollout_is == "icepop":
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = (w >= algo.rollout_is_low) & (w <= algo.rollout_is_high)
        return torch.where(keep, w, torch.zeros_like(w))
    raise ValueError(f"unknown rollout_is {algo.rollout_is!r}; use one of {ROLLOUT_IS_MODES}")


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgoConfig,
    counts: GlobalCounts,
    rollout_log_prob: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    row_sum: RowSum | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics, both as partial sums over GLOBAL denominators.

    Args: [batch, tokens] tensors (advantages broadcast per token); `counts` from the full global
    batch (GlobalCounts.from_mask); `rollout_log_prob` when algo.rollout_is is set; `ref_log_prob`
    when algo.kl_coef > 0; `entropy` (differentiable) when algo.entropy_coef > 0 (also logged when
    given); `seq_lens` only when rows hold partial sequences; `row_sum` when rows hold parts of sequences
    whose other parts are on other ranks (context parallel): sums a per-row [batch] tensor over them,
    differentiably (mcore_rl.megatron.context_parallel.row_sum); then `seq_lens` defaults to its mask sums.

    loss = agg(w * l_pg) + kl_coef * agg(kl) - entropy_coef * agg(H) with agg = algo.agg_mode and w
    the detached rollout IS weight. Summing `loss` over micro-batches and DP ranks gives the
    mini-batch loss. Metrics are detached token means over counts.num_tokens, summable the same way:
    pg_loss, clipfrac_upper/lower, dual_clipfrac, approx_kl_old (k3 of pi_theta vs pi_old), and when
    inputs allow: kl_ref, entropy, is_weight_mean, rollout_mismatch_k3 (k3 of old vs rollout).
    """
    counts.validate()
    shape = log_prob.shape
    for name, t in (
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("mask", mask),
        ("rollout_log_prob", rollout_log_prob),
        ("ref_log_prob", ref_log_prob),
        ("entropy", entropy),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but log_prob has {tuple(shape)}; all must be [batch, tokens]"
            )
    if algo.rollout_is is not None and rollout_log_prob is None:
        raise ValueError(
            f"algo.rollout_is={algo.rollout_is!r} needs rollout_log_prob (the engine's sampled-token log-probs)"
        )
    if algo.kl_coef > 0 and ref_log_prob is None:
        raise ValueError(
            f"algo.kl_coef={algo.kl_coef} needs ref_log_prob (a reference-model pass); set kl_coef=0 to skip it"
        )
    if algo.entropy_coef > 0 and entropy is None:
        raise ValueError(
            f"algo.entropy_coef={algo.entropy_coef} needs the per-token entropy; compute it with the log-probs"
        )

    mask = mask.to(log_prob.dtype)
    advantages = advantages.to(log_prob.dtype)
    if row_sum is None:
        row_sum = _own
    elif seq_lens is None:
        seq_lens = row_sum(sequence_lengths(mask))

    def agg(values):
        return aggregate(values, mask, algo.agg_mode, counts, seq_lens)

    def token_mean(values):  # metrics: detached, summable over micro-batches / ranks
        return (values.detach().to(log_prob.dtype) * mask).sum() / counts.num_tokens

    pg, ratio, flags = pg_token_loss(log_prob, old_log_prob, advantages, mask, algo, row_sum)
    metrics = {name: token_mean(flag) for name, flag in flags.items()}
    if rollout_log_prob is not None:
        x = (rollout_log_prob - old_log_prob).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics["rollout_mismatch_k3"] = token_mean(torch.exp(-x) + x - 1.0)
    if algo.rollout_is is not None:
        w = rollout_is_weight(old_log_prob, rollout_log_prob, mask, algo, row_sum)
        pg = pg * w
        metrics["is_weight_mean"] = token_mean(w)
    pg_loss = agg(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    log_r = _token_log_ratio(log_prob.detach(), old_log_prob)
    metrics["approx_kl_old"] = token_mean(torch.exp(log_r) - log_r - 1.0)
    if ref_log_prob is not None:
        kl = kl_estimate(log_prob, ref_log_prob, algo.kl_type)
        metrics["kl_ref"] = token_mean(kl)
        if algo.kl_coef > 0:
            loss = loss + algo.kl_coef * agg(kl)
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * agg(entropy)
    return loss, metrics
