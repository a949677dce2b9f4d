"""The layout of a run directory: the names of its files, a checkpoint's place, and crash-safe writes.

RUN_DIR/config.yaml                 resolved config (save_config)
RUN_DIR/metrics.jsonl               one JSON line per step (metrics.MetricsLogger)
RUN_DIR/.lock                       "pid host start-time" of the run holding the directory (ownership.RunLock)
RUN_DIR/checkpoints/step_00000020/  a complete checkpoint: payload + CHECKSUMS.json + COMPLETE marker (last)
RUN_DIR/checkpoints/step_00000030.tmp/  a checkpoint being written (or left by a crash; never read)
RUN_DIR/checkpoints/latest          name of the newest published checkpoint (atomically replaced)
RUN_DIR/hf/                         the trained model as a Hugging Face folder (checkpoint.save_hf)
RUN_DIR/rollout_status.json         what a streaming rollout rank is doing (streaming.RolloutStatus)
RUN_DIR/checkpoints/abandoned/      checkpoints newer than the one a run resumed from, and beside the newest of
                                    them (step_N.metrics.jsonl, step_N.hf/) that line's metrics and export
RUN_DIR/previous_runs/<time>/       an older run moved aside (checkpoint.move_old_run)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MARKER = "COMPLETE"
POINTER = "latest"
CHECKSUMS = "CHECKSUMS.json"  # {relative path: {"size": bytes, "crc32": "8 hex digits"}} of every payload file
STEP_DIR = re.compile(r"^step_(\d+)$")
LOCK_FILE = ".lock"  # RUN_DIR/.lock: "pid host start-time" of the run holding it
PREVIOUS_RUNS = "previous_runs"  # RUN_DIR/previous_runs/<time>/: an older run moved aside (move_old_run)
ABANDONED = "abandoned"  # RUN_DIR/checkpoints/abandoned/: checkpoints newer than the one a run resumed from
EXPORT_DIR = "hf"  # RUN_DIR/hf: the Hugging Face export of the trained model


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.path / MARKER).read_text())


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, durable: bool = True) -> None:
    """`path` replaced whole: a reader sees the old text or the new one, never half of one. `durable`: on disk
    before it returns (fsync), not only in place (a status rewritten a few times a step)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def free_bytes(path: Path) -> Optional[int]:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            continue
    return None
