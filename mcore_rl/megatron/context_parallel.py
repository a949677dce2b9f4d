"""Context parallelism (actor.parallel.cp > 1): each CP rank computes its part of every sequence.

The split (`plan_shard` / `shard`), as Megatron's CP attention expects it:
  * every sequence of a micro-batch (a padded row, or a segment of a packed row) is padded to a multiple of
    2 x cp tokens and cut into 2 x cp equal chunks; CP rank r takes chunks r and 2cp-1-r (load balance under
    causal attention: an early chunk with a late one). The per-sequence padding is tokens like any other,
    outside the loss mask, after the sequence's real tokens (so causal attention keeps them away from those);
  * a trailing padding segment makes the local length a multiple of tp under sequence parallelism;
  * next-token targets (`MicroBatch.labels`) and every per-token field are taken from the unsplit row BEFORE
    the split, so the token at a chunk edge keeps its target;
  * the local micro-batch is one packed row [1, T / cp] whose segments are this rank's parts of the sequences,
    in the same order on every CP rank (row i of `segment_rows` is sequence i on every CP rank).

The model sees the split through `ContextParallelParams` (Megatron's `PackedSeqParams`, qkv_format "thd",
cu_seqlens = the padded global bounds): Megatron's RoPE then gives each local token its position inside its
sequence (megatron-core 0.12.1 and 0.16.1 both: `_apply_rotary_pos_emb_thd` cuts each sequence's padded
length / cp into the two chunks of this rank, positions 0..L-1 per sequence). The local layer spec's attention
(`mcore_rl/models/segment_attention.py`) all-gathers K / V over the CP group (its backward sums the K / V
gradients of all CP ranks and keeps this rank's part) and attends per sequence with a causal mask by the
tokens' positions in their sequence (`attention_index` here says which).

Outputs of forward-only passes are all-gathered over CP and put back into the unsplit alignment
(`unshard`). Loss terms that reduce over a sequence's tokens (GSPO's sequence ratio, sequence-level rollout
IS, per-sequence token means) sum their per-row partial sums over the CP group (`row_sum`): see
mcore_rl/megatron/policy_loss.py and docs/context-parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_rl.batch import TOKEN_FIELDS, MicroBatch
from mcore_rl.models.segment_attention import AttentionIndex
from mcore_rl.preflight.context_parallel import padded_length

# per-token fields of a MicroBatch taken along with the tokens (routes: [b, s, layers, k])
_TOKEN_FIELDS = (*TOKEN_FIELDS, "routed_experts")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ShardPlan:
    """Where every local token of every CP rank comes from, for one micro-batch.

    shape: the unsplit micro-batch's [b, s]; padded: the global padded length of each segment (the
    sequences, then possibly a trailing padding segment); index: [cp, T_local] flat index into the unsplit
    [b * s] tokens, -1 for inserted padding; positions: [cp, T_local] each token's position in its sequence.
    """

    cp: int
    rank: int
    shape: tuple[int, int]
    padded: list[int]
    index: torch.Tensor
    positions: torch.Tensor

    @property
    def local_lengths(self) -> list[int]:
        return [n // self.cp for n in self.padded]

    @property
    def local_tokens(self) -> int:
        return sum(self.padded) // self.cp


def _segments(mb: MicroBatch) -> tuple[list[int], list[int]]:
    """(start in the flat unsplit row(s), real length) of each sequence."""
    b, s = mb.tokens.shape
    if not mb.packed:
        return [i * s for i in range(b)], [s] * b
    lengths = list(mb.seq_lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return starts, lengths


def rank_positions(padded: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (inside a sequence of `padded` tokens) that CP rank `rank` holds: chunks rank and 2cp-1-rank."""
    chunk = padded // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def plan_shard(mb: MicroBatch, cp: int, rank: int, local_multiple: int = 1) -> ShardPlan:
    """The split of micro-batch `mb` over `cp` ranks (module docstring); `local_multiple`: the local row length
    must be a multiple of it (tp under sequence parallelism)."""
    starts, lengths = _segments(mb)
    padded = [padded_length(n, cp) for n in lengths]  # the pre-flight's rule, so `mcore-rl check` says the same
    total = sum(padded)
    extra = _round_up(total, 2 * cp * local_multiple) - total
    if extra:
        padded.append(extra)
        starts.append(0)
        lengths.append(0)  # nothing real in the trailing padding segment
    index, positions = [], []
    for r in range(cp):
        idx, pos = [], []
        for start, n, length in zip(starts, lengths, padded):
            p = rank_positions(length, cp, r)
            idx.append(torch.where(p < n, start + p, torch.full_like(p, -1)))
            pos.append(p)
        index.append(torch.cat(idx))
        positions.append(torch.cat(pos))
    return ShardPlan(cp, rank, tuple(mb.tokens.shape), padded, torch.stack(index), torch.stack(positions))


def _take(values: torch.Tensor, index: torch.Tensor, fill=0) -> torch.Tensor:
    """values [b, s, ...] -> [1, T_local, ...] at flat `index` (-1: `fill`)."""
    flat = values.reshape(-1, *values.shape[2:])
    inside = index >= 0
    picked = flat[index.clamp(min=0).to(flat.device)]
    keep = inside.to(flat.device).view(-1, *([1] * (flat.dim() - 1)))
    if fill is None:  # routes: a real token's (distinct) experts stand in for padding; route_valid masks them
        return picked.unsqueeze(0)
    return torch.where(keep, picked, torch.full_like(picked, fill)).unsqueeze(0)


def take_local(values: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """A per-token field [b, s, ...] -> this CP rank's part [1, T_local, ...] (zeros / False on inserted padding;
    routes: a real token's experts there, so every padding token still has k distinct experts)."""
    return _take(values, plan.index[plan.rank], None if values.dim() > 2 else 0)


def shard(mb: MicroBatch, plan: ShardPlan) -> MicroBatch:
    """This CP rank's micro-batch: one packed row of its parts of the sequences, targets taken before the split."""
    index = plan.index[plan.rank]
    labels = mb.targets()
    fields: dict[str, Any] = {}
    for name in _TOKEN_FIELDS:
        value = getattr(mb, name)
        if value is not None:
            fields[name] = take_local(value, plan)
    device = mb.tokens.device
    return MicroBatch(
        tokens=_take(mb.tokens, index),
        labels=_take(labels, index),
        position_ids=plan.positions[plan.rank].unsqueeze(0).to(device),
        seq_lengths=plan.local_lengths,
        **fields,
    )


def unshard(local: torch.Tensor, plan: ShardPlan, group) -> torch.Tensor:
    """A forward-only output [..., 1, T_local] of every CP rank -> [..., b, s] in the unsplit alignment
    (collective over the CP group; inserted padding dropped)."""
    parts = [torch.empty_like(local) for _ in range(plan.cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    b, s = plan.shape
    lead = local.shape[:-2]
    out = torch.zeros(*lead, b * s, dtype=local.dtype, device=local.device)
    for part, index in zip(parts, plan.index):
        inside = index >= 0
        out[..., index[inside].to(local.device)] = part[..., 0, inside.to(local.device)]
    return out.view(*lead, b, s)


# ---- sums over a sequence's parts, attention layout ------------------------------------------------


class _RowSum(torch.autograd.Function):
    """All-reduce (sum) over the CP group; backward: the same (each rank's loss used the total)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def row_sum(values: torch.Tensor, group) -> torch.Tensor:
    """Per-row partial sums of this CP rank -> the sums over the whole sequence (every CP rank's part),
    differentiable; no-op without a CP group."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    return _RowSum.apply(values, group)


def attention_index(plan: ShardPlan) -> AttentionIndex:
    """The per-sequence attention layout of `plan` (the same on every CP rank but for the queries)."""
    cp, local = plan.cp, plan.local_tokens
    n, q_len, k_len = len(plan.padded), max(plan.local_lengths), max(plan.padded)
    query = torch.zeros(n, q_len, dtype=torch.long)
    query_pos = torch.zeros(n, q_len, dtype=torch.long)
    query_valid = torch.zeros(n, q_len, dtype=torch.bool)
    key = torch.zeros(n, k_len, dtype=torch.long)
    key_valid = torch.zeros(n, k_len, dtype=torch.bool)
    start = 0
    for i, length in enumerate(plan.padded):
        part = length // cp
        query[i, :part] = torch.arange(start, start + part)
        query_pos[i, :part] = rank_positions(length, cp, plan.rank)
        query_valid[i, :part] = True
        for r in range(cp):  # rank r's part of sequence i, at rank r's offset in the gathered tokens
            key[i, rank_positions(length, cp, r)] = torch.arange(r * local + start, r * local + start + part)
        key_valid[i, :length] = True
        start += part
    key_pos = torch.arange(k_len).expand(n, k_len)
    return AttentionIndex(query, query_pos, query_valid, key, key_pos, key_valid)


@dataclass
class ContextParallelParams(PackedSeqParams):
    """Megatron's THD params plus the CP group and the per-sequence attention layout of this rank's tokens."""

    cp_group: Any = None
    cp_index: Optional[AttentionIndex] = None


def packed_params(plan: ShardPlan, group, device) -> Any:
    """Megatron's THD params for a CP-split micro-batch (global padded bounds: what its RoPE reads) plus what
    the local spec's attention needs (`ContextParallelParams`)."""
    bounds = torch.zeros(len(plan.padded) + 1, dtype=torch.int32)
    bounds[1:] = torch.tensor(plan.padded, dtype=torch.int32).cumsum(0)
    bounds = bounds.to(device)
    longest = max(plan.padded)
    return ContextParallelParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        cu_seqlens_q_padded=bounds,
        cu_seqlens_kv_padded=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=group,
        cp_index=attention_index(plan),
    )
