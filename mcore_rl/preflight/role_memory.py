"""`mcore-rl plan` for the separate placement (`rollout.placement: separate`): one memory plan per role.

An actor rank holds what a colocated rank holds outside rollout, and nothing of the engine: its phases are the
log-prob passes, the update, the save and the weight send (resident state + one sync bucket); there is no
rollout phase and no actor.offload. A rollout rank holds the engine only: its weights at rollout.tp and its KV
cache (vLLM reserves gpu_memory_utilization x the device, or weights + kv_cache_gb), and during the weight sync
one received bucket beside them; no actor parameters, gradients or optimizer state. docs/memory.md, "Per role".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from mcore_rl.config import Config
from mcore_rl.preflight.layout import Layout, ModelDims
from mcore_rl.preflight.memory_plan import (
    GIB,
    MemoryPlan,
    Phase,
    StateBytes,
    engine_bytes,
    engine_items,
    rank_plan,
    sync_bucket,
)

NO_STATE = StateBytes(params=0, grads=0, main_params=0, moments=0, main_grads=0, host=0)
UTILIZATION_LEVERS = (0.85, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class RolePlans:
    """The separate placement's plans: an actor rank's and a rollout rank's; it fits where both do."""

    actor: MemoryPlan
    rollout: MemoryPlan
    actor_ranks: int
    rollout_ranks: int

    @property
    def fits(self) -> Optional[bool]:
        if self.actor.fits is None:
            return None
        return self.actor.fits and self.rollout.fits

    @property
    def peak(self) -> Phase:
        """The larger of the two roles' peaks (what one device must hold, whichever role it has)."""
        return max(self.actor.peak, self.rollout.peak, key=lambda p: p.total)

    @property
    def device_bytes(self) -> Optional[int]:
        return self.actor.device_bytes

    def table(self) -> str:
        return "\n".join(
            [
                f"actor ranks ({self.actor_ranks}): the actor only, no engine resident",
                self.actor.table(),
                f"rollout ranks ({self.rollout_ranks}): the engine only, no actor state",
                self.rollout.table(),
            ]
        )


def rollout_plan(cfg: Config, layout: Layout, dims: ModelDims, device_bytes: Optional[int]) -> MemoryPlan:
    """A rollout rank's plan: the engine while it generates, and with one received sync bucket during the sync."""
    eng = engine_bytes(cfg, dims, layout, device_bytes)
    engine = engine_items(cfg, eng, device_bytes)
    phases = (Phase("rollout", tuple(engine)), Phase("weight sync", tuple(engine + [sync_bucket(cfg, dims)])))
    notes = ()
    if cfg.rollout.engine == "vllm":
        notes = (
            f"vLLM KV cache holds ~{eng.kv_tokens:,} tokens per replica; all its samples at once need {eng.needed_tokens:,}",
        )
    return MemoryPlan(phases, 0, device_bytes, NO_STATE, eng, notes, (), "rollout")


def rollout_levers(cfg: Config, layout: Layout, dims: ModelDims, plan: MemoryPlan) -> list[str]:
    """For a rollout rank that does not fit: a lower gpu_memory_utilization (vLLM), each value that fits."""
    out = []
    if cfg.rollout.engine == "vllm" and cfg.rollout.kv_cache_gb is None:
        for util in (u for u in UTILIZATION_LEVERS if u < cfg.rollout.gpu_memory_utilization):
            lower = replace(cfg, rollout=replace(cfg.rollout, gpu_memory_utilization=util))
            p = rollout_plan(lower, layout, dims, plan.device_bytes)
            if p.fits:
                out.append(
                    f"rollout.gpu_memory_utilization={util} -> peak {p.peak.total / GIB:.1f} GiB ({p.peak.name})"
                )
                break
    return out or [f"raise rollout.tp (now {cfg.rollout.tp}): each rank holds 1/tp of the engine's weights"]


def plan_roles(
    cfg: Config, layout: Layout, dims: ModelDims, device_gib: Optional[float], with_levers: bool = True
) -> RolePlans:
    """`plan_memory` for the separate placement (`layout.rollout_ranks` > 0)."""
    device_bytes = None if device_gib is None else int(device_gib * GIB)
    actor = rank_plan(cfg, layout, dims, device_gib, with_levers)
    rollout = rollout_plan(cfg, layout, dims, device_bytes)
    if rollout.fits is False and with_levers:
        rollout = replace(rollout, levers=tuple(rollout_levers(cfg, layout, dims, rollout)))
    return RolePlans(actor, rollout, layout.world_size, layout.rollout_ranks)
