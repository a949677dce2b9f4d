"""launch/ray_launch.py for real: a local Ray, a placement group of 2 CPU bundles, a gloo job of 2 ranks.

Ray is an optional extra; this module runs where it is installed (e.g. a venv made with
`python -m venv .venv-ray && .venv-ray/bin/pip install 'ray==2.60.*' && .venv-ray/bin/pip install -e .`).
"""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'mcore-rl[ray]')")

from tests.torchrun_util import REPO  # noqa: E402
from tests.workers.harness import read_results  # noqa: E402

pytestmark = pytest.mark.slow
ENTRY = REPO / "tests" / "workers" / "ray_entry.py"


def launch(tmp_path, tiny_model_dir, entry, *overrides):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"platform: cpu\nmodel:\n  path: {tiny_model_dir}\nrollout:\n  n: 2\ndata:\n  prompts_per_step: 2\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")
    cmd = [
        sys.executable,
        str(REPO / "launch" / "ray_launch.py"),
        str(cfg),
        "--accelerator",
        "CPU",
        "--num-cpus",
        "2",
        "--cpus-per-rank",
        "1",
        "--entry",
        entry,
        "trainer.nproc=2",
        f"trainer.run_dir={tmp_path / 'run'}",
        *overrides,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=240)


def test_ray_launch_runs_two_ranks(tmp_path, tiny_model_dir):
    proc = launch(tmp_path, tiny_model_dir, "tests.workers.ray_entry:run", "algo.loss=sapo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = read_results(tmp_path / "run" / "results", 2, proc.stdout + proc.stderr)  # one per rank
    # 1 + 2 over the two ranks; overrides reached the ranks
    assert [(r["sum"], r["loss"]) for r in results] == [(3.0, "sapo")] * 2, results
    envs = [r["env"] for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["LOCAL_RANK"] for e in envs} == {"0", "1"}
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


def test_ray_launch_stops_all_ranks_when_one_fails(tmp_path, tiny_model_dir):
    start = time.time()
    proc = launch(tmp_path, tiny_model_dir, "tests.workers.ray_entry:fail_on_rank1")
    assert proc.returncode == 1 and "rank 1 failed on purpose" in proc.stderr
    assert time.time() - start < 200
    # the last line: the rank's exception and where it was raised (Ray's wrapped traceback stays above it)
    raised_at = next(i for i, line in enumerate(ENTRY.read_text().splitlines(), 1) if "raise RuntimeError" in line)
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last == f"mcore-rl: error: rank 1 failed: RuntimeError: rank 1 failed on purpose (ray_entry.py:{raised_at})"
