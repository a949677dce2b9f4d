"""The separate placement end to end through `mcore-rl train` (real torchrun, Megatron actor, embedded engine).

- exact: rollout.placement=separate with rollout.max_staleness=0 on 2 processes (1 actor rank + 1 rollout rank)
  writes the same metrics rows (timings aside), the same checkpoint bytes and the same export as the colocated run
  on 1 process with the same actor layout and engine replicas (docs/placement.md)
- one step off-policy (max_staleness 1, the default): every step after the first trains on samples exactly one
  weight version old (train/staleness_max = mean = 1), the proximal pass runs every step, and resumes after kill -9
  (a checkpoint holds the next step's samples, generated before its update) reproduce the run bit for bit
- the verification across the split: a sync the rollout rank's engine did not fully apply is seen and rebuilt from
  the export sent over the bridge (rollout.verify_fallback=rebuild), or ends the run with one line naming the rollout
  rank (error)
"""

import contextlib
import hashlib
import json
import os
import pickle
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import EXACT_TOKENS
from tests.test_trainer_e2e import TIMING_PREFIXES, load_hf, overrides, read_metrics, run_train, task  # noqa: F401

pytestmark = pytest.mark.slow

SEPARATE = {"trainer.nproc": 2, "rollout.placement": "separate", "rollout.ranks": 1, "actor.parallel.ep": 1}
# files of a checkpoint that name its own run: its config (the placement keys differ), its publication time and the
# checksums over those
RUN_NAMING = {"config.yaml", "COMPLETE", "CHECKSUMS.json", "actor/.metadata"}
# the metrics only rollout.streaming writes: the token lags' histogram, interrupted samples, steps queued behind
STREAMING_KEYS = ("train/staleness_hist/0", "rollout/interrupted_samples", "rollout/queued_steps")


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


def test_separate_at_zero_staleness_equals_colocated(tiny_model_dir, colocated_reference, tmp_path):
    """The colocated run on 1 process (conftest.colocated_reference, shared with tests/test_ray_launch.py) against
    separate on 2 at max_staleness 0; and rollout.streaming=true at max_staleness 0 (admission waits for every
    session: no weights arrive mid generation) writes the synchronous separate run's rows, its own metrics besides."""
    colocated, reference_task = colocated_reference
    separate, streaming = tmp_path / "separate", tmp_path / "streaming"
    exact = {**SEPARATE, **EXACT_TOKENS, "rollout.max_staleness": 0}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, reference_task, separate, **exact))
    streams = {**exact, "rollout.streaming": "true"}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, reference_task, streaming, **streams))
    rows_c, rows_s = read_metrics(colocated), read_metrics(separate)
    assert [r["step"] for r in rows_s] == [1, 2, 3, 4]
    assert untimed(rows_c) == untimed(rows_s)
    rows_z = read_metrics(streaming)
    assert [[r[k] for k in STREAMING_KEYS] for r in rows_z] == [[1.0, 0, 0]] * 4  # lag 0, no interruption, no queue
    assert [{k: v for k, v in r.items() if k not in STREAMING_KEYS} for r in untimed(rows_z)] == untimed(rows_s)
    assert all(r["train/staleness_max"] == 0 for r in rows_s)
    assert "sync/verify_max_diff" in rows_s[1] and "val/reward_mean" in rows_s[1]  # verified, validated across
    assert "time/rollout_wait" in rows_s[0] and "time/actor_wait" in rows_s[0]
    for step in ("step_00000002", "step_00000004"):
        a, b = colocated / "checkpoints" / step, separate / "checkpoints" / step
        assert checkpoint_bytes(a) == checkpoint_bytes(b), step
        assert dcp_metadata(a) == dcp_metadata(b), step
    hf_c, hf_s = load_hf(colocated), load_hf(separate)
    assert hf_c.keys() == hf_s.keys() and all(torch.equal(hf_c[k], hf_s[k]) for k in hf_c)


def test_streaming_bounds_the_lag_of_every_trained_token(tiny_model_dir, task, tmp_path):  # noqa: F811
    """rollout.streaming=true, max_staleness 2: the rollout rank generates ahead as admission allows and takes each
    session between decode steps; every trained token's lag behind the update's starting weights, from its own
    version (the histogram over every token), stays within 2, and some samples span a weight update. (Here the
    rollout rank, with 24-token responses, is mostly the slower role: the lag is mostly 0-1, at times 2.)

    The run is killed with kill -9 during an interruption, then resumed (docs/async.md, "Checkpoint and resume"):
    once its status file (RUN_DIR/rollout_status.json) says samples are paused mid-generation while the session
    after step 6, 7 or 8 is served (the newest checkpoint is then step 4's, and step 5's row is written), the whole
    job - launcher, torchrun, the actor rank inside that session and the rollout rank - is killed at once: a lost
    node, the OOM killer or a scheduler does that, and it is the kill that leaves no process to save or clean up
    anything (the in-flight and queued samples and the open session go with the processes; a rollout rank killed
    alone is `test_a_rollout_rank_killed_is_named_and_the_checkpoints_stay`). The job is frozen (SIGSTOP) while
    the file and the metrics rows are read again, so the state read is the one the kill hits. Then every published
    checkpoint verifies, nothing half-written is left, the lock is free, and the resume from the step-4 checkpoint
    trains its samples (step 5) exactly as the killed run did; the steps after are generated again from the
    checkpoint's weights within the same bound."""
    from mcore_rl.run_dir import CheckpointManager, RunLock, verify_checkpoint
    from mcore_rl.streaming import STATUS_FILE

    run_dir = tmp_path / "run"
    extra = {
        "rollout.streaming": "true",
        "rollout.max_staleness": 2,
        "rollout.max_new_tokens": 24,
        "algo.routing_replay": "r3",
        "trainer.steps": 10,
        "checkpoint.save_every": 4,
    }
    args = overrides(tiny_model_dir, task, run_dir, **SEPARATE, **extra)
    frozen = killed_during_interruption(args, run_dir, sessions=range(6, 9), timeout=400)
    after = json.loads((run_dir / STATUS_FILE).read_text())
    assert after == frozen and after["state"] == "interrupted" and after["in_flight"] > 0, after
    killed = read_metrics(run_dir)  # the steps before the session: 1 .. 5 at least
    assert [r["step"] for r in killed] == list(range(1, frozen["session"])), (frozen, [r["step"] for r in killed])
    published = CheckpointManager(run_dir).complete()
    assert [c.step for c in published] == [4] and not any(verify_checkpoint(c) for c in published)
    assert not list((run_dir / "checkpoints").glob("*.tmp")) and not (run_dir / "hf").exists()
    RunLock.acquire(run_dir).release()

    out = run_train("gspo_cpu.yaml", args)
    assert "resumed from" in out and "step_00000004" in out, out[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert untimed(rows[:5]) == untimed(killed[:5])  # step 5 trains the checkpoint's samples, as before the kill
    hist = [[r[f"train/staleness_hist/{lag}"] for lag in range(3)] for r in rows]
    assert all(abs(sum(h) - 1) < 1e-9 for h in hist), hist  # every token has a lag in 0..2
    assert not any(k.startswith("train/staleness_hist/") and int(k.rsplit("/", 1)[1]) > 2 for r in rows for k in r)
    assert all(r["train/staleness_max"] <= 2 for r in rows) and hist[0] == [1.0, 0.0, 0.0]
    # a weight update landed mid-generation: one step's tokens at two lags (a step's samples start at one version)
    assert any(0 < h[1] < 1 for h in hist) and sum(r["rollout/interrupted_samples"] for r in rows) > 0, hist
    assert all(0 <= r["perf/rollout_idle_fraction"] <= 1 for r in rows)
    assert [c.step for c in CheckpointManager(run_dir).complete()] == [8, 10]
    assert not any(verify_checkpoint(c) for c in CheckpointManager(run_dir).complete())
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    done = json.loads((run_dir / STATUS_FILE).read_text())
    assert done["state"] == "done" and done["version"] == 10 and done["pid"] != frozen["pid"], done


def killed_during_interruption(args: list[str], run_dir: Path, sessions: range, timeout: float, preset="gspo_cpu.yaml"):
    """`mcore-rl train` started with `args` and killed as `_kill_during_interruption` says; the status it was killed
    in. The job's output goes to a file beside the run directory (a pipe nobody reads would block a job that logs
    more than it holds, as vLLM does) and is printed when no interruption came."""
    from mcore_rl.streaming import STATUS_FILE
    from tests.test_trainer_e2e import kill_job

    log = run_dir.parent / "killed.log"
    with log.open("w") as out:
        proc = _start(args, preset, stdout=out)
        try:
            return _kill_during_interruption(proc, run_dir / STATUS_FILE, sessions, timeout)
        except AssertionError:
            print(log.read_text()[-6000:])
            raise
        finally:
            if proc.poll() is None:
                kill_job(proc)


def _kill_during_interruption(proc, status_file: Path, sessions: range, timeout: float) -> dict:
    """SIGKILL the whole job while the rollout rank has samples paused mid-generation for a session in `sessions`
    (the weight version it brings; RUN_DIR/rollout_status.json says "interrupted") and the actor is still inside that
    session (its step's metrics row not written); return that status. The rank's file says "interrupted" until the
    paused samples continue, a little after the actor has left the session and may have written the row: so the job
    is frozen (SIGSTOP, every process under the launcher) while the file and the rows are read again, and when
    either moved on it goes on (SIGCONT) to the next."""
    import time

    import psutil

    from tests.test_trainer_e2e import kill_job

    rows = status_file.parent / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before an interruption in sessions {sessions}")
        status = _status(status_file)
        if status.get("state") == "interrupted" and status["session"] in sessions:
            job = psutil.Process(proc.pid).children(recursive=True)
            assert psutil.Process(status["pid"]) in job, status  # the rollout rank that wrote it, one of the job's
            _signal_all(job, "suspend")
            written = len(rows.read_text().splitlines()) if rows.exists() else 0
            if _status(status_file) == status and written < status["session"]:
                kill_job(proc)
                return status
            _signal_all(job, "resume")
        time.sleep(0.005)
    raise AssertionError(f"no interruption in sessions {sessions} within {timeout} s: {_status(status_file)}")


def _signal_all(processes: list, action: str) -> None:
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            getattr(p, action)()


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def test_a_rollout_rank_killed_is_named_and_the_checkpoints_stay(tiny_model_dir, task, tmp_path):  # noqa: F811
    """kill -9 of the rollout rank mid-run: the job ends with one line naming the rollout rank and the signal, and
    every published checkpoint still verifies (nothing half-written is left)."""
    import signal

    import psutil

    from mcore_rl.run_dir import CheckpointManager
    from tests.test_trainer_e2e import _wait_for_checkpoint_write, kill_job

    run_dir = tmp_path / "killed"
    args = overrides(tiny_model_dir, task, run_dir, **SEPARATE, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    proc = _start(args)
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


# the tensor tests/dropped_sync_tensor.py leaves out of the rollout rank's engine: one every step's update changes
DROPPED = "model.layers.0.self_attn.q_proj.weight"


def dropping_cmd(arrival: int, args: list[str], rank: int = 1) -> list[str]:
    """`mcore-rl train` (gspo_cpu.yaml) whose rollout rank `rank` (global; 1: the first rollout rank of 1 actor rank)
    does not apply the `arrival`-th sync of DROPPED: the fault is in the receiving engine's load, every other part of
    the run is real."""
    import sys

    from tests.test_trainer_e2e import REPO

    drop = ["--rank", str(rank), "--tensor", DROPPED, "--arrival", str(arrival)]
    return [
        sys.executable,
        "-m",
        "tests.dropped_sync_tensor",
        *drop,
        "--",
        "train",
        str(REPO / "configs/tiny/gspo_cpu.yaml"),
        *args,
    ]


def _train(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd` run as run_train runs `mcore-rl train`: from the repository, without launcher variables, one thread."""
    from tests.test_trainer_e2e import LAUNCHER_VARS, REPO

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        timeout=600,
        env=dict(env, OMP_NUM_THREADS="1"),
    )


def test_dynamic_sampling_rounds_are_generated_ahead_too(tiny_model_dir, task, tmp_path):  # noqa: F811
    """DAPO dynamic sampling one step off-policy: the rollout ranks run the step's extra rounds ahead (their own
    sampler, the same decisions from the same rewards) and the actor ranks train on exactly those rounds, checked
    against their own sampler's prompts; every step has its groups with signal. The same job runs the loglinear
    proximal log-probs with the geometric-mean sequence weight (docs/async-objective.md): no proximal pass runs, the
    update's forward gives the entropy metric.

    And the rebuild across the split: the rollout rank's engine leaves one tensor of sync 2 (verified: verify_every 2)
    unapplied (tests/dropped_sync_tensor.py). The verification sees it on the rollout side (that tensor's fingerprint,
    the probe's log-probs against the actor's), the fallback rebuilds the engine from the export sent over the bridge,
    the rebuilt engine matches the actor, and the run goes on: step 4 is generated from it, sync 4 verifies clean."""
    run_dir = tmp_path / "run"
    extra = {"algo.dynamic_sampling": "true", "reward.fn": "tests.dapo_reward:score", "trainer.val_every": 0}
    extra.update({"algo.proximal": "loglinear", "algo.rollout_is": "sequence_geomean"})
    proc = _train(dropping_cmd(2, overrides(tiny_model_dir, task, run_dir, **SEPARATE, **extra)))
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["groups/kept"] == 4 for r in rows), [r.get("groups/kept") for r in rows]
    assert any(r["groups/rounds"] > 1 for r in rows), [r["groups/rounds"] for r in rows]
    assert [r["train/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert not any("time/old_logprob" in r for r in rows), [sorted(r) for r in rows]
    assert all(r["train/entropy_old"] == r["train/entropy"] and 0 < r["train/is_weight_mean"] for r in rows), rows

    verified = {r["step"]: r for r in rows if "sync/rebuilt" in r}
    assert sorted(verified) == [2, 4] and f"rank 1 left {DROPPED} (arrival 2) out" in out, out[-4000:]
    assert verified[2]["sync/rebuilt"] == 1 and verified[2]["sync/verify_weights_differ"] == 1, verified[2]
    assert f"1 of 69 tensors differ (e.g. {DROPPED}): FAILED; rebuilt the engine from exported weights" in out
    after = float(re.search(r"rebuilt the engine from exported weights -> max (\S+)", out).group(1))
    assert after <= 1e-5 < verified[2]["sync/verify_max_diff"], (after, verified[2])  # fp32: exact after the rebuild
    assert verified[4]["sync/rebuilt"] == 0 and verified[4]["sync/verify_weights_differ"] == 0
    assert verified[4]["sync/verify_max_diff"] <= 1e-5, verified[4]


def test_a_sync_the_rollout_rank_did_not_apply_ends_the_run_with_fallback_error(tiny_model_dir, task, tmp_path):  # noqa: F811
    """rollout.verify_fallback=error and the same fault in sync 1: the job ends with one line naming the rollout rank
    whose engine differs, the tensor and the fix; no worker's traceback."""
    from tests.test_faults_e2e import assert_no_worker_traceback, last_line

    extra = {"trainer.steps": 1, "rollout.verify_every": 1, "rollout.verify_fallback": "error", "trainer.val_every": 0}
    extra["reward.fn"] = "tests.dapo_reward:score"  # groups with signal: the first update changes the weights
    run_dir = tmp_path / "run"
    proc = _train(dropping_cmd(1, overrides(tiny_model_dir, task, run_dir, **SEPARATE, **extra)))
    out, line = proc.stdout, last_line(proc.stdout)
    assert proc.returncode == 1, out[-6000:]
    assert line.startswith("mcore-rl: error: the engine of rollout rank 1, at step 1: sync "), line
    assert f"tensors differ (e.g. {DROPPED})" in line and "use rollout.verify_fallback=rebuild to recover" in line
    assert_no_worker_traceback(out)
    assert not (run_dir / "checkpoints" / "step_00000001").exists()  # nothing trained past a failed sync is saved


def _start(args: list[str], preset: str = "gspo_cpu.yaml", stdout=subprocess.PIPE):
    """`mcore-rl train` started in the background as run_train runs it (without launcher variables, one thread).
    A job that logs more than a pipe holds (vLLM) blocks on a PIPE nobody reads: pass an open file as `stdout`."""
    from tests.test_trainer_e2e import LAUNCHER_VARS, REPO, train_cmd

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.Popen(
        train_cmd(preset, args),
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env, OMP_NUM_THREADS="1"),
    )


def _ranks(proc) -> list:
    """torchrun's workers by global rank (here 0: the actor rank, 1: the rollout rank)."""
    import psutil

    torchrun = psutil.Process(proc.pid).children()[0]
    return sorted(torchrun.children(), key=lambda p: int(p.environ().get("RANK", "0")))


@pytest.mark.parametrize("target, sig", [("launcher", "SIGTERM"), ("rollout rank", "SIGTERM"), ("launcher", "SIGINT")])
def test_sigterm_stops_the_separate_placement_like_the_colocated_one(tiny_model_dir, task, tmp_path, target, sig):  # noqa: F811
    """SIGTERM (or Ctrl-C once) to `mcore-rl train` (or SIGTERM to the rollout rank alone) while a checkpoint is written: the checkpoint is
    published, every worker stops at the step boundary and the launcher exits 128 + SIGTERM with the colocated stop
    line (README "Stopping"). The rollout rank used to die of the signal (torchrun's log: a failed job under the stop
    line), or, signalled alone, the actor lost it at the next step: an error instead of the stop."""
    import signal

    import psutil

    from mcore_rl.run_dir import CheckpointManager, verify_checkpoint
    from tests.test_faults_e2e import assert_no_worker_traceback, last_line
    from tests.test_trainer_e2e import _wait_for_checkpoint_write, kill_job

    run_dir = tmp_path / "stopped"
    proc = _start(
        overrides(tiny_model_dir, task, run_dir, **SEPARATE, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    )
    try:
        _wait_for_checkpoint_write(proc, run_dir, 2, timeout=240)
        started = psutil.Process(proc.pid).children(recursive=True)
        (proc if target == "launcher" else _ranks(proc)[1]).send_signal(signal.Signals[sig])
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    line = last_line(out)
    assert proc.returncode == 128 + signal.Signals[sig], out[-6000:]
    assert line.startswith(f"mcore-rl: stopped by {sig} after step "), out[-6000:]
    assert "continue with checkpoint.resume=auto" in line
    assert_no_worker_traceback(out)
    assert "stopped answering" not in out, out[-6000:]
    failures = run_dir / "torchrun.log"  # written when a rank failed: none died of the signal
    job_log = failures.read_text() if failures.exists() else ""
    assert "ChildFailedError" not in job_log and "exitcode" not in job_log, job_log[-4000:]
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    newest = CheckpointManager(run_dir).latest()
    assert newest.step >= 2 and f"newest checkpoint: {newest.path}" in line and not verify_checkpoint(newest)
    assert not list((run_dir / "checkpoints").glob("*.tmp")) and newest.step < 50


def test_kill_9_of_the_actor_rank_and_of_the_launcher_lose_nothing_and_resume_exactly(tiny_model_dir, task, tmp_path):  # noqa: F811
    """One step off-policy with R3, a checkpoint every step. The uninterrupted run: every step after the first
    trains on samples exactly one version old and runs the proximal (old-policy) pass. Then kill -9 of the actor
    rank while checkpoint 2 is written (the last line names it: `actor rank 0`, SIGKILL), resume (its checkpoint
    holds the next step's samples, generated before its update), kill -9 of the launcher alone while checkpoint 4 is
    written (every process of the job ends within seconds, nothing more is written, the lock is free), resume again:
    each time the newest published checkpoint verifies, and the run that went through both kills writes the same
    metrics rows (timings aside) and the same export as the uninterrupted run of the same seed."""
    import signal

    import psutil

    from mcore_rl.run_dir import CheckpointManager, RunLock, verify_checkpoint
    from tests.test_faults_e2e import last_line
    from tests.test_trainer_e2e import _wait_for_checkpoint_write, kill_job

    extra = {**SEPARATE, "trainer.steps": 5, "checkpoint.save_every": 1, "algo.routing_replay": "r3"}
    straight, run_dir = tmp_path / "straight", tmp_path / "killed"
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, straight, **extra))
    rows = read_metrics(straight)
    assert [(r["train/staleness_max"], r["train/staleness_mean"]) for r in rows] == [(0, 0)] + [(1, 1)] * 4
    # the proximal (old-policy) pass ran every step: off-policy it is never taken from the update
    assert all("time/old_logprob" in r for r in rows), [sorted(r) for r in rows]
    args = overrides(tiny_model_dir, task, run_dir, **extra)

    proc = _start(args)
    try:
        _wait_for_checkpoint_write(proc, run_dir, 2, timeout=240)
        _ranks(proc)[0].send_signal(signal.SIGKILL)  # global rank 0: the actor rank
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    line = last_line(out)
    assert proc.returncode != 0 and "actor rank 0" in line and "SIGKILL" in line, out[-6000:]
    newest = CheckpointManager(run_dir).latest()
    assert newest is not None and newest.step in (1, 2) and not verify_checkpoint(newest)

    proc, started = _start(args), []
    try:
        _wait_for_checkpoint_write(proc, run_dir, 4, timeout=300)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)  # the launcher alone
        proc.wait()
        _, alive = psutil.wait_procs(started, timeout=30)
    finally:
        if proc.poll() is None:
            kill_job(proc)
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.stdout.close()
    assert len(started) >= 3 and not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    written = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    time.sleep(3)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == written  # nothing more
    newest = CheckpointManager(run_dir).latest()
    assert newest.step in (3, 4) and not verify_checkpoint(newest) and not (run_dir / "hf").exists()
    RunLock.acquire(run_dir).release()

    out = run_train("gspo_cpu.yaml", args)
    assert "resumed from" in out and f"step_{newest.step:08d}" in out, out[-3000:]
    rows_b = read_metrics(run_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5]
    assert untimed(rows) == untimed(rows_b)
    hf_a, hf_b = load_hf(straight), load_hf(run_dir)
    assert hf_a.keys() == hf_b.keys() and all(torch.equal(hf_a[k], hf_b[k]) for k in hf_a)


def test_ctrl_c_twice_stops_the_separate_placement_at_once(tiny_model_dir, task, tmp_path):  # noqa: F811
    """Ctrl-C twice while checkpoint 2 is written: the colocated run's line and exit 130, no traceback from either
    role, and the checkpoint being written is never published."""
    import signal
    import time

    from mcore_rl.run_dir import CheckpointManager, verify_checkpoint
    from tests.test_faults_e2e import assert_no_worker_traceback, last_line
    from tests.test_trainer_e2e import _wait_for_checkpoint_write, kill_job

    run_dir = tmp_path / "run"
    args = overrides(tiny_model_dir, task, run_dir, **SEPARATE, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    proc = _start(args)
    try:
        _wait_for_checkpoint_write(proc, run_dir, 2, timeout=240)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    line = last_line(out)
    assert proc.returncode == 128 + signal.SIGINT, out[-6000:]
    assert line.startswith("mcore-rl: stopped ") and "continue with checkpoint.resume=auto" in line, out[-6000:]
    assert_no_worker_traceback(out)
    newest = CheckpointManager(run_dir).latest()
    assert newest.step in (1, 2) and not verify_checkpoint(newest) and f"newest checkpoint: {newest.path}" in line


def test_streaming_over_two_replicas_takes_each_session_together(tiny_model_dir, task, tmp_path):  # noqa: F811
    """rollout.streaming=true over 2 embedded replicas (1 actor rank + 2 rollout ranks): the replicas agree at every
    decode step where a session is taken (mcore_rl/streaming.py, `Agreement`). At max_staleness 0 the rows equal the
    synchronous separate run's with the same 2 replicas (its streaming metrics aside; validation in the session after
    step 2). At 1, with 24-token responses and dynamic sampling's extra rounds, the run ends (no deadlock), every
    token's lag is within 1, and updates landed mid-generation on both replicas: some step had more samples
    interrupted than one replica generates (8, and at K = 1 at most one update lands in a step's generation). In
    that run the second replica alone (rollout rank 2) leaves a tensor of sync 2 unapplied: the verification compares
    every replica's weights, names rank 2 and rebuilds every replica (the probe is scored by the first one's)."""
    replicas = {**SEPARATE, "trainer.nproc": 3, "rollout.ranks": 2, "checkpoint.save_every": 0}
    exact = {**replicas, "trainer.steps": 3, "rollout.max_new_tokens": 6, "rollout.max_staleness": 0}
    separate, streaming, ahead = tmp_path / "separate", tmp_path / "streaming", tmp_path / "ahead"
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, separate, **exact))
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, streaming, **exact, **{"rollout.streaming": "true"}))
    rows_s, rows_z = read_metrics(separate), read_metrics(streaming)
    assert [r["step"] for r in rows_s] == [1, 2, 3] and "val/reward_mean" in rows_s[1]
    assert [[r[k] for k in STREAMING_KEYS] for r in rows_z] == [[1.0, 0, 0]] * 3  # lag 0, no interruption, no queue
    assert [{k: v for k, v in r.items() if k not in STREAMING_KEYS} for r in untimed(rows_z)] == untimed(rows_s)

    extra = {"rollout.streaming": "true", "rollout.max_staleness": 1, "rollout.max_new_tokens": 24}
    extra.update({"algo.dynamic_sampling": "true", "reward.fn": "tests.dapo_reward:score"})
    proc = _train(dropping_cmd(2, overrides(tiny_model_dir, task, ahead, **replicas, **extra), rank=2))
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    rows = read_metrics(ahead)
    verified = {r["step"]: r for r in rows if "sync/rebuilt" in r}
    assert f"rank 2 left {DROPPED} (arrival 2) out" in out and sorted(verified) == [2, 4], out[-4000:]
    assert "rollout rank 2: its engine differs from rollout rank 1's in 1 of 69 tensors" in out, out[-4000:]
    assert verified[2]["sync/rebuilt"] == 1 and verified[2]["sync/verify_weights_differ"] == 1, verified[2]
    assert verified[4]["sync/rebuilt"] == 0 and verified[4]["sync/verify_weights_differ"] == 0, verified[4]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val/reward_mean" in rows[1]
    hist = [[r[f"train/staleness_hist/{lag}"] for lag in range(2)] for r in rows]
    assert all(abs(sum(h) - 1) < 1e-9 for h in hist) and all(r["train/staleness_max"] <= 1 for r in rows), hist
    assert all(r["groups/kept"] == 4 for r in rows) and any(r["groups/rounds"] > 1 for r in rows), rows
    assert max(r["rollout/interrupted_samples"] for r in rows) > 8, [r["rollout/interrupted_samples"] for r in rows]
