"""How Megatron cuts a full tensor into tensor-parallel shards, and where each shard sits in the full tensor.

A TP-split parameter is cut along its partition dim into equal parts, except the gated fc1 (``[gate; up]``),
whose rank r holds ``[gate_r; up_r]``. Loading cuts (`split_shards`); exporting gathers each rank's shard
straight into its place in the merged tensor (`shard_views`, `as_shard_view`).
"""

from __future__ import annotations

import torch


def split_shards(canonical: str, full: torch.Tensor, parts: int, partition_dim: int, gated: bool) -> list[torch.Tensor]:
    if parts == 1 or partition_dim < 0:
        return [full] * parts
    if gated and "linear_fc1.weight" in canonical:  # [gate; up] -> per rank [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(parts), up.chunk(parts))]
    return list(full.chunk(parts, dim=partition_dim))


def shard_views(canonical: str, full: torch.Tensor, parts: int, partition_dim: int, gated: bool) -> list[torch.Tensor]:
    """Views of `full` where each rank's shard (as `_split` cuts it) belongs; a gathered shard is copied in place."""
    if gated and "linear_fc1.weight" in canonical:  # rank r holds [gate_r; up_r] -> view (2, rows_r, ...) of [gate; up]
        halves = full.view(2, parts, full.shape[0] // (2 * parts), *full.shape[1:])
        return [halves[:, r] for r in range(parts)]
    return list(full.chunk(parts, dim=partition_dim))


def as_shard_view(canonical: str, shard: torch.Tensor, gated: bool) -> torch.Tensor:
    """`shard` in the shape of its `_shard_views` destination (gated fc1: [gate_r; up_r] as (2, rows_r, ...))."""
    if gated and "linear_fc1.weight" in canonical:
        return shard.view(2, shard.shape[0] // 2, *shard.shape[1:])
    return shard


def merge_shards(canonical: str, shards: list[torch.Tensor], partition_dim: int, gated: bool) -> torch.Tensor:
    if len(shards) == 1 or partition_dim < 0:
        return shards[0]
    full = shards[0].new_empty(merged_shape(shards[0], len(shards), partition_dim))
    for view, shard in zip(shard_views(canonical, full, len(shards), partition_dim, gated), shards):
        view.copy_(as_shard_view(canonical, shard, gated))
    return full


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def merged_shape(shard: torch.Tensor, parts: int, partition_dim: int) -> tuple[int, ...]:
    shape = list(shard.shape)
    shape[partition_dim] *= parts
    return tuple(shape)
