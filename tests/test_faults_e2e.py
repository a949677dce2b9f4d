"""Faults of a running job that end in one line (`mcore-rl: error: ...` or the stop line), printed last, with a
non-zero exit and nothing saved lost: a full disk during a checkpoint save, the export and the plots (a real
tmpfs mounted where each is written), Ctrl-C twice during a save (real signals to `mcore-rl train`), a reward
function that raises KeyboardInterrupt on every call with reward.max_error_rate = 1.0, one that SIGKILLs its
rank, NaN input weights where no pre-flight ran, convert with a layout its torchrun processes cannot hold. Real
torchrun, 2 processes, the tiny model, a few steps."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.run_dir import CheckpointManager, verify_checkpoint
from tests.torchrun_util import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path_factory.mktemp("task"), train_size=64, val_size=8, seed=0)
    return str(train), str(val)


def train_cmd(model, task, run_dir, **extra) -> list[str]:
    settings = {
        "model.path": model,
        "data.train_path": task[0],
        "data.val_path": task[1],
        "trainer.run_dir": str(run_dir),
        "trainer.val_every": 0,
        "trainer.steps": 2,
        "checkpoint.save_every": 2,
        "data.prompts_per_step": 4,
        "rollout.n": 4,
        "actor.parallel.micro_batch_size": 4,
        "trainer.plots": "false",  # on only where a plot's write is the fault
        **extra,
    }
    args = [f"{k}={v}" for k, v in settings.items()]
    return [sys.executable, "-m", "mcore_rl.cli", "train", str(REPO / "configs/tiny/gspo_cpu.yaml"), *args]


def last_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def assert_no_worker_traceback(out: str) -> None:
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-6000:]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(path, size): a tmpfs of `size` at path (made), unmounted after the test; skips where not root."""
    points: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        points.append(path)
        return path

    yield mount
    for point in points:
        subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.mark.parametrize(
    "where, size, steps, expected",
    [
        # room for one checkpoint (~3.6 MiB) of the tiny model, not for the second next to it
        ("checkpoints", "6m", 4, "checkpoint step 4 was not written ([Errno 28] No space left on device"),
        ("hf", "256k", 2, "the Hugging Face export {run}/hf was not written ([Errno 28] No space left on device"),
        ("plots", "64k", 2, "the plots {run}/plots were not written ([Errno 28] No space left on device"),
    ],
    ids=["save", "export", "plots"],
)
def test_disk_full_while_writing(tiny_model_dir, task, tmp_path, tmpfs, where, size, steps, expected):
    run = tmp_path / "run"
    tmpfs(run / where, size)
    proc = subprocess.run(
        train_cmd(tiny_model_dir, task, run, **{"trainer.steps": steps, "trainer.plots": "true"}),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout + proc.stderr
    line = last_line(out)
    assert proc.returncode == 1, out[-6000:]
    assert line.startswith("mcore-rl: error: ") and expected.format(run=run) in line, out[-6000:]
    assert out.count(line) == 1  # said once, by one rank
    assert_no_worker_traceback(out)
    newest = CheckpointManager(run).latest()
    assert newest.step == 2 and not verify_checkpoint(newest)  # what the line says is intact, is
    assert f"{newest.path}" in line or where == "plots"
    assert not list((run / "checkpoints").glob("*.tmp"))  # the failed save's part is gone (space given back)
    if where == "hf":
        assert not list((run / "hf").iterdir())  # no half-written shard
        assert "mcore-rl convert mcore-to-hf" in line
    if where == "plots":
        assert (run / "hf" / "model.safetensors").is_file() and f"mcore-rl plot {run}" in line


def test_disk_filling_during_the_run_is_named(tiny_model_dir, task, tmp_path, tmpfs):
    """The run directory's disk fills after step 2's checkpoint (another writer takes the rest): the next write,
    TensorBoard's events or metrics.jsonl, ended the run with "a worker failed" and a traceback in the log; the
    last line now names the run directory, "No space left on device" and the checkpoint, which verifies."""
    run = tmpfs(tmp_path / "run", "16m")
    cmd = train_cmd(tiny_model_dir, task, run, **{"trainer.steps": 8})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_00000002").is_dir():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.05)
    with open(run / "filler", "wb", buffering=0) as f, pytest.raises(OSError):  # the disk fills
        while True:
            f.write(b"\0" * 65536)
    out, _ = proc.communicate(timeout=600)
    line = last_line(out)
    assert proc.returncode == 1, out[-6000:]
    assert line.startswith("mcore-rl: error: the run stopped: a write failed ([Errno 28] No space left on device: "), (
        out[-6000:]
    )
    newest = CheckpointManager(run).latest()
    assert (
        newest.step == 2 and not verify_checkpoint(newest) and f"the newest checkpoint {newest.path} is intact" in line
    )


def test_ctrl_c_twice_during_a_save_prints_the_stop_line(tiny_model_dir, task, tmp_path):
    """Ctrl-C twice used to print KeyboardInterrupt tracebacks from inside the checkpoint writer (and torchrun's
    SignalException); the checkpoint being written was never published, which still holds."""
    run = tmp_path / "run"
    cmd = train_cmd(tiny_model_dir, task, run, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.time() + 300
        while not list((run / "checkpoints").glob("step_00000002.tmp")):  # the second save is being written
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-4000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = last_line(out)
    assert proc.returncode == 128 + signal.SIGINT, out[-6000:]
    assert line.startswith("mcore-rl: stopped ") and "continue with checkpoint.resume=auto" in line, out[-6000:]
    assert_no_worker_traceback(out)
    newest = CheckpointManager(run).latest()
    assert newest.step in (1, 2) and not verify_checkpoint(newest) and f"newest checkpoint: {newest.path}" in line
    assert newest.step < 50 and not (run / "hf").exists()


def test_reward_that_always_raises_keyboard_interrupt(tiny_model_dir, task, tmp_path):
    """In the trainer's process (reward.timeout_s = 0) with reward.max_error_rate = 1.0: the run used to end in
    a traceback ("global counts must be positive"); now step 1 stops with the reward's own error."""
    run = tmp_path / "run"
    cmd = train_cmd(
        tiny_model_dir,
        task,
        run,
        **{"reward.fn": "tests.faulty_reward:interrupts", "reward.timeout_s": 0, "reward.max_error_rate": 1.0},
    )
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    out = proc.stdout + proc.stderr
    line = last_line(out)
    assert proc.returncode == 1, out[-6000:]
    assert line.startswith("mcore-rl: error: step 1: the reward function failed on all 16 samples"), out[-6000:]
    assert "first error: KeyboardInterrupt" in line and "fix the reward function" in line
    assert "Traceback" not in out
    assert CheckpointManager(run).latest() is None and not (run / "hf").exists()


def test_reward_that_kills_the_trainer_process(tiny_model_dir, task, tmp_path):
    """A SIGKILL leaves no worker line: the launcher names the rank, the signal and the likely causes."""
    run = tmp_path / "run"
    cmd = train_cmd(
        tiny_model_dir, task, run, **{"reward.fn": "tests.faulty_reward:kills_its_process", "reward.timeout_s": 0}
    )
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    out = proc.stdout + proc.stderr
    line = last_line(out)
    assert proc.returncode == 128 + signal.SIGKILL, out[-6000:]
    assert line.startswith("mcore-rl: error: rank ") and "was killed by SIGKILL" in line, out[-6000:]
    assert "set reward.timeout_s > 0" in line and f"{run / 'torchrun.log'}" in line
    assert "Traceback" not in out
    assert CheckpointManager(run).latest() is None and not (run / "hf").exists()


def test_convert_with_a_layout_the_processes_cannot_hold(tiny_model_dir, tmp_path):
    """--tp 3 on 2 torchrun processes used to fail inside Megatron on both ranks; now rank 0 says it once."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "mcore_rl.convert",
    ]
    cmd += ["hf-to-mcore", "--hf", tiny_model_dir, "--out", str(out), "--tp", "3"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("mcore-rl convert: error: ")]
    assert proc.returncode != 0 and len(errors) == 1, text[-4000:]
    assert "world size 2" in errors[0] and "tp" in errors[0], errors
    assert "[rank0]" not in text and "[rank1]" not in text  # no worker traceback
    assert not out.exists()


def test_nan_input_weights_under_plain_torchrun(tiny_model_dir, task, tmp_path):
    """Launchers that start the ranks themselves (launch/, a scheduler's torchrun) skip the pre-flight: the
    loaded weights are checked on every rank before the engine samples from them (it used to be a sampling
    traceback on every rank)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.1.mlp.gate.weight"][3, 5] = float("nan")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    run = tmp_path / "run"
    cmd = train_cmd(str(model), task, run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *cmd[1:]]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("mcore-rl: error: ")]
    assert proc.returncode != 0 and len(errors) == 1, text[-4000:]
    assert errors[0].startswith(f"mcore-rl: error: model.path = {model}: the weights hold NaN/inf (first: ")
    assert "the input model is damaged: download it again" in errors[0]
    assert "[rank0]" not in text and "[rank1]" not in text  # no worker traceback (torchrun's own report remains)
    assert CheckpointManager(run).latest() is None
