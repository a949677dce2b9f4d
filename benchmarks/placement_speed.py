"""Colocated (synchronous) against separate one-step off-policy on the same cores: wall time to a reward target,
tokens/s, and what each role of the separate run spent waiting.

    python benchmarks/placement_speed.py [--preset configs/tiny/gspo_cpu.yaml] [--rounds 2] [--seeds 1]
                                         [--threshold 0.8] [--window 10] [--max-steps 300] [--steps N]
                                         [--rollout-ranks 1] [key=value ...]
    python benchmarks/placement_speed.py --decode-scaling [--preset ...] [key=value ...]

Per round and seed, back to back (so under the same machine load; the 1-minute load average before and after each
run is printed): the preset as it is (colocated, its own layout), then `rollout.placement=separate` with
`--rollout-ranks` of its `trainer.nproc` ranks generating and the rest training (`actor.parallel.ep=1` when one actor
rank is left). Each run stops at a `window`-step mean reward of `threshold` (or the end of step N with --steps).
Printed per run: the step and wall seconds to the goal, trained tokens/s over the run (tokens trained / wall time
after the first step), the step and wall seconds (from launch) to the reward target - the first step whose
`window`-step mean reward reaches `threshold`, found in the metrics also when the run goes on to step N - and
for the separate run the per-role busy / waiting seconds summed from its metrics: the actor training
(time/old_logprob + ref_logprob + update), syncing (time/sync, which holds its wait for the rollout ranks to finish
a generation and take the weights) and waiting for samples (time/actor_wait); the rollout ranks generating
(time/rollout_generate) and waiting for the weights (time/rollout_wait). For the colocated run: the share of its
step spent in rollout (time/rollout over perf/step_seconds, steps 2 on). At the end: the median and spread
(min - max) of separate / colocated wall time, tokens/s and wall time to the target over the rounds, and each
round's steps to the target.

--decode-scaling times only the embedded engine's generation (one process, one thread) of one colocated rank's
share of a step's prompts against all of them, which one rollout rank generates in the 1 + 1 split: the ratio
says how far decode is from overhead-bound (1x: twice the rows cost nothing more) or row-bound (2x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_speed import REPO, Goal, run_mcore  # noqa: E402


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def separate_overrides(nproc: int, rollout_ranks: int) -> list[str]:
    """The overrides that split a preset's `nproc` ranks: `rollout_ranks` generate, the rest train
    (`actor.parallel.ep=1` when one actor rank is left)."""
    split = ["rollout.placement=separate", f"rollout.ranks={rollout_ranks}"]
    return split + (["actor.parallel.ep=1"] if nproc - rollout_ranks == 1 else [])


def _tokens_per_s(rows: list[dict], upto: int) -> float:
    """Trained response tokens per wall second, from the end of step 1 to the end of step `upto`."""
    used = [r for r in rows if r["step"] <= upto]
    if len(used) < 2:
        return float("nan")
    tokens = sum(r["perf/tokens_per_s"] * r["perf/step_seconds"] for r in used[1:])
    return tokens / max(used[-1]["time"] - used[0]["time"], 1e-9)


def _roles(rows: list[dict], upto: int) -> str:
    used = [r for r in rows if r["step"] <= upto]
    total = lambda key: sum(r.get(key, 0.0) for r in used)
    trains = total("time/old_logprob") + total("time/ref_logprob") + total("time/update")
    return (
        f"actor trains {trains:.1f} s, syncs {total('time/sync'):.1f} s, waits {total('time/actor_wait'):.1f} s; "
        f"rollout generates {total('time/rollout_generate'):.1f} s, waits {total('time/rollout_wait'):.1f} s"
    )


def _rollout_share(rows: list[dict], upto: int) -> float:
    """The colocated step's share spent in rollout (generation and rewards), steps 2..upto (step 1: start-up)."""
    used = [r for r in rows if 2 <= r["step"] <= upto]
    step = sum(r["perf/step_seconds"] for r in used)
    return sum(r.get("time/rollout", 0.0) for r in used) / step if step else float("nan")


def to_target(rows: list[dict], threshold: float, window: int) -> Optional[dict]:
    """The first row whose `window`-step trailing mean of reward/mean reaches `threshold` (None: none does)."""
    rewards = [r["reward/mean"] for r in rows]
    for i in range(window - 1, len(rows)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= threshold:
            return rows[i]
    return None


def run(name: str, preset: str, overrides: list[str], goal: Goal, tmp: Path) -> dict:
    run_dir = tmp / name
    before = os.getloadavg()[0]
    result = run_mcore(preset, overrides, run_dir, goal)
    rows = [r for r in _rows(run_dir) if r["step"] <= (result["step"] or 0)]
    result.update(name=name, tokens_per_s=_tokens_per_s(rows, result["step"] or 0), roles=_roles(rows, result["step"]))
    target = to_target(rows, goal.threshold, goal.window)
    # wall seconds from launch: the goal step's, less the time between the target's row and the goal's
    result.update(
        target_step=target["step"] if target else None,
        target_wall_s=result["wall_s"] - (rows[-1]["time"] - target["time"]) if target else float("nan"),
    )
    status = f"step {result['step']}" + ("" if result["reached"] else " (goal NOT reached)")
    reached = (
        f"target at step {result['target_step']}, {result['target_wall_s']:.1f} s"
        if target
        else f"target not reached in {len(rows)} steps"
    )
    print(
        f"{name:10s} {status}: {result['wall_s']:.1f} s, {result['tokens_per_s']:.0f} trained tokens/s; {reached}"
        + (f"; {result['roles']}" if name == "separate" else "")
        + (f"; rollout {_rollout_share(rows, result['step'] or 0):.0%} of the step" if name == "colocated" else "")
        + f" (load {before:.1f} -> {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return result


def decode_scaling(preset: str, overrides: list[str], repeats: int = 3) -> None:
    """One process, one thread: the embedded engine's generation of one colocated rank's share of the step's prompts
    (prompts_per_step / nproc) against all of them (what one rollout rank generates in a 1 + 1 split), median of
    `repeats` after a warm-up each, the preset's sampling (seeded)."""
    import torch

    from mcore_rl.config import load_config
    from mcore_rl.data.dataset import load_prompt_dataset
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(1)
    cfg = load_config(str(REPO / preset), overrides)
    engine = EmbeddedEngine(str(REPO / cfg.model.path), return_routed_experts=False)
    data = load_prompt_dataset(REPO / cfg.data.train_path, engine.tokenizer, cfg.data.max_prompt_len)
    r = cfg.rollout
    params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, [engine.eos_token_id], seed=1)
    share = cfg.data.prompts_per_step // cfg.trainer.nproc
    seconds = {}
    for prompts in (share, cfg.data.prompts_per_step):
        batch = [data[i].prompt_ids for i in range(prompts)]
        engine.generate(batch, r.n, params)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate(batch, r.n, params)
            times.append(time.perf_counter() - start)
        seconds[prompts] = statistics.median(times)
        print(f"decode {prompts * r.n} rows: {seconds[prompts]:.3f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"all rows / one rank's share: {seconds[cfg.data.prompts_per_step] / seconds[share]:.2f}x the seconds")


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x, spread {min(values):.2f}x - {max(values):.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_cpu.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("--decode-scaling", action="store_true", help="time the embedded engine's decode only")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.decode_scaling:
        decode_scaling(args.preset, args.overrides)
        return
    goal = Goal(args.threshold, args.window, args.steps)
    from mcore_rl.config import load_config

    nproc = load_config(str(REPO / args.preset), args.overrides).trainer.nproc
    separate = separate_overrides(nproc, args.rollout_ranks)
    common = [f"trainer.steps={args.steps or args.max_steps}", "trainer.val_every=0", "checkpoint.save_hf=false"]
    print(f"{args.preset}: to {goal.describe()}; {nproc} ranks, separate: {args.rollout_ranks} rollout", flush=True)
    ratios_wall, ratios_tps, ratios_target, target_steps = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="placement-speed-") as tmp:
        for rnd in range(args.rounds):
            for seed in args.seeds:
                extra = [*common, f"trainer.seed={seed}", *args.overrides]
                c = run("colocated", args.preset, extra, goal, Path(tmp) / f"r{rnd}s{seed}")
                s = run("separate", args.preset, [*extra, *separate], goal, Path(tmp) / f"r{rnd}s{seed}")
                ratios_wall.append(c["wall_s"] / s["wall_s"])
                ratios_tps.append(s["tokens_per_s"] / c["tokens_per_s"])
                target_steps.append(f"{c['target_step']} / {s['target_step']}")
                if c["target_step"] and s["target_step"]:
                    ratios_target.append(c["target_wall_s"] / s["target_wall_s"])
    print(f"colocated / separate wall time: {_spread(ratios_wall)}")
    print(f"separate / colocated tokens/s: {_spread(ratios_tps)}")
    target = f"a {args.window}-step mean reward of {args.threshold}"
    print(f"steps to {target}, colocated / separate: {', '.join(target_steps)}")
    if ratios_target:
        print(f"colocated / separate wall time to {target}: {_spread(ratios_target)}")


if __name__ == "__main__":
    main()
