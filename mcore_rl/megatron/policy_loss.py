"""The actor's training loss: vocab-parallel log-probs of the sampled tokens, then `policy_loss`.

`make_policy_loss_fn` builds the `loss_fn(head, micro_batch) -> (loss, metrics)` that
`Actor.train_step` calls on the last pipeline stage; `make_log_prob_fn` builds the `post_fn` for
`Actor.forward_only` (old / reference log-probs). `head` is an `OutputHead` (last hidden states + this
rank's output-weight shard): the log-probs come from `fused_output_log_probs`, so no [tokens, V/tp]
logits tensor exists. Both take the tensor-parallel process group explicitly (`Layout.groups.tp`).

Per-token tensors are the typed fields of `mcore_rl.batch.MicroBatch`, aligned with the hidden states by
Megatron's label convention (position t holds quantities of token t + 1). The loss and the metrics are
this micro-batch's partial sums over GLOBAL counts (see `mcore_rl.algos.aggregation`):
Actor.train_step sums them over micro-batches and data-parallel ranks. The algorithm settings are
validated once, when the config is loaded (`mcore_rl.config.validate_config`).
"""

from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.algos import GlobalCounts, LossInputs, build_loss, loglinear_proximal, policy_loss
from mcore_rl.batch import MicroBatch, next_token_targets, segment_rows
from mcore_rl.config import AlgoConfig
from mcore_rl.megatron.context_parallel import row_sum as cp_row_sum
from mcore_rl.megatron.logprobs import OutputHead


def next_token_log_probs(
    head: OutputHead, tokens: torch.Tensor, temperature: float, tp_group, with_entropy: bool = False, targets=None
):
    """Log-probs (and entropy) of each next token [b, s], from the last hidden states and the output weight;
    `targets` (`MicroBatch.targets()`): the next tokens when they are not the row's own shifted tokens (CP)."""
    targets = next_token_targets(tokens) if targets is None else targets
    return head.log_probs(targets, temperature, tp_group, with_entropy)


def make_log_prob_fn(temperature: float, tp_group, with_entropy: bool = False) -> Callable:
    """post_fn(head, micro_batch) -> next-token log-probs [b, s] (or [2, b, s] with entropy)."""

    def post_fn(head: OutputHead, mb: MicroBatch):
        log_prob, entropy = next_token_log_probs(head, mb.tokens, temperature, tp_group, with_entropy, mb.targets())
        return torch.stack([log_prob, entropy]) if with_entropy else log_prob

    return post_fn


def make_policy_loss_fn(algo: AlgoConfig, counts: GlobalCounts, tp_group, on_policy: bool = False) -> Callable:
    """loss_fn(head, micro_batch) -> (loss, metrics) for Actor.train_step (`head`: an OutputHead).

    `counts` must come from the full global mini-batch mask (GlobalCounts.from_mask) before it is
    split over data-parallel ranks and micro-batches. Micro-batches need loss_mask, old_log_prob and
    advantages (rollout_log_prob with algo.rollout_is, ref_log_prob with algo.kl_coef > 0).
    `on_policy` (AlgoConfig.old_from_update): old_log_prob is not read; the log-probs of this forward,
    detached, take its place (ratio exactly 1), and the entropy is always computed (the metric the
    skipped old-policy pass would have given). algo.proximal=loglinear (off-policy): neither; the proximal
    log-probs are interpolated from rollout_log_prob, this forward's and each token's `version_lag`.
    """
    counts.validate()
    loglinear = algo.proximal == "loglinear" and not on_policy
    with_entropy = algo.entropy_coef > 0 or on_policy or loglinear
    loss = build_loss(algo)  # the PolicyLoss of algo.loss, once per update

    def loss_fn(head: OutputHead, mb: MicroBatch):
        log_prob, entropy = next_token_log_probs(
            head, mb.tokens, algo.temperature, tp_group, with_entropy, mb.targets()
        )
        if entropy is not None and algo.entropy_coef == 0:
            entropy = entropy.detach()  # a metric only: no backward through it
        if on_policy:
            old = log_prob.detach()
        elif loglinear:
            mb.require("rollout_log_prob", "version_lag")
            old = loglinear_proximal(mb.rollout_log_prob.float(), log_prob, mb.version_lag.float())
        else:
            old = mb.old_log_prob.float()
        # packed: one row per sequence, so per-sequence reductions see the same rows as the padded layout
        rows = (lambda t: segment_rows(t, mb.seq_lengths)) if mb.packed else (lambda t: t)
        optional = lambda t: None if t is None else rows(t.float())
        # context parallel: a row holds this rank's part of its sequence; per-sequence sums add every part
        group = head.cp_group
        inputs = LossInputs(
            rows(log_prob),
            rows(old),
            rows(mb.advantages.float()),
            rows(mb.loss_mask.float()),
            rollout_log_prob=optional(mb.rollout_log_prob),
            ref_log_prob=optional(mb.ref_log_prob),
            entropy=optional(entropy),
            row_sum=None if group is None else lambda t: cp_row_sum(t, group),
        )
        return policy_loss(inputs, algo, counts, loss)

    return loss_fn
