"""Megatron process groups for a validated layout: the one place that reads Megatron's parallel_state.

`init_parallel` validates the layout, creates Megatron's groups and returns the `Layout` bound to this
process's ranks and groups; everything else takes that object as an argument instead of asking
`parallel_state` again.
"""

from __future__ import annotations

import logging
import os
import random

import torch

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.compat import torch as compat_torch
from mcore_rl.config import ParallelConfig
from mcore_rl.platform import Platform
from mcore_rl.preflight.layout import Groups, Layout, Ranks, validate_layout

logger = logging.getLogger(__name__)


def _world_size() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _create_groups(layout: Layout) -> None:
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
        return
    existing = (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_expert_model_parallel_world_size(),
        mpu.get_context_parallel_world_size(),
    )
    if existing != (layout.tp, layout.pp, layout.ep, layout.cp):
        raise RuntimeError(
            "Megatron's process groups already exist with another layout: one layout per process, or "
            "release_groups() before the next"
        )


def _bind(layout: Layout) -> Layout:
    from megatron.core import parallel_state as mpu

    ranks = Ranks(
        rank=torch.distributed.get_rank(),
        tp=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_rank(),
        cp=mpu.get_context_parallel_rank(),
        dp=mpu.get_data_parallel_rank(),
        ep=mpu.get_expert_model_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_rank(),
    )
    groups = Groups(
        tp=mpu.get_tensor_model_parallel_group(),
        pp=mpu.get_pipeline_model_parallel_group(),
        dp=mpu.get_data_parallel_group(),
        dp_cp=mpu.get_data_parallel_group(with_context_parallel=True),
        ep=mpu.get_expert_model_parallel_group(),
        etp=mpu.get_expert_tensor_parallel_group(),
        cp=mpu.get_context_parallel_group(),
    )
    return layout.bind(ranks, groups)


def init_parallel(parallel: ParallelConfig, platform: Platform, hf_config, seed: int = 1) -> Layout:
    """Validate the layout, start torch.distributed (if needed), create Megatron's groups, seed RNGs.

    Validation runs before any process group exists, so a bad layout fails in a second.
    Calling it again with the same layout is a no-op for the groups (Megatron keeps global state).
    Returns the layout bound to this process's ranks and groups.
    """
    layout = validate_layout(
        parallel, _world_size(), hf_config, platform=platform.name, transformer_engine=platform.uses_transformer_engine
    )
    if os.environ.get("RANK", "0") == "0":  # every rank reaches the same verdict: say it once
        for warning in layout.warnings:
            logger.warning("layout: %s", warning)
    platform.adapt_megatron(layout.cp)  # on NPU: MindSpeed's CP arguments before the groups exist
    compat_megatron.apply_shims()
    compat_torch.apply_shims()
    platform.init_distributed()
    _create_groups(layout)

    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return _bind(layout)


def release_groups() -> None:
    """Drop Megatron's process groups, torch.distributed stays: the next `init_parallel` creates another layout's
    (one job checking several layouts in turn)."""
    compat_megatron.destroy_model_parallel()


def destroy_parallel() -> None:
    release_groups()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
