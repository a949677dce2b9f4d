"""Rollout engines (embedded transformers, vLLM / vLLM-Ascend) and the weight sync that feeds them."""

from __future__ import annotations

from typing import Any, Optional

from mcore_rl.config import RolloutConfig
from mcore_rl.rollout.base import EngineCapabilities, RolloutEngine, RolloutSample, SamplingParams
from mcore_rl.rollout.embedded import EmbeddedEngine

__all__ = ["EngineCapabilities", "RolloutEngine", "RolloutSample", "SamplingParams", "make_engine", "sampling_params"]


def sampling_params(
    cfg: RolloutConfig, stop_token_ids: Optional[list[int]] = None, seed: Optional[int] = None
) -> SamplingParams:
    """The engine-neutral sampling parameters of a rollout config."""
    return SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=list(stop_token_ids or []),
        seed=seed,
    )


def make_engine(
    cfg: RolloutConfig, model_path: str, platform: Any = None, dtype: str = "float32", **kwargs: Any
) -> RolloutEngine:
    """Build the engine named by `cfg.engine` for the HF checkpoint at `model_path`.

    `platform` (mcore_rl.platform.Platform or None for CPU) places the embedded engine on the local device (vLLM
    picks its own). Extra keyword arguments go to the embedded engine's constructor / vLLM's `VllmSettings`.
    An engine asked for routed experts (`return_routed_experts=True`: routing replay R3) that cannot return them
    is refused here, before a step samples without them.
    """
    engine = _build_engine(cfg, model_path, platform, dtype, kwargs)
    if kwargs.get("return_routed_experts") and not engine.capabilities.routes:
        engine.close()
        raise ValueError(
            f"algo.routing_replay=r3 replays the experts the engine chose, but rollout.engine={cfg.engine} cannot "
            f"return them here (vLLM: only where it can capture routed experts, not on CPU; the log says why): "
            f"use algo.routing_replay=r2 (routes recorded in the actor's old-log-prob pass) or rollout.engine=embedded"
        )
    return engine


def _build_engine(cfg: RolloutConfig, model_path: str, platform: Any, dtype: str, kwargs: dict) -> RolloutEngine:
    if cfg.engine == "embedded":
        device = getattr(platform, "device", "cpu") if platform is not None else "cpu"
        return EmbeddedEngine(model_path, dtype=dtype, device=device, **kwargs)
    if cfg.engine == "vllm":
        try:
            from mcore_rl.rollout.vllm_engine import VllmEngine, VllmSettings
        except ImportError as err:
            raise ImportError(
                f"rollout.engine=vllm but vLLM cannot be imported ({err}); install it "
                f"(make setup-vllm on CPU) or use rollout.engine=embedded"
            ) from err
        return VllmEngine(model_path, VllmSettings.of(cfg, dtype=dtype, **kwargs))
    raise ValueError(f"rollout.engine={cfg.engine!r}; use 'embedded' or 'vllm'")
