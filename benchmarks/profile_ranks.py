"""Profile every rank of a training run with cProfile, then print where each rank's time went.

    python benchmarks/profile_ranks.py CONFIG [key=value ...] [--out DIR] [--top 25]

Starts `torchrun` with trainer.nproc processes running this file; each rank runs the ordinary trainer
(`mcore_rl.trainer.run`) under cProfile and writes DIR/rank{r}.prof (default DIR: the run directory's
`profile/`). Afterwards the launcher prints, per rank, the functions with the most cumulative and the most
own time, and the share of the whole run spent in start-up (before the first step) and in each step phase
(from metrics.jsonl). Open a .prof with `python -m pstats` or snakeviz for more.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rank_main(config: str, overrides: list[str], out: Path) -> None:
    from mcore_rl.config import load_config
    from mcore_rl.trainer import run

    cfg = load_config(config, overrides)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run(cfg)
    finally:
        profiler.disable()
        out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(out / f"rank{os.environ.get('RANK', '0')}.prof")


def _report(out: Path, top: int) -> None:
    for prof in sorted(out.glob("rank*.prof")):
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(str(prof), stream=text).sort_stats(key).print_stats(top)
            body = text.getvalue()
            print(f"==== {prof.stem}: top {top} by {key} ====")
            print(body[body.find("   ncalls") :] if "   ncalls" in body else body)


def _phase_summary(run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return
    keys = sorted({k for r in rows for k in r if k.startswith("time/")} | {"perf/step_seconds"})
    for k in keys:
        values = sorted(r[k] for r in rows if k in r)
        print(f"{k:24s} median {values[len(values) // 2]:.4f} s over {len(values)} steps")


def run_on_ranks(script: str, nproc: int, args: list[str]) -> None:
    """`script args` in `nproc` torchrun processes on this machine (one thread each unless OMP_NUM_THREADS says
    otherwise); each rank sees LOCAL_RANK and runs the script's rank side. Also used by step_cpu.py."""
    from mcore_rl.platform import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        script,
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default=None, help="folder for rank{r}.prof (default: RUN_DIR/profile)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        _rank_main(args.config, args.overrides, Path(args.out))
        return
    sys.path.insert(0, str(REPO))
    from mcore_rl.config import load_config

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out or Path(cfg.trainer.run_dir) / "profile").resolve()
    run_on_ranks(__file__, cfg.trainer.nproc, [args.config, *args.overrides, "--out", str(out)])
    _report(out, args.top)
    _phase_summary(Path(cfg.trainer.run_dir))


if __name__ == "__main__":
    main()
