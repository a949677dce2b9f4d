"""Spread a global prompt list over rollout replicas and give every rank the full result.

Engines that place replicas themselves (vLLM's external launcher: `handles_data_parallel = True`)
receive the full list. For the others (the embedded engine: one replica per rank) each rank generates
a contiguous share and the shares are gathered, so every rank returns result[i] for prompt i.
"""

from __future__ import annotations

import torch.distributed as dist

from mcore_rl.rollout.base import RolloutEngine, RolloutSample, SamplingParams


def share(count: int, index: int, parts: int) -> range:
    """The contiguous slice of `count` items that part `index` of `parts` handles (the first parts take
    one more when `count` does not divide evenly)."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def generate_global(
    engine: RolloutEngine, prompts: list[list[int]], n: int, params: SamplingParams, seed: int
) -> list[list[RolloutSample]]:
    """n samples for every prompt, identical on all ranks; `seed` makes the step reproducible."""
    if getattr(engine, "handles_data_parallel", False):
        params.seed = seed
        return engine.generate(prompts, n, params)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = share(len(prompts), rank, world)
    # A replica's seed depends on its first prompt, so results depend only on the world size.
    params.seed = seed + mine.start
    local = engine.generate([prompts[i] for i in mine], n, params) if len(mine) else []
    if world == 1:
        return local
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    return [groups for part in gathered for groups in part]
