"""Per-step metrics on rank 0: JSONL (crash-safe), TensorBoard, optional W&B, and a progress line.

Metric names are flat strings, "section/name"; the plot groups them by name. The trainer logs:
  reward/{mean,std,errors} (every sample generated in the step, all rounds), val/reward_mean,
  groups/{all_correct,all_wrong} (fractions of the step's generated groups; with algo.dynamic_sampling also
  groups/{kept,dropped,rounds}: docs/dynamic-sampling.md), response/{length_mean,length_max,clip_ratio},
  train/{loss,pg_loss,kl_ref,approx_kl_old,entropy_old,clipfrac_upper,clipfrac_lower,dual_clipfrac,grad_norm,skipped_steps,update_successful,
  lr,rollout_mismatch_k3,is_weight_mean}, routing/{token_mismatch,expert_mismatch}, perf/{tokens_per_s,
  rollout_tokens_per_s,step_seconds}, time/{rollout,to_training,old_logprob,ref_logprob,update,sync}, sync/{seconds,gb_per_s,
  verify_max_diff,verify_mean_diff,rebuilt}. Any other numeric key is logged and plotted as well.

The progress line (without a terminal; with one, a tqdm bar) reads like a progress bar's:
  step 12/300 | 0.16 s/step | ETA 0:45 | reward 0.420 | tok/s 1234
where s/step is the median wall time of the last STEP_WINDOW steps as rank 0 logs them (validation and
checkpoints included; the median keeps one slow step from swinging the ETA) and the ETA is that x steps left.

JSONL lines are appended and flushed one step at a time, so a crash loses at most the step being written;
on resume from step S, lines of steps > S (logged after the checkpoint, replayed now) are dropped first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
REWARD_KEYS = ("reward/mean", "reward_mean", "reward")
THROUGHPUT_KEYS = ("perf/tokens_per_s", "tokens_per_s")
STEP_WINDOW = 20  # steps whose median wall time gives s/step and the ETA


class PhaseTimer:
    """Wall seconds per phase of a step (rollout, old_logprob, update, sync, ...): the time/* metrics."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def to_python(value: Any) -> Any:
    """Tensors / numpy scalars -> float or int; other values unchanged."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl (or of RUN_DIR/metrics.jsonl); a torn last line from a crash is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records = []
    if not path.exists():
        return records
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # only a line cut by a crash can be torn; later lines are still good
    return records


def _truncate_after(path: Path, step: int) -> None:
    """Keep records with step <= `step` (atomic rewrite)."""
    kept = [r for r in read_metrics(path) if r.get("step", -1) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def _first(metrics: Mapping[str, Any], keys: tuple[str, ...]) -> Optional[float]:
    for key in keys:
        if key in metrics and _is_number(metrics[key]):
            return float(metrics[key])
    return None


def format_duration(seconds: float) -> str:
    """M:SS, or H:MM:SS from an hour on (the clock format of progress bars)."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_step_seconds(seconds: float) -> str:
    """Three significant digits at most: 0.16, 2.35, 12.4, 130."""
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def eta_seconds(recent_step_seconds: Sequence[float], steps_left: int) -> Optional[float]:
    """Steps left x the median of the recent step times; None before the first step."""
    if not recent_step_seconds:
        return None
    return max(0, steps_left) * statistics.median(recent_step_seconds)


def progress_line(
    step: int, total: Optional[int], recent_step_seconds: Sequence[float], parts: Mapping[str, str]
) -> str:
    """`step 12/300 | 0.16 s/step | ETA 0:45 | reward 0.420 | tok/s 1234`: s/step is the median of the recent
    step times; no ETA without a total, neither before the first step time."""
    fields = [f"step {step}" + (f"/{total}" if total else "")]
    if recent_step_seconds:
        fields.append(f"{format_step_seconds(statistics.median(recent_step_seconds))} s/step")
        if total:
            fields.append(f"ETA {format_duration(eta_seconds(recent_step_seconds, total - step))}")
    fields += [f"{k} {v}" for k, v in parts.items()]
    return " | ".join(fields)


class StepTimes:
    """Wall seconds per step from the clock at each logged step (a gap of several steps is spread over them);
    the last `window` are kept in `recent`."""

    def __init__(self, start_step: int = 0, clock: Callable[[], float] = time.monotonic, window: int = STEP_WINDOW):
        self.clock = clock
        self.last_step, self.last_time = start_step, clock()
        self.recent: deque[float] = deque(maxlen=window)

    def tick(self, step: int) -> None:
        now = self.clock()
        steps = max(1, step - self.last_step)
        self.recent.extend([(now - self.last_time) / steps] * min(steps, self.recent.maxlen))
        self.last_step, self.last_time = step, now


class MetricsLogger:
    """Rank 0 writes; on other ranks every method is a no-op, so the trainer calls it unconditionally."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg=None,
        rank: Optional[int] = None,
        start_step: int = 0,
        progress: Optional[bool] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.total_steps = cfg.trainer.steps if cfg is not None else None
        self.log_every = cfg.trainer.log_every if cfg is not None else 1
        self._file = self._tb = self._wandb = self._bar = None
        self.step_times = StepTimes(start_step, clock)
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        if path.exists():
            _truncate_after(path, start_step)
        self._file = open(path, "a")
        if cfg is None or cfg.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if cfg is not None and cfg.trainer.wandb:
            self._wandb = self._init_wandb(cfg)
        use_bar = sys.stderr.isatty() if progress is None else progress
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _init_wandb(self, cfg):
        try:
            import wandb
        except ImportError:
            log.warning(
                "trainer.wandb=true but wandb is not installed (pip install 'mcore-rl[wandb]'): logging to JSONL/TensorBoard only"
            )
            return None
        # A stable id in the run dir makes a resumed run continue the same W&B run.
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        return wandb.init(
            project=cfg.trainer.wandb_project,
            name=self.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=asdict(cfg),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Record one step; returns the JSON record written (empty on non-zero ranks)."""
        if not self.enabled:
            return {}
        record = {"step": int(step), "time": time.time()}
        record.update({k: to_python(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        numbers = {k: float(v) for k, v in record.items() if k not in ("step", "time") and _is_number(v)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        self.step_times.tick(step)
        self._show(step, numbers)
        return record

    def _show(self, step: int, numbers: Mapping[str, float]) -> None:
        reward, speed = _first(numbers, REWARD_KEYS), _first(numbers, THROUGHPUT_KEYS)
        parts = {}
        if reward is not None:
            parts["reward"] = f"{reward:.3f}"
        if speed is not None and math.isfinite(speed):
            parts["tok/s"] = f"{speed:.0f}"
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(parts, refresh=True)
        elif step % self.log_every == 0 or step == self.total_steps:
            print(progress_line(step, self.total_steps, list(self.step_times.recent), parts), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()
        self._file = self._tb = self._wandb = self._bar = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SAMPLES_FILE = "samples.jsonl"


class SampleLog:
    """RUN_DIR/samples.jsonl (trainer.sample_log): rank 0's first `limit` scored samples of each rollout round,
    one JSON line each, so a person (or a test) sees what the policy wrote and how it was scored."""

    def __init__(self, run_dir: str | os.PathLike, limit: int, rank: int):
        self.limit = limit
        self._file = open(Path(run_dir) / SAMPLES_FILE, "a") if limit > 0 and rank == 0 else None

    def write(self, step: int, local, tokenizer, scored) -> None:
        """local: the round's LocalRollout; scored: the RewardBatch over its samples this rank scored (in order)."""
        if self._file is None:
            return
        for i, index in enumerate(local.scored[: self.limit]):
            s = local.sample(index)
            row = {
                "step": step,
                "response": tokenizer.decode(s.response_ids, skip_special_tokens=False),
                "response_ids": list(s.response_ids),
                "length": len(s.response_ids),
                "finish_reason": s.finish_reason,
                "task_reward": scored.task_rewards[i],
                "overlong_penalty": scored.penalties[i],
                "reward": scored.rewards[i],
            }
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
