"""Colocated (synchronous) against separate one-step off-policy against streaming, on the same cores: wall time and
steps to a reward target, and how much of its time the rollout role spent idle.

    python benchmarks/async_speed.py [--preset configs/tiny/gspo_multitoken_cpu.yaml] [--rounds 2]
                                     [--staleness 1] [--threshold 0.8] [--window 10] [--max-steps 300]
                                     [--steps N] [key=value ...]

Per round, back to back (so under the same machine load; the 1-minute load average before and after each run is
printed): the preset as it is (colocated, its own layout), then 1 actor rank + 1 rollout rank
(`rollout.placement=separate rollout.ranks=1 actor.parallel.ep=1`) one step off (`rollout.max_staleness=1`), then
the same split streaming (`rollout.streaming=true rollout.max_staleness=--staleness`). Each run stops at a
`window`-step mean reward of `threshold` (or the end of step N with --steps). Printed per run: the step and wall
seconds to the goal, and for the separate runs the median over steps 2.. of `perf/rollout_idle_fraction` (the
rollout rank's waiting over its waiting plus generating) and the interrupted samples. At the end, per mode, the
median and spread of wall time and steps against colocated over the rounds (docs/async.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_speed import Goal, run_mcore  # noqa: E402
from benchmarks.placement_speed import _rows, _spread  # noqa: E402

SPLIT = ["trainer.nproc=2", "rollout.placement=separate", "rollout.ranks=1", "actor.parallel.ep=1"]


def modes(staleness: int) -> dict[str, list[str]]:
    return {
        "colocated": [],
        "one-step": [*SPLIT, "rollout.max_staleness=1"],
        "streaming": [*SPLIT, "rollout.streaming=true", f"rollout.max_staleness={staleness}"],
    }


def run(name: str, preset: str, overrides: list[str], goal: Goal, run_dir: Path) -> dict:
    before = os.getloadavg()[0]
    result = run_mcore(preset, overrides, run_dir, goal)
    rows = [r for r in _rows(run_dir) if r["step"] <= (result["step"] or 0)]
    idle = [r["perf/rollout_idle_fraction"] for r in rows[1:] if "perf/rollout_idle_fraction" in r]
    result["idle"] = statistics.median(idle) if idle else float("nan")
    interrupted = sum(r.get("rollout/interrupted_samples", 0) for r in rows)
    status = f"step {result['step']}" + ("" if result["reached"] else " (goal NOT reached)")
    roles = f"; rollout idle {result['idle']:.2f}, {interrupted} interrupted" if idle else ""
    print(
        f"{name:10s} {status}: {result['wall_s']:.1f} s{roles} (load {before:.1f} -> {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_multitoken_cpu.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    goal = Goal(args.threshold, args.window, args.steps)
    common = [f"trainer.steps={args.steps or args.max_steps}", "trainer.val_every=0", "checkpoint.save_hf=false"]
    print(f"{args.preset}: to {goal.describe()}; streaming at max_staleness {args.staleness}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in modes(args.staleness)}
    with tempfile.TemporaryDirectory(prefix="async-speed-") as tmp:
        for rnd in range(args.rounds):
            for name, extra in modes(args.staleness).items():
                overrides = [*common, *args.overrides, *extra]
                results[name].append(run(name, args.preset, overrides, goal, Path(tmp) / f"r{rnd}" / name))
    base = results["colocated"]
    for name in ("one-step", "streaming"):
        wall = [b["wall_s"] / r["wall_s"] for b, r in zip(base, results[name])]
        steps = [r["step"] / b["step"] for b, r in zip(base, results[name]) if r["step"] and b["step"]]
        idle = statistics.median(r["idle"] for r in results[name])
        print(f"{name}: colocated / {name} wall time {_spread(wall)}; steps / colocated's {_spread(steps or [0.0])}")
        print(f"{name}: rollout idle fraction, median over rounds {idle:.2f}")


if __name__ == "__main__":
    main()
