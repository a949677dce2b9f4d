"""Entries for launch/ray_launch.py tests: a real gloo job started from the env the launcher sets."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.platform import get_platform

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(cfg) -> None:
    info = get_platform(cfg.platform).init_distributed()
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    envs = [None] * info.world_size
    dist.all_gather_object(envs, {k: os.environ.get(k) for k in ENV_KEYS})
    if info.rank == 0:
        out = Path(cfg.trainer.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ray_result.json").write_text(json.dumps({"sum": total.item(), "envs": envs, "loss": cfg.algo.loss}))
    dist.barrier()
    dist.destroy_process_group()


def fail_on_rank1(cfg) -> None:
    get_platform(cfg.platform).init_distributed()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed on purpose")
    dist.barrier()  # rank 0 would wait here forever: the launcher must stop it
