"""Resume with changed settings: every class applied (and listed) or refused before any process starts,
against the config a real checkpoint folder was written with. The actor applying a changed optimizer /
schedule / batch / loss / layout for real: tests/test_trainer_e2e.py::test_kill_9_of_the_launcher_alone_ends_the_job."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config, save_config
from mcore_rl.preflight.resume_changes import CONFIG_FILE, check_resume_changes, describe
from mcore_rl.run_dir import CheckpointManager
from tests.torchrun_util import REPO

PRESET = REPO / "configs/tiny/gspo_cpu.yaml"


def _saved_run(run_dir: Path, *overrides: str, step: int = 4, state: bytes = b"state") -> Path:
    """A run directory with a published checkpoint at `step` written by the config PRESET + overrides."""
    cfg = load_config(PRESET, [f"trainer.run_dir={run_dir}", *overrides])

    def write(tmp: Path) -> None:
        (tmp / "trainer_state_rank0.pt").write_bytes(state)
        save_config(cfg, tmp / CONFIG_FILE)

    return CheckpointManager(run_dir, keep_last=5).save(step, write, meta={"world_size": 2}).path


# applied: (class, overrides) - each changes only settings the checkpoint's state does not depend on
APPLIED = [
    ("optimizer", ["actor.optim.lr=5e-4", "actor.optim.weight_decay=0.1", "actor.optim.clip_grad=0.5"]),
    ("schedule", ["actor.optim.warmup_steps=2", "actor.optim.decay_style=cosine", "trainer.steps=400"]),
    ("batch", ["data.prompts_per_step=4", "rollout.n=8", "algo.mini_batches=2"]),
    ("loss options", ["algo.clip_high=5e-4", "algo.kl_coef=0.01", "algo.loss=sapo"]),
    ("layout", ["actor.parallel.ep=1", "actor.parallel.tp=2"]),
    ("other", ["rollout.verify_every=5", "trainer.val_every=5", "checkpoint.keep_last=3"]),
]

# refused: (class, override, the saved value the fix names)
REFUSED = [
    ("world size", "trainer.nproc=4", "trainer.nproc=2"),
    ("data", "data.train_path=other/train.parquet", "data.train_path=artifacts/task/train.parquet"),
    ("data", "data.seed=7", "data.seed=1"),
    ("data", "data.max_prompt_len=32", "data.max_prompt_len=64"),
    ("seed", "trainer.seed=7", "trainer.seed=1"),
    ("model", "model.dtype=bfloat16", "model.dtype=float32"),
]


@pytest.mark.parametrize("name,overrides", APPLIED, ids=[a[0] for a in APPLIED])
def test_applied_classes_are_listed(tmp_path, name, overrides):
    ckpt = _saved_run(tmp_path / "run")
    cfg = load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}", *overrides])
    found = check_resume_changes(cfg, ckpt)
    assert {c.key for c in found} == {o.split("=")[0] for o in overrides}
    assert {c.rule.name for c in found} == {name} and all(c.rule.applied for c in found)
    assert describe(found).startswith(f"{name}: ")
    nothing = load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}", "checkpoint.resume=auto"])
    assert check_resume_changes(nothing, ckpt) == []  # the same config (and how to resume) is no change


@pytest.mark.parametrize("name,override,saved", REFUSED, ids=[f"{r[0]}:{r[1]}" for r in REFUSED])
def test_refused_classes_name_the_key_both_values_and_the_fix(tmp_path, name, override, saved):
    ckpt = _saved_run(tmp_path / "run")
    cfg = load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}", override, "actor.optim.lr=5e-4"])
    with pytest.raises(ConfigError) as err:
        check_resume_changes(cfg, ckpt)
    msg = str(err.value)
    assert f"{name}: {override.split('=')[0]} " in msg and f"Set {saved} as saved in {ckpt / CONFIG_FILE}" in msg
    assert "actor.optim.lr" not in msg  # an applied change is not part of the refusal
    assert "start a new run in another trainer.run_dir" in msg


def test_the_same_file_under_another_path_is_no_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _saved_run(tmp_path / "run", "data.train_path=data/train.parquet")
    cfg = load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}", f"data.train_path={tmp_path}/data/train.parquet"])
    assert check_resume_changes(cfg, ckpt) == []


def test_a_checkpoint_of_another_world_size_without_a_saved_config_is_refused(tmp_path):
    ckpt = _saved_run(tmp_path / "run")
    (ckpt / CONFIG_FILE).unlink()  # an older checkpoint: the run directory's config.yaml is used, here none
    with pytest.raises(
        ConfigError, match="written by 2 processes, with 1 cannot work.*trainer.nproc x trainer.nnodes = 2"
    ):
        check_resume_changes(load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}", "trainer.nproc=1"]), ckpt)
    save_config(load_config(PRESET, ["data.seed=3"]), tmp_path / "run" / CONFIG_FILE)  # the run's own copy
    with pytest.raises(ConfigError, match="data: data.seed 3 -> 1"):
        check_resume_changes(load_config(PRESET, [f"trainer.run_dir={tmp_path / 'run'}"]), ckpt)


@pytest.mark.parametrize(
    "override", ["trainer.nproc=4", "data.seed=7", "trainer.seed=7"], ids=["world size", "data", "seed"]
)
def test_train_refuses_before_any_process_starts(tmp_path, tiny_model_dir, override):
    """Used to fail as a traceback on every rank after launch (world size, data) or not at all (seed)."""
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path / "task", train_size=64, val_size=8, seed=0)
    run = tmp_path / "run"
    args = [
        f"model.path={tiny_model_dir}",
        f"data.train_path={train}",
        f"data.val_path={val}",
        f"trainer.run_dir={run}",
    ]
    ckpt = _saved_run(run, *args)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", str(PRESET), *args, override],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mcore-rl: error:")]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr[-3000:]
    assert f"resuming from {ckpt}" in errors[0] and override.split("=")[0] in errors[0]
    assert "process(es) on" not in proc.stdout  # torchrun was never started
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_damaged_saved_config_is_checked_before_it_is_parsed(tmp_path):
    """Issue 34 (3): step_4's config.yaml overwritten with text that is no YAML made resume=auto stop on a 6-line
    YAML error in the pre-flight, though step_2 verifies and docs/reliability.md promises the fallback. The
    checksum is checked before the config is parsed: auto compares with step_2 (the one the ranks take), an
    explicit step_4 is one line naming the file."""
    from mcore_rl.cli import check_resume

    run = tmp_path / "run"
    older = _saved_run(run, "data.seed=3", step=2)  # a refused difference tells which one was compared
    newest = _saved_run(run, "data.seed=3", step=4)
    (newest / CONFIG_FILE).write_text("model: {path: [unclosed\n  - : :\n")
    auto = load_config(PRESET, [f"trainer.run_dir={run}", "data.seed=3", "actor.optim.lr=5e-4"])
    check_resume(auto)  # the pre-flight passes: step_2's config, with an applied change
    from mcore_rl.run_dir import resolve_resume_checked

    assert resolve_resume_checked(auto, files=(CONFIG_FILE,)).path == older
    with pytest.raises(ConfigError) as err:  # and it is step_2's config it compares with
        check_resume(load_config(PRESET, [f"trainer.run_dir={run}"]))
    assert f"Set data.seed=3 as saved in {older / CONFIG_FILE}" in str(err.value)
    explicit = load_config(PRESET, [f"trainer.run_dir={run}", "data.seed=3", f"checkpoint.resume={newest}"])
    with pytest.raises(ConfigError) as err:
        check_resume(explicit)
    msg = str(err.value)
    assert "\n" not in msg and f"checkpoint {newest} is damaged: {newest / CONFIG_FILE} has " in msg, msg
    assert "checkpoint.resume=auto takes the newest that verifies" in msg
