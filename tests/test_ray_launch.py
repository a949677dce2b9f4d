"""launch/ray_launch.py for real: a local Ray, a placement group of 2 CPU bundles, a gloo job of 2 ranks: the trainer
in the separate placement (1 actor rank + 1 rollout rank) against the colocated run, and a rank that fails.

Ray is an optional extra; this module runs where it is installed (e.g. a venv made with
`python -m venv .venv-ray && .venv-ray/bin/pip install 'ray==2.60.*' && .venv-ray/bin/pip install -e .`).
"""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'mcore-rl[ray]')")

import torch  # noqa: E402

from tests.conftest import EXACT_TOKENS  # noqa: E402
from tests.test_placement_e2e import untimed  # noqa: E402
from tests.test_trainer_e2e import load_hf, overrides, read_metrics  # noqa: E402
from tests.torchrun_util import REPO  # noqa: E402
from tests.workers.harness import read_results  # noqa: E402

pytestmark = pytest.mark.slow
ENTRY = REPO / "tests" / "workers" / "ray_entry.py"


def launch(tmp_path, config, entry, *settings):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")
    cmd = [
        sys.executable,
        str(REPO / "launch" / "ray_launch.py"),
        str(config),
        "--accelerator",
        "CPU",
        "--num-cpus",
        "2",
        "--cpus-per-rank",
        "1",
        "--entry",
        entry,
        "trainer.nproc=2",
        *settings,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def small_config(tmp_path, tiny_model_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"platform: cpu\nmodel:\n  path: {tiny_model_dir}\nrollout:\n  n: 2\ndata:\n  prompts_per_step: 2\n")
    return cfg


def test_ray_launch_trains_the_separate_placement_as_colocated(tmp_path, tiny_model_dir, colocated_reference):
    """Ray starts the separate placement (rank 0 the actor, rank 1 the rollout rank: the split of torchrun's ranks)
    and at rollout.max_staleness 0 it trains exactly the colocated run on 1 process (conftest.colocated_reference,
    under torchrun): the same metrics rows (timings aside; syncs verified across the split, validation) and export."""
    colocated, task = colocated_reference
    separate = tmp_path / "separate"
    split = {"rollout.placement": "separate", "rollout.ranks": 1, "rollout.max_staleness": 0, "actor.parallel.ep": 1}
    args = overrides(tiny_model_dir, task, separate, **split, **EXACT_TOKENS)
    proc = launch(tmp_path, REPO / "configs/tiny/gspo_cpu.yaml", "tests.workers.ray_entry:train", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ray_launch: 2 ranks on 1 node(s)" in proc.stdout and "ray_launch: all ranks finished" in proc.stdout
    results = read_results(tmp_path / "results", 2, proc.stdout + proc.stderr)  # one per rank, after training
    envs = [r["env"] for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["LOCAL_RANK"] for e in envs} == {"0", "1"}
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {r["placement"] for r in results} == {"separate"}  # the overrides reached the ranks

    rows_c, rows_s = read_metrics(colocated), read_metrics(separate)
    assert [r["step"] for r in rows_s] == [1, 2, 3, 4] and untimed(rows_c) == untimed(rows_s)
    assert all(r["train/staleness_max"] == 0 and "time/rollout_wait" in r for r in rows_s)
    assert "sync/verify_max_diff" in rows_s[1] and "val/reward_mean" in rows_s[1]  # verified, validated across
    hf_c, hf_s = load_hf(colocated), load_hf(separate)
    assert hf_c.keys() == hf_s.keys() and all(torch.equal(hf_c[k], hf_s[k]) for k in hf_c)


def test_ray_launch_stops_all_ranks_when_one_fails(tmp_path, tiny_model_dir):
    start = time.time()
    run_dir = f"trainer.run_dir={tmp_path / 'run'}"
    proc = launch(tmp_path, small_config(tmp_path, tiny_model_dir), "tests.workers.ray_entry:fail_on_rank1", run_dir)
    assert proc.returncode == 1 and "rank 1 failed on purpose" in proc.stderr
    assert time.time() - start < 200
    # the last line: the rank's exception and where it was raised (Ray's wrapped traceback stays above it)
    raised_at = next(i for i, line in enumerate(ENTRY.read_text().splitlines(), 1) if "raise RuntimeError" in line)
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last == f"mcore-rl: error: rank 1 failed: RuntimeError: rank 1 failed on purpose (ray_entry.py:{raised_at})"
