"""Entries for launch/ray_launch.py tests: a real gloo job started from the env the launcher sets.

`train` trains (mcore_rl.trainer.run, the launcher's default entry), then writes one result per rank
(tests/workers/harness.py) into the run directory's parent folder, `results`: the launcher's environment variables
as the rank saw them and the placement named in the config it got. `fail_on_rank1` fails on rank 1.
"""

import os
from pathlib import Path

import torch.distributed as dist

from mcore_rl.platform import get_platform
from tests.workers.harness import write_result

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def train(cfg) -> None:
    from mcore_rl.trainer import run as run_trainer

    env = {k: os.environ.get(k) for k in ENV_KEYS}  # before the trainer: the launcher's, as the rank got them
    run_trainer(cfg)
    write_result(Path(cfg.trainer.run_dir).parent / "results", env=env, placement=cfg.rollout.placement)


def fail_on_rank1(cfg) -> None:
    get_platform(cfg.platform).init_distributed()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed on purpose")
    dist.barrier()  # rank 0 would wait here forever: the launcher must stop it
