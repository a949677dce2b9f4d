"""Why writing a run's output failed, in one line that names the path, the free space and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mcore_rl.run_dir.layout import Checkpoint, free_bytes


class OutputWriteError(OSError):
    """Writing a run's output (a checkpoint, the export, the plots) failed; the message says why, what was not
    written and what is intact (raised on every rank)."""


class CheckpointWriteError(OutputWriteError):
    """Writing a checkpoint failed (disk full, quota, I/O error); the previous checkpoint is intact."""


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception chain, or torch's zip writer's "unexpected pos" (how
    torch.save reports a short write)."""
    import errno

    seen, todo = set(), [exc]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text or "unexpected pos" in text:
            return True
        # torch.distributed.checkpoint's CheckpointException: {rank: exception} of every rank that failed
        failures = getattr(exc, "failures", None)
        todo += [e for e in failures.values() if isinstance(e, BaseException)] if isinstance(failures, dict) else []
        todo += [exc.__cause__, exc.__context__]
    return False


def write_failure(exc: BaseException, path: Path) -> tuple[str, bool]:
    """(why writing under `path` failed, in one line; whether the disk is full). A full disk reads
    "[Errno 28] No space left on device: PATH, N MiB free there" however the writer reported it."""
    if _is_disk_full(exc):
        free = free_bytes(path)
        free_text = f", {free / 2**20:.1f} MiB free there" if free is not None else ""
        return f"[Errno 28] No space left on device: {path}{free_text}", True
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", False


def checkpoint_write_error(
    exc: BaseException, step: int, tmp: Path, previous: Optional["Checkpoint"]
) -> CheckpointWriteError:
    kept = f"the previous checkpoint {previous.path} is intact" if previous else "no earlier checkpoint exists"
    reason, full = write_failure(exc, tmp)
    if full:
        fix = "free space or set trainer.run_dir on a larger filesystem, then resume (checkpoint.resume=auto)"
    else:
        fix = "fix the cause, then resume (checkpoint.resume=auto)"
    return CheckpointWriteError(f"checkpoint step {step} was not written ({reason}); {kept}: {fix}")


def disk_full_error(exc: BaseException, run_dir: str | Path) -> Optional[OutputWriteError]:
    """A full disk met by a write outside the checkpoint's own (metrics.jsonl, samples.jsonl, TensorBoard's events,
    a log) as the error the launcher prints: the file (or, where the OS error names none, the run directory),
    "No space left on device" with the free space, and the newest checkpoint, which is intact; None for any
    other error."""
    if isinstance(exc, OutputWriteError) or not _is_disk_full(exc):
        return None
    from mcore_rl.run_dir.checkpoints import CheckpointManager  # checkpoints imports this module

    name = getattr(exc, "filename", None)
    reason, _ = write_failure(exc, Path(name) if name else Path(run_dir))
    newest = CheckpointManager(run_dir).latest()
    kept = f"the newest checkpoint {newest.path} is intact" if newest else "no checkpoint was written yet"
    return OutputWriteError(
        f"the run stopped: a write failed ({reason}); {kept}: free space or set trainer.run_dir on a larger "
        f"filesystem, then resume (checkpoint.resume=auto)"
    )
