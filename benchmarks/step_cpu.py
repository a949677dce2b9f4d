"""CPU time (time.process_time) and wall time of each phase of a training step, per rank.

    python benchmarks/step_cpu.py CONFIG [key=value ...] [--skip 3]

Starts `torchrun` with trainer.nproc processes running this file; each rank runs the ordinary trainer
(`mcore_rl.trainer.run`) with the step's phases wrapped in timers, then writes RUN_DIR/step_cpu/rank{r}.json;
the launcher prints, per rank, the median CPU and wall milliseconds of each phase over the steps after the first
`--skip` (a phase counted only in the steps it ran in, e.g. the sync verification every rollout.verify_every).
CPU time is what a rank itself spends, whatever else the machine runs; wall minus CPU is mostly waiting for the
other ranks in collectives (or for a core). Python's own garbage collections are counted apart (`gc`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (owner, method, phase): owner "trainer" is mcore_rl.trainer.Trainer, "generator" mcore_rl.generation.StepGenerator,
# "actor" mcore_rl.megatron.actor.Actor, "sync" mcore_rl.weight_sync.sync.WeightSync, "verifier"
# mcore_rl.weight_sync.verifier.SyncVerifier
PHASES = [
    ("generator", "step", "rollout (generate + score + metadata)"),
    ("trainer", "_mini_batches", "mini-batches (plan + step data)"),
    ("trainer", "_actor_passes", "actor passes (old lp + update)"),
    ("actor", "_run_schedule", "  forward / backward schedule"),
    ("actor", "_step_if_finite", "  optimizer step"),
    ("actor", "_reduce_metrics", "  loss metrics reduce"),
    ("actor", "check_weights_finite", "weights finite check"),
    ("sync", "after_update", "sync (+ verify)"),
    ("verifier", "verify", "  verification"),
    ("trainer", "_step_metrics", "step metrics"),
]


class Timers:
    """Per-step CPU / wall seconds of each phase, then one list entry per step."""

    def __init__(self):
        self.current: dict[str, list[float]] = {}
        self.steps: list[dict[str, list[float]]] = []
        self._gc_start = None

    def add(self, phase: str, cpu: float, wall: float) -> None:
        total = self.current.setdefault(phase, [0.0, 0.0])
        total[0] += cpu
        total[1] += wall

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(phase, time.process_time() - cpu, time.perf_counter() - wall)

        setattr(owner, name, timed)

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.process_time()
        elif self._gc_start is not None:
            self.add("gc", time.process_time() - self._gc_start, 0.0)
            self._gc_start = None


def _rank_main(config: str, overrides: list[str], skip: int) -> None:
    from mcore_rl import trainer as trainer_module
    from mcore_rl.config import load_config
    from mcore_rl.weight_sync.sync import WeightSync
    from mcore_rl.weight_sync.verifier import SyncVerifier

    cfg = load_config(config, overrides)
    timers = Timers()
    gc.callbacks.append(timers.on_gc)
    trainer_cls = trainer_module.Trainer
    from mcore_rl.generation import StepGenerator

    owners = {"trainer": trainer_cls, "generator": StepGenerator, "sync": WeightSync, "verifier": SyncVerifier}
    for owner, name, phase in PHASES:
        if owner in owners:
            timers.wrap(owners[owner], name, phase)
    build_actors, train_step = trainer_cls._build_actors, trainer_cls.train_step

    def build_and_wrap(self):
        build_actors(self)
        from mcore_rl.megatron.actor import Actor  # imported by _build_actors, after the CPU adaptation

        for owner, name, phase in PHASES:
            if owner == "actor":
                timers.wrap(Actor, name, phase)

    def step(self):
        timers.current = {}
        cpu, wall = time.process_time(), time.perf_counter()
        out = train_step(self)
        timers.add("step", time.process_time() - cpu, time.perf_counter() - wall)
        timers.steps.append(timers.current)
        return out

    trainer_cls._build_actors, trainer_cls.train_step = build_and_wrap, step
    trainer_module.run(cfg)
    kept = timers.steps[skip:]
    summary = {}
    for phase in ["step", *dict.fromkeys(p for _, _, p in PHASES), "gc"]:
        values = [s[phase] for s in kept if phase in s]
        if values:
            summary[phase] = {
                "cpu_ms": 1e3 * statistics.median(v[0] for v in values),
                "wall_ms": 1e3 * statistics.median(v[1] for v in values),
                "steps": len(values),
            }
    out = Path(cfg.trainer.run_dir) / "step_cpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(summary, indent=1))


def _report(folder: Path) -> None:
    for path in sorted(folder.glob("rank*.json")):
        print(f"==== {path.stem}: median per step (ms)        CPU     wall  steps")
        for phase, v in json.loads(path.read_text()).items():
            print(f"  {phase:38s} {v['cpu_ms']:7.1f}  {v['wall_ms']:7.1f}  {v['steps']:5d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--skip", type=int, default=3, help="steps left out at the start (first-step costs)")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        _rank_main(args.config, args.overrides, args.skip)
        return
    sys.path.insert(0, str(REPO))
    from profile_ranks import run_on_ranks  # this script's folder is first on sys.path

    from mcore_rl.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_on_ranks(__file__, cfg.trainer.nproc, [args.config, *args.overrides, "--skip", str(args.skip)])
    _report(Path(cfg.trainer.run_dir) / "step_cpu")


if __name__ == "__main__":
    main()
