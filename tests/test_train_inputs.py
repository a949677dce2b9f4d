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
    from mcore_rl.run_dir import CheckpointManager

    used = root / "used"  # another run's directory
    CheckpointManager(used).save(3, lambda tmp: (tmp / "weights.bin").write_text("x"))
    a_file = root / "a_file"
    a_file.write_text("x")
    models = _damaged_models(root, tiny_model_dir)
    dup = root / "dup.yaml"
    dup.write_text(open(PRESET).read() + "\nplatform: cpu\n")
    return {
        "base": base,
        "malformed": str(bad),
        "empty": str(empty),
        "root": root,
        "used": used,
        "file": a_file,
        "dup": dup,
        **models,
    }


def _damaged_models(root, tiny_model_dir) -> dict:
    """Copies of the tiny model folder, each broken in one way a download or an edit can break it."""
    import shutil

    out = {}
    for name in ("truncated", "no_weights_file", "no_tokenizer", "llama", "bad_config", "incomplete_config"):
        folder = root / f"model_{name}"
        shutil.copytree(tiny_model_dir, folder)
        out[f"model_{name}"] = str(folder)
    weights = root / "model_truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    (root / "model_no_weights_file" / "model.safetensors").unlink()
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (root / "model_no_tokenizer" / f).unlink(missing_ok=True)
    cfg = json.loads((root / "model_llama" / "config.json").read_text())
    (root / "model_llama" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    (root / "model_bad_config" / "config.json").write_text("{not json")
    del cfg["num_hidden_layers"]
    (root / "model_incomplete_config" / "config.json").write_text(json.dumps(cfg))
    return out


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
        ("trainer.run_dir={file}", "is a file, not a directory"),
        ("trainer.run_dir=", "trainer.run_dir = '' is empty"),
        ("checkpoint.resume={root}/no_such_checkpoint", "is not a complete checkpoint"),
        ("actor.optim.lr=.inf", "actor.optim.lr = inf is not a finite number"),
        ("rollout.temperature=.inf algo.temperature=.inf", "is not a finite number"),
        ("actor.optim.decay_style=cosine actor.optim.warmup_steps=300", "must be < the decay steps 300"),
        ("rollout.engine=vllm", "vLLM is not installed"),
        ("model.dtype=float16", "model.dtype = 'float16' is not one of: float32, bfloat16"),
        ("model.path={model_truncated}", "it is truncated or damaged"),
        ("model.path={model_no_weights_file}", "has no *.safetensors weights"),
        ("model.path={model_no_tokenizer}", "has no tokenizer files"),
        ("model.path={model_llama}", "model_type 'llama' (config.json) is not supported"),
        ("model.path={model_bad_config}", "config.json is unreadable"),
        ("model.path={model_incomplete_config}", "lacks integer num_hidden_layers"),
    ],
)
def test_bad_input_fails_before_processes_start(inputs, override, expected):
    proc, _ = train(*inputs["base"], *override.format(**inputs).split())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "process(es) on" not in proc.stdout  # torchrun was never started
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback
    assert not (inputs["root"] / "run").exists()  # nothing was written


def test_fresh_start_in_another_runs_directory_fails_before_processes_start(inputs):
    proc, _ = train(*inputs["base"], f"trainer.run_dir={inputs['used']}", "checkpoint.resume=never")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"trainer.run_dir = {inputs['used']} holds another run's checkpoints" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "process(es) on" not in proc.stdout
    assert (inputs["used"] / "checkpoints" / "step_00000003" / "weights.bin").read_text() == "x"


def test_duplicate_yaml_key_fails_before_processes_start(inputs):
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", str(inputs["dup"]), *inputs["base"]],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "key 'platform' is given twice" in proc.stderr, proc.stderr
