"""Colocated (synchronous) against separate one-step off-policy against streaming, on the same cores: wall time and
steps to a reward target, and how much of its time the rollout role spent idle.

    python benchmarks/async_speed.py [--preset configs/tiny/gspo_multitoken_cpu.yaml] [--rounds 2]
                                     [--staleness 1 [2 ...]] [--threshold 0.8] [--window 10] [--max-steps 300]
                                     [--steps N] [--seeds S1 S2 ...] [key=value ...]
    python benchmarks/async_speed.py --make-task [DIR]   # the long-tail preset's data (`make longtail-artifacts`)

Per round (one per --seeds value, its trainer.seed and data.seed; else --rounds with the preset's seeds), back to
back (so under the same machine load; the 1-minute load average before and after each run is printed): the preset
as it is (colocated, its own layout), then 1 actor rank + 1 rollout rank
(`rollout.placement=separate rollout.ranks=1 actor.parallel.ep=1`) one step off (`rollout.max_staleness=1`), then
the same split streaming (`rollout.streaming=true rollout.max_staleness=K`, once per K of --staleness). Each run stops
at a `window`-step mean reward of `threshold` (or the end of step N with --steps). Printed per run: the step and wall
seconds to the goal, the response lengths of rank 0's sample log (median, p75, p90, p99, max, mean), and for the separate runs the
median over steps 2.. of `perf/rollout_idle_fraction` (the rollout rank's waiting over its waiting plus generating),
the interrupted samples and each role's seconds summed over the steps (actor waiting for samples; rollout
generating / waiting). At the end, per mode, the median and spread of wall time and steps against colocated over
the rounds, and the median idle fraction (docs/async.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_speed import Goal, run_mcore  # noqa: E402
from benchmarks.placement_speed import _rows, _spread, separate_overrides  # noqa: E402
from mcore_rl.data.task import TaskSpec, make_example, write_rows  # noqa: E402

# The long tail: most prompts 2-4 digits, a few 20-28 (answers 3-5 and 21-29 tokens with <|im_end|>). A step's
# rollout then takes several times longer with a long prompt in it than without, and the actor's step lies between
# the two: the roles swing past each other step by step (docs/async.md).
SHORT, LONG = TaskSpec(kind="reverse", length=4, min_length=2), TaskSpec(kind="reverse", length=28, min_length=20)
LONG_SHARE = 0.08
LONGTAIL_DIR = "artifacts/longtail/task"


def longtail_rows(n: int, seed: int) -> list[dict]:
    """Reverse-task rows whose length is drawn from LONG with probability LONG_SHARE, else from SHORT."""
    rng = random.Random(seed)
    return [make_example(rng, LONG if rng.random() < LONG_SHARE else SHORT) for _ in range(n)]


def make_longtail_task(out_dir: str, train_size: int = 4096, val_size: int = 256, seed: int = 0) -> None:
    """train/val parquet as `mcore-rl make-task` writes them (validation from another seed)."""
    out = Path(out_dir)
    write_rows(longtail_rows(train_size, seed), out / "train.parquet")
    write_rows(longtail_rows(val_size, seed + 1_000_003), out / "val.parquet")
    spec = {"short": SHORT.__dict__, "long": LONG.__dict__, "long_share": LONG_SHARE, "seed": seed}
    (out / "task.json").write_text(json.dumps(spec, indent=2))
    print(f"wrote {out}/train.parquet ({train_size} rows), val.parquet ({val_size} rows)")


SPLIT = ["trainer.nproc=2", *separate_overrides(2, 1)]  # 1 actor rank + 1 rollout rank


def modes(staleness: list[int]) -> dict[str, list[str]]:
    streaming = {f"stream-K{k}": [*SPLIT, "rollout.streaming=true", f"rollout.max_staleness={k}"] for k in staleness}
    return {"colocated": [], "one-step": [*SPLIT, "rollout.max_staleness=1"], **streaming}


def _lengths(run_dir: Path) -> str:
    """Response lengths in rank 0's sample log: median, p75, p90, p99, max and mean."""
    path = run_dir / "samples.jsonl"
    lengths = sorted(json.loads(line)["length"] for line in path.read_text().splitlines()) if path.is_file() else []
    if not lengths:
        return ""
    pct = {p: lengths[min(len(lengths) - 1, int(p / 100 * len(lengths)))] for p in (75, 90, 99)}
    return (
        f"; lengths median {statistics.median(lengths):g}, p75 {pct[75]}, p90 {pct[90]}, p99 {pct[99]}, "
        f"max {lengths[-1]}, mean {statistics.mean(lengths):.1f} (n {len(lengths)})"
    )


def _roles(rows: list[dict]) -> str:
    """Each role's seconds over the steps: the actor waiting for samples, the rollout rank generating / waiting."""
    total = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) for k in ("actor_wait", "rollout_generate", "rollout_wait")}
    return "; s actor wait {actor_wait:.1f}, rollout generate {rollout_generate:.1f} / wait {rollout_wait:.1f}".format(
        **total
    )


def run(name: str, preset: str, overrides: list[str], goal: Goal, run_dir: Path) -> dict:
    before = os.getloadavg()[0]
    result = run_mcore(preset, overrides, run_dir, goal)
    rows = [r for r in _rows(run_dir) if r["step"] <= (result["step"] or 0)]
    idle = [r["perf/rollout_idle_fraction"] for r in rows[1:] if "perf/rollout_idle_fraction" in r]
    result["idle"] = statistics.median(idle) if idle else float("nan")
    interrupted = sum(r.get("rollout/interrupted_samples", 0) for r in rows)
    status = f"step {result['step']}" + ("" if result["reached"] else " (goal NOT reached)")
    roles = f"; rollout idle {result['idle']:.2f}, {interrupted} interrupted{_roles(rows)}" if idle else ""
    print(
        f"{name:10s} {status}: {result['wall_s']:.1f} s{roles}{_lengths(run_dir)} "
        f"(load {before:.1f} -> {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_multitoken_cpu.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1], help="streaming runs, one per K")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="one round per seed (trainer/data.seed)")
    parser.add_argument("--sample-log", type=int, default=128, help="trainer.sample_log: samples a round, for lengths")
    parser.add_argument("--make-task", nargs="?", const=LONGTAIL_DIR, default=None, metavar="DIR")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.make_task:
        return make_longtail_task(args.make_task)
    goal = Goal(args.threshold, args.window, args.steps)
    common = [f"trainer.steps={args.steps or args.max_steps}", "trainer.val_every=0", "checkpoint.save_hf=false"]
    common.append(f"trainer.sample_log={args.sample_log}")
    print(f"{args.preset}: to {goal.describe()}; streaming at max_staleness {args.staleness}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in modes(args.staleness)}
    with tempfile.TemporaryDirectory(prefix="async-speed-") as tmp:
        for rnd, seed in enumerate(args.seeds or [None] * args.rounds):
            seeded = [f"trainer.seed={seed}", f"data.seed={seed}"] if seed is not None else []
            for name, extra in modes(args.staleness).items():
                overrides = [*common, *seeded, *args.overrides, *extra]
                results[name].append(run(name, args.preset, overrides, goal, Path(tmp) / f"r{rnd}" / name))
    base = results["colocated"]
    for name in list(results)[1:]:
        wall = [b["wall_s"] / r["wall_s"] for b, r in zip(base, results[name])]
        steps = [r["step"] / b["step"] for b, r in zip(base, results[name]) if r["step"] and b["step"]]
        idle = statistics.median(r["idle"] for r in results[name])
        print(f"{name}: colocated / {name} wall time {_spread(wall)}; steps / colocated's {_spread(steps or [0.0])}")
        print(f"{name}: rollout idle fraction, median over rounds {idle:.2f}")


if __name__ == "__main__":
    main()
