"""The policy objective of one micro-batch: a `PolicyLoss`'s per-token values times the rollout importance
weight, aggregated over GLOBAL counts, plus the KL penalty and the entropy bonus; and its metrics.
Plain torch; `policy_loss` is the one entry point the actor's loss function calls."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, get_args

import torch

from mcore_rl.algo_config import AlgoConfig, RolloutCorrection
from mcore_rl.algos.aggregation import GlobalCounts, aggregate, sequence_lengths
from mcore_rl.algos.kl import LOG_RATIO_CLAMP, kl_estimate
from mcore_rl.algos.losses import LossInputs, PolicyLoss, build_loss
from mcore_rl.algos.losses.base import token_log_ratio

ROLLOUT_IS_MODES = (None, *get_args(RolloutCorrection))


def rollout_is_weight(x: LossInputs, algo: AlgoConfig) -> torch.Tensor:
    """Detached importance weight proximal / behaviour (`old_log_prob` / `rollout_log_prob`, each token its own)
    per token, by algo.rollout_is (docs/async-objective.md): token and sequence (the product of the sequence's token
    weights) truncated at rollout_is_cap; sequence_geomean: the geometric mean of the sequence's token weights, the
    sequence rejected (0) outside [rollout_is_low, rollout_is_high], else truncated at rollout_is_cap; icepop: each
    token rejected outside the bounds, else unchanged."""
    log_w = (x.old_log_prob - x.rollout_log_prob).detach() * x.mask
    if algo.rollout_is == "token":
        return torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=algo.rollout_is_cap)
    if algo.rollout_is == "sequence":
        seq = x.sequence_sum(log_w.sum(dim=-1)).unsqueeze(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(seq).clamp(max=algo.rollout_is_cap).expand_as(log_w)
    if algo.rollout_is == "sequence_geomean":
        w = torch.exp(x.masked_seq_mean(log_w).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = (w >= algo.rollout_is_low) & (w <= algo.rollout_is_high)
        return torch.where(keep, w.clamp(max=algo.rollout_is_cap), torch.zeros_like(w)).expand_as(log_w)
    if algo.rollout_is == "icepop":
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = (w >= algo.rollout_is_low) & (w <= algo.rollout_is_high)
        return torch.where(keep, w, torch.zeros_like(w))
    raise ValueError(f"unknown rollout_is {algo.rollout_is!r}; use one of {ROLLOUT_IS_MODES}")


def loglinear_proximal(rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """algo.proximal=loglinear: the proximal log-probs interpolated per token between the behaviour policy's (the
    engine's) and the current policy's, detached, by the token's lag d behind the update's starting weights (their
    version v; the update makes v + 1): alpha = d / (d + 1), log pi_prox ~ log pi_b + alpha (log pi_theta - log pi_b).
    Lag 0: the behaviour policy is the proximal one."""
    alpha = lag / (lag + 1.0)
    return (rollout_log_prob + alpha * (log_prob.detach() - rollout_log_prob)).detach()


def _check_inputs(x: LossInputs, algo: AlgoConfig) -> None:
    shape = x.log_prob.shape
    for name in ("old_log_prob", "advantages", "mask", "rollout_log_prob", "ref_log_prob", "entropy"):
        t = getattr(x, name)
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but log_prob has {tuple(shape)}; all must be [batch, tokens]"
            )
    if algo.rollout_is is not None and x.rollout_log_prob is None:
        raise ValueError(
            f"algo.rollout_is={algo.rollout_is!r} needs rollout_log_prob (the engine's sampled-token log-probs)"
        )
    if algo.kl_coef > 0 and x.ref_log_prob is None:
        raise ValueError(
            f"algo.kl_coef={algo.kl_coef} needs ref_log_prob (a reference-model pass); set kl_coef=0 to skip it"
        )
    if algo.entropy_coef > 0 and x.entropy is None:
        raise ValueError(
            f"algo.entropy_coef={algo.entropy_coef} needs the per-token entropy; compute it with the log-probs"
        )


def policy_loss(
    x: LossInputs, algo: AlgoConfig, counts: GlobalCounts, loss_fn: Optional[PolicyLoss] = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics, both as partial sums over GLOBAL denominators.

    `counts` from the full global batch (GlobalCounts.from_mask); `loss_fn` the PolicyLoss of algo.loss
    (built here when not given). loss = agg(w * l_pg) + kl_coef * agg(kl) - entropy_coef * agg(H) with
    agg = algo.agg_mode and w the detached rollout IS weight. Summing `loss` over micro-batches and DP ranks
    gives the mini-batch loss. Metrics are detached token means over counts.num_tokens, summable the same
    way: the loss's flags (clipfrac_upper/lower, dual_clipfrac for the clipped losses), pg_loss,
    approx_kl_old (k3 of pi_theta vs pi_old), and when inputs allow: kl_ref, entropy, is_weight_mean,
    rollout_mismatch_k3 (k3 of old vs rollout).
    """
    counts.validate()
    _check_inputs(x, algo)
    log_prob, old_log_prob = x.log_prob, x.old_log_prob
    x = replace(x, mask=x.mask.to(log_prob.dtype), advantages=x.advantages.to(log_prob.dtype))
    mask = x.mask
    seq_lens = x.seq_lens
    if seq_lens is None and x.row_sum is not None:  # rows hold parts of sequences: the whole ones' lengths
        seq_lens = x.sequence_sum(sequence_lengths(mask))

    def agg(values):
        return aggregate(values, mask, algo.agg_mode, counts, seq_lens)

    def token_mean(values):  # metrics: detached, summable over micro-batches / ranks
        return (values.detach().to(log_prob.dtype) * mask).sum() / counts.num_tokens

    terms = (loss_fn or build_loss(algo)).token_loss(x)
    pg = terms.loss
    metrics = {name: token_mean(flag) for name, flag in terms.flags.items()}
    if x.rollout_log_prob is not None:
        d = (x.rollout_log_prob - old_log_prob).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics["rollout_mismatch_k3"] = token_mean(torch.exp(-d) + d - 1.0)
    if algo.rollout_is is not None:
        w = rollout_is_weight(x, algo)
        pg = pg * w
        metrics["is_weight_mean"] = token_mean(w)
    pg_loss = agg(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    log_r = token_log_ratio(log_prob.detach(), old_log_prob)
    metrics["approx_kl_old"] = token_mean(torch.exp(log_r) - log_r - 1.0)
    if x.ref_log_prob is not None:
        kl = kl_estimate(log_prob, x.ref_log_prob, algo.kl_type)
        metrics["kl_ref"] = token_mean(kl)
        if algo.kl_coef > 0:
            loss = loss + algo.kl_coef * agg(kl)
    if x.entropy is not None:
        metrics["entropy"] = token_mean(x.entropy)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * agg(x.entropy)
    return loss, metrics
