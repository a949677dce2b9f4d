"""Model inputs of a packed micro-batch (`MicroBatch.seq_lengths`): attention confined to each segment.

Two implementations, chosen by `Platform.packed_attention`:
  "thd"  - Megatron's packed-sequence path: `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`
           passed to `GPTModel.forward(..., packed_seq_params=...)`. Transformer Engine's (and MindSpeed's)
           attention then runs variable-length flash attention over the segments, and RoPE restarts at
           every cu_seqlens boundary (`RotaryEmbedding.get_rotary_seq_len` takes max_seqlen from the params).
           Needs the Transformer Engine layer spec; it cannot run on CPU.
  "mask" - a block-diagonal causal mask [1, 1, T, T] (bool, True = masked, Megatron's convention, applied
           by `FusedScaleMaskSoftmax` with masked_fill(-10000)). Outside the THD path Megatron's RoPE uses
           positions 0..T-1 of the row and ignores position_ids; RoPE is relative (a query-key score depends
           on the position difference only), so inside a segment the result equals the unpacked one up to
           rounding. Attention scores are still computed over the whole row (T x T) and then masked.

Every segment, the trailing padding one included, attends only to itself, so pads never reach real tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def cu_seqlens(seq_lengths: list[int], device) -> torch.Tensor:
    """[n + 1] int32 cumulative segment boundaries, starting at 0."""
    bounds = torch.zeros(len(seq_lengths) + 1, dtype=torch.int32)
    bounds[1:] = torch.tensor(seq_lengths, dtype=torch.int32).cumsum(0)
    return bounds.to(device)


def block_causal_mask(seq_lengths: list[int], device) -> torch.Tensor:
    """[1, 1, T, T] bool, True where query t may NOT attend key u: u > t or u in another segment."""
    segment = torch.repeat_interleave(torch.arange(len(seq_lengths)), torch.tensor(seq_lengths)).to(device)
    pos = torch.arange(segment.numel(), device=device)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, *allowed.shape)


def packed_seq_params(seq_lengths: list[int], device) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = cu_seqlens(seq_lengths, device)
    longest = max(seq_lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def model_inputs(mb, mode: str) -> tuple[Optional[torch.Tensor], dict]:
    """(attention_mask, extra forward kwargs) for micro-batch `mb` (already on its device)."""
    if not mb.packed:
        return mb.attention_mask, {}
    if mode == "mask":
        return block_causal_mask(mb.seq_lengths, mb.tokens.device), {}
    if mode == "thd":
        return None, {"packed_seq_params": packed_seq_params(mb.seq_lengths, mb.tokens.device)}
    raise ValueError(f"packed attention mode {mode!r} unknown: 'thd' or 'mask'")
