"""Model inputs of a packed micro-batch (`MicroBatch.seq_lengths`): attention confined to each segment.

Two implementations, chosen by `Platform.packed_attention`:
  "thd"  - Megatron's packed-sequence path: `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`
           passed to `GPTModel.forward(..., packed_seq_params=...)`. Transformer Engine's (and MindSpeed's)
           attention then runs variable-length flash attention over the segments, and RoPE restarts at
           every cu_seqlens boundary (`RotaryEmbedding.get_rotary_seq_len` takes max_seqlen from the params).
           Needs the Transformer Engine layer spec (Megatron's local DotProductAttention asserts on the params).
  "segments" - the row's segment bounds (cu_seqlens, int32 [n + 1]) passed where the attention mask goes;
           the local layer spec's (CPU, CUDA without TE) `SegmentDotProductAttention` (`mcore_rl/megatron/segment_attention.py`)
           attends within each segment as a right-padded batch of segments. Outside the THD path Megatron's
           RoPE uses positions 0..T-1 of the row and ignores position_ids; RoPE is relative (a query-key score
           depends on the position difference only), so inside a segment the result equals the unpacked one up
           to rounding. Work grows with the sum of the segments' squared lengths, not the row's.

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
    if mode == "segments":
        return cu_seqlens(mb.seq_lengths, mb.tokens.device), {}
    if mode == "thd":
        return None, {"packed_seq_params": packed_seq_params(mb.seq_lengths, mb.tokens.device)}
    raise ValueError(f"packed attention mode {mode!r} unknown: 'thd' or 'segments'")
