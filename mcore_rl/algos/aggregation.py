"""Aggregation of per-token losses over the GLOBAL mini-batch.

Every mode returns this micro-batch's partial sum divided by global denominators, so summing the
results over micro-batches and data-parallel ranks gives the loss of the whole mini-batch, whatever
the split. The denominators come from `GlobalCounts`, computed once from the full, unsplit masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from mcore_rl.algo_config import AggMode

AGG_MODES = get_args(AggMode)


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of the global mini-batch (all micro-batches, all data-parallel ranks).

    num_tokens: valid response tokens N; num_seqs: sequences with at least one valid token |B|;
    max_len: longest response length L_max (for seq-mean-token-sum-norm, Dr.GRPO).
    """

    num_tokens: int
    num_seqs: int
    max_len: int

    @classmethod
    def from_mask(cls, mask: torch.Tensor, max_len: int | None = None) -> "GlobalCounts":
        """Counts from the full global [batch, tokens] response mask, before it is split.

        max_len defaults to the mask's width; pass the configured generation length to keep the
        Dr.GRPO denominator constant across steps.
        """
        if mask.dim() != 2:
            raise ValueError(f"mask must be [batch, tokens], got shape {tuple(mask.shape)}")
        lengths = [int(n) for n in mask.sum(dim=-1).tolist()]
        return cls.from_lengths(lengths, mask.shape[-1] if max_len is None else max_len)

    @classmethod
    def from_lengths(cls, loss_tokens: list[int], max_len: int) -> "GlobalCounts":
        """Counts from the valid response tokens of each sequence of the mini-batch (the row sums of its
        mask): what a rank that holds only its own share of the sequences computes from the step's lengths."""
        return cls(
            num_tokens=int(sum(loss_tokens)),
            num_seqs=sum(1 for n in loss_tokens if n > 0),
            max_len=int(max_len),
        )

    def validate(self) -> None:
        if self.num_tokens <= 0 or self.num_seqs <= 0 or self.max_len <= 0:
            raise ValueError(
                f"global counts must be positive, got {self}; the mini-batch has no valid response "
                f"tokens - check the response mask"
            )


def sequence_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Valid tokens per row; a sequence never spans micro-batches, so this is its full length."""
    return mask.sum(dim=-1)


def aggregate(
    token_values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    counts: GlobalCounts,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partial sum of masked [batch, tokens] values over global denominators (see module docstring).

    seq_lens: per-row valid-token counts n_i; defaults to mask row sums. Pass them explicitly when a
    row holds only part of its sequence (context parallel).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; use one of {AGG_MODES}")
    masked = token_values * mask
    if mode == "token-mean":
        return masked.sum() / counts.num_tokens
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        n = sequence_lengths(mask) if seq_lens is None else seq_lens
        # all-masked rows contribute 0; clamp avoids 0/0
        per_seq = per_seq / n.to(per_seq.dtype).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / counts.max_len
    return per_seq.sum() / counts.num_seqs
