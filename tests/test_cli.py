"""The `mcore-rl` command line, run for real in subprocesses."""

import hashlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from mcore_rl.compat import megatron as compat_megatron
from tests.torchrun_util import REPO

PRESET_DIR = REPO / "configs" / "qwen3_30b_a3b"
QWEN_JSON = PRESET_DIR / "config.json"


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mcore-rl: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_make_tiny_is_deterministic(tmp_path, tiny_model_dir):
    for name, seed in (("a", 0), ("c", 1)):
        proc = cli("make-tiny", "--out", tmp_path / name, "--seed", seed)
        assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["num_local_experts"] == 8 and config["vocab_size"] == 128
    assert list((tmp_path / "a").glob("*.safetensors")) and (tmp_path / "a" / "tokenizer.json").exists()
    # the command writes exactly what the library writes for the same seed (the session fixture: seed 0)
    assert tree_digest(tmp_path / "a") == tree_digest(Path(tiny_model_dir)) != tree_digest(tmp_path / "c")


def test_make_task(tmp_path):
    proc = cli("make-task", "--out", tmp_path, "--train-size", 16, "--val-size", 4, "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr
    train = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(train) == 16 and len((tmp_path / "val.jsonl").read_text().splitlines()) == 4
    assert "prompt" in json.loads(train[0])


@pytest.mark.parametrize("preset", sorted(PRESET_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_check_every_preset_at_its_world_size(preset):
    proc = cli("check", preset, "--model-config", QWEN_JSON)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OK: {preset}") and "actor: tp" in proc.stdout


def test_check_rejects_32_device_recipe_on_2x8():
    proc = cli(
        "check",
        PRESET_DIR / "npu32_tp4_pp4_ep8.yaml",
        "--nnodes",
        2,
        "--nproc-per-node",
        8,
        "--model-config",
        QWEN_JSON,
    )
    msg = one_line_error(proc)
    assert "ep*etp = 8*1 = 8 must divide tp*cp*dp = 4*1*1 = 4" in msg and "multiple of 32" in msg
    # and at its own 4 x 8 it passes, with the derived sizes printed
    proc = cli(
        "check",
        PRESET_DIR / "npu32_tp4_pp4_ep8.yaml",
        "--nnodes",
        4,
        "--nproc-per-node",
        8,
        "--model-config",
        QWEN_JSON,
    )
    assert proc.returncode == 0 and "tp4 pp4 cp1 dp2 | ep8 etp1 edp1" in proc.stdout


def test_check_overrides_before_and_after_options(tiny_model_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"platform: cpu\nmodel:\n  path: {tiny_model_dir}\nrollout:\n  n: 4\n")
    proc = cli("check", cfg, "actor.parallel.ep=2", "--world-size", 2, "algo.loss=sapo")
    assert proc.returncode == 0, proc.stderr
    assert "tp1 pp1 cp1 dp2 | ep2 etp1 edp1" in proc.stdout and "algo: sapo" in proc.stdout
    msg = one_line_error(cli("check", cfg, "--world-size", 4, "actor.parallel.tp=4"))
    assert "tp = 4 must divide the model's 2 query groups" in msg


@pytest.mark.parametrize(
    "args, expected",
    [
        (["algo.los=sapo"], "Did you mean 'algo.loss'?"),
        (["actor.parallel.tp=two"], "actor.parallel.tp: expected int, got 'two'"),
        (["algo.loss=ppo"], "algo.loss = 'ppo' is not one of: grpo, gspo, gspo_token, sapo"),
        (["algo.temperature=0.5"], "differs from rollout.temperature"),
    ],
)
def test_bad_config_errors(tmp_path, args, expected):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: nowhere\n")
    assert expected in one_line_error(cli("check", cfg, *args, "--model-config", QWEN_JSON))


def test_missing_files_errors(tmp_path):
    assert "does not exist" in one_line_error(cli("check", tmp_path / "nope.yaml"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path / 'no_model'}\n")
    assert "has no config.json" in one_line_error(cli("check", cfg))


def test_train_fails_fast_before_starting_processes(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"platform: cpu\nmodel:\n  path: {tiny_model_dir}\ndata:\n  train_path: {data}\n"
        f"trainer:\n  nproc: 3\n  run_dir: {tmp_path / 'run'}\n"
    )
    start = time.time()
    msg = one_line_error(cli("train", cfg))
    assert "world size 3" not in msg and "a step's 64 samples" in msg  # 8 prompts x 8 over dp 3
    msg = one_line_error(cli("train", cfg, "trainer.nproc=2", "actor.parallel.tp=4"))
    assert "world size 2 is not divisible by tp*pp*cp = 4*1*1 = 4" in msg
    assert "model.path = " in one_line_error(cli("train", cfg, f"model.path={tmp_path}"))
    assert "data.train_path" in one_line_error(cli("train", cfg, f"data.train_path={tmp_path}/none.parquet"))
    assert "launch/torchrun_multinode.sh" in one_line_error(cli("train", cfg, "trainer.nnodes=2"))
    assert time.time() - start < 100
    assert not (tmp_path / "run").exists()


def test_train_rejects_layout_the_installed_megatron_cannot_run(tmp_path, tiny_model_dir):
    """SAPO's TP2 preset with experts not split over TP (etp = 1): megatron-core < 0.13 computes it wrongly, so
    `mcore-rl train` must stop in the pre-flight with the reason, before any process starts; newer versions
    accept it. `mcore-rl check` prints the detected versions either way."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1"}\n' * 8)
    args = [
        REPO / "configs/tiny/sapo_cpu.yaml",
        f"model.path={tiny_model_dir}",
        f"data.train_path={data}",
        "trainer.val_every=0",
        f"trainer.run_dir={tmp_path / 'run'}",
        "actor.parallel.etp=1",
    ]
    check = cli("check", *args)
    if compat_megatron.layout_problem(2, 1, 1, True, None):
        for proc in (check, cli("train", *args)):
            msg = one_line_error(proc)
            assert "tp = 2 with ep = 1, etp = 1 and sequence parallel is wrong on megatron-core 0.12" in msg
            assert "set actor.parallel.etp = 2" in msg and "torch.distributed.run" not in proc.stdout
        assert not (tmp_path / "run").exists()
    else:
        assert check.returncode == 0, check.stderr
        assert "ep1 etp1" in check.stdout
    installed = Version(metadata.version("megatron-core")).base_version
    assert f"megatron-core {installed}" in cli("check", *args[:-1]).stdout


def test_plot_command(tmp_path):
    from mcore_rl.metrics import MetricsLogger

    with MetricsLogger(tmp_path, rank=0, progress=False) as m:
        for step in (1, 2, 3):
            m.log(step, {"reward_mean": step / 3, "pg_loss": 1.0 / step})
    proc = cli("plot", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plots" / "overview.png").stat().st_size > 1000 and "overview" in proc.stdout
    assert "no numeric metrics" in one_line_error(cli("plot", tmp_path / "empty"))
