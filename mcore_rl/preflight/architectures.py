"""The one table of supported architectures (HF config.json `model_type` -> what it is) and the check of a
run's model against it: a known `model_type`, experts where the table says MoE, and no MoE-only feature
(routing replay) asked of a dense model."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import Config
from mcore_rl.preflight.layout import LayoutError, ModelDims


@dataclass(frozen=True)
class Architecture:
    """What the project supports for one Hugging Face `model_type` (bridge, actor, both engines, weight sync)."""

    moe: bool
    example: str  # the real model the presets use


# The one table of supported architectures: HF config.json `model_type` -> what it is.
ARCHITECTURES: dict[str, Architecture] = {
    "qwen3_moe": Architecture(moe=True, example="Qwen3-30B-A3B"),
    "qwen3": Architecture(moe=False, example="Qwen3-8B"),
    "qwen2": Architecture(moe=False, example="Qwen2.5-3B-Instruct"),
}


def check_architecture(cfg: Config, dims: ModelDims) -> Architecture | None:
    """The model's architecture is in ARCHITECTURES and supports what the config asks of it."""
    if not dims.model_type:
        return None
    arch = ARCHITECTURES.get(dims.model_type)
    if arch is None:
        known = ", ".join(f"{t} ({'MoE' if a.moe else 'dense'}, e.g. {a.example})" for t, a in ARCHITECTURES.items())
        raise LayoutError(
            f"model_type {dims.model_type!r} (config.json) is not supported: use a model of a supported "
            f"architecture: {known}"
        )
    if cfg.algo.routing_replay is not None and not arch.moe:
        raise LayoutError(
            f"algo.routing_replay = {cfg.algo.routing_replay} replays MoE expert routing, but model_type "
            f"{dims.model_type!r} is dense (no experts): set algo.routing_replay=null"
        )
    if bool(dims.num_experts) != arch.moe:
        raise LayoutError(
            f"model_type {dims.model_type!r} should be {'MoE' if arch.moe else 'dense'} but config.json has "
            f"{dims.num_experts} experts: fix the config.json"
        )
    return arch
