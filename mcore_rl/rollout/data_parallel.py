"""Spread a step's prompts over rollout replicas: who generates, holds and scores which sample.

A replica is `tp` consecutive ranks (the embedded engine: one rank, tp = 1; vLLM's external launcher:
`rollout.tp` ranks, a `DataParallelEngine`: `capabilities.handles_data_parallel`). Replica q generates the contiguous prompt share
`share(P, q, world / tp)`; its ranks all hold the same samples afterwards. `generate_local` returns that share
as a `LocalRollout` (no exchange); `mcore_rl.step_data` then moves each sample only to the ranks that train
on it. Sample i of the step is sample i % n of prompt i // n (group order).

Rewards: each sample is scored once, by one rank of the replica that holds it: the replica's held samples
split contiguously over its ranks (`LocalRollout.scored`). Every rank scores about B / world samples.

`generate_global` (every rank gets every sample, a pickled object gather) is kept for callers that want
the full list (the vLLM multi-process test); the trainer does not use it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from mcore_rl.rollout.base import RolloutEngine, RolloutSample, SamplingParams


def share(count: int, index: int, parts: int) -> range:
    """The contiguous slice of `count` items that part `index` of `parts` handles (the first parts take
    one more when `count` does not divide evenly)."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class ReplicaLayout:
    """Where this process sits: ``tp`` consecutive ranks form one engine replica."""

    rank: int
    world: int
    tp: int

    @property
    def num_replicas(self) -> int:
        return self.world // self.tp

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    def share(self, count: int) -> range:
        """The contiguous slice of ``count`` items this replica handles (the first replicas take one more)."""
        return share(count, self.replica, self.num_replicas)

    def prompts_of(self, replica: int, count: int) -> range:
        """The prompts replica `replica` generates, of `count`."""
        return share(count, replica, self.num_replicas)

    def holders(self, replica: int) -> range:
        """The ranks of replica `replica` (each holds its samples after generation)."""
        return range(replica * self.tp, (replica + 1) * self.tp)


class DataParallelEngine(RolloutEngine):
    """An engine that places its replicas itself (`capabilities.handles_data_parallel`): every rank passes the
    same full prompt list; `generate` returns every result on every rank, `generate_share` this replica's."""

    @property
    @abc.abstractmethod
    def replicas(self) -> ReplicaLayout:
        """Where this process sits among the engine's replicas."""

    @abc.abstractmethod
    def generate_share(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """Like generate(), without the gather: the results of this replica's share (`replicas.share`) only;
        prompt i of the full list is seeded from `params.seed + i * n`."""


@dataclass(frozen=True)
class LocalRollout:
    """What this rank holds after generation: n samples for each prompt of its replica's share.

    Frozen: the ranges below are computed once (the step data asks for them per sample)."""

    replicas: ReplicaLayout
    num_prompts: int
    n: int
    groups: list[list[RolloutSample]]  # groups[k][j]: sample j of prompt prompts[k]

    @cached_property
    def prompts(self) -> range:
        return self.replicas.share(self.num_prompts)

    @cached_property
    def held(self) -> range:
        """Step sample indices this rank holds (group order)."""
        return range(self.prompts.start * self.n, self.prompts.stop * self.n)

    @cached_property
    def scored(self) -> range:
        """Step sample indices this rank scores: its contiguous part of the replica's held samples."""
        held, peer = self.held, self.replicas.rank % self.replicas.tp
        part = share(len(held), peer, self.replicas.tp)
        return range(held.start + part.start, held.start + part.stop)

    def sample(self, index: int) -> RolloutSample:
        """Step sample `index` (must be held here)."""
        k = index - self.held.start
        if not 0 <= k < len(self.held):
            raise IndexError(f"sample {index} is not held by rank {self.replicas.rank} (holds {self.held})")
        return self.groups[k // self.n][k % self.n]

    def holder_ranks(self, index: int) -> range:
        """The ranks that hold step sample `index`."""
        prompt = index // self.n
        if not 0 <= prompt < self.num_prompts:
            raise IndexError(f"sample {index} is outside the step ({self.num_prompts} prompts x {self.n})")
        base, extra = divmod(self.num_prompts, self.replicas.num_replicas)  # the inverse of `share`
        longer = extra * (base + 1)  # prompts of the replicas that take one more
        replica = prompt // (base + 1) if prompt < longer else extra + (prompt - longer) // base
        return self.replicas.holders(replica)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def generate_local(
    engine: RolloutEngine, prompts: list[list[int]], n: int, params: SamplingParams, seed: int
) -> LocalRollout:
    """n samples for each prompt of this rank's replica share; `seed` makes the step reproducible.

    The seeds are the same as ever: an engine that places replicas itself gets `seed` and seeds prompt i
    from it; the embedded engine's replica seeds from `seed + its first prompt`, so results depend only on
    the world size."""
    if engine.capabilities.handles_data_parallel:
        params.seed = seed
        return LocalRollout(engine.replicas, len(prompts), n, engine.generate_share(prompts, n, params))
    rank, world = _world()
    replicas = ReplicaLayout(rank, world, 1)
    mine = replicas.share(len(prompts))
    params.seed = seed + mine.start
    local = engine.generate([prompts[i] for i in mine], n, params) if len(mine) else []
    return LocalRollout(replicas, len(prompts), n, local)


def generate_global(
    engine: RolloutEngine, prompts: list[list[int]], n: int, params: SamplingParams, seed: int
) -> list[list[RolloutSample]]:
    """n samples for every prompt, identical on all ranks (every rank's share pickled to every rank)."""
    if engine.capabilities.handles_data_parallel:
        params.seed = seed
        return engine.generate(prompts, n, params)
    local = generate_local(engine, prompts, n, params, seed)
    if local.replicas.world == 1:
        return local.groups
    gathered: list = [None] * local.replicas.world
    dist.all_gather_object(gathered, local.groups)
    return [groups for part in gathered for groups in part]
