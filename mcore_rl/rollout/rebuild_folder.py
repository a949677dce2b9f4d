"""The folder a vLLM rebuild reads its weights from: one copy per node, written once and atomically by the node's
first rank of the engine's world while the node's other ranks wait for it (mcore_rl.rollout.vllm_engine,
`rebuild_from`)."""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Callable


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def writes_node_folder(world_rank: int) -> bool:
    """Whether this rank writes its node's copy: local rank 0, or rank 0 of the engine's world (`world_rank`, its
    rank in the default process group). Colocated both are global rank 0's node; in the separate placement the
    rollout ranks' world starts mid-node when the first rollout rank shares its node with actor ranks (1 + 1 on
    one host: rollout rank 0 is local rank 1), and then no rollout rank of that node has local rank 0. The roles
    take contiguous global ranks, node by node, so every later node's first rollout rank is its local rank 0."""
    return local_rank() == 0 or world_rank == 0


def node_folder(base: str, count: int) -> str:
    """Rebuild `count`'s folder under `base`: the same name on every rank of the job (one copy per node)."""
    job = re.sub(
        r"[^A-Za-z0-9_.-]",
        "_",
        "_".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
        or str(os.getpid()),
    )
    return os.path.join(base, f"mcore_rl_vllm_rebuild_{job}_{count}")


def write_folder_once(folder: str, write: Callable[[str], None]) -> None:
    """Write a folder atomically: `write(tmp)` fills a sibling temporary folder, renamed when complete, so
    readers (`wait_for_folder`) never see a partial copy."""
    tmp = f"{folder}.partial"
    shutil.rmtree(folder, ignore_errors=True)  # a leftover of an earlier job must not pass for this copy
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def wait_for_folder(folder: str, timeout_s: float = 3600.0, poll_s: float = 0.5) -> None:
    """Wait until the node's writer has renamed `folder` into place (write_folder_once)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(folder):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rebuild folder {folder} did not appear within {timeout_s:.0f} s: the node's first engine rank "
                f"writes it (local rank 0, or the first rollout rank); rollout.rebuild_dir must be a node-local directory every rank of the node can read"
            )
        time.sleep(poll_s)
