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
