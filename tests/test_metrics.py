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
from mcore_rl.metrics import (
    METRICS_FILE,
    MetricsLogger,
    StepTimes,
    eta_seconds,
    format_duration,
    format_step_seconds,
    progress_line,
    read_metrics,
)
from mcore_rl.plot import group_metrics, numeric_series, overview_figure, plot_run
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


class FakeClock:
    """Returns the given times one call after another."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_progress_formats():
    assert [format_duration(s) for s in (0, 45.4, 59.6, 61, 3599, 3600, 3725, 36000)] == [
        "0:00",
        "0:45",
        "1:00",
        "1:01",
        "59:59",
        "1:00:00",
        "1:02:05",
        "10:00:00",
    ]
    assert [format_step_seconds(s) for s in (0.1612, 2.346, 12.44, 130.4)] == ["0.16", "2.35", "12.4", "130"]
    line = progress_line(12, 300, [0.15, 0.16, 0.17], {"reward": "0.420", "tok/s": "1234"})
    assert line == "step 12/300 | 0.16 s/step | ETA 0:46 | reward 0.420 | tok/s 1234"  # 288 x 0.16 s
    assert progress_line(3, None, [2.0], {}) == "step 3 | 2.00 s/step"  # no total, no ETA
    assert progress_line(1, 10, [], {"reward": "0.1"}) == "step 1/10 | reward 0.1"


def test_eta_is_steps_left_times_the_median_recent_step():
    assert eta_seconds([], 10) is None
    assert eta_seconds([1.0, 1.2, 30.0], 100) == pytest.approx(120.0)  # one slow (checkpoint) step: no swing
    assert eta_seconds([1.0, 3.0], 0) == 0.0
    times = StepTimes(start_step=5, clock=FakeClock(100.0, 101.0, 102.5, 112.5), window=3)
    times.tick(6)
    times.tick(7)
    assert list(times.recent) == [1.0, 1.5]
    times.tick(11)  # four steps in 10 s (e.g. log_every > 1 upstream): 2.5 s each, the window keeps 3
    assert list(times.recent) == [2.5, 2.5, 2.5]


def test_progress_line_and_bar(tmp_path, capsys):
    clock = FakeClock(0.0, 2.0, 2.5, 3.5, 4.0)  # the logger's start, then one time per logged step
    with MetricsLogger(
        tmp_path,
        cfg_for(tmp_path, "trainer.log_every=2", "trainer.tensorboard=false"),
        rank=0,
        progress=False,
        clock=clock,
    ) as m:
        m.log(1, {"reward_mean": 0.1, "tokens_per_s": 10.0})
        m.log(2, {"reward_mean": 0.5, "tokens_per_s": 1234.4})
        m.log(3, {"reward_mean": 0.5})
        m.log(4, {"reward/mean": 0.25, "perf/tokens_per_s": 99.6})
    out = capsys.readouterr().out
    # step times 2.0, 0.5, 1.0, 0.5: medians 1.25 (after step 2) and 0.75 (after step 4, 6 steps left)
    assert out.strip().splitlines() == [
        "step 2/10 | 1.25 s/step | ETA 0:10 | reward 0.500 | tok/s 1234",
        "step 4/10 | 0.75 s/step | ETA 0:04 | reward 0.250 | tok/s 100",
    ]
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
                    "time/rollout": 1.0,
                    "time/update": 0.5,
                    "custom_thing": step,
                },
            )
    paths = plot_run(tmp_path)
    names = {p.name for p in paths}
    assert "overview.png" in names and "reward_mean.png" in names and "custom_thing.png" in names
    assert len(paths) == 1 + 11
    image = matplotlib.image.imread(tmp_path / "plots" / "overview.png")
    assert image.shape[0] > 300 and image.shape[1] > 800


def test_plot_run_in_parts_writes_the_same_pngs(tmp_path):
    """The trainer's ranks write the plots together (part=(rank, world)): the parts are disjoint, together they are
    the whole set, and each PNG is the one a single call writes."""
    with MetricsLogger(tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=False) as m:
        for step in range(1, 5):
            m.log(step, {"reward_mean": step / 4, "pg_loss": 1 / step, "grad_norm": 0.5, "time/update": 0.5})
    whole = {p.name: p.read_bytes() for p in plot_run(tmp_path, tmp_path / "whole")}
    parts = [plot_run(tmp_path, tmp_path / "parts", part=(i, 3)) for i in range(3)]
    names = [p.name for part in parts for p in part]
    assert sorted(names) == sorted(whole) and len(names) == len(set(names)) == 5
    assert parts[0][0].name == "overview.png" and all(len(part) >= 1 for part in parts)
    for name, data in whole.items():
        assert (tmp_path / "parts" / name).read_bytes() == data, name
    with pytest.raises(ValueError, match="index must be in 0 .. 2"):
        plot_run(tmp_path, part=(3, 3))


def test_group_metrics():
    groups = group_metrics(
        [
            "reward_mean",
            "val_reward_mean",
            "clipfrac_upper",
            "clipfrac_lower",
            "tokens_per_s",
            "time/sync",
            "kl_ref",
            "approx_kl_old",
            "rollout_mismatch_k3",
            "weird",
        ]
    )
    assert groups["reward"] == ["reward_mean", "val_reward_mean"]
    assert groups["clip fractions"] == ["clipfrac_lower", "clipfrac_upper"]
    assert groups["tokens / s"] == ["tokens_per_s"] and groups["seconds per phase"] == ["time/sync"]
    assert groups["KL"] == ["approx_kl_old", "kl_ref"] and groups["train / rollout mismatch"] == ["rollout_mismatch_k3"]
    assert list(groups)[-1] == "weird"


def test_separate_placement_metrics_have_their_panels():
    """Staleness and each role's wait get panels of their own; the roles' rates join the tokens / s panel."""
    keys = [
        "train/staleness_max",
        "train/staleness_mean",
        "time/actor_wait",
        "time/rollout_wait",
        "time/rollout_generate",
        "time/update",
        "perf/rollout_role_tokens_per_s",
        "perf/tokens_per_s",
    ]
    groups = group_metrics(keys)
    assert groups["staleness (weight versions)"] == ["train/staleness_max", "train/staleness_mean"]
    assert groups["seconds each role waits"] == ["time/actor_wait", "time/rollout_wait"]
    assert groups["seconds per phase"] == ["time/rollout_generate", "time/update"]
    assert groups["tokens / s"] == ["perf/rollout_role_tokens_per_s", "perf/tokens_per_s"]


# One record with every name the trainer logs (mcore_rl/trainer.py: train_step, validate, sync_engine; KL, entropy
# and routing keys of an SAPO + KL + R2 run with a separate old-policy pass).
TRAINER_RECORD = {
    **dict.fromkeys(("reward/mean", "reward/std", "reward/errors", "val/reward_mean"), 0.5),
    **dict.fromkeys(("response/length_mean", "response/length_max", "response/clip_ratio"), 3.0),
    **dict.fromkeys(("perf/step_data_bytes", "perf/tokens_per_s", "perf/rollout_tokens_per_s"), 900.0),
    "perf/step_seconds": 1.25,
    **dict.fromkeys(("train/staleness_max", "train/staleness_mean"), 0.0),
    **dict.fromkeys(
        ("time/rollout", "time/to_training", "time/old_logprob", "time/ref_logprob", "time/update", "time/sync"), 0.2
    ),
    **dict.fromkeys(
        (
            "train/loss",
            "train/pg_loss",
            "train/kl_ref",
            "train/approx_kl_old",
            "train/entropy",
            "train/entropy_old",
            "train/clipfrac_upper",
            "train/clipfrac_lower",
            "train/dual_clipfrac",
            "train/grad_norm",
            "train/lr",
            "train/rollout_mismatch_k3",
            "train/update_successful",
            "train/skipped_steps",
            "routing/token_mismatch",
            "routing/expert_mismatch",
        ),
        0.01,
    ),
    **dict.fromkeys(("sync/seconds", "sync/gb_per_s", "sync/verify_max_diff", "sync/verify_mean_diff"), 0.1),
    **dict.fromkeys(("sync/verify_high_diff", "sync/verify_weights_differ", "sync/rebuilt"), 0.0),
}


def test_phase_panel_holds_the_phase_times_only(tmp_path):
    """The trainer's phase times, and no rate or total (sync/gb_per_s once landed on this seconds axis)."""
    with MetricsLogger(tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=False) as m:
        for step in (1, 2):
            m.log(step, TRAINER_RECORD)
    keys = {k for r in read_metrics(tmp_path) for k in r} - {"step", "time"}
    assert keys == set(TRAINER_RECORD)
    assert group_metrics(keys)["seconds per phase"] == [
        "time/old_logprob",
        "time/ref_logprob",
        "time/rollout",
        "time/sync",
        "time/to_training",
        "time/update",
    ]


def test_overview_title_clears_the_panels():
    """The run's name above the panels: it overlaps no panel or panel title (with tight_layout it sat on the
    second panel's title)."""
    series = {key: ([1, 2, 3], [value] * 3) for key, value in TRAINER_RECORD.items()}
    fig = overview_figure(series, "tiny_gspo_cpu")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (title,) = [t for t in fig.texts if t.get_text() == "tiny_gspo_cpu"]
    box = title.get_window_extent(renderer)
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == len(group_metrics(series))
    for ax in panels:
        assert not box.overlaps(ax.title.get_window_extent(renderer)), ax.get_title()
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_empty_run_errors(tmp_path):
    with pytest.raises(ValueError, match="no numeric metrics"):
        plot_run(tmp_path)


def test_overview_draws_only_the_metrics_that_change(tmp_path):
    """Issue 34 (12): a third of a run's 31 overview panels were flat lines (KL 0 without a reference, clip
    fractions 0, a constant lr, update_successful). The overview draws the metrics that change; the constant ones
    are named under its panels with their value, and every metric keeps its own PNG."""
    changing = {"reward/mean": lambda s: s / 6, "train/grad_norm": lambda s: 1 / s, "time/update": lambda s: 0.1 * s}
    constant = {"train/kl_ref": 0.0, "train/clipfrac_upper": 0.0, "train/lr": 1e-3, "train/update_successful": 1.0}
    with MetricsLogger(tmp_path, cfg_for(tmp_path, "trainer.tensorboard=false"), rank=0, progress=False) as m:
        for step in range(1, 7):
            once = {"sync/calibration_max_diff": 2e-7} if step == 1 else {}  # logged at the first sync only
            m.log(step, {**{k: f(step) for k, f in changing.items()}, **constant, **once})
    constant["sync/calibration_max_diff"] = 2e-7
    series = numeric_series(read_metrics(tmp_path))
    fig = overview_figure(series, "run")
    panels = sorted(ax.get_title() for ax in fig.axes if ax.axison)
    assert panels == ["grad norm", "reward", "seconds per phase"]  # GROUPS' titles of the three changing metrics
    footer = fig._supxlabel.get_text().replace("\n", " ")
    assert all(f"{key} {value:.4g}" in footer for key, value in constant.items()), footer
    assert not any(key in footer for key in changing)
    names = {p.name for p in plot_run(tmp_path)}
    assert names == {"overview.png", *(f"{k.replace('/', '_')}.png" for k in [*changing, *constant])}
    from mcore_rl.plot import informative

    one_step = {key: ([1], ys[:1]) for key, (xs, ys) in series.items()}  # nothing changes yet: all of them
    assert informative(one_step) == (one_step, {})
    import matplotlib.pyplot as plt

    plt.close(fig)
