"""Run directory and crash-safe checkpoints.

Layout of a run directory:
    RUN_DIR/config.yaml                 resolved config (save_config)
    RUN_DIR/metrics.jsonl               one JSON line per step (metrics.MetricsLogger)
    RUN_DIR/checkpoints/step_00000020/  a complete checkpoint: payload + COMPLETE marker (written last)
    RUN_DIR/checkpoints/step_00000030.tmp/  a checkpoint being written (or left by a crash; never read)
    RUN_DIR/checkpoints/latest          name of the newest published checkpoint (atomically replaced)

Save protocol (every rank calls `save` with the same step; Megatron dist-checkpointing writes collectively):
    1. rank 0 clears stale *.tmp dirs and creates step_N.tmp           -> barrier
    2. every rank runs write_fn(tmp_dir) (its shards, into the same dir) -> barrier
    3. rank 0 writes the COMPLETE marker, renames step_N.tmp -> step_N, atomically replaces `latest`,
       prunes complete checkpoints beyond keep_last                     -> barrier
A crash (any rank, any moment) before the rename leaves only a *.tmp dir, which readers ignore; the
rename is atomic, so the previous checkpoint stays the newest complete one and remains loadable.
`latest()` trusts only the marker: it scans for the newest directory that has one, so a crash between
the rename and the pointer update still resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

MARKER = "COMPLETE"
POINTER = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.path / MARKER).read_text())


def _dist_rank_and_barrier() -> tuple[int, Callable[[], None]]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.barrier
    return 0, lambda: None


def _fsync_dir(path: Path) -> None:
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


class CheckpointManager:
    """Publishes checkpoints under RUN_DIR/checkpoints atomically and keeps the newest `keep_last`."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last = {keep_last} must be >= 1: the newest checkpoint is always kept")
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Checkpoint]:
        """All complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir() and is_complete(entry):
                found.append(Checkpoint(int(m.group(1)), entry))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Optional[Checkpoint]:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1] if done else None

    def save(
        self,
        step: int,
        write_fn: Callable[[Path], None],
        meta: Optional[dict] = None,
        rank: Optional[int] = None,
        barrier: Optional[Callable[[], None]] = None,
    ) -> Checkpoint:
        """Collective: every rank calls this with the same step; write_fn(tmp_dir) writes this rank's part.

        `rank`/`barrier` default to torch.distributed's (or 0 / no-op without a process group).
        """
        default_rank, default_barrier = _dist_rank_and_barrier()
        rank = default_rank if rank is None else rank
        barrier = default_barrier if barrier is None else barrier
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):  # left by a crash; never complete
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        write_fn(tmp)
        barrier()
        if rank == 0:
            self._publish(step, tmp, final, meta or {})
            self._prune()
        barrier()
        return Checkpoint(step, final)

    def _publish(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        record = {"step": step, "time": time.time(), **meta}
        _write_atomic(tmp / MARKER, json.dumps(record))
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / POINTER, final.name + "\n")

    def _prune(self) -> None:
        done = self.complete()
        for ckpt in done[: max(0, len(done) - self.keep_last)]:
            # Unpublish first (drop the marker), so a crash mid-delete never leaves a half checkpoint that looks complete.
            (ckpt.path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(ckpt.path, ignore_errors=True)


def resolve_resume(cfg) -> Optional[Checkpoint]:
    """checkpoint.resume: 'never' -> None; 'auto' -> newest complete in the run dir (or None); PATH -> that one.

    PATH may be a checkpoint directory or another run directory (its newest complete checkpoint is used).
    """
    from mcore_rl.config import ConfigError

    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return CheckpointManager(cfg.trainer.run_dir, cfg.checkpoint.keep_last).latest()
    path = Path(resume)
    if is_complete(path):
        m = _STEP_DIR.match(path.name)
        step = int(m.group(1)) if m else int(json.loads((path / MARKER).read_text())["step"])
        return Checkpoint(step, path)
    newest = CheckpointManager(path, 1).latest() if path.is_dir() else None
    if newest is None:
        raise ConfigError(
            f"checkpoint.resume = {resume} is not a complete checkpoint (no {MARKER} marker) nor a run directory "
            f"with one: use auto, never, or the path of a checkpoints/step_N directory"
        )
    return newest
