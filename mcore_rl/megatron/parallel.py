"""Megatron process groups for a validated layout, and where this rank sits in them."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass

import torch

from mcore_rl.config import ParallelConfig
from mcore_rl.megatron.layout import DerivedLayout, validate_layout
from mcore_rl.platform import Platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's coordinates; the sizes come from `layout`, the validated derived layout."""

    rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    layout: DerivedLayout

    world_size = property(lambda self: self.layout.world_size)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    cp = property(lambda self: self.layout.cp)
    dp = property(lambda self: self.layout.dp)
    ep = property(lambda self: self.layout.ep)
    etp = property(lambda self: self.layout.etp)
    sequence_parallel = property(lambda self: self.layout.sequence_parallel)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def effective_parallel(self, parallel: ParallelConfig) -> ParallelConfig:
        """`parallel` with sequence_parallel set to the value actually in use."""
        return dataclasses.replace(parallel, sequence_parallel=self.sequence_parallel)


def init_parallel(parallel: ParallelConfig, platform: Platform, hf_config, seed: int = 1) -> ParallelInfo:
    """Validate the layout, start torch.distributed (if needed), create Megatron's groups, seed RNGs.

    Validation runs before any process group exists, so a bad layout fails in a second.
    Calling it again with the same layout is a no-op for the groups (Megatron keeps global state).
    """
    world_size = (
        torch.distributed.get_world_size()
        if torch.distributed.is_initialized()
        else int(os.environ.get("WORLD_SIZE", "1"))
    )
    layout = validate_layout(parallel, world_size, hf_config, platform=platform.name)
    for warning in layout.warnings:
        logger.warning("layout: %s", warning)
    platform.adapt_megatron()
    platform.init_distributed()

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.virtual_pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp,
        )
    elif (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_expert_model_parallel_world_size(),
    ) != (parallel.tp, parallel.pp, parallel.ep):
        raise RuntimeError("Megatron's process groups already exist with another layout; one layout per process")

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        rank=torch.distributed.get_rank(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        cp_rank=mpu.get_context_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        layout=layout,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
