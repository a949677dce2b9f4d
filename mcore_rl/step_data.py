"""Per-rank step data: each data-parallel rank receives only the samples it trains on.

After generation every rank holds its replica's samples and has scored its part of them
(`mcore_rl.rollout.data_parallel.LocalRollout`: each sample scored once, by one rank of the replica that
generated it). Then, on every rank:

1. `exchange_meta`: the few values of EVERY sample that the plan, the loss normalisation (`GlobalCounts`),
   group advantages and metrics need - prompt and response length, truncated, reward, validity, the shape
   of the engine's routes, whether it carries its tokens' weight versions - as tensors: a [B, 7] int64 and a [B] float32 tensor, all-reduced (summed) over
   the world. Each rank writes only the samples it scored, so each sum has exactly one non-zero term (exact).
2. `batch.plan_mini_batches` from those lengths: the same token-balanced partition over data-parallel ranks
   and micro-batches that `batch.split_for_rank` decides for the whole batch, computed identically on every
   rank (pure).
3. `exchange_samples`: tokens (int32), rollout log-probs (float32), routes (int16, R3) and token versions (int32,
   where the engine gave them) of each sample move
   as raw bytes in one `all_to_all_single`, from one rank that holds the sample to every rank that trains on it
   and does not hold it: the ranks of its data-parallel rank, i.e. that DP rank's model-parallel peers (TP, PP,
   EP inside it), which run the same micro-batches. Every rank knows every sample's size from step 1, so
   the split sizes need no extra round.
4. `local_mini_batches`: the received samples packed like the whole step (same padded width) and cut by the
   plan (`batch.build_mini_batches`): exactly the micro-batches `split_for_rank` gives for the whole batch.

Transport: CPU tensors on the default process group, whose backend serves the CPU on every platform (gloo;
`cpu:gloo,cuda:nccl` / `cpu:gloo,npu:hccl` on devices: docs/devices.md): the samples are host memory, and
no device memory is touched while the engine may still hold its KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mcore_rl.batch import (
    MiniBatch,
    MiniBatchPlan,
    RolloutSample,
    build_mini_batches,
    pad_rollouts,
    step_seq_len,
)
from mcore_rl.platform import collectives
from mcore_rl.rollout.data_parallel import LocalRollout

# prompt length, response length, truncated, valid, route layers, route top-k, carries token versions
_META_COLUMNS = 7
_TRUNCATED = "length"


@dataclass
class StepMeta:
    """Every sample's small values, identical on every rank (group order: sample i of prompt i // n)."""

    prompt_lengths: torch.Tensor  # [B] int64
    response_lengths: torch.Tensor  # [B] int64
    truncated: torch.Tensor  # [B] bool: finished by max_new_tokens
    valid: torch.Tensor  # [B] bool: the reward was scored (False: left out of its group and the loss)
    rewards: torch.Tensor  # [B] float32 (0.0 where not valid)
    route_shape: Optional[tuple[int, int]]  # (MoE layers, top-k) when every sample carries engine routes
    versioned: Optional[torch.Tensor] = None  # [B] bool: the sample carries its tokens' weight versions

    @property
    def size(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sequence (prompt + response)."""
        return (self.prompt_lengths + self.response_lengths).tolist()

    @property
    def loss_tokens(self) -> list[int]:
        """Response tokens of each sequence that count in the loss (0 where the reward failed)."""
        return (self.response_lengths * self.valid).tolist()

    @property
    def errors(self) -> int:
        return int((~self.valid).sum())

    def without_truncated(self) -> "StepMeta":
        """The same samples with the truncated ones out of the loss (algo.overlong_filtering): no loss tokens,
        as a failed reward has; their rewards stay (the group advantages are taken before)."""
        return replace(self, valid=self.valid & ~self.truncated)

    def sample_nbytes(self, index: int) -> int:
        """Bytes of sample `index` on the wire: tokens int32, rollout log-probs float32, routes int16, token versions
        int32."""
        p, r = int(self.prompt_lengths[index]), int(self.response_lengths[index])
        layers, k = self.route_shape or (0, 0)
        return 4 * (p + r) + 4 * r + 2 * (p + r) * layers * k + 4 * r * int(self.has_versions(index))

    def has_versions(self, index: int) -> bool:
        return self.versioned is not None and bool(self.versioned[index])


@dataclass
class ExchangeStats:
    """Bytes this rank sent and received for one step (meta: its share of the all-reduce's traffic)."""

    meta_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0


@dataclass(frozen=True)
class ExchangePlan:
    """Which samples this rank sends to / receives from every other rank, in wire order."""

    sends: dict[int, list[int]] = field(default_factory=dict)  # destination rank -> step indices
    recvs: dict[int, list[int]] = field(default_factory=dict)  # source rank -> step indices
    needed: list[int] = field(default_factory=list)  # step indices this rank trains on, sorted


def _source(index: int, dest: int, holders: Callable[[int], range]) -> int:
    """The rank that sends sample `index` to `dest`: dest itself when it holds it, else one of the holders
    (spread by destination, so peers of a multi-rank engine replica share the sending)."""
    ranks = holders(index)
    return dest if dest in ranks else ranks[dest % len(ranks)]


def plan_exchange(rank: int, needs: list[list[int]], holders: Callable[[int], range]) -> ExchangePlan:
    """The exchange of rank `rank`: needs[r] lists the step indices rank r trains on; holders(i) the ranks
    that hold sample i after generation. Pure: every rank derives the same global picture."""
    sends: dict[int, list[int]] = {}
    for dest, wanted in enumerate(needs):
        if dest != rank:
            mine = [i for i in wanted if _source(i, dest, holders) == rank]
            if mine:
                sends[dest] = mine
    recvs: dict[int, list[int]] = {}
    for i in needs[rank]:
        src = _source(i, rank, holders)
        if src != rank:
            recvs.setdefault(src, []).append(i)
    return ExchangePlan(sends, recvs, sorted(needs[rank]))


def needs_by_rank(plans: list[MiniBatchPlan], dp_of_rank: list[int]) -> list[list[int]]:
    """Step indices every rank trains on: those of its data-parallel rank, over all mini-batches."""
    by_dp = {dp: sorted(i for plan in plans for i in plan.rows(dp)) for dp in set(dp_of_rank)}
    return [by_dp[dp] for dp in dp_of_rank]


def dp_ranks(dp_rank: int) -> list[int]:
    """Collective: the data-parallel rank of every global rank (this rank passes its own)."""
    if not dist.is_initialized():
        return [dp_rank]
    rank = dist.get_rank()
    return collectives.sum_ints([dp_rank if r == rank else 0 for r in range(dist.get_world_size())])


# ---- metadata ------------------------------------------------------------------------------------


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_meta(local: LocalRollout, rewards: list[float], valid: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contribution: [B, 7] int64 and [B] float32, zero except the samples it scored."""
    total = local.num_prompts * local.n
    ints = torch.zeros(total, _META_COLUMNS, dtype=torch.int64)
    floats = torch.zeros(total, dtype=torch.float32)
    scored = local.scored  # a contiguous range of step indices
    if len(rewards) != len(scored) or len(valid) != len(scored):
        raise ValueError(f"{len(rewards)} rewards / {len(valid)} flags for the {len(scored)} samples this rank scores")
    rows = []
    for k, i in enumerate(scored):
        s = local.sample(i)
        routes = s.routed_experts
        layers, top_k = (int(routes.shape[1]), int(routes.shape[2])) if routes is not None else (0, 0)
        rows.append(
            [
                len(s.prompt_ids),
                len(s.response_ids),
                int(s.finish_reason == _TRUNCATED),
                int(valid[k]),
                layers,
                top_k,
                int(s.token_versions is not None),
            ]
        )
        floats[i] = float(rewards[k])
    if rows:  # one tensor, not one per sample
        ints[scored.start : scored.stop] = torch.tensor(rows, dtype=torch.int64)
    return ints, floats


def meta_from_tensors(ints: torch.Tensor, floats: torch.Tensor) -> StepMeta:
    """The step's metadata from the summed contributions (checks that every sample was scored once)."""
    if bool((ints[:, 0] <= 0).any()):
        missing = (ints[:, 0] <= 0).nonzero().flatten().tolist()[:5]
        raise RuntimeError(f"step metadata: samples {missing} were scored by no rank (internal error)")
    layers, top_k = ints[:, 4], ints[:, 5]
    uniform = bool((layers > 0).all()) and bool((layers == layers[0]).all()) and bool((top_k == top_k[0]).all())
    return StepMeta(
        prompt_lengths=ints[:, 0].clone(),
        response_lengths=ints[:, 1].clone(),
        truncated=ints[:, 2].bool(),
        valid=ints[:, 3].bool(),
        rewards=floats.clone(),
        route_shape=(int(layers[0]), int(top_k[0])) if uniform else None,
        versioned=ints[:, 6].bool(),
    )


def exchange_meta(
    local: LocalRollout, rewards: list[float], valid: list[bool], stats: Optional[ExchangeStats] = None
) -> StepMeta:
    """Collective: every sample's metadata on every rank, from each rank's scored samples (tensors, summed)."""
    ints, floats = local_meta(local, rewards, valid)
    world = _world()
    if world > 1:
        dist.all_reduce(ints)
        dist.all_reduce(floats)
    if stats is not None:
        stats.meta_bytes += meta_nbytes(ints.shape[0], world)  # summed over a step's rounds
    return meta_from_tensors(ints, floats)


def meta_nbytes(size: int, world: int) -> int:
    """Bytes one rank receives in the metadata all-reduce of a `size`-sample step: a ring all-reduce moves
    2 (world - 1) / world of the tensors ([B, 7] int64 + [B] float32) into each rank."""
    return 2 * (world - 1) * size * (_META_COLUMNS * 8 + 4) // world


def first_reward_error(local_first: Optional[str]) -> Optional[str]:
    """Collective, only when the reward error rate stops the run: the first error message of the lowest
    rank that saw one (each rank scored its own samples), for the one message every rank raises."""
    if _world() == 1:
        return local_first
    messages: list = [None] * _world()
    dist.all_gather_object(messages, local_first)
    return next((m for m in messages if m is not None), None)


# ---- samples -------------------------------------------------------------------------------------


def encode_sample(sample: RolloutSample, route_shape: Optional[tuple[int, int]]) -> torch.Tensor:
    """A sample's tokens (int32), rollout log-probs (float32), routes (int16, when `route_shape`) and token versions
    (int32, when it has them) as bytes."""
    tokens = torch.tensor(list(sample.prompt_ids) + list(sample.response_ids), dtype=torch.int32)
    parts = [tokens.view(torch.uint8), sample.logprobs.to(torch.float32).contiguous().view(torch.uint8)]
    if route_shape is not None:
        parts.append(sample.routed_experts.to(torch.int16).contiguous().view(torch.uint8).flatten())
    if sample.token_versions is not None:
        parts.append(torch.tensor(sample.token_versions, dtype=torch.int32).view(torch.uint8))
    return torch.cat(parts)


def decode_sample(data: torch.Tensor, meta: StepMeta, index: int) -> RolloutSample:
    """Inverse of `encode_sample` for step sample `index` (lengths and flags from `meta`)."""
    p, r = int(meta.prompt_lengths[index]), int(meta.response_lengths[index])
    tokens = data[: 4 * (p + r)].clone().view(torch.int32).tolist()
    logprobs = data[4 * (p + r) : 4 * (p + 2 * r)].clone().view(torch.float32)
    routes = versions = None
    end = 4 * (p + 2 * r)
    if meta.route_shape is not None:
        layers, k = meta.route_shape
        routes = data[end : end + 2 * (p + r) * layers * k].clone().view(torch.int16).view(p + r, layers, k)
        end += 2 * (p + r) * layers * k
    if meta.has_versions(index):
        versions = data[end : end + 4 * r].clone().view(torch.int32).tolist()
    finish = _TRUNCATED if bool(meta.truncated[index]) else "stop"
    return RolloutSample(tokens[:p], tokens[p:], logprobs, finish, routes, versions)


def encode_sends(local: LocalRollout, meta: StepMeta, plan: ExchangePlan, world: int) -> tuple[torch.Tensor, list[int]]:
    """The bytes this rank sends (destinations in rank order) and their split sizes per destination."""
    sizes = [sum(meta.sample_nbytes(i) for i in plan.sends.get(r, [])) for r in range(world)]
    pieces = [encode_sample(local.sample(i), meta.route_shape) for r in range(world) for i in plan.sends.get(r, [])]
    return (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)), sizes


def receive_sizes(meta: StepMeta, plan: ExchangePlan, world: int) -> list[int]:
    """Bytes this rank receives from each source rank."""
    return [sum(meta.sample_nbytes(i) for i in plan.recvs.get(r, [])) for r in range(world)]


def decode_receives(data: torch.Tensor, meta: StepMeta, plan: ExchangePlan, world: int) -> dict[int, RolloutSample]:
    """Step index -> sample of what this rank received (sources in rank order, as `encode_sends` wrote)."""
    out, offset = {}, 0
    for r in range(world):
        for i in plan.recvs.get(r, []):
            size = meta.sample_nbytes(i)
            out[i] = decode_sample(data[offset : offset + size], meta, i)
            offset += size
    if offset != data.numel():
        raise RuntimeError(f"step data: received {data.numel()} bytes, the plan accounts for {offset} (internal error)")
    return out


def exchange_samples(
    local: LocalRollout, meta: StepMeta, plan: ExchangePlan, stats: Optional[ExchangeStats] = None
) -> dict[int, RolloutSample]:
    """Collective: the samples this rank trains on (`plan.needed`), step index -> sample: its own from
    `local`, the others received from their holders in one all_to_all_single of bytes."""
    world = _world()
    received: dict[int, RolloutSample] = {}
    if world > 1:
        send, send_sizes = encode_sends(local, meta, plan, world)
        recv_sizes = receive_sizes(meta, plan, world)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
        received = decode_receives(recv, meta, plan, world)
        if stats is not None:
            stats.sent_bytes, stats.received_bytes = sum(send_sizes), sum(recv_sizes)
    return collect_needed(local, plan, received)


def collect_needed(local: LocalRollout, plan: ExchangePlan, received: dict[int, RolloutSample]) -> list[RolloutSample]:
    """The samples of `plan.needed`, in its order: held ones from `local`, the others from `received`."""
    out = []
    for i in plan.needed:
        if i in local.held:
            out.append(local.sample(i))
        elif i in received:
            out.append(received[i])
        else:
            raise RuntimeError(f"step data: sample {i} neither held nor received (internal error)")
    return out


def assemble(
    samples: list[RolloutSample],
    needed: list[int],
    meta: StepMeta,
    plans: list[MiniBatchPlan],
    advantages: torch.Tensor,
    dp_rank: int,
    pad_id: int,
    multiple: int,
    route_experts: Optional[int] = None,
    versions: Optional[tuple[int, int]] = None,
) -> list[MiniBatch]:
    """Data-parallel rank `dp_rank`'s micro-batches from the samples it trains on (step indices `needed`):
    packed like the whole step (same padded width), cut by the plan; `versions`: `batch.pad_rollouts`'."""
    index = torch.tensor(needed, dtype=torch.long)
    rows = pad_rollouts(
        samples,
        meta.rewards[index],
        advantages[index],
        pad_id,
        multiple,
        valid=meta.valid[index],
        seq_len=step_seq_len(meta.lengths, multiple),
        versions=versions,
    )
    row_of = {i: k for k, i in enumerate(needed)}
    return build_mini_batches(plans, dp_rank, rows, row_of, route_experts, meta.route_shape, multiple)


def local_mini_batches(
    local: LocalRollout,
    meta: StepMeta,
    plans: list[MiniBatchPlan],
    advantages: torch.Tensor,
    dp_of_rank: list[int],
    pad_id: int,
    multiple: int,
    route_experts: Optional[int] = None,
    stats: Optional[ExchangeStats] = None,
    versions: Optional[tuple[int, int]] = None,
) -> list[MiniBatch]:
    """Collective: this rank's micro-batches of every mini-batch, receiving only the samples it trains on.

    dp_of_rank[r]: the data-parallel rank of global rank r; advantages: [B], from the step's rewards; versions
    (the update's starting weight version, the version of samples without their own token versions): each
    micro-batch's `version_lag`."""
    rank = local.replicas.rank
    plan = plan_exchange(rank, needs_by_rank(plans, dp_of_rank), local.holder_ranks)
    samples = exchange_samples(local, meta, plan, stats)
    dp_rank = dp_of_rank[rank]
    return assemble(samples, plan.needed, meta, plans, advantages, dp_rank, pad_id, multiple, route_experts, versions)
