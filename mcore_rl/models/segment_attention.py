"""Attention of a packed row one segment at a time, for the local (non-Transformer-Engine) layer spec
(CPU, and CUDA without Transformer Engine).

A packed micro-batch is one row of T tokens holding several sequences (segments). Transformer Engine and
MindSpeed attend within each segment with variable-length flash attention ("thd", `mcore_rl/megatron/attention_inputs.py`);
Megatron's local `DotProductAttention` has no such path, and a block-diagonal [T, T] mask scores every pair of
the row and throws most of them away: with 64 sequences of ~40 tokens in a 2,500-token row that is ~60x the
work, and the reason larger token budgets ran slower on CPU than small ones.

`SegmentDotProductAttention` is Megatron's `DotProductAttention` plus one case: when `attention_mask` is the
row's segment bounds (int32 [n + 1], `packing.cu_seqlens`) instead of a boolean mask, it gathers the segments
into a right-padded [n, L] batch, runs causal attention on it and scatters the real positions back. Causality
alone keeps the padding out: a segment's pads sit after all its real tokens, so no real query reaches them,
and the pads' own outputs are dropped. RoPE has already been applied along the row (positions 0..T-1); it is
relative, so a segment's scores equal those at positions 0..len-1 up to rounding. Any other mask (padded
micro-batches, None) goes to Megatron's own forward unchanged.

Megatron's `PackedSeqParams` (qkv_format "thd") reaching this class - the TE-style call - takes the same segment
path from its cu_seqlens instead of Megatron's assert (`DotProductAttention` refuses packed_seq_params): Megatron's
attention has then squeezed the batch dimension ([T, heads, d]) and RoPE has restarted at every segment. The
actor passes bounds, not params, with this spec (`Platform.packed_attention`); this keeps any other caller working.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention


def is_segment_bounds(attention_mask) -> bool:
    """True when `attention_mask` carries a packed row's segment bounds rather than a mask."""
    return (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int32 and attention_mask.dim() == 1
    )


def segment_index(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n, L] into the row, valid [n, L] bool) for segments [bounds[i], bounds[i+1]); L = longest."""
    starts = bounds[:-1].long()
    lengths = bounds[1:].long() - starts
    offsets = torch.arange(int(lengths.max()), device=bounds.device)
    valid = offsets[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)
    return index, valid


def segment_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float, dropout: float
) -> torch.Tensor:
    """Causal attention within each segment of one packed row.

    query [T, 1, heads, d], key / value [T, 1, groups, d] (Megatron's [s, b, np, hn]); returns [T, 1, heads * d]."""
    tokens, batch, heads, dim = query.shape
    if batch != 1:
        raise ValueError(
            f"a packed micro-batch is one row, got a batch of {batch}: pack with split_for_rank(max_tokens=...)"
        )
    if int(bounds[-1]) != tokens:
        raise ValueError(f"segment bounds end at {int(bounds[-1])} but the row has {tokens} tokens")
    index, valid = segment_index(bounds)
    groups = key.shape[2]

    def segments(x: torch.Tensor, repeat: int) -> torch.Tensor:  # [T, 1, g, d] -> [n, heads, L, d]
        x = x[:, 0][index].transpose(1, 2)
        return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

    q = segments(query, 1)
    k = segments(key, heads // groups)
    v = segments(value, heads // groups)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    return out.transpose(1, 2)[valid].reshape(tokens, 1, heads * dim)


# ---- attention across context-parallel ranks (mcore_rl/megatron/context_parallel.py splits the sequences)


@dataclass(frozen=True)
class AttentionIndex:
    """Per sequence (row n): its local queries and all of its keys in the gathered K / V.

    query [n, Lq] index into the local tokens, query_pos [n, Lq] their positions, query_valid [n, Lq];
    key [n, Lk] index into the gathered [cp * T_local] tokens, key_pos [n, Lk], key_valid [n, Lk]."""

    query: torch.Tensor
    query_pos: torch.Tensor
    query_valid: torch.Tensor
    key: torch.Tensor
    key_pos: torch.Tensor
    key_valid: torch.Tensor

    def to(self, device) -> "AttentionIndex":
        return AttentionIndex(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward: the gradients of every rank summed, this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries used this rank's keys / values
        return grad.chunk(dist.get_world_size(ctx.group), dim=0)[dist.get_rank(ctx.group)], None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[T_local, ...] of every CP rank -> [cp * T_local, ...] in rank order, differentiable."""
    return _GatherSequence.apply(x, group)


def cp_causal_attention(query, key, value, index: AttentionIndex, group, scale: float, dropout: float):
    """Causal attention of this rank's queries [T_local, heads, d] over its sequences' keys / values on every CP
    rank (key / value [T_local, groups, d], all-gathered here); returns [T_local, 1, heads * d]."""
    tokens, heads, dim = query.shape
    groups = key.shape[1]
    index = index.to(query.device)
    keys = gather_sequence(key, group)
    values = gather_sequence(value, group)

    def rows(x, at, repeat):  # [T, g, d] -> [n, heads, L, d]
        x = x[at].transpose(1, 2)
        return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

    q = rows(query, index.query, 1)
    k = rows(keys, index.key, heads // groups)
    v = rows(values, index.key, heads // groups)
    allowed = (index.key_pos[:, None, :] <= index.query_pos[:, :, None]) & index.key_valid[:, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], dropout_p=dropout, scale=scale
    )
    return out.transpose(1, 2)[index.query_valid].reshape(tokens, 1, heads * dim)


class SegmentDotProductAttention(DotProductAttention):
    """Megatron's local attention, plus packed rows described by their segment bounds (module docstring), plus
    context parallelism (`ContextParallelParams`: K / V gathered over the CP group, mcore_rl/megatron/context_parallel.py)."""

    def __init__(self, config, *args, **kwargs):
        # Megatron's DotProductAttention asserts context_parallel_size == 1; this class attends across CP
        # ranks itself (only for ContextParallelParams, and refuses any other input when cp > 1)
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, *args, **kwargs)
        self.config = config

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if getattr(packed_seq_params, "cp_group", None) is not None:
            return self._context_parallel_forward(query, key, value, packed_seq_params)
        if self.config.context_parallel_size > 1:
            raise ValueError(
                "context parallel attention on the local spec needs the actor's CP split (ContextParallelParams, "
                "mcore_rl/megatron/context_parallel.py); call the model through mcore_rl.megatron.actor.Actor"
            )
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, packed_seq_params)
        if not is_segment_bounds(attention_mask):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        return self._segment_forward(query, key, value, attention_mask)

    def _packed_forward(self, query, key, value, params):
        """Megatron's THD call: [T, heads, d] tensors, bounds in params.cu_seqlens_q (no padded layout)."""
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params with qkv_format {params.qkv_format!r}: only 'thd' is supported here")
        padded = getattr(params, "cu_seqlens_q_padded", None)
        if padded is not None and not torch.equal(padded, params.cu_seqlens_q):
            raise ValueError(
                "packed rows with padded cu_seqlens need Transformer Engine; pack without per-segment padding"
            )
        if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = params.cu_seqlens_q.to(torch.int32)
        unsqueezed = [x.unsqueeze(1) if x.dim() == 3 else x for x in (query, key, value)]
        return self._segment_forward(*unsqueezed, bounds)

    def _context_parallel_forward(self, query, key, value, params):
        """This rank's queries over the keys / values of every CP rank, per sequence, causal by position."""
        self._check_plain_softmax()
        squeezed = [x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value)]  # [T_local, heads, d]
        scale, dropout = self._scale_and_dropout()
        return cp_causal_attention(*squeezed, params.cp_index, params.cp_group, scale, dropout)

    def _scale_and_dropout(self) -> tuple[float, float]:
        # under query-key layer scaling Megatron divides the scale by the layer number and its softmax multiplies it back
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        return scale, (self.attention_dropout.p if self.training else 0.0)

    def _check_plain_softmax(self) -> None:
        if getattr(self.config, "window_size", None) is not None:
            raise ValueError(
                "packed micro-batches on the local attention do not support sliding windows: unset window_size"
            )
        if getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"packed micro-batches on the local attention need softmax_type 'vanilla', not {self.config.softmax_type!r}"
            )

    def _segment_forward(self, query, key, value, bounds):
        self._check_plain_softmax()
        scale, dropout = self._scale_and_dropout()
        return segment_causal_attention(query, key, value, bounds, scale, dropout)
