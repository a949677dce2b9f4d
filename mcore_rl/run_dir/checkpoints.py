"""Crash-safe checkpoints: publishing, pruning and choosing the one to resume from.

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
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from mcore_rl.config import ConfigError
from mcore_rl.run_dir.checksums import (
    TRUST_FLAG,
    checksum_share,
    file_problem,
    marker_problem,
    unverifiable,
    verify_checkpoint,
)
from mcore_rl.run_dir.errors import CheckpointWriteError, checkpoint_write_error
from mcore_rl.run_dir.layout import (
    CHECKSUMS,
    MARKER,
    POINTER,
    STEP_DIR,
    Checkpoint,
    fsync_dir,
    is_complete,
    write_atomic,
)


def dist_rank_and_barrier() -> tuple[int, Callable[[], None]]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.barrier
    return 0, lambda: None


def dist_world_and_gather() -> tuple[int, Callable[[Any], list]]:
    """(world size, all-gather of one Python object per rank); (1, [obj]) without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():

        def gather(obj):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        return dist.get_world_size(), gather
    return 1, lambda obj: [obj]


def _raised_on_every_rank(exc: BaseException) -> bool:
    """torch.distributed.checkpoint's CheckpointException: raised on every rank at the same point of a save,
    with the failures of all ranks on the coordinator (rank 0) and none elsewhere."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return False
    return isinstance(exc, CheckpointException)


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
            m = STEP_DIR.match(entry.name)
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

        `rank`/`barrier` default to torch.distributed's (or 0 / no-op without a process group). Each
        rank then checksums the files it wrote; rank 0 stores them all in CHECKSUMS.json before publishing.
        """
        default_rank, default_barrier = dist_rank_and_barrier()
        rank = default_rank if rank is None else rank
        barrier = default_barrier if barrier is None else barrier
        world, gather = dist_world_and_gather()
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):  # left by a crash; never complete
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        try:
            write_fn(tmp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # this rank could not write its part (torch's CheckpointException is a
            # BaseException): name the OS error and the path; the partial write is removed, it is never read
            error = checkpoint_write_error(e, step, tmp, self.latest())
            if _raised_on_every_rank(e):  # only rank 0, the writer's coordinator, holds every rank's error
                from mcore_rl.platform import collectives  # torch, as in ownership: not for the pre-flight

                error = CheckpointWriteError(collectives.from_rank0(str(error)))
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from e
        barrier()
        shares = gather(checksum_share(tmp, rank, world))
        if rank == 0:
            manifest = {rel: entry for share in shares for rel, entry in share.items()}
            try:
                write_atomic(tmp / CHECKSUMS, json.dumps(manifest, indent=0, sort_keys=True))
                self._publish(step, tmp, final, {"world_size": world, **(meta or {})})
            except OSError as e:
                raise checkpoint_write_error(e, step, tmp, self.latest()) from e
            self._prune()
        barrier()
        return Checkpoint(step, final)

    def _publish(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        record = {"step": step, "time": time.time(), **meta}
        write_atomic(tmp / MARKER, json.dumps(record))
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        write_atomic(self.root / POINTER, final.name + "\n")

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
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return CheckpointManager(cfg.trainer.run_dir, cfg.checkpoint.keep_last).latest()
    path = Path(resume)
    if is_complete(path):
        problem = marker_problem(path)
        if problem:
            raise ConfigError(
                f"checkpoint.resume = {resume}: {problem}: resume from another checkpoint (checkpoint.resume=auto "
                f"takes the newest that verifies)"
            )
        m = STEP_DIR.match(path.name)
        step = int(m.group(1)) if m else int(json.loads((path / MARKER).read_text())["step"])
        return Checkpoint(step, path)
    newest = CheckpointManager(path, 1).latest() if path.is_dir() else None
    if newest is None:
        raise ConfigError(
            f"checkpoint.resume = {resume} is not a complete checkpoint (no {MARKER} marker) nor a run directory "
            f"with one: use auto, never, or the path of a checkpoints/step_N directory"
        )
    return newest


def resolve_resume_checked(cfg, files: tuple[str, ...] = ()) -> Optional[Checkpoint]:
    """resolve_resume for the pre-flight, which reads no weights: resume=auto takes the newest complete checkpoint
    whose marker is sound, whose manifest is there (or checkpoint.trust_unverified) and whose `files` (small ones, to
    be parsed: its config) match their checksums; None when none does (the ranks then say why each failed). The
    ranks verify every file of the one they load (resolve_verified_resume)."""
    if cfg.checkpoint.resume != "auto":
        return resolve_resume(cfg)
    for ckpt in reversed(CheckpointManager(cfg.trainer.run_dir).complete()):
        unsure = unverifiable(ckpt) and not cfg.checkpoint.trust_unverified
        if not (marker_problem(ckpt.path) or unsure or any(file_problem(ckpt.path, f) for f in files)):
            return ckpt
    return None


def resolve_verified_resume(cfg, log=None) -> Optional[Checkpoint]:
    """resolve_resume, then the checksums (collective: every rank verifies a share of the files).

    resume=auto falls back to the newest complete checkpoint that verifies, saying which it skipped and
    why; an explicit PATH that does not verify is a ConfigError naming the file."""
    rank, _ = dist_rank_and_barrier()
    world, gather = dist_world_and_gather()
    chosen = resolve_resume(cfg)
    if chosen is None:
        return None
    trust = cfg.checkpoint.trust_unverified
    if cfg.checkpoint.resume != "auto":
        problems = verify_checkpoint(chosen, rank, world, gather, trust)
        if problems:
            raise ConfigError(
                f"checkpoint.resume = {cfg.checkpoint.resume}: {chosen.path} is damaged: {'; '.join(problems[:3])}; "
                f"resume from another checkpoint (checkpoint.resume=auto takes the newest that verifies)"
            )
        return chosen
    for ckpt in reversed(CheckpointManager(cfg.trainer.run_dir).complete()):
        problems = verify_checkpoint(ckpt, rank, world, gather, trust)
        if not problems:
            if trust and unverifiable(ckpt) and log is not None and rank == 0:
                log.warning("checkpoint %s has no %s: loaded unverified (%s)", ckpt.path, CHECKSUMS, TRUST_FLAG)
            return ckpt
        if log is not None and rank == 0:
            log.warning("checkpoint %s skipped: %s", ckpt.path, "; ".join(problems[:3]))
    raise ConfigError(
        f"no checkpoint in {CheckpointManager(cfg.trainer.run_dir).root} verifies (see the warnings above): "
        f"restore one, or start over in a new trainer.run_dir"
    )
