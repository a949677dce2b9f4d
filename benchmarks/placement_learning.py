"""Does the separate placement (one step off) learn like the colocated one? Reward curves over seeds.

    python benchmarks/placement_learning.py [--preset configs/tiny/gspo_multitoken_cpu.yaml] [--seeds 1 2 3]
                                            [--steps 200] [--window 10] [--rollout-ranks 1] [--save FILE]
                                            [--colocated-from FILE] [--separate-extra KEY=VALUE ...] [key=value ...]

For each seed (`trainer.seed`), the preset as it is (colocated, its own layout) and then `rollout.placement=separate`
with `--rollout-ranks` of its `trainer.nproc` ranks generating (`actor.parallel.ep=1` when one actor rank is left),
`--steps` steps each, no validation. Printed: each run's `window`-step mean reward at every `window`-th step; the
colocated runs' band (min - max over the seeds) of that curve; for each separate run the share of its curve's
points inside the band, and how far outside the farthest one lies; the last `window` steps' mean of every run.
Step counts and rewards do not depend on the machine's load (the runs are deterministic per seed). `--save` writes
every curve to a JSON file; `--colocated-from` takes the colocated curves from such a file instead of running them
(to compare another separate setting, e.g. `algo.rollout_is=sequence`, with the same band; the overrides then
apply to the separate runs only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_speed import Goal, run_mcore  # noqa: E402
from benchmarks.placement_speed import _rows, separate_overrides  # noqa: E402
from mcore_rl.config import load_config  # noqa: E402


def curve(run_dir: Path, window: int) -> list[float]:
    """The trailing `window`-step mean reward at every step from `window` on."""
    rewards = [r["reward/mean"] for r in _rows(run_dir) if "reward/mean" in r]
    return [sum(rewards[i - window : i]) / window for i in range(window, len(rewards) + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_multitoken_cpu.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("--separate-extra", nargs="*", default=[], help="overrides for the separate runs only")
    parser.add_argument("--save", default=None, help="write the curves to this JSON file")
    parser.add_argument("--colocated-from", default=None, help="the colocated curves from a --save file")
    args, overrides = parser.parse_known_args()
    common = [f"trainer.steps={args.steps}", "trainer.val_every=0", "checkpoint.save_every=0", *overrides]
    nproc = load_config(args.preset, []).trainer.nproc
    separate = [*separate_overrides(nproc, args.rollout_ranks), *args.separate_extra]
    placements = {"colocated": [], "separate": separate}
    curves: dict[str, dict[int, list[float]]] = {name: {} for name in placements}
    if args.colocated_from:
        saved = json.loads(Path(args.colocated_from).read_text())["colocated"]
        curves["colocated"] = {int(seed): c for seed, c in saved.items()}
        del placements["colocated"]
    goal = Goal(threshold=2.0, window=args.window, steps=args.steps)  # run every step
    print(f"# {args.preset}, {args.steps} steps, seeds {args.seeds}; load {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="placement-learning-") as tmp:
        for seed in args.seeds:
            for name, extra in placements.items():
                run_dir = Path(tmp) / f"{name}-{seed}"
                run_mcore(args.preset, [*common, f"trainer.seed={seed}", *extra], run_dir, goal)
                curves[name][seed] = curve(run_dir, args.window)
                points = curves[name][seed][:: args.window]
                print(f"{name:9s} seed {seed}: " + " ".join(f"{v:.2f}" for v in points), flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(curves))
    report(curves, args.window)


def report(curves: dict[str, dict[int, list[float]]], window: int) -> None:
    colocated = list(curves["colocated"].values())
    length = min(len(c) for runs in curves.values() for c in runs.values())
    low = [min(c[i] for c in colocated) for i in range(length)]
    high = [max(c[i] for c in colocated) for i in range(length)]
    print(f"colocated band ({window}-step mean, every {window}th step):")
    print("  low  " + " ".join(f"{v:.2f}" for v in low[::window]))
    print("  high " + " ".join(f"{v:.2f}" for v in high[::window]))
    for seed, c in curves["separate"].items():
        inside = sum(low[i] <= c[i] <= high[i] for i in range(length))
        outside = max(max(low[i] - c[i], c[i] - high[i], 0.0) for i in range(length))
        print(
            f"separate seed {seed}: {inside}/{length} points inside the colocated band ({inside / length:.0%}), "
            f"farthest outside by {outside:.3f}; last {window} steps {c[length - 1]:.3f}"
        )
    for seed, c in curves["colocated"].items():
        print(f"colocated seed {seed}: last {window} steps {c[length - 1]:.3f}")


if __name__ == "__main__":
    main()
