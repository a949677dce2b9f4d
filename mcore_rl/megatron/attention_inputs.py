"""Model inputs of a packed micro-batch (`MicroBatch.seq_lengths`): attention confined to each segment.

Two implementations, chosen by `Platform.packed_attention`:
  "thd"  - Megatron's packed-sequence path: `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`
           passed to `GPTModel.forward(..., packed_seq_params=...)`. Transformer Engine's (and MindSpeed's)
           attention then runs variable-length flash attention over the segments, and RoPE restarts at
           every cu_seqlens boundary (`RotaryEmbedding.get_rotary_seq_len` takes max_seqlen from the params).
           Needs the Transformer Engine layer spec (Megatron's local DotProductAttention asserts on the params).
  "thd-ends" - NPU: the same params with cu_seqlens in the convention of MindSpeed's fused attention (end offsets
           without the leading 0) and Megatron's bounds as cu_seqlens_*_padded, which Megatron's RoPE reads.
  "segments" - the row's segment bounds (cu_seqlens, int32 [n + 1]) passed where the attention mask goes;
           the local layer spec's (CPU, CUDA without TE) `SegmentDotProductAttention` (`mcore_rl/models/segment_attention.py`)
           attends within each segment as a right-padded batch of segments. Outside the THD path Megatron's
           RoPE uses positions 0..T-1 of the row and ignores position_ids; RoPE is relative (a query-key score
           depends on the position difference only), so inside a segment the result equals the unpacked one up
           to rounding. Work grows with the sum of the segments' squared lengths, not the row's.

Every segment, the trailing padding one included, attends only to itself, so pads never reach real tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mcore_rl.platform import npu_actual_seq_len


def cu_seqlens(seq_lengths: list[int], device) -> torch.Tensor:
    """[n + 1] int32 cumulative segment boundaries, starting at 0."""
    bounds = torch.zeros(len(seq_lengths) + 1, dtype=torch.int32)
    bounds[1:] = torch.tensor(seq_lengths, dtype=torch.int32).cumsum(0)
    return bounds.to(device)


def packed_seq_params(seq_lengths: list[int], device, ends_only: bool = False) -> Any:
    """Megatron's THD params; `ends_only` (mode "thd-ends", NPU): cu_seqlens as the fused attention's end offsets
    (`mcore_rl.platform.npu_actual_seq_len`) and Megatron's bounds, which its RoPE reads, as the padded ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = cu_seqlens(seq_lengths, device)
    longest = max(seq_lengths)
    if not ends_only:
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest, max_seqlen_kv=longest
        )
    ends = npu_actual_seq_len(bounds)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=ends,
        cu_seqlens_kv=ends,
        cu_seqlens_q_padded=bounds,
        cu_seqlens_kv_padded=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def model_inputs(mb, mode: str) -> tuple[Optional[torch.Tensor], dict]:
    """(attention_mask, extra forward kwargs) for micro-batch `mb` (already on its device)."""
    if not mb.packed:
        return mb.attention_mask, {}
    if mode == "segments":
        return cu_seqlens(mb.seq_lengths, mb.tokens.device), {}
    if mode in ("thd", "thd-ends"):
        params = packed_seq_params(mb.seq_lengths, mb.tokens.device, ends_only=mode == "thd-ends")
        return None, {"packed_seq_params": params}
    raise ValueError(f"packed attention mode {mode!r} unknown: 'thd', 'thd-ends' or 'segments'")
