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
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

MARKER = "COMPLETE"
POINTER = "latest"
CHECKSUMS = "CHECKSUMS.json"  # {relative path: {"size": bytes, "crc32": "8 hex digits"}} of every payload file
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 16 << 20


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


def _free_bytes(path: Path) -> Optional[int]:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            continue
    return None


def write_failure(exc: BaseException, path: Path) -> tuple[str, bool]:
    """(why writing under `path` failed, in one line; whether the disk is full). A full disk reads
    "[Errno 28] No space left on device: PATH, N MiB free there" however the writer reported it."""
    if _is_disk_full(exc):
        free = _free_bytes(path)
        free_text = f", {free / 2**20:.1f} MiB free there" if free is not None else ""
        return f"[Errno 28] No space left on device: {path}{free_text}", True
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", False


def _write_error(exc: BaseException, step: int, tmp: Path, previous: Optional["Checkpoint"]) -> CheckpointWriteError:
    kept = f"the previous checkpoint {previous.path} is intact" if previous else "no earlier checkpoint exists"
    reason, full = write_failure(exc, tmp)
    if full:
        fix = "free space or set trainer.run_dir on a larger filesystem, then resume (checkpoint.resume=auto)"
    else:
        fix = "fix the cause, then resume (checkpoint.resume=auto)"
    return CheckpointWriteError(f"checkpoint step {step} was not written ({reason}); {kept}: {fix}")


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


def _dist_world_and_gather() -> tuple[int, Callable[[Any], list]]:
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


# ---- checksums: each rank hashes the files it wrote at save, and a share of them at load ----------------
_WRITER = (re.compile(r"__(\d+)_\d+\.distcp$"), re.compile(r"rank(\d+)"))  # dist-checkpoint shards, per-rank state


def file_owner(relpath: str, world: int) -> int:
    """The rank that wrote a payload file (Megatron's __R_k.distcp, our *_rankR.pt), else rank 0; mod world."""
    for pattern in _WRITER:
        m = pattern.search(relpath)
        if m:
            return int(m.group(1)) % world
    return 0


def file_crc32(path: Path) -> str:
    """CRC-32 (zlib) of a file, read in 16 MiB chunks; cost per GB in docs/benchmarks.md (benchmarks/checksum_speed.py)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _payload_files(directory: Path) -> list[str]:
    skip = {MARKER, CHECKSUMS}
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name not in skip)


def _checksum_share(directory: Path, rank: int, world: int) -> dict[str, dict]:
    return {
        rel: {"size": (directory / rel).stat().st_size, "crc32": file_crc32(directory / rel)}
        for rel in _payload_files(directory)
        if file_owner(rel, world) == rank
    }


def _verify_share(directory: Path, manifest: dict[str, dict], rank: int, world: int) -> list[str]:
    problems = []
    for rel, want in sorted(manifest.items()):
        if file_owner(rel, world) != rank:
            continue
        path = directory / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, {want['size']} were written (truncated?)")
        elif file_crc32(path) != want["crc32"]:
            problems.append(f"{path} fails its checksum (crc32 {file_crc32(path)}, written {want['crc32']})")
    return problems


def _marker_problem(path: Path) -> Optional[str]:
    """Why the COMPLETE marker of a checkpoint is unusable (it is the JSON record _publish writes), or None."""
    marker = path / MARKER
    try:
        record = json.loads(marker.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError("not a record with an integer step")
    except (OSError, ValueError) as e:
        return f"{marker} is damaged ({type(e).__name__}: {e})"
    return None


TRUST_FLAG = "checkpoint.trust_unverified=true"


def unverifiable(ckpt: "Checkpoint") -> Optional[str]:
    """Why a checkpoint cannot be verified (its CHECKSUMS.json is gone), or None. Every checkpoint this
    project writes has one: without it a flipped byte would be trained on unnoticed."""
    manifest_path = ckpt.path / CHECKSUMS
    if manifest_path.is_file():
        return None
    return f"{manifest_path} is missing, so its files cannot be verified ({TRUST_FLAG} loads it unverified)"


def verify_checkpoint(
    ckpt: "Checkpoint", rank: int = 0, world: int = 1, gather=None, trust_unverified: bool = False
) -> list[str]:
    """Collective when `gather` is given (every rank checks its share): the problems found, [] when it
    verifies. One without a manifest is a problem, unless `trust_unverified` (then taken as it is)."""
    manifest_path = ckpt.path / CHECKSUMS
    problems = []
    missing = unverifiable(ckpt)
    if missing and not trust_unverified and rank == 0:
        problems = [missing]
    elif not missing:
        try:
            manifest = json.loads(manifest_path.read_text())
            problems = _verify_share(ckpt.path, manifest, rank, world)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems = [f"{manifest_path} is unreadable ({type(e).__name__}: {e})"] if rank == 0 else []
    marker_problem = _marker_problem(ckpt.path) if rank == 0 else None  # the marker is not in the manifest
    problems += [marker_problem] if marker_problem else []
    if gather is not None:
        problems = [p for share in gather(problems) for p in share]
    return problems


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

        `rank`/`barrier` default to torch.distributed's (or 0 / no-op without a process group). Each
        rank then checksums the files it wrote; rank 0 stores them all in CHECKSUMS.json before publishing.
        """
        default_rank, default_barrier = _dist_rank_and_barrier()
        rank = default_rank if rank is None else rank
        barrier = default_barrier if barrier is None else barrier
        world, gather = _dist_world_and_gather()
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
            error = _write_error(e, step, tmp, self.latest())
            if _raised_on_every_rank(e):  # only rank 0, the writer's coordinator, holds every rank's error
                from mcore_rl.platform import collectives

                error = CheckpointWriteError(collectives.from_rank0(str(error)))
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from e
        barrier()
        shares = gather(_checksum_share(tmp, rank, world))
        if rank == 0:
            manifest = {rel: entry for share in shares for rel, entry in share.items()}
            try:
                _write_atomic(tmp / CHECKSUMS, json.dumps(manifest, indent=0, sort_keys=True))
                self._publish(step, tmp, final, {"world_size": world, **(meta or {})})
            except OSError as e:
                raise _write_error(e, step, tmp, self.latest()) from e
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
        problem = _marker_problem(path)
        if problem:
            raise ConfigError(
                f"checkpoint.resume = {resume}: {problem}: resume from another checkpoint (checkpoint.resume=auto "
                f"takes the newest that verifies)"
            )
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


# ---------------------------------------------------------------------------------------------------------
# Ownership: one run per run directory
# ---------------------------------------------------------------------------------------------------------

LOCK_FILE = ".lock"  # RUN_DIR/.lock: "pid host start-time" of the run holding it
PREVIOUS_RUNS = "previous_runs"  # RUN_DIR/previous_runs/<time>/: an older run moved aside (move_old_run)
ABANDONED = "abandoned"  # RUN_DIR/checkpoints/abandoned/: checkpoints newer than the one a run resumed from


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

        from mcore_rl.config import ConfigError

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
    _fsync_dir(run_dir)
    return target


def abandon_newer(manager: CheckpointManager, resume: Checkpoint) -> list[Path]:
    """Move complete checkpoints newer than `resume` (an abandoned line of training) to checkpoints/abandoned/,
    so that resume=auto can never pick them up after this run continued from an older one."""
    moved = []
    for ckpt in manager.complete():
        if ckpt.step > resume.step:
            target = _unique(manager.root / ABANDONED / ckpt.path.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(ckpt.path, target)
            moved.append(target)
    if moved:
        _fsync_dir(manager.root)
        _write_atomic(manager.root / POINTER, resume.path.name + "\n")
    return moved


def claim_run_dir(cfg, resume: Optional[Checkpoint], log=None) -> RunLock:
    """Rank 0, before anything is written: lock RUN_DIR, refuse (or move aside) another run, abandon newer
    checkpoints when resuming from an older one of this run. Raises ConfigError with the fix."""
    from mcore_rl.config import ConfigError

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
            manager = CheckpointManager(run_dir)
            for path in abandon_newer(manager, resume):
                if log:
                    log.warning("resuming from %s: the newer %s was moved to %s", resume.path.name, path.name, path)
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
    checkpoint (`checkpoint_bytes`, from the memory plan: mcore_rl.megatron.memory_plan.checkpoint_bytes)."""
    from mcore_rl.config import ConfigError

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
    free = _free_bytes(target)
    if checkpoint_bytes is not None and free is not None and free < checkpoint_bytes:
        raise ConfigError(
            f"trainer.run_dir = {run_dir}: no space left for a checkpoint: one needs ~{checkpoint_bytes / 2**20:.1f} "
            f"MiB (weights and optimizer state), {free / 2**20:.1f} MiB are free on {target}: free space or choose a "
            f"trainer.run_dir on a larger filesystem"
        )


def check_run_dir(cfg, checkpoint_bytes: Optional[int] = None) -> None:
    """Pre-flight, before any process starts: the run directory is usable by this run (not a file, writable,
    room for one checkpoint, not locked by another run, not another run's checkpoints unless moving them aside)."""
    from mcore_rl.config import ConfigError

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
    import torch.distributed as dist

    from mcore_rl.config import ConfigError

    rank, _ = _dist_rank_and_barrier()
    lock, error = None, None
    if rank == 0:
        try:
            lock = claim_run_dir(cfg, resume, log)
        except ConfigError as e:
            error = str(e)
    if dist.is_available() and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)
    return lock


def resolve_verified_resume(cfg, log=None) -> Optional[Checkpoint]:
    """resolve_resume, then the checksums (collective: every rank verifies a share of the files).

    resume=auto falls back to the newest complete checkpoint that verifies, saying which it skipped and
    why; an explicit PATH that does not verify is a ConfigError naming the file."""
    from mcore_rl.config import ConfigError

    rank, _ = _dist_rank_and_barrier()
    world, gather = _dist_world_and_gather()
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
