"""What the rollout engine must fit: the vLLM engine's tensor-parallel size (world size, attention and KV heads),
and what the engine of a platform cannot deliver (vLLM-Ascend's missing capabilities, with the first release
that has each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mcore_rl.config import Config
from mcore_rl.preflight.layout import LayoutError, ModelDims, divisors
from mcore_rl.preflight.support import first_release_with


@dataclass(frozen=True)
class RolloutLayout:
    tp: int
    dp: int  # engine replicas: world / tp
    warnings: tuple[str, ...] = ()


def validate_rollout_tp(
    rollout_tp: int, world_size: int, dims: Any, ranks_name: str = "the world size"
) -> RolloutLayout:
    """Check the inference engine's tensor-parallel size against the ranks that generate (`world_size` of them:
    the world, or rollout.ranks in the separate placement, `ranks_name`) and the attention heads."""
    dims = ModelDims.from_hf(dims)
    if rollout_tp < 1 or world_size % rollout_tp:
        raise LayoutError(
            f"rollout.tp = {rollout_tp} must be >= 1 and divide {ranks_name} {world_size}: use rollout.tp in "
            f"{divisors(world_size)}"
            + (f", or make {ranks_name} a multiple of it" if ranks_name.startswith("rollout") else "")
        )
    if dims.num_attention_heads % rollout_tp:
        raise LayoutError(
            f"rollout.tp = {rollout_tp} must divide the model's {dims.num_attention_heads} attention heads: "
            f"use rollout.tp in {divisors(dims.num_attention_heads)}"
        )
    kv = dims.num_query_groups
    warnings: tuple[str, ...] = ()
    if rollout_tp > kv:
        if rollout_tp % kv:
            raise LayoutError(
                f"rollout.tp = {rollout_tp} above the {kv} KV heads must be a multiple of them: use rollout.tp in {divisors(kv)} or a multiple of {kv}"
            )
        warnings = (
            f"rollout.tp = {rollout_tp} > {kv} KV heads: the engine replicates each KV head {rollout_tp // kv}x (memory and sync cost)",
        )
    elif kv % rollout_tp:
        raise LayoutError(
            f"rollout.tp = {rollout_tp} must divide the model's {kv} KV heads: use rollout.tp in {divisors(kv)}"
        )
    return RolloutLayout(tp=rollout_tp, dp=world_size // rollout_tp, warnings=warnings)


def check_engine_capabilities(cfg: Config, platform: Optional[str]) -> None:
    """What the rollout engine of `platform` cannot deliver (docs/devices.md, "Ascend").

    vLLM-Ascend 0.11 (the supported line, mcore_rl.preflight.support) ignores `logprobs_mode` (its sampler returns log-probs
    of the raw, temperature-1 distribution) and returns no routed experts; the messages name the first release
    that would allow each and why it cannot share the actor's process today."""
    if platform != "npu" or cfg.rollout.engine != "vllm":
        return

    a, r = cfg.algo, cfg.rollout
    if a.routing_replay == "r3":
        raise LayoutError(
            f"algo.routing_replay=r3 replays the engine's routed experts, which vLLM-Ascend 0.11 does not return "
            f"({first_release_with('routed_experts')}): use algo.routing_replay=r2 (routes recorded in the actor's "
            f"old-log-prob pass) on NPU"
        )
    if r.temperature != 1.0 and a.rollout_is is not None:
        raise LayoutError(
            f"algo.rollout_is uses the engine's sampling log-probs, but vLLM-Ascend 0.11 ignores logprobs_mode and "
            f"returns them at temperature 1, not rollout.temperature = {r.temperature} "
            f"({first_release_with('logprobs_mode')}): set rollout.temperature = algo.temperature = 1.0, or "
            f"algo.rollout_is=null on NPU"
        )
