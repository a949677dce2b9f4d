"""The actor's training loss: vocab-parallel log-probs of the sampled tokens, then `policy_loss`.

`make_policy_loss_fn` builds the `loss_fn(logits_shard, micro_batch) -> (loss, metrics)` that
`Actor.train_step` calls on the last pipeline stage; `make_log_prob_fn` builds the `post_fn` for
`Actor.forward_only` (old / reference log-probs). Both take the tensor-parallel process group
explicitly (Megatron's: `parallel_state.get_tensor_model_parallel_group()`).

Per-token tensors travel in `MicroBatch.extras` (build them with `policy_extras`) and are aligned
with the logits, Megatron's label convention: position t holds quantities of token t + 1, the
token predicted from the prefix up to t; so `loss_mask[:, -1]` is always 0. The loss and the
metrics are this micro-batch's partial sums over GLOBAL counts (see `mcore_rl.algos.aggregation`):
Actor.train_step sums them over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mcore_rl.algos import GlobalCounts, policy_loss, validate_algo
from mcore_rl.config import AlgoConfig
from mcore_rl.megatron.logprobs import vocab_parallel_log_probs

REQUIRED_KEYS = ("loss_mask", "old_log_prob", "advantages")
OPTIONAL_KEYS = ("rollout_log_prob", "ref_log_prob")


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """targets[:, t] = tokens[:, t + 1]; the last column has no next token (a placeholder that must be masked)."""
    return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)


def token_log_probs(
    logits_shard: torch.Tensor, tokens: torch.Tensor, temperature: float, tp_group, with_entropy: bool = False
):
    """Log-probs (and entropy) of each next token from vocab-parallel logits [b, s, V/tp] -> [b, s]."""
    return vocab_parallel_log_probs(
        logits_shard, next_token_targets(tokens), temperature, group=tp_group, with_entropy=with_entropy
    )


def policy_extras(
    loss_mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """The MicroBatch.extras the loss reads; all [b, s] aligned with the logits (module docstring)."""
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}")
    if bool(loss_mask[:, -1].any()):
        raise ValueError(
            "loss_mask[:, -1] is set, but the last position has no next token: shift the response mask "
            "left by one so that position t marks tokens[:, t + 1]"
        )
    extras = {
        "loss_mask": loss_mask,
        "old_log_prob": old_log_prob,
        "advantages": advantages,
        "rollout_log_prob": rollout_log_prob,
        "ref_log_prob": ref_log_prob,
    }
    for name, t in extras.items():
        if t is not None and t.shape != loss_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, loss_mask has {tuple(loss_mask.shape)}: all must be [batch, seq]"
            )
    return {k: v for k, v in extras.items() if v is not None}


def make_log_prob_fn(temperature: float, tp_group, with_entropy: bool = False) -> Callable:
    """post_fn(logits_shard, micro_batch) -> next-token log-probs [b, s] (or [2, b, s] with entropy)."""

    def post_fn(logits_shard, mb):
        log_prob, entropy = token_log_probs(logits_shard, mb.tokens, temperature, tp_group, with_entropy)
        return torch.stack([log_prob, entropy]) if with_entropy else log_prob

    return post_fn


def make_policy_loss_fn(algo: AlgoConfig, counts: GlobalCounts, tp_group) -> Callable:
    """loss_fn(logits_shard, micro_batch) -> (loss, metrics) for Actor.train_step.

    `counts` must come from the full global mini-batch mask (GlobalCounts.from_mask) before it is
    split over data-parallel ranks and micro-batches.
    """
    validate_algo(algo)
    counts.validate()

    def loss_fn(logits_shard, mb):
        missing = [k for k in REQUIRED_KEYS if k not in mb.extras]
        if missing:
            raise KeyError(f"micro-batch extras lack {missing}; build them with policy_extras(...)")
        ex = {k: (v.float() if k != "loss_mask" else v) for k, v in mb.extras.items()}
        log_prob, entropy = token_log_probs(
            logits_shard, mb.tokens, algo.temperature, tp_group, with_entropy=algo.entropy_coef > 0
        )
        return policy_loss(
            log_prob,
            ex["old_log_prob"],
            ex["advantages"],
            ex["loss_mask"].float(),
            algo,
            counts,
            rollout_log_prob=ex.get("rollout_log_prob"),
            ref_log_prob=ex.get("ref_log_prob"),
            entropy=entropy,
        )

    return loss_fn
