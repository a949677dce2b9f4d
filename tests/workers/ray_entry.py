"""Entries for launch/ray_launch.py tests: a real gloo job started from the env the launcher sets.

`run` writes one result per rank (tests/workers/harness.py) into <trainer.run_dir>/results: the all-reduced sum,
the launcher's environment variables as the rank saw them, and the loss named in the config it got.
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.platform import get_platform
from tests.workers.harness import write_result

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(cfg) -> None:
    info = get_platform(cfg.platform).init_distributed()
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    write_result(
        Path(cfg.trainer.run_dir) / "results",
        sum=total.item(),
        env={k: os.environ.get(k) for k in ENV_KEYS},
        loss=cfg.algo.loss,
    )
    dist.destroy_process_group()


def fail_on_rank1(cfg) -> None:
    get_platform(cfg.platform).init_distributed()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed on purpose")
    dist.barrier()  # rank 0 would wait here forever: the launcher must stop it
