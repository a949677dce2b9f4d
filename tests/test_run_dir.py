"""Checkpoint publishing: atomic under SIGKILL, pruning, resume resolution, multi-rank protocol."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.run_dir import MARKER, POINTER, CheckpointManager, resolve_resume
from tests.torchrun_util import REPO, run_torchrun

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
    out = run_torchrun(WORKERS / "run_dir_save.py", 2, str(tmp_path), timeout=120)
    assert "rank 0 ok" in out and "rank 1 ok" in out
