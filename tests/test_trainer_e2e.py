"""End to end through `mcore-rl train`: real torchrun, 2 processes, Megatron actor, embedded engine.

- a short GSPO (EP2, rollout routing replay) and SAPO (TP2 + KL + entropy, old-policy routing replay from a
  separate old-policy pass: algo.old_log_prob_pass=always) run writes metrics, checkpoints, plots and a HF
  export; both run the old-policy pass; so do the dense presets (SAPO on Qwen3 TP2, GSPO on the tied Qwen2
  over PP2), whose export holds exactly the checkpoint's names (tied: no lm_head)
- the plain GSPO run (exactly on-policy) skips that pass and still reports the entropy
- a response cut at rollout.max_new_tokens on the multi-token preset has no <|im_end|>, is marked truncated
  (finish reason, response/clip_ratio) and gets the overlong penalty in its reward (trainer.sample_log); that run
  trains with a loss registered from outside the package (algo.loss=tests.reinforce_loss:Reinforce)
- a SIGKILL while the step-4 checkpoint is being written leaves step 2 loadable, and resuming from it
  reproduces the uninterrupted run exactly (final weights and metrics)
- with DAPO dynamic sampling (steps with extra generation rounds, R3), a resume from step 2 reproduces the
  4-step run exactly
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcore_rl.run_dir import is_complete
from tests.torchrun_util import REPO

pytestmark = pytest.mark.slow

# Quantities that depend on wall time, not on the computation.
TIMING_PREFIXES = ("time", "perf/", "time/", "sync/seconds", "sync/gb_per_s")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path_factory.mktemp("task"), train_size=256, val_size=32, seed=0)
    return str(train), str(val)


def overrides(model_dir, task, run_dir, **extra):
    base = {
        "model.path": model_dir,
        "data.train_path": task[0],
        "data.val_path": task[1],
        "trainer.run_dir": str(run_dir),
        "trainer.steps": 4,
        "trainer.val_every": 2,
        "trainer.val_prompts": 16,
        "checkpoint.save_every": 2,
        "data.prompts_per_step": 4,
        "rollout.n": 4,
        "actor.parallel.micro_batch_size": 4,
        "rollout.verify_every": 2,
        "trainer.plots": "false",  # ~60 PNGs a run, the largest cost of a short job; the tests that check them ask
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_cmd(preset: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "mcore_rl.cli", "train", str(REPO / "configs/tiny" / preset), *args]


# A single-process vLLM engine built earlier in this pytest process sets these (vllm_engine._ensure_launcher_env);
# inherited, they would tell `mcore-rl train` it already runs inside torchrun as a world of one.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_train(preset: str, args: list[str], timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        train_cmd(preset, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # in the order a terminal shows them
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=dict(env, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    return out


def first_screen(out: str) -> list[str]:
    """The lines a person sees before the first step's progress line."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("step 1/"))
    return lines[:first]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def load_hf(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(run_dir / "hf")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize(
    "preset, arch, extra",
    [
        ("gspo_cpu.yaml", "qwen3-moe", {"algo.routing_replay": "r3"}),
        # old_log_prob_pass=always: R2 records routes in a separate old-policy pass and the update replays them;
        # actor.offload: the actor's state on the host around rollout, the reference model outside its pass
        (
            "sapo_cpu.yaml",
            "qwen3-moe",
            {
                "algo.kl_coef": 0.01,
                "algo.entropy_coef": 0.001,
                "algo.routing_replay": "r2",
                "algo.old_log_prob_pass": "always",
                "actor.offload": "true",
            },
        ),
        ("sapo_dense_cpu.yaml", "qwen3", {"algo.entropy_coef": 0.001}),
        # every library warning shown (else the known ones are hidden behind one line)
        ("gspo_dense_cpu.yaml", "qwen2", {"trainer.verbose": "true"}),
    ],
    ids=["gspo-moe", "sapo-moe", "sapo-dense-qwen3", "gspo-dense-qwen2"],
)
def test_short_run(tiny_arch_dir, task, tmp_path, preset, arch, extra):
    run_dir = tmp_path / "run"
    tiny_model_dir = tiny_arch_dir(arch)
    out = run_train(preset, overrides(tiny_model_dir, task, run_dir, **extra, **{"trainer.plots": "true"}))
    assert "step 4/4 | " in out and " s/step | ETA 0:00 | reward " in out and "tok/s" in out  # the progress line
    # The first screen: the launcher's line, versions, what is absent and why that is fine, data, engine; the
    # library warnings (36 lines on the MoE preset, megatron-core 0.16.1) only with trainer.verbose.
    screen = first_screen(out)
    absent = "Transformer Engine and Apex are not installed: not used on CPU"
    if "trainer.verbose" in extra:
        assert not any(absent in line for line in screen), screen
        assert any("UserWarning: Transformer Engine and Apex are not installed" in line for line in screen), screen
        assert any("UserWarning: Apex is not installed. Falling back to Torch Norm" in line for line in screen)
        assert any("version shim" in line for line in screen)
    else:
        assert len(screen) <= 8 and sum(absent in line for line in screen) == 1, "\n".join(screen)
        assert not any("Warning: " in line for line in screen), "\n".join(screen)
    assert ("actor.offload: " in out and "MiB of the actor's device state released" in out) == (
        "actor.offload" in extra
    )
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    clip_keys = (
        ("train/clipfrac_upper", "train/clipfrac_lower") if preset.startswith("gspo") else ()
    )  # SAPO never clips
    for key in (
        "reward/mean",
        "train/loss",
        "train/grad_norm",
        *clip_keys,
        "train/approx_kl_old",
        "train/entropy_old",
        "response/length_mean",
        "perf/tokens_per_s",
        "time/rollout",
        "time/update",
        "time/sync",
    ):
        assert all(key in r for r in rows), key
    # R3 / old_log_prob_pass=always: a separate old-policy pass runs; exactly on-policy runs (the dense
    # presets here) take the update's own log-probs and have no such phase, yet report train/entropy_old
    separate_pass = extra.get("algo.routing_replay") == "r3" or extra.get("algo.old_log_prob_pass") == "always"
    assert all(("time/old_logprob" in r) == separate_pass for r in rows)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert "val/reward_mean" in rows[1] and "sync/verify_max_diff" in rows[1]
    assert rows[1]["sync/verify_max_diff"] <= 1e-4  # the engine samples from the trained policy
    # the calibration: the engine/actor gap at the initial weights on step 1's own rollout sequences, logged once
    assert rows[0]["sync/calibration_max_diff"] <= 1e-4 and "sync calibration" not in out  # within: no line
    assert 0 <= rows[0]["sync/calibration_high_diff"] <= rows[0]["sync/calibration_max_diff"]
    assert not any("sync/calibration_mean_diff" in r for r in rows[1:])
    if "algo.kl_coef" in extra:
        assert all("train/kl_ref" in r for r in rows) and rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
        assert rows[-1]["train/kl_ref"] > 0  # the policy moved away from the reference
    # Replayed routes come from the same weights (on-policy, one mini-batch): no mismatch beyond rare
    # near-ties that float rounding may flip between the engine's and Megatron's router (R3).
    if "algo.routing_replay" in extra:
        assert all(r["routing/token_mismatch"] <= 0.01 for r in rows)
    else:
        assert not any(k.startswith("routing/") for r in rows for k in r)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "plots" / "overview.png").is_file()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000002", "step_00000004"]
    # The exported model loads in transformers and holds the trained weights: it moved away from the
    # initial ones exactly when some step had a gradient (a batch of all-equal rewards has none, and the
    # random model's first hits are rare; the SAPO run's entropy bonus always gives one).
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(trained.state_dict().values(), initial.state_dict().values())
    )
    assert (
        load_hf(run_dir).keys() == read_safetensors(Path(tiny_model_dir)).keys()
    )  # tied qwen2: embed_tokens, no lm_head
    had_gradient = any(r["train/grad_norm"] > 0 for r in rows)
    assert (moved > 0) == had_gradient, (moved, [r["train/grad_norm"] for r in rows])
    if "algo.entropy_coef" in extra:
        assert had_gradient


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it. torchrun's workers live in their own sessions, so
    killing the launcher's process group alone would leave them running (and finishing the checkpoint)."""
    import psutil

    victims = [psutil.Process(proc.pid)]
    try:
        victims += victims[0].children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(victims[1:], timeout=30)


def _wait_for_checkpoint_write(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    """Return as soon as checkpoint `step` is being written (its .tmp folder exists, not yet published)."""
    tmp = run_dir / "checkpoints" / f"step_{step:08d}.tmp"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if tmp.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before writing checkpoint {step}")
        time.sleep(0.01)
    raise AssertionError(f"checkpoint {step} was not being written within {timeout} s")


def _kill_while_writing(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    """SIGKILL the whole job as soon as checkpoint `step` is being written. The job's processes are listed while
    waiting, so the kill follows the .tmp folder's appearance within a few milliseconds: a tiny model's write
    takes well under a second, and listing them only after seeing the folder let the write finish first."""
    import psutil

    tmp = run_dir / "checkpoints" / f"step_{step:08d}.tmp"
    deadline = time.time() + timeout
    victims: list = []
    try:
        while not tmp.exists():
            if proc.poll() is not None:
                raise AssertionError(f"training exited ({proc.returncode}) before writing checkpoint {step}")
            if time.time() > deadline:
                raise AssertionError(f"checkpoint {step} was not being written within {timeout} s")
            try:
                root = psutil.Process(proc.pid)
                victims = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.002)
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
    finally:
        kill_job(proc)  # whatever started since it was listed


def test_kill_during_checkpoint_write_then_exact_resume(tiny_model_dir, task, tmp_path):
    """4 steps straight == the same run SIGKILLed while writing its step-4 checkpoint, then resumed.

    The interrupted and resumed run moves the actor's state to the host around every rollout (actor.offload)
    and the straight one does not: the weights and every metric must still be identical, bit for bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    offload = {"actor.offload": "true"}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, straight))
    # exactly on-policy (one mini-batch, one epoch, no R3): no old-policy pass, entropy still reported
    rows = read_metrics(straight)
    assert all("time/old_logprob" not in r and r["train/entropy_old"] > 0 for r in rows), rows[0]

    proc = subprocess.Popen(
        train_cmd("gspo_cpu.yaml", overrides(tiny_model_dir, task, resumed, **offload)),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    _kill_while_writing(proc, resumed, 4, timeout=240)  # torchrun and both ranks, mid-write
    from mcore_rl.run_dir import CheckpointManager

    assert not is_complete(resumed / "checkpoints" / "step_00000004")
    assert CheckpointManager(resumed).latest().step == 2  # the previous checkpoint is still the newest complete
    assert not (resumed / "hf").exists()  # it really died before the end

    out = run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, resumed, **offload))
    assert "resumed from" in out and "step_00000002" in out, out[-3000:]
    assert "MiB of the actor's device state released for rollout" in out, out[-3000:]

    a, b = load_hf(straight), load_hf(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    rows_a, rows_b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
        assert keep(ra) == keep(rb), f"step {ra['step']} metrics differ"


def _finite_checkpoint(ckpt_dir: Path) -> None:
    """Every floating tensor of a published dist checkpoint (model and optimizer state) is finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt_dir.parent / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir / "actor", flat)
    state = torch.load(flat, weights_only=False)
    flat.unlink()
    tensors = []

    def walk(obj, key=""):
        if torch.is_tensor(obj):
            tensors.append((key, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}")

    walk(state)
    assert tensors, f"no tensors read from {ckpt_dir}"
    bad = [k for k, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, f"{ckpt_dir} holds non-finite tensors: {bad[:5]}"


def test_bad_rewards_and_non_finite_updates_are_never_applied(tiny_model_dir, task, tmp_path):
    """NaN / string / raising rewards are reward errors left out of their group; the steps whose gradient
    norm overflows (1e30 rewards) are skipped on both ranks; every published checkpoint and the export
    are finite. A second run whose weights turn inf at step 2 refuses to save it: step 1 survives keep_last=1."""
    run_dir = tmp_path / "faulty"
    args = overrides(
        tiny_model_dir,
        task,
        run_dir,
        **{
            "reward.fn": "tests.faulty_reward:score",
            "algo.adv_estimator": "drgrpo",
            "trainer.val_every": 0,
            "checkpoint.save_every": 1,
            "checkpoint.keep_last": 1,
            "trainer.max_consecutive_skips": 2,
        },
    )
    out = run_train("gspo_cpu.yaml", args)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["reward/errors"] == 3 and "returned nan, not a finite number" in out
    assert all(r["reward/errors"] == 0 for r in rows[1:])
    assert [r["train/skipped_steps"] for r in rows] == [0.0, 1.0, 0.0, 1.0], rows
    assert [r["train/update_successful"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    import math

    assert math.isfinite(rows[0]["train/loss"]) and math.isfinite(rows[2]["train/grad_norm"])
    assert not math.isfinite(rows[1]["train/grad_norm"]) and not math.isfinite(rows[3]["train/grad_norm"])
    assert "optimizer step(s) skipped" in out
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000004"]
    _finite_checkpoint(run_dir / "checkpoints" / "step_00000004")
    hf = load_hf(run_dir)
    assert all(torch.isfinite(t).all() for t in hf.values())

    # Continuing it (checksums of the real Megatron checkpoint verified) with a reward that fails on
    # every sample stops at once with the first error, instead of training on nothing to the end. The
    # reward calls sys.exit(0) in the trainer's own process (timeout_s = 0): that used to end the run with
    # status 0, no checkpoint and no export; it is a reward error like any other.
    saved = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    args = overrides(
        tiny_model_dir,
        task,
        run_dir,
        **{
            "reward.fn": "tests.faulty_reward:exits",
            "reward.timeout_s": 0,
            "trainer.val_every": 0,
            "trainer.steps": 6,
        },
    )
    proc = subprocess.run(
        train_cmd("gspo_cpu.yaml", args),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "resumed from" in out and "step_00000004" in out, out[-5000:]
    assert "mcore-rl: error: step 5: the reward function failed on 16 of 16 samples" in out, out[-5000:]
    assert "first error: SystemExit: it called sys.exit(0)" in out
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == saved
    # the worker's line comes last, once; torchrun's ChildFailedError report is in the run's log file
    assert proc.stderr.strip().splitlines()[-1].startswith("mcore-rl: error: step 5: the reward function"), out[-3000:]
    assert out.count("mcore-rl: error:") == 1 and "ChildFailedError" not in out
    assert f"torchrun's report (exit codes, pids): {run_dir / 'torchrun.log'}" in out
    assert "ChildFailedError" in (run_dir / "torchrun.log").read_text()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]

    # Weights that become inf (weight decay x lr overflow at step 2, after a warm-up step at lr 0) are
    # never written: the run stops with the reason, and step 1 stays the newest checkpoint.
    diverged = tmp_path / "diverged"
    args = overrides(
        tiny_model_dir,
        task,
        diverged,
        **{
            "trainer.steps": 2,
            "trainer.val_every": 0,
            "checkpoint.save_every": 1,
            "checkpoint.keep_last": 1,
            "actor.optim.lr": 1e20,
            "actor.optim.weight_decay": 1e20,
            "actor.optim.warmup_steps": 1,
        },
    )
    proc = subprocess.run(
        train_cmd("gspo_cpu.yaml", args),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "mcore-rl: error: step 2 made the weights non-finite: the weights hold NaN/inf" in out, out[-8000:]
    from mcore_rl.run_dir import CheckpointManager

    assert CheckpointManager(diverged).latest().step == 1
    assert not (diverged / "checkpoints" / "step_00000002").exists() and not (diverged / "hf").exists()
    _finite_checkpoint(diverged / "checkpoints" / "step_00000001")


@pytest.mark.parametrize("target", ["launcher", "one rank"])
def test_sigterm_stops_every_worker_at_a_step_boundary(tiny_model_dir, task, tmp_path, target):
    """`kill -TERM` of `mcore-rl train` used to leave the workers training to the end: now every worker
    stops after its current step (a checkpoint being written is published first) and nothing the run
    started is left running. A SIGTERM that reaches one rank only (a scheduler signalling one process)
    stops every rank the same way, and the launcher's status still says SIGTERM (it used to be 0)."""
    import psutil

    run_dir = tmp_path / "stopped"
    args = overrides(tiny_model_dir, task, run_dir, **{"trainer.steps": 50, "checkpoint.save_every": 1})
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
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 3  # torchrun and its two workers
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:  # rank 1: the second of torchrun's workers
            torchrun = psutil.Process(proc.pid).children()[0]
            ranks = sorted(torchrun.children(), key=lambda p: p.environ().get("RANK", ""))
            ranks[1].send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert "stopped by SIGTERM after step" in out, out[-4000:]
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    from mcore_rl.run_dir import CheckpointManager

    newest = CheckpointManager(run_dir).latest()
    assert newest.step >= 2 and f"newest checkpoint: {newest.path}" in out
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # nothing half-written was left
    assert newest.step < 50 and not (run_dir / "hf").exists()


def test_kill_9_of_the_launcher_alone_ends_the_job(tiny_model_dir, task, tmp_path):
    """kill -9 of `mcore-rl train` only (what a terminal or a scheduler holds), while a checkpoint is being
    written: torchrun, both workers and everything they started are gone within seconds, the checkpoint in
    progress is never published, nothing more is written, and the run directory's lock is free."""
    import psutil

    from mcore_rl.run_dir import CheckpointManager, RunLock

    run_dir = tmp_path / "orphaned"
    args = overrides(tiny_model_dir, task, run_dir, **{"trainer.steps": 50, "checkpoint.save_every": 1})
    proc = subprocess.Popen(
        train_cmd("gspo_cpu.yaml", args),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    started = []
    try:
        _wait_for_checkpoint_write(proc, run_dir, 2, timeout=240)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)  # the launcher alone
        proc.wait()
        _, alive = psutil.wait_procs(started, timeout=10)
    finally:
        if proc.poll() is None:
            kill_job(proc)
        for p in started:  # whatever outlived it (the test fails then): not left running
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert len(started) >= 3  # torchrun and its two workers (and their helpers)
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    written = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    time.sleep(3)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == written  # nothing more
    assert CheckpointManager(run_dir).latest().step == 1  # step 2 was being written: never published
    assert not (run_dir / "hf").exists()
    RunLock.acquire(run_dir).release()  # free: no process of the dead job holds it

    # Resuming it with changed settings of every applied class (mcore_rl.preflight.resume_changes): the new learning
    # rate is used (it used to stay the checkpoint's 1e-3), the layout changes from EP2 to EP1 x DP2.
    changed = {
        "actor.optim.lr": 5e-4,  # optimizer
        "trainer.steps": 2,  # schedule
        "data.prompts_per_step": 2,  # batch
        "algo.clip_high": 5e-4,  # loss options
        "actor.parallel.ep": 1,  # layout
    }
    out = run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run_dir, **changed))
    assert "resumed from" in out and "step_00000001" in out, out[-3000:]
    line = next((x for x in out.splitlines() if "with changed settings, applied:" in x), out[-3000:])
    for part in (
        "optimizer: actor.optim.lr 0.001 -> 0.0005",
        "schedule: trainer.steps 50 -> 2",
        "batch: data.prompts_per_step 4 -> 2",
        "loss options: algo.clip_high 0.0004 -> 0.0005",
        "layout: actor.parallel.ep 2 -> 1",
    ):
        assert part in line, line
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["train/lr"] == 1e-3 and rows[1]["train/lr"] == 5e-4
    assert CheckpointManager(run_dir).latest().step == 2 and (run_dir / "hf").is_dir()


def test_dynamic_sampling_resumes_exactly_after_steps_with_extra_rounds(tiny_model_dir, task, tmp_path):
    """algo.dynamic_sampling with a reward whose groups are all-equal for about half the prompts
    (tests/dapo_reward.py) and rollout routing replay (R3: the engine's routes travel with the kept samples):
    steps need extra generation rounds. 4 steps straight; then its step-4 checkpoint and export are deleted
    and the run resumes from step 2 (the sampler's position after the extra rounds comes from the checkpoint):
    the same weights and every metric bit for bit."""
    import shutil

    run_dir = tmp_path / "run"
    extra = {
        "algo.dynamic_sampling": "true",
        "algo.routing_replay": "r3",
        "reward.fn": "tests.dapo_reward:score",
        "trainer.val_every": 0,
    }
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run_dir, **extra))
    rows = read_metrics(run_dir)
    assert all(r["groups/kept"] == 4 for r in rows), [r.get("groups/kept") for r in rows]
    rounds = [r["groups/rounds"] for r in rows]
    assert rounds[2] > 1 or rounds[3] > 1, rounds  # the resumed steps needed extra rounds
    assert all(r["groups/dropped"] == 4 * n - 4 for r, n in zip(rows, rounds))
    assert all(r["groups/all_correct"] > 0 for r in rows)
    straight = load_hf(run_dir)

    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "hf")
    out = run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run_dir, **extra))
    assert "resumed from" in out and "step_00000002" in out, out[-3000:]
    resumed = load_hf(run_dir)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"{name} differs after resume"
    rows_b = read_metrics(run_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows, rows_b):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
        assert keep(ra) == keep(rb), f"step {ra['step']} metrics differ"


def test_a_response_cut_at_max_new_tokens_has_no_eos_is_truncated_and_penalised(tiny_model_dir, tmp_path):
    """The multi-token preset (EP2, two mini-batches, overlong penalty) on the reverse task from the random
    model: with max_new_tokens = 6 most responses run into the cap and a few stop. Every logged sample is checked
    against its own tokens and the DAPO formula written out here. The loss is plain REINFORCE, a PolicyLoss
    defined in tests/reinforce_loss.py and named as algo.loss: its metric shows it trained both mini-batches."""
    from mcore_rl.data.task import TaskSpec, make_task_dataset
    from mcore_rl.models.tiny import build_tokenizer

    train, val = make_task_dataset(tmp_path / "task", 64, 16, seed=0, spec=TaskSpec(kind="reverse", length=12))
    run_dir = tmp_path / "run"
    max_new, buffer = 6, 3
    args = overrides(
        tiny_model_dir,
        (str(train), str(val)),
        run_dir,
        **{
            "trainer.steps": 2,
            "trainer.val_every": 0,
            "checkpoint.save_every": 0,
            "checkpoint.save_hf": "false",
            "rollout.max_new_tokens": max_new,
            "reward.overlong_buffer": buffer,
            "trainer.sample_log": 1000,
            # a loss registered from outside the package (plain REINFORCE, tests/reinforce_loss.py)
            "algo.loss": "tests.reinforce_loss:Reinforce",
        },
    )
    run_train("gspo_multitoken_cpu.yaml", args)
    eos = build_tokenizer().eos_token_id
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    per_step = [sum(s["step"] == step for s in samples) for step in (1, 2)]
    assert all(0 < n <= 16 for n in per_step), per_step  # rank 0's share of 4 prompts x 4 samples
    cut = [s for s in samples if s["finish_reason"] == "length"]
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert cut and len(cut) + len(stopped) == len(samples)
    for s in cut:  # cut at the cap, never an <|im_end|> in it, the full penalty
        assert s["length"] == max_new and eos not in s["response_ids"], s
        assert s["overlong_penalty"] == -1.0 and s["reward"] == pytest.approx(s["task_reward"] - 1.0), s
    for s in stopped:  # ended by <|im_end|>: penalised only inside the buffer, linearly
        assert s["response_ids"][-1] == eos and eos not in s["response_ids"][:-1], s
        want = -max(0, s["length"] - (max_new - buffer)) / buffer
        assert s["overlong_penalty"] == pytest.approx(want) and s["reward"] == pytest.approx(s["task_reward"] + want)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the step's truncation rate counts the cut responses of every rank; rank 0's are among them
        mine = sum(s["finish_reason"] == "length" for s in samples if s["step"] == r["step"])
        assert r["response/clip_ratio"] >= mine / 16 and r["response/clip_ratio"] > 0
        assert r["response/length_max"] == max_new
        # the registered loss trained both mini-batches: its flag covers every valid token, no clip was applied
        assert r["train/reinforce_tokens"] == pytest.approx(1.0, abs=1e-6) and "train/clipfrac_upper" not in r


QUIET = dict(capture_output=True, text=True, cwd=REPO, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_branching_keeps_the_abandoned_line_and_a_damaged_newest_config_falls_back(tiny_model_dir, task, tmp_path):
    """Issue 34 on a real 6-step run. (10) every rank's trainer state reads with weights_only=True. (4) resuming
    from step_4 with another lr trains a new line; the abandoned line's metrics lines 5-6 and its export are kept,
    byte for byte, beside its step_6, and the log line says where (they used to be deleted and overwritten). (3) the
    new line's step_6/config.yaml overwritten with text that is no YAML: resume=auto falls back to step_4, which
    verifies, and names the file (it used to stop in the pre-flight on a 6-line YAML error)."""
    from mcore_rl.run_dir import ABANDONED

    run = tmp_path / "run"
    six = {"trainer.steps": 6, "checkpoint.keep_last": 3}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run, **six))
    ckpts = run / "checkpoints"
    for rank in (0, 1):  # plain tensors and types: no code can run from the file
        state = torch.load(ckpts / "step_00000006" / f"trainer_state_rank{rank}.pt", weights_only=True)
        assert state["step"] == 6 and torch.is_tensor(state["rng"]["numpy"]["keys"])
    first_lines = (run / "metrics.jsonl").read_text().splitlines()
    first_export = _folder_bytes(run / "hf")
    assert [json.loads(line)["step"] for line in first_lines] == [1, 2, 3, 4, 5, 6]

    branch = {**six, "checkpoint.resume": ckpts / "step_00000004", "actor.optim.lr": 5e-4}
    out = run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run, **branch))
    kept = ckpts / ABANDONED
    said = next((x for x in out.splitlines() if "abandons a newer line of training" in x), out[-3000:])
    assert f"metrics of steps 5-6 moved from metrics.jsonl to {kept / 'step_00000006.metrics.jsonl'}" in said, said
    assert f"Hugging Face export moved to {kept / 'step_00000006.hf'}" in said, said
    assert (kept / "step_00000006.metrics.jsonl").read_text().splitlines() == first_lines[4:]
    assert _folder_bytes(kept / "step_00000006.hf") == first_export
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[:4] == [json.loads(x) for x in first_lines[:4]]
    assert rows[4]["train/lr"] == 5e-4 and _folder_bytes(run / "hf") != first_export  # the new line's own

    damaged = ckpts / "step_00000006" / "config.yaml"
    not_yaml = "model: {path: [unclosed\n  - : :\n"
    damaged.write_text(not_yaml)
    out = run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run, **six))
    assert f"checkpoint {damaged.parent} skipped: {damaged} has " in out, out[-3000:]
    assert f"resumed from {ckpts / 'step_00000004'} at step 4" in out, out[-3000:]
    assert (kept / "step_00000006.1" / "config.yaml").read_text() == not_yaml  # kept as it was, out of auto's way

    # (10) torch.distributed.checkpoint unpickles actor/.metadata with a plain pickle.load: one altered to run code,
    # its checksum updated (checksums prove integrity, not origin), is refused before any process starts.
    import pickle

    from mcore_rl.run_dir import CHECKSUMS, file_crc32
    from tests.test_trainer_state import _RunsCode

    newest, marker = ckpts / "step_00000006", tmp_path / "code_ran"
    metadata = newest / "actor" / ".metadata"
    metadata.write_bytes(pickle.dumps((pickle.loads(metadata.read_bytes()), _RunsCode(marker))))
    manifest = json.loads((newest / CHECKSUMS).read_text())
    manifest["actor/.metadata"] = {"size": metadata.stat().st_size, "crc32": file_crc32(metadata)}
    (newest / CHECKSUMS).write_text(json.dumps(manifest))
    proc = subprocess.run(train_cmd("gspo_cpu.yaml", overrides(tiny_model_dir, task, run, **six)), **QUIET)
    assert proc.returncode == 2 and not marker.exists(), proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"mcore-rl: error: {metadata} holds Python objects")
    assert "checkpoint.trust_pickle=true" in proc.stderr and "process(es) on" not in proc.stdout
