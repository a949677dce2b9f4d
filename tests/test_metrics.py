"""Metrics: crash-safe JSONL, TensorBoard read back, resume truncation, rank gating, progress output, plots."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.metrics import METRICS_FILE, MetricsLogger, read_metrics
from mcore_rl.plot import group_metrics, plot_run
from tests.torchrun_util import REPO

LOGGING_CHILD = r"""
import sys, time
from pathlib import Path
from mcore_rl.metrics import MetricsLogger

m = MetricsLogger(sys.argv[1], rank=0, progress=False)
for step in (1, 2, 3):
    m.log(step, {"reward_mean": step / 10})
Path(sys.argv[2]).write_text("logged")
time.sleep(600)
"""


def cfg_for(tmp_path, *overrides):
    return load_config(None, [f"trainer.run_dir={tmp_path}", "trainer.steps=10", *overrides])


def test_jsonl_survives_sigkill(tmp_path):
    signal_file = tmp_path / "signal"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOGGING_CHILD, str(tmp_path), str(signal_file)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
    )
    try:
        deadline = time.time() + 120
        while not signal_file.exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_values_tensorboard_and_torn_line(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = cfg_for(tmp_path)
    with MetricsLogger(tmp_path, cfg, rank=0, progress=False) as m:
        rec = m.log(1, {"reward_mean": torch.tensor(0.25), "grad_norm": 1.5, "n_prompts": 8, "note": "warmup"})
        m.log(2, {"reward_mean": 0.5, "grad_norm": float("nan")})
    assert rec["reward_mean"] == 0.25 and isinstance(rec["reward_mean"], float) and rec["note"] == "warmup"
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert "note" not in acc.Tags()["scalars"]
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 3, "rew')  # a line cut by a crash
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_resume_drops_steps_after_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=False) as m:
        for step in range(1, 6):
            m.log(step, {"reward_mean": step})
    # Crash after step 5, checkpoint at step 3: steps 4, 5 will be replayed.
    with MetricsLogger(
        tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, start_step=3, progress=False
    ) as m:
        m.log(4, {"reward_mean": 40})
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_other_ranks_write_nothing(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, cfg_for(run), rank=1) as m:
        assert m.log(1, {"reward_mean": 1.0}) == {}
    assert not run.exists()


def test_wandb_enabled(tmp_path, caplog, monkeypatch):
    try:
        import wandb  # noqa: F401  (an optional extra; the default venv does not have it)

        installed = True
        monkeypatch.setenv("WANDB_MODE", "offline")
    except ImportError:
        installed = False
    with caplog.at_level(logging.WARNING):
        with MetricsLogger(
            tmp_path, cfg_for(tmp_path, "trainer.wandb=true", "trainer.tensorboard=false"), rank=0, progress=False
        ) as m:
            m.log(1, {"reward_mean": 1.0})
    assert read_metrics(tmp_path)[0]["reward_mean"] == 1.0
    if installed:
        assert (tmp_path / "wandb_id").exists()
    else:
        assert "wandb is not installed" in caplog.text


def test_progress_line_and_bar(tmp_path, capsys):
    with MetricsLogger(
        tmp_path, cfg_for(tmp_path, "trainer.log_every=2", "trainer.tensorboard=false"), rank=0, progress=False
    ) as m:
        m.log(1, {"reward_mean": 0.1, "tokens_per_s": 10.0})
        m.log(2, {"reward_mean": 0.5, "tokens_per_s": 1234.4})
    out = capsys.readouterr().out
    assert out.strip().splitlines() == ["step 2/10 reward 0.500 tok/s 1234"]
    with MetricsLogger(tmp_path / "bar", cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=True) as m:
        m.log(3, {"reward_mean": 0.75})
    err = capsys.readouterr().err
    assert "3/10" in err and "reward=0.750" in err


def test_plot_run_writes_pngs(tmp_path):
    import matplotlib.image

    with MetricsLogger(tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=False) as m:
        for step in range(1, 8):
            m.log(
                step,
                {
                    "reward_mean": step / 7,
                    "val_reward_mean": step / 8,
                    "response_len_mean": 10 + step,
                    "pg_loss": 1 / step,
                    "clipfrac_upper": 0.01,
                    "clipfrac_lower": 0.02,
                    "grad_norm": 0.5,
                    "tokens_per_s": 1000.0 + step,
                    "time_rollout_s": 1.0,
                    "time_update_s": 0.5,
                    "custom_thing": step,
                },
            )
    paths = plot_run(tmp_path)
    names = {p.name for p in paths}
    assert "overview.png" in names and "reward_mean.png" in names and "custom_thing.png" in names
    assert len(paths) == 1 + 11
    image = matplotlib.image.imread(tmp_path / "plots" / "overview.png")
    assert image.shape[0] > 300 and image.shape[1] > 800


def test_group_metrics():
    groups = group_metrics(
        [
            "reward_mean",
            "val_reward_mean",
            "clipfrac_upper",
            "clipfrac_lower",
            "tokens_per_s",
            "time_sync_s",
            "kl_ref",
            "approx_kl_old",
            "rollout_mismatch_k3",
            "weird",
        ]
    )
    assert groups["reward"] == ["reward_mean", "val_reward_mean"]
    assert groups["clip fractions"] == ["clipfrac_lower", "clipfrac_upper"]
    assert groups["tokens / s"] == ["tokens_per_s"] and groups["seconds per phase"] == ["time_sync_s"]
    assert groups["KL"] == ["approx_kl_old", "kl_ref"] and groups["train / rollout mismatch"] == ["rollout_mismatch_k3"]
    assert list(groups)[-1] == "weird"


def test_plot_empty_run_errors(tmp_path):
    with pytest.raises(ValueError, match="no numeric metrics"):
        plot_run(tmp_path)
