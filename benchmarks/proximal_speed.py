"""algo.proximal=loglinear against recompute in the separate placement, one step off: what skipping the proximal pass
saves per step and what the approximation costs in reward (docs/async-objective.md).

    python benchmarks/proximal_speed.py [--preset configs/tiny/gspo_multitoken_cpu.yaml] [--steps 40] [--seeds 1 2]
                                        [--rounds 1] [--rollout-ranks 1] [key=value ...]

Per round and seed, back to back (so under the same machine load; the 1-minute load average before and after each
run is printed): the preset in `rollout.placement=separate` (`--rollout-ranks` of its ranks generating, the rest
training; `actor.parallel.ep=1` when one actor rank is left; `rollout.max_staleness` its default 1), first with
`algo.proximal=recompute`, then `loglinear`, the same seed and overrides. Printed per run: the mean reward of the
first and last 10 steps, the median seconds per step of the proximal pass (time/old_logprob), of the update and of
the whole step (the first step left out: start-up), and the mean importance weight. At the end, per seed: the
loglinear run's last-10 reward minus recompute's and its median step time over recompute's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_speed import REPO, Goal, run_mcore  # noqa: E402
from benchmarks.placement_speed import _rows, separate_overrides  # noqa: E402


def _median(rows: list[dict], key: str) -> float:
    values = [r.get(key, 0.0) for r in rows[1:]]
    return statistics.median(values) if values else float("nan")


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def run(proximal: str, preset: str, overrides: list[str], steps: int, run_dir: Path) -> dict:
    before = os.getloadavg()[0]
    run_mcore(preset, [*overrides, f"algo.proximal={proximal}"], run_dir, Goal(0.0, 1, steps))
    rows = [r for r in _rows(run_dir) if "reward/mean" in r]
    out = dict(
        proximal=proximal,
        steps=len(rows),
        first10=_mean(rows[:10], "reward/mean"),
        last10=_mean(rows[-10:], "reward/mean"),
        old_pass_s=_median(rows, "time/old_logprob"),
        update_s=_median(rows, "time/update"),
        step_s=_median(rows, "perf/step_seconds"),
        is_weight=_mean(rows, "train/is_weight_mean"),
    )
    print(
        f"{proximal:9s} {out['steps']} steps: reward first 10 {out['first10']:.3f}, last 10 {out['last10']:.3f}; "
        f"median s/step: proximal pass {out['old_pass_s']:.3f}, update {out['update_s']:.3f}, "
        f"step {out['step_s']:.3f}; is_weight_mean {out['is_weight']:.4f} "
        f"(load {before:.1f} -> {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_multitoken_cpu.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from mcore_rl.config import load_config

    nproc = load_config(str(REPO / args.preset), args.overrides, validate=False).trainer.nproc
    common = [*separate_overrides(nproc, args.rollout_ranks), f"trainer.steps={args.steps}"]
    common += ["trainer.val_every=0", "checkpoint.save_hf=false", "checkpoint.save_every=1000"]
    print(f"{args.preset}, separate ({args.rollout_ranks} rollout ranks of {nproc}), {args.steps} steps", flush=True)
    summary = []
    with tempfile.TemporaryDirectory(prefix="proximal-speed-") as tmp:
        for rnd in range(args.rounds):
            for seed in args.seeds:
                extra = [*common, f"trainer.seed={seed}", *args.overrides]
                runs = {
                    p: run(p, args.preset, extra, args.steps, Path(tmp) / f"r{rnd}s{seed}{p}")
                    for p in ("recompute", "loglinear")
                }
                rec, log = runs["recompute"], runs["loglinear"]
                summary.append((seed, log["last10"] - rec["last10"], log["step_s"] / rec["step_s"]))
    for seed, reward, time_ratio in summary:
        print(f"seed {seed}: loglinear - recompute last-10 reward {reward:+.3f}; step time {time_ratio:.2f}x")


if __name__ == "__main__":
    main()
