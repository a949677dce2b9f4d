"""What every policy loss reads (`LossInputs`), gives (`TokenLoss`) and is (`PolicyLoss`), and `build_loss`.

Tensors are [batch, tokens] over response tokens; `mask` is 1 on valid tokens. Each row holds one
sequence (a sequence never spans micro-batches), so per-sequence quantities such as GSPO's
length-normalised ratio use only the row's own tokens - unless the row holds only part of its sequence
(context parallelism): then `LossInputs.sequence_sum` adds each per-row sum over the ranks holding the other parts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mcore_rl.algo_config import AlgoConfig, loss_target
from mcore_rl.algos.aggregation import sequence_lengths
from mcore_rl.algos.kl import LOG_RATIO_CLAMP

RowSum = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token inputs of the loss, all [batch, tokens] (advantages broadcast per token).

    log_prob: the current policy's, differentiable; old_log_prob: the policy that the ratio is taken against;
    mask: 1 on valid response tokens; seq_lens: valid tokens per row, only when a row holds part of its
    sequence; rollout_log_prob: the engine's (algo.rollout_is); ref_log_prob: the reference model's
    (algo.kl_coef > 0); entropy: per-token entropy (differentiable with algo.entropy_coef > 0); row_sum: when
    rows hold parts of sequences whose other parts are on other ranks (context parallel), sums a per-row [batch]
    tensor over them, differentiably (mcore_rl.megatron.context_parallel.row_sum)."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_lens: Optional[torch.Tensor] = None
    rollout_log_prob: Optional[torch.Tensor] = None
    ref_log_prob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    row_sum: Optional[RowSum] = None

    def sequence_sum(self, per_row: torch.Tensor) -> torch.Tensor:
        """A per-row [batch] sum over each row's whole sequence (all its parts under context parallelism)."""
        return per_row if self.row_sum is None else self.row_sum(per_row)

    def masked_seq_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence mean of `values` over its valid tokens, [batch, 1]; all-masked rows give 0."""
        n = self.sequence_sum(sequence_lengths(self.mask)).to(values.dtype).clamp(min=1)
        return (self.sequence_sum((values * self.mask).sum(dim=-1)) / n).unsqueeze(-1)

    def sequence_log_ratio(self) -> torch.Tensor:
        """log s_i = (1/n_i) sum_t m d_{i,t}: GSPO's length-normalised sequence log-ratio, [batch, 1]."""
        log_ratio = self.masked_seq_mean(self.log_prob - self.old_log_prob.detach())
        return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dataclass(frozen=True)
class TokenLoss:
    """A loss's per-token values [batch, tokens] and its per-token flags (bool or float, same shape), each
    logged as a token mean under its name (e.g. clipfrac_upper)."""

    loss: torch.Tensor
    flags: dict[str, torch.Tensor] = field(default_factory=dict)


class PolicyLoss:
    """One policy-gradient loss. A subclass reads its options from `self.algo` and implements `token_loss`;
    `mcore_rl.algos.objective.policy_loss` applies the rollout importance weight, the aggregation, KL and
    entropy around it. Register it in `mcore_rl.algo_config.LOSSES` (or name it as algo.loss='module:Class')."""

    def __init__(self, algo: AlgoConfig):
        self.algo = algo

    def token_loss(self, x: LossInputs) -> TokenLoss:
        raise NotImplementedError(f"{type(self).__name__} must implement token_loss")


def build_loss(algo: AlgoConfig) -> PolicyLoss:
    """The PolicyLoss named by algo.loss (a registered name or 'module:Class'), built with `algo`."""
    module_name, _, class_name = loss_target(algo.loss).partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"algo.loss = {algo.loss!r}: cannot load {class_name!r} from {module_name!r} ({type(e).__name__}: {e}); "
            f"check the module is on PYTHONPATH"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        raise ValueError(f"algo.loss = {algo.loss!r} is not a subclass of mcore_rl.algos.losses.PolicyLoss")
    return cls(algo)


def token_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
