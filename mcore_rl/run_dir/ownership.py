"""One run per run directory: its lock, refusing (or moving aside) another run, and the pre-flight check."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mcore_rl.config import ConfigError
from mcore_rl.metrics import METRICS_FILE
from mcore_rl.run_dir.checkpoints import CheckpointManager, dist_rank_and_barrier, resolve_resume
from mcore_rl.run_dir.checksums import unverifiable
from mcore_rl.run_dir.layout import (
    ABANDONED,
    EXPORT_DIR,
    LOCK_FILE,
    POINTER,
    PREVIOUS_RUNS,
    Checkpoint,
    free_bytes,
    fsync_dir,
    write_atomic,
)


def _holder(text: str) -> str:
    parts = text.split()
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(parts[2])))
        return f"pid {int(parts[0])} on host {parts[1]}, since {since}"
    except (IndexError, ValueError):
        return "an unknown process"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on a run directory, held for the life of the run (one process: rank 0).

    It is an flock(2) on RUN_DIR/.lock: the kernel drops it when the process exits or dies, however it
    dies, so a lock left by a dead run never blocks the next one; the file keeps "pid host time" of the
    holder for the error message. On a shared filesystem the lock is only as good as the filesystem's
    flock: NFS (v4, or v3 with the lock manager running) and Lustre mounted with `-o flock` lock across
    nodes; Lustre's `localflock` or a mount without lock support does not. Where flock fails with
    "not supported", the file's contents are used instead: a holder on this host whose pid is gone is
    stale and replaced; a holder on another host must be removed by hand (the error says so).
    """

    def __init__(self, path: Path, fd: int, flocked: bool):
        self.path, self._fd, self._flocked = path, fd, flocked

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> "RunLock":
        """Take the lock or raise ConfigError naming the holder."""
        import fcntl
        import socket

        path = Path(run_dir) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise ConfigError(
                f"trainer.run_dir = {run_dir} is in use by another run ({holder}; lock {path}): wait for it to "
                f"finish or stop it, or use another trainer.run_dir"
            ) from None
        except OSError:  # the filesystem has no flock (ENOLCK, EOPNOTSUPP, ENOSYS): use the file's contents
            flocked = False
            text = os.pread(fd, 4096, 0).decode(errors="replace").split()
            if len(text) >= 3 and text[0].isdigit():
                pid, host = int(text[0]), text[1]
                if host != socket.gethostname() or _pid_alive(pid):
                    os.close(fd)
                    raise ConfigError(
                        f"trainer.run_dir = {run_dir} is in use by another run ({_holder(' '.join(text))}; lock "
                        f"{path}, this filesystem has no flock): stop that run, or delete {path} if it is gone"
                    ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)
        os.fsync(fd)
        lock = cls(path, fd, flocked)
        # An flock belongs to the open file, which a fork shares: a process forked by the holder (a
        # checkpoint writer) would keep the directory locked after the holder died. Children drop their copy.
        os.register_at_fork(after_in_child=lock._drop_in_child)
        return lock

    def _drop_in_child(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def release(self) -> None:
        if self._fd < 0:
            return
        os.ftruncate(self._fd, 0)  # no holder recorded: nothing looks locked after a clean exit
        os.close(self._fd)  # drops the flock
        self._fd = -1


def check_lock_free(run_dir: str | os.PathLike) -> None:
    """Pre-flight: ConfigError when another run holds RUN_DIR (takes and drops the lock)."""
    if (Path(run_dir) / LOCK_FILE).exists():
        RunLock.acquire(run_dir).release()


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def ownership_problem(cfg, resume: Optional[Checkpoint]) -> Optional[str]:
    """Why starting this run in cfg.trainer.run_dir would mix it with another run, or None.

    A run directory holding complete checkpoints belongs to the run that wrote them: only resuming from
    one of them continues it. A fresh start (resume=never, or resume=PATH of another directory) is refused.
    """
    manager = CheckpointManager(cfg.trainer.run_dir)
    done = manager.complete()
    if not done or (resume is not None and _inside(resume.path, manager.root)):
        return None
    return (
        f"trainer.run_dir = {cfg.trainer.run_dir} holds another run's checkpoints (newest {done[-1].path.name}) and "
        f"checkpoint.resume = {cfg.checkpoint.resume} would start over in it: use a new trainer.run_dir, continue "
        f"that run with checkpoint.resume=auto, or set checkpoint.move_old_run=true to move it to "
        f"{Path(cfg.trainer.run_dir) / PREVIOUS_RUNS}/ (nothing is deleted)"
    )


def _unique(path: Path) -> Path:
    candidate, i = path, 1
    while candidate.exists():
        candidate, i = path.with_name(f"{path.name}.{i}"), i + 1
    return candidate


def move_old_run(run_dir: str | os.PathLike) -> Path:
    """Move everything of RUN_DIR (but its lock and earlier moved runs) to RUN_DIR/previous_runs/<time>/."""
    run_dir = Path(run_dir)
    target = _unique(run_dir / PREVIOUS_RUNS / time.strftime("%Y%m%d-%H%M%S"))
    target.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name not in (LOCK_FILE, PREVIOUS_RUNS):
            os.rename(entry, target / entry.name)
    fsync_dir(run_dir)
    return target


@dataclass(frozen=True)
class AbandonedLine:
    """Where the line of training a resume from an older checkpoint leaves behind was moved (nothing is deleted)."""

    checkpoints: list[Path]
    metrics: Optional[Path] = None  # its metrics.jsonl lines after the resumed step
    metric_steps: tuple[int, ...] = ()
    export: Optional[Path] = None  # its Hugging Face export, RUN_DIR/hf

    def describe(self, resumed: str) -> str:
        said = [f"the newer {', '.join(p.name for p in self.checkpoints)} moved to {self.checkpoints[0].parent}"]
        if self.metrics is not None:
            steps = self.metric_steps
            said.append(f"its metrics of steps {steps[0]}-{steps[-1]} moved from metrics.jsonl to {self.metrics}")
        if self.export is not None:
            said.append(f"its Hugging Face export moved to {self.export}")
        return f"resuming from {resumed} abandons a newer line of training, kept: {'; '.join(said)}"


def _split_metrics(run_dir: Path, after_step: int, target: Path) -> tuple[int, ...]:
    """Copy the metrics.jsonl lines of steps after `after_step` to `target`; the steps copied. metrics.jsonl itself
    is cut when the resumed run opens it (metrics.MetricsLogger), after the checkpoints have been moved."""
    source = run_dir / METRICS_FILE
    if not source.is_file():
        return ()
    lines, steps = [], []
    for line in source.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line torn by a crash
        if isinstance(step, int) and step > after_step:
            lines.append(line)
            steps.append(step)
    if lines:
        write_atomic(target, "\n".join(lines) + "\n")
    return tuple(steps)


def abandon_newer(manager: CheckpointManager, resume: Checkpoint) -> Optional[AbandonedLine]:
    """Move complete checkpoints newer than `resume` (an abandoned line of training) to checkpoints/abandoned/,
    so that resume=auto can never pick them up after this run continued from an older one; that line's metrics
    (the metrics.jsonl lines after the resumed step) and its Hugging Face export go beside its newest checkpoint.
    Order for a crash at any moment: the metrics copied, the export moved, then the checkpoints."""
    newer = [ckpt for ckpt in manager.complete() if ckpt.step > resume.step]
    if not newer:
        return None
    targets = [_unique(manager.root / ABANDONED / ckpt.path.name) for ckpt in newer]
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    run_dir, newest = manager.root.parent, targets[-1]
    metrics = _unique(newest.with_name(f"{newest.name}.{METRICS_FILE}"))
    steps = _split_metrics(run_dir, resume.step, metrics)
    export = None
    if (run_dir / EXPORT_DIR).is_dir():
        export = _unique(newest.with_name(f"{newest.name}.{EXPORT_DIR}"))
        os.rename(run_dir / EXPORT_DIR, export)
    for ckpt, target in zip(newer, targets):
        os.rename(ckpt.path, target)
    fsync_dir(manager.root)
    write_atomic(manager.root / POINTER, resume.path.name + "\n")
    return AbandonedLine(targets, metrics if steps else None, steps, export)


def claim_run_dir(cfg, resume: Optional[Checkpoint], log=None) -> RunLock:
    """Rank 0, before anything is written: lock RUN_DIR, refuse (or move aside) another run, abandon newer
    checkpoints when resuming from an older one of this run. Raises ConfigError with the fix."""
    run_dir = Path(cfg.trainer.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.run_dir = {run_dir} is a file, not a directory: choose another trainer.run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir)
    try:
        (run_dir / "STOP").unlink(missing_ok=True)  # a stop request (safety.STOP_FILE) of an earlier run
        problem = ownership_problem(cfg, resume)
        if problem and not cfg.checkpoint.move_old_run:
            raise ConfigError(problem)
        if problem:
            moved = move_old_run(run_dir)
            if log:
                log.warning("moved the previous run in %s to %s (checkpoint.move_old_run=true)", run_dir, moved)
        elif resume is not None and _inside(resume.path, run_dir / "checkpoints"):
            abandoned = abandon_newer(CheckpointManager(run_dir), resume)
            if abandoned and log:
                log.warning("%s", abandoned.describe(resume.path.name))
    except BaseException:
        lock.release()
        raise
    return lock


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path("/")


def _check_writable(run_dir: Path, checkpoint_bytes: Optional[int]) -> None:
    """The run directory (or the folder it will be made in) is a writable directory with room for one
    checkpoint (`checkpoint_bytes`, from the memory plan: mcore_rl.preflight.memory_plan.checkpoint_bytes)."""
    base = _existing_ancestor(run_dir)
    if not base.is_dir():
        raise ConfigError(
            f"trainer.run_dir = {run_dir}: {base} is a file, not a directory: choose another trainer.run_dir"
        )
    for path in (base, base / "checkpoints"):
        if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            st = os.statvfs(path)
            why = "is on a read-only filesystem" if st.f_flag & os.ST_RDONLY else "is not writable by this user"
            raise ConfigError(
                f"trainer.run_dir = {run_dir}: {path} {why}: choose a writable trainer.run_dir (or remount it "
                f"read-write)"
            )
    target = _existing_ancestor(run_dir / "checkpoints")  # may be a filesystem of its own
    free = free_bytes(target)
    if checkpoint_bytes is not None and free is not None and free < checkpoint_bytes:
        raise ConfigError(
            f"trainer.run_dir = {run_dir}: no space left for a checkpoint: one needs ~{checkpoint_bytes / 2**20:.1f} "
            f"MiB (weights and optimizer state), {free / 2**20:.1f} MiB are free on {target}: free space or choose a "
            f"trainer.run_dir on a larger filesystem"
        )


def check_run_dir(cfg, checkpoint_bytes: Optional[int] = None) -> None:
    """Pre-flight, before any process starts: the run directory is usable by this run (not a file, writable,
    room for one checkpoint, not locked by another run, not another run's checkpoints unless moving them aside)."""
    run_dir = Path(cfg.trainer.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.run_dir = {run_dir} is a file, not a directory: choose another trainer.run_dir")
    _check_writable(run_dir, checkpoint_bytes)
    resume = resolve_resume(cfg)  # a bad checkpoint.resume fails here
    if resume is not None and cfg.checkpoint.resume != "auto" and not cfg.checkpoint.trust_unverified:
        missing = unverifiable(resume)  # the checksums themselves are checked by the ranks (their shares)
        if missing:
            raise ConfigError(f"checkpoint.resume = {cfg.checkpoint.resume}: {missing}")
    if not run_dir.is_dir():
        return
    check_lock_free(run_dir)
    problem = ownership_problem(cfg, resume)
    if problem and not cfg.checkpoint.move_old_run:
        raise ConfigError(problem)


def claim_run_dir_collective(cfg, resume: Optional[Checkpoint], log=None) -> Optional[RunLock]:
    """Every rank calls this; rank 0 claims the run directory (claim_run_dir) and every rank raises the
    same ConfigError when it cannot. Returns the lock on rank 0, None elsewhere."""
    from mcore_rl.platform import collectives  # torch: only the collective paths load it (the pre-flight's do not)

    rank, _ = dist_rank_and_barrier()
    lock, error = None, None
    if rank == 0:
        try:
            lock = claim_run_dir(cfg, resume, log)
        except ConfigError as e:
            error = str(e)
    error = collectives.from_rank0(error)
    if error:
        raise ConfigError(error)
    error = collectives.first_given(_not_shared(cfg.trainer.run_dir, collectives.from_rank0(_shared_token(cfg, rank))))
    if error:
        raise ConfigError(error)
    return lock


SHARED_TOKEN = "nodes/shared-token"  # rank 0's token: every node's first rank must read it (one run directory)


def _shared_token(cfg, rank: int) -> Optional[str]:
    if rank != 0 or cfg.trainer.nnodes <= 1:
        return None
    import uuid

    path = Path(cfg.trainer.run_dir) / SHARED_TOKEN
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    path.write_text(token)
    return token


def _not_shared(run_dir: str, token: Optional[str]) -> Optional[str]:
    """On each node's first rank: why this node does not see rank 0's run directory, or None."""
    import socket

    if token is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    try:
        seen = (Path(run_dir) / SHARED_TOKEN).read_text()
    except OSError:
        seen = None
    if seen == token:
        return None
    return (
        f"trainer.run_dir = {run_dir} is not the same directory on every node: {socket.gethostname()} does not see "
        f"the token rank 0 wrote into {Path(run_dir) / SHARED_TOKEN}. Every node writes its shards of each "
        f"checkpoint there: give the run a directory on a filesystem all nodes share (NFS, Lustre, ...)"
    )
