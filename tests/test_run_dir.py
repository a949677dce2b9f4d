"""Checkpoint publishing: atomic under SIGKILL, pruning, resume resolution, multi-rank protocol."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.run_dir import MARKER, POINTER, CheckpointManager, resolve_resume
from tests.torchrun_util import REPO, run_worker

WORKERS = Path(__file__).parent / "workers"

# A real writer process that starts writing checkpoint `step`, signals, then hangs until killed.
KILLED_WRITER = r"""
import sys, time
from pathlib import Path
from mcore_rl.run_dir import CheckpointManager

run_dir, signal_file, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])

def write(tmp):
    with open(tmp / "weights.bin", "wb") as f:
        f.write(b"partial" * 1000)
        f.flush()
        signal_file.write_text("writing")
        time.sleep(600)
        f.write(b"never")

CheckpointManager(run_dir, keep_last=2).save(step, write)
"""


def write_payload(text: str):
    def write(tmp: Path) -> None:
        (tmp / "weights.bin").write_text(text)

    return write


def test_kill_during_write_keeps_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(10, write_payload("weights at 10"))
    signal_file = tmp_path / "signal"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(signal_file), "20"],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
    )
    try:
        deadline = time.time() + 60
        while not signal_file.exists():
            assert proc.poll() is None, "writer exited early"
            assert time.time() < deadline, "writer never started writing"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # The half-written checkpoint exists but is not complete; the previous one is the latest and loads.
    assert (manager.root / "step_00000020.tmp" / "weights.bin").exists()
    latest = manager.latest()
    assert latest.step == 10 and (latest.path / "weights.bin").read_text() == "weights at 10"
    assert (manager.root / POINTER).read_text().strip() == "step_00000010"
    # The next save clears the debris and publishes normally.
    manager.save(20, write_payload("weights at 20"))
    assert not list(manager.root.glob("*.tmp"))
    assert manager.latest().step == 20 and (manager.latest().path / "weights.bin").read_text() == "weights at 20"


def test_crash_after_rename_before_pointer_still_finds_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, write_payload("a"))
    manager.save(2, write_payload("b"))
    (manager.root / POINTER).write_text("step_00000001\n")  # pointer update lost in a crash
    assert manager.latest().step == 2
    # A marker written into a tmp dir that was never renamed is not a published checkpoint.
    stray = manager.root / "step_00000003.tmp"
    stray.mkdir()
    (stray / MARKER).write_text("{}")
    assert manager.latest().step == 2


def test_pruning_keeps_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10, 15, 20, 25):
        manager.save(step, write_payload(str(step)), meta={"data_position": step * 3})
    assert [c.step for c in manager.complete()] == [20, 25]
    assert sorted(p.name for p in manager.root.iterdir()) == [POINTER, "step_00000020", "step_00000025"]
    assert manager.latest().meta["data_position"] == 75
    with pytest.raises(ValueError, match="keep_last = 0"):
        CheckpointManager(tmp_path, keep_last=0)


def test_resave_same_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(3, write_payload("old"))
    manager.save(3, write_payload("new"))
    assert [c.step for c in manager.complete()] == [3]
    assert (manager.latest().path / "weights.bin").read_text() == "new"


def test_resolve_resume(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [f"trainer.run_dir={run}", "checkpoint.resume=auto"])
    assert resolve_resume(cfg) is None  # fresh run
    manager = CheckpointManager(run, keep_last=2)
    manager.save(4, write_payload("x"))
    manager.save(8, write_payload("y"))
    assert resolve_resume(cfg).step == 8
    assert resolve_resume(load_config(None, [f"trainer.run_dir={run}", "checkpoint.resume=never"])) is None
    explicit = load_config(None, [f"trainer.run_dir={tmp_path / 'other'}", f"checkpoint.resume={manager.step_dir(4)}"])
    assert resolve_resume(explicit).step == 4
    from_run = load_config(None, [f"trainer.run_dir={tmp_path / 'other'}", f"checkpoint.resume={run}"])
    assert resolve_resume(from_run).step == 8
    bad = load_config(None, [f"checkpoint.resume={run / 'checkpoints' / 'step_00000009'}"])
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        resolve_resume(bad)


@pytest.mark.slow
def test_multi_rank_save_protocol(tmp_path):
    results = run_worker(WORKERS / "run_dir_save.py", 2, run_dir=tmp_path, timeout=120).results
    assert [(r["world"], r["complete"], r["resumed_after_damage"]) for r in results] == [(2, [2, 3], 2)] * 2, results


# ---------------------------------------------------------------- one run per run directory
def _cfg(run, *overrides):
    return load_config(None, [f"trainer.run_dir={run}", *overrides])


def test_fresh_start_over_another_run_is_refused_or_moved_aside(tmp_path):
    """resume=never in a used run directory used to truncate its metrics and prune its checkpoints."""
    from mcore_rl.run_dir import PREVIOUS_RUNS, check_run_dir, claim_run_dir

    run = tmp_path / "run"
    CheckpointManager(run).save(8, write_payload("old run"))
    (run / "metrics.jsonl").write_text('{"step": 8}\n')
    never = _cfg(run, "checkpoint.resume=never")
    for check in (check_run_dir, lambda c: claim_run_dir(c, resolve_resume(c))):
        with pytest.raises(ConfigError) as err:
            check(never)
        message = str(err.value)
        assert str(run) in message and "step_00000008" in message
        assert "new trainer.run_dir" in message and "checkpoint.move_old_run=true" in message
    # Starting over from another directory's checkpoint is a fresh start too.
    other = tmp_path / "other"
    CheckpointManager(other).save(2, write_payload("other run"))
    with pytest.raises(ConfigError, match="holds another run's checkpoints"):
        check_run_dir(_cfg(run, f"checkpoint.resume={other}"))
    check_run_dir(_cfg(run, "checkpoint.resume=auto"))  # continuing the run is fine
    assert not (run / ".lock").read_text()  # the failed claims released the lock

    moving = _cfg(run, "checkpoint.resume=never", "checkpoint.move_old_run=true")
    check_run_dir(moving)
    lock = claim_run_dir(moving, resolve_resume(moving))
    lock.release()
    (moved,) = (run / PREVIOUS_RUNS).iterdir()
    assert (moved / "checkpoints" / "step_00000008" / "weights.bin").read_text() == "old run"
    assert (moved / "metrics.jsonl").read_text() == '{"step": 8}\n'
    assert CheckpointManager(run).latest() is None and not (run / "metrics.jsonl").exists()


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    from mcore_rl.run_dir import check_run_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_run_dir(_cfg(tmp_path / "f"))


LOCK_HOLDER = r"""
import sys, time
from mcore_rl.run_dir import RunLock
lock = RunLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
    """Two runs on one directory corrupted each other; the lock dies with its holder (kill -9 included)."""
    from mcore_rl.run_dir import RunLock, check_lock_free

    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        for attempt in (lambda: RunLock.acquire(tmp_path), lambda: check_lock_free(tmp_path)):
            with pytest.raises(ConfigError) as err:
                attempt()
            assert f"pid {holder.pid} on host" in str(err.value) and "is in use by another run" in str(err.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock.acquire(tmp_path)  # the dead holder's lock is gone with it
    assert str(os.getpid()) in (tmp_path / ".lock").read_text()
    lock.release()


FORKING_HOLDER = r"""
import os, sys, time
from mcore_rl.run_dir import RunLock
lock = RunLock.acquire(sys.argv[1])
child = os.fork()  # like a process forked to write checkpoint files: it shares the holder's open files
if child == 0:
    # the fork's after-in-child hooks have run once fork() returns here: say so only now (under load the
    # child may start long after the holder printed anything)
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_lock_dies_with_its_holder_not_with_what_it_forked(tmp_path):
    """A child forked by the holder outlives a kill -9 of it: the lock must be free all the same (an flock
    belongs to the open file, which the fork shares)."""
    from mcore_rl.run_dir import RunLock

    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            RunLock.acquire(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # still running
        RunLock.acquire(tmp_path).release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_lock_without_flock_detects_stale_and_live_holders(tmp_path, monkeypatch):
    """Filesystems without flock (Lustre without -o flock): the recorded pid/host decides."""
    import errno
    import fcntl
    import socket

    from mcore_rl.run_dir import RunLock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{dead.pid} {socket.gethostname()} 0\n")
    RunLock.acquire(tmp_path).release()  # stale: that pid is gone
    (tmp_path / ".lock").write_text(f"{os.getppid()} {socket.gethostname()} 0\n")
    with pytest.raises(ConfigError, match="has no flock"):
        RunLock.acquire(tmp_path)
    (tmp_path / ".lock").write_text("1 another-host 0\n")
    with pytest.raises(ConfigError, match="on host another-host.*delete"):
        RunLock.acquire(tmp_path)


def test_resuming_from_an_older_checkpoint_abandons_the_newer_ones(tmp_path):
    """Resume from step 4, save step 6: a later resume=auto must load that 6, never the stale 8."""
    from mcore_rl.run_dir import ABANDONED, claim_run_dir

    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=5)
    for step in (2, 4, 6, 8):
        manager.save(step, write_payload(f"first line {step}"))
    cfg = _cfg(run, f"checkpoint.resume={manager.step_dir(4)}")
    claim_run_dir(cfg, resolve_resume(cfg)).release()
    assert [c.step for c in manager.complete()] == [2, 4]
    abandoned = manager.root / ABANDONED
    assert sorted(p.name for p in abandoned.iterdir()) == ["step_00000006", "step_00000008"]
    assert (abandoned / "step_00000008" / "weights.bin").read_text() == "first line 8"
    assert (manager.root / POINTER).read_text().strip() == "step_00000004"
    manager.save(6, write_payload("second line 6"))
    auto = resolve_resume(_cfg(run, "checkpoint.resume=auto"))
    assert auto.step == 6 and (auto.path / "weights.bin").read_text() == "second line 6"


# ---------------------------------------------------------------- checksums
def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "0xFF":  # same size, 4 KiB of 0xFF: only the checksum can tell
        with open(path, "r+b") as f:
            f.seek(16)
            f.write(b"\xff" * 4096)
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "0xFF", "missing"])
def test_damaged_newest_checkpoint_falls_back_and_names_the_file(tmp_path, caplog, how):
    import logging

    from mcore_rl.run_dir import CHECKSUMS, resolve_verified_resume

    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=3)

    def write(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "__0_0.distcp").write_bytes(os.urandom(10_000))
        (tmp / "trainer_state_rank0.pt").write_bytes(os.urandom(100))

    for step in (2, 4):
        manager.save(step, write)
    manifest = json.loads((manager.step_dir(4) / CHECKSUMS).read_text())
    assert sorted(manifest) == ["actor/__0_0.distcp", "trainer_state_rank0.pt"]
    damaged = manager.step_dir(4) / "actor" / "__0_0.distcp"
    _damage(damaged, how)
    expected = {"truncated": "truncated", "0xFF": "fails its checksum", "missing": "is missing"}[how]
    with caplog.at_level(logging.WARNING):
        chosen = resolve_verified_resume(_cfg(run, "checkpoint.resume=auto"), logging.getLogger("test"))
    assert chosen.step == 2
    assert f"checkpoint {manager.step_dir(4)} skipped: {damaged}" in caplog.text and expected in caplog.text
    with pytest.raises(ConfigError) as err:
        resolve_verified_resume(_cfg(run, f"checkpoint.resume={manager.step_dir(4)}"))
    assert str(damaged) in str(err.value) and expected in str(err.value)


def test_checkpoint_without_its_checksums_is_not_trusted_unless_asked(tmp_path, caplog):
    """The newest checkpoint's CHECKSUMS.json deleted and a byte of its shard flipped: it used to be resumed
    from silently. resume=auto falls back to the previous one with a warning; resume=PATH fails in the
    pre-flight naming the flag; checkpoint.trust_unverified=true loads it (with a warning)."""
    import logging

    from mcore_rl.run_dir import CHECKSUMS, check_run_dir, resolve_verified_resume

    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=3)

    def write(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "__0_0.distcp").write_bytes(bytes(10_000))

    for step in (2, 4):
        manager.save(step, write)
    newest = manager.step_dir(4)
    (newest / CHECKSUMS).unlink()
    with open(newest / "actor" / "__0_0.distcp", "r+b") as f:
        f.seek(5000)
        f.write(b"\x01")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    log = logging.getLogger("test")
    with caplog.at_level(logging.WARNING):
        assert resolve_verified_resume(_cfg(run, "checkpoint.resume=auto"), log).step == 2
    assert f"checkpoint {newest} skipped: {newest / CHECKSUMS} is missing" in caplog.text
    assert "checkpoint.trust_unverified=true loads it unverified" in caplog.text
    for check in (check_run_dir, resolve_verified_resume):  # the pre-flight, then the ranks
        with pytest.raises(ConfigError) as err:
            check(_cfg(run, f"checkpoint.resume={newest}"))
        assert f"{newest / CHECKSUMS} is missing" in str(err.value)
        assert "checkpoint.trust_unverified=true" in str(err.value)
    caplog.clear()
    trusted = "checkpoint.trust_unverified=true"
    with caplog.at_level(logging.WARNING):
        assert resolve_verified_resume(_cfg(run, "checkpoint.resume=auto", trusted), log).step == 4
    assert "loaded unverified" in caplog.text
    check_run_dir(_cfg(run, f"checkpoint.resume={newest}", trusted))
    assert resolve_verified_resume(_cfg(run, f"checkpoint.resume={newest}", trusted)).step == 4
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing changed


# ---------------------------------------------------------------- disk full
@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs where one can be mounted (root), else None (the test injects ENOSPC instead)."""
    mount = tmp_path / "small"
    mount.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if ok.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        # Lazy: the failed write's file object may still be open in the test's traceback.
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_outside_a_checkpoint_write_is_named(small_filesystem, tmp_path):
    """A disk that filled during the run failed the next metrics.jsonl write: the run ended with "a worker failed"
    and a traceback in the log; `disk_full_error` (the trainer's run() raises it) names the path, "No space left
    on device" and the newest checkpoint, which verifies. Other errors stay as they are."""
    import errno

    import torch

    from mcore_rl.metrics import MetricsLogger
    from mcore_rl.run_dir import verify_checkpoint
    from mcore_rl.run_dir.errors import disk_full_error

    run = (small_filesystem or tmp_path) / "run"
    manager = CheckpointManager(run, keep_last=1)
    manager.save(1, lambda tmp: torch.save({"w": torch.ones(50_000)}, tmp / "state.pt"))
    logger = MetricsLogger(run, _cfg(run, "trainer.tensorboard=false"), rank=0, progress=False)
    logger.log(1, {"loss": 1.0})
    if small_filesystem is None:  # not root: the error a full disk gives a flush (no file named), injected
        failure = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    else:
        with (
            open(run / "filler", "wb", buffering=0) as f,
            pytest.raises(OSError) as filled,
        ):  # what fills the disk mid-run
            while True:
                f.write(b"\0" * 65536)
        assert filled.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as err:  # the file's last page fills first: a few steps more
            for step in range(2, 1000):
                logger.log(step, {"loss": 0.5, "note": "x" * 512})
        failure = err.value
    assert failure.errno == errno.ENOSPC and failure.filename is None  # the reference: the OS's own error
    error = disk_full_error(failure, run)
    message = str(error)
    assert message.startswith(f"the run stopped: a write failed ([Errno 28] No space left on device: {run}, ")
    assert f"the newest checkpoint {manager.step_dir(1)} is intact" in message and "checkpoint.resume=auto" in message
    assert not verify_checkpoint(manager.latest())  # what the line says is intact, is
    named = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "samples.jsonl"))
    assert f"No space left on device: {run / 'samples.jsonl'}, " in str(disk_full_error(named, run))
    assert disk_full_error(OSError(errno.EACCES, "Permission denied"), run) is None
    assert disk_full_error(error, run) is None  # already the one line


def test_disk_full_names_the_os_error_and_keeps_the_previous_checkpoint(small_filesystem, tmp_path):
    """torch.save on a full disk said only "enforce fail at inline_container.cc ... unexpected pos"."""
    import errno

    import torch

    from mcore_rl.run_dir import CheckpointWriteError, resolve_verified_resume

    run = (small_filesystem or tmp_path) / "run"
    manager = CheckpointManager(run, keep_last=1)

    def write(size):
        def fn(tmp: Path) -> None:
            if small_filesystem is None and size > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "state.pt"))
            torch.save({"w": torch.ones(size // 4)}, tmp / "state.pt")  # torch's own zip writer

        return fn

    manager.save(1, write(200_000))
    with pytest.raises(CheckpointWriteError) as err:
        manager.save(2, write(2_000_000))  # does not fit next to step 1
    message = str(err.value)
    assert "No space left on device" in message and str(manager.root / "step_00000002.tmp") in message
    assert f"the previous checkpoint {manager.step_dir(1)} is intact" in message
    assert manager.latest().step == 1
    assert resolve_verified_resume(_cfg(run, "checkpoint.resume=auto")).step == 1  # and its checksums verify
