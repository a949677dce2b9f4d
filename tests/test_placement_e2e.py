"""The separate placement end to end through `mcore-rl train` (real torchrun, Megatron actor, embedded engine).

- exact: rollout.placement=separate with rollout.max_staleness=0 on 2 processes (1 actor rank + 1 rollout rank)
  writes the same metrics rows (timings aside), the same checkpoint bytes and the same export as the colocated run
  on 1 process with the same actor layout and engine replicas (docs/placement.md)
- one step off-policy (max_staleness 1, the default): every step after the first trains on samples exactly one
  weight version old (train/staleness_max = mean = 1), the proximal pass runs every step, and a resume from the
  step-2 checkpoint (which holds step 3's samples, generated before step 2's update) reproduces the run bit for bit
"""

import hashlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_trainer_e2e import TIMING_PREFIXES, load_hf, overrides, read_metrics, run_train, task  # noqa: F401

pytestmark = pytest.mark.slow

SEPARATE = {"trainer.nproc": 2, "rollout.placement": "separate", "rollout.ranks": 1, "actor.parallel.ep": 1}
# files of a checkpoint that name its own run: its config (the placement keys differ), its publication time and the
# checksums over those
RUN_NAMING = {"config.yaml", "COMPLETE", "CHECKSUMS.json", "actor/.metadata"}


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def checkpoint_bytes(ckpt: Path) -> dict[str, str]:
    return {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and str(p.relative_to(ckpt)) not in RUN_NAMING
    }


def dcp_metadata(ckpt: Path):
    """torch.distributed.checkpoint's metadata without its storage_meta (the folder it was written to, a uuid)."""
    meta = pickle.loads((ckpt / "actor" / ".metadata").read_bytes())
    return meta.state_dict_metadata, meta.planner_data, meta.storage_data


def test_separate_at_zero_staleness_equals_colocated(tiny_model_dir, task, tmp_path):  # noqa: F811
    colocated, separate = tmp_path / "colocated", tmp_path / "separate"
    run_train(
        "gspo_cpu.yaml", overrides(tiny_model_dir, task, colocated, **{"trainer.nproc": 1, "actor.parallel.ep": 1})
    )
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, separate, **SEPARATE, **{"rollout.max_staleness": 0}))
    rows_c, rows_s = read_metrics(colocated), read_metrics(separate)
    assert [r["step"] for r in rows_s] == [1, 2, 3, 4]
    assert untimed(rows_c) == untimed(rows_s)
    assert all(r["train/staleness_max"] == 0 for r in rows_s)
    assert "sync/verify_max_diff" in rows_s[1] and "val/reward_mean" in rows_s[1]  # verified, validated across
    assert "time/rollout_wait" in rows_s[0] and "time/actor_wait" in rows_s[0]
    for step in ("step_00000002", "step_00000004"):
        a, b = colocated / "checkpoints" / step, separate / "checkpoints" / step
        assert checkpoint_bytes(a) == checkpoint_bytes(b), step
        assert dcp_metadata(a) == dcp_metadata(b), step
    hf_c, hf_s = load_hf(colocated), load_hf(separate)
    assert hf_c.keys() == hf_s.keys() and all(torch.equal(hf_c[k], hf_s[k]) for k in hf_c)


def test_one_step_off_policy_is_one_version_stale_and_resumes_exactly(tiny_model_dir, task, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = overrides(tiny_model_dir, task, run_dir, **SEPARATE, **{"algo.routing_replay": "r3"})
    run_train("gspo_cpu.yaml", args)
    rows = read_metrics(run_dir)
    assert [(r["train/staleness_max"], r["train/staleness_mean"]) for r in rows] == [(0, 0)] + [(1, 1)] * 3
    # the proximal (old-policy) pass ran every step: off-policy it is never taken from the update
    assert all("time/old_logprob" in r for r in rows), [sorted(r) for r in rows]
    straight = load_hf(run_dir)

    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "hf")
    out = run_train("gspo_cpu.yaml", args)
    assert "resumed from" in out and "step_00000002" in out, out[-3000:]
    resumed = load_hf(run_dir)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    rows_b = read_metrics(run_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert untimed(rows) == untimed(rows_b)


def test_a_rollout_rank_killed_is_named_and_the_checkpoints_stay(tiny_model_dir, task, tmp_path):  # noqa: F811
    """kill -9 of the rollout rank mid-run: the job ends with one line naming the rollout rank and the signal, and
    every published checkpoint still verifies (nothing half-written is left)."""
    import os
    import signal
    import subprocess

    import psutil

    from mcore_rl.run_dir import CheckpointManager
    from tests.test_trainer_e2e import REPO, _wait_for_checkpoint_write, kill_job, train_cmd

    run_dir = tmp_path / "killed"
    args = overrides(tiny_model_dir, task, run_dir, **SEPARATE, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    proc = subprocess.Popen(
        train_cmd("gspo_cpu.yaml", args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        _wait_for_checkpoint_write(proc, run_dir, 2, timeout=240)
        torchrun = psutil.Process(proc.pid).children()[0]
        ranks = sorted(torchrun.children(), key=lambda p: p.environ().get("RANK", ""))
        ranks[1].send_signal(signal.SIGKILL)  # global rank 1: the rollout rank
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    assert "rollout rank 1" in out and "SIGKILL" in out, out[-4000:]
    newest = CheckpointManager(run_dir).latest()  # published ones only: a .tmp the kill cut short is not taken
    assert newest is not None and newest.step >= 1 and (newest.path / "actor").is_dir()


def test_dynamic_sampling_rounds_are_generated_ahead_too(tiny_model_dir, task, tmp_path):  # noqa: F811
    """DAPO dynamic sampling one step off-policy: the rollout ranks run the step's extra rounds ahead (their own
    sampler, the same decisions from the same rewards) and the actor ranks train on exactly those rounds, checked
    against their own sampler's prompts; every step has its groups with signal."""
    run_dir = tmp_path / "run"
    extra = {"algo.dynamic_sampling": "true", "reward.fn": "tests.dapo_reward:score", "trainer.val_every": 0}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run_dir, **SEPARATE, **extra))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["groups/kept"] == 4 for r in rows), [r.get("groups/kept") for r in rows]
    assert any(r["groups/rounds"] > 1 for r in rows), [r["groups/rounds"] for r in rows]
    assert [r["train/staleness_max"] for r in rows] == [0, 1, 1, 1]
