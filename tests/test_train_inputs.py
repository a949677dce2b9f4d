"""`mcore-rl train` rejects bad inputs before any process starts, with an error that names the fix."""

import json
import subprocess
import sys
import time

import pytest

from tests.torchrun_util import REPO

PRESET = str(REPO / "configs/tiny/gspo_cpu.yaml")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    from mcore_rl.data.task import make_task_dataset

    root = tmp_path_factory.mktemp("inputs")
    train, val = make_task_dataset(root / "task", train_size=64, val_size=16, seed=0)
    bad = root / "malformed.jsonl"
    bad.write_text(json.dumps({"prompt": "not a list"}) + "\n" + json.dumps({"reward_model": {}}) + "\n")
    empty = root / "empty.jsonl"
    empty.write_text("")
    base = [
        f"model.path={tiny_model_dir}",
        f"data.train_path={train}",
        f"data.val_path={val}",
        f"trainer.run_dir={root / 'run'}",
    ]
    return {"base": base, "malformed": str(bad), "empty": str(empty), "root": root}


def train(*overrides):
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", PRESET, *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    return proc, time.perf_counter() - start


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.not_a_key=1", "unknown key 'algo.not_a_key'"),
        ("actor.parallel.tp=4", "world size 2 is not divisible by tp*pp*cp"),
        ("model.path=/no/such/model", "has no config.json"),
        ("reward.fn=no_such_module:score", "cannot import module 'no_such_module'"),
        ("data.train_path={malformed}", "rows are malformed"),
        ("data.train_path={empty}", "is empty"),
    ],
)
def test_bad_input_fails_before_processes_start(inputs, override, expected):
    proc, _ = train(*inputs["base"], override.format(**inputs))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "process(es) on" not in proc.stdout  # torchrun was never started
    assert not (inputs["root"] / "run").exists()  # nothing was written
