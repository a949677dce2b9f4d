"""Bad inputs and faults that end in one `mcore-rl: error:` line naming the file / key / path and the fix, with a
non-zero exit and nothing written - checked before torchrun starts where the input allows it (one process each:
`mcore_rl.cli.main` in this process, real files, real mounts). The faults that need a running job are in
tests/test_faults_e2e.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.cli import main
from tests.torchrun_util import REPO

PRESET = str(REPO / "configs/tiny/gspo_cpu.yaml")


def snapshot(root: Path) -> dict:
    """Every file under root with its bytes: 'nothing saved changed' is this staying equal."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(capsys, argv, code=2, prog="mcore-rl") -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == code, err
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path_factory.mktemp("task"), train_size=32, val_size=8, seed=0)
    return str(train), str(val)


def train_argv(model, task, run_dir, *overrides) -> list[str]:
    base = [f"model.path={model}", f"data.train_path={task[0]}", f"data.val_path={task[1]}"]
    return ["train", PRESET, *base, f"trainer.run_dir={run_dir}", *overrides]


def refused_before_launch(capsys, argv, watched: Path, expected: str) -> str:
    """`mcore-rl train` exits 2 with one line holding `expected`; nothing under `watched` changed."""
    before = snapshot(watched)
    line = one_error_line(capsys, argv)
    assert expected in line, line
    assert snapshot(watched) == before
    return line


def mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def mounts():
    """Mount points made by a test, unmounted afterwards (lazily: a test's open file must not block it)."""
    made: list[Path] = []
    yield made
    for point in reversed(made):
        subprocess.run(["umount", "-l", str(point)], check=True)


# ---------------------------------------------------------------- data
def test_data_files_that_are_not_text_or_not_parquet(capsys, tmp_path, tiny_model_dir, task):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from mcore_rl.data import load_prompt_dataset

    rows = pq.read_table(task[0]).to_pylist()
    lines = [json.dumps(r).encode() for r in rows[:4]]
    mixed = tmp_path / "mixed.jsonl"  # one line of Latin-1 bytes among UTF-8 ones: skipped and counted
    mixed.write_bytes(b"\n".join(lines[:2] + ['{"prompt": "caf\xe9"}'.encode("latin-1")] + lines[2:]) + b"\n")
    dataset = load_prompt_dataset(mixed, AutoTokenizer.from_pretrained(tiny_model_dir), 64)
    assert (len(dataset), dataset.summary.malformed) == (4, 1)
    assert dataset.summary.malformed_example.startswith("row 2: not UTF-8 text (byte 0xe9")

    latin1 = tmp_path / "latin1.jsonl"  # a file saved as Latin-1: every line has a byte that is not UTF-8
    for r in rows[:3]:
        r["prompt"][0]["content"] += " caf\xe9"
    latin1.write_bytes(b"\n".join(json.dumps(r, ensure_ascii=False).encode("latin-1") for r in rows[:3]))
    random_parquet = tmp_path / "random.parquet"
    random_parquet.write_bytes(os.urandom(4096))
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(Path(task[1]).read_bytes()[:-100])
    for override, expected in (
        (f"data.train_path={latin1}", f"dataset {latin1}: all 3 rows are malformed (e.g. row 0: not UTF-8 text"),
        (f"data.train_path={random_parquet}", f"data.train_path = {random_parquet} is not a readable parquet file"),
        (f"data.val_path={truncated}", f"data.val_path = {truncated} is not a readable parquet file"),
    ):
        argv = train_argv(tiny_model_dir, task, tmp_path / "run", override, "trainer.val_every=1")
        refused_before_launch(capsys, argv, tmp_path, expected)
        assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- model folder
def test_expected_tensors_are_what_transformers_writes(tiny_arch_dir):
    """The pre-flight's table of names and shapes (mcore_rl.preflight.hf_tensors) against the checkpoints that
    transformers' own save_pretrained wrote for the three architectures."""
    from mcore_rl.preflight.hf_tensors import expected_hf_tensors
    from mcore_rl.preflight.inputs import _safetensors_header

    for arch in ("qwen3-moe", "qwen3", "qwen2"):
        folder = Path(tiny_arch_dir(arch))
        header = _safetensors_header(folder / "model.safetensors")
        written = {name: tuple(entry["shape"]) for name, entry in header.items()}
        assert expected_hf_tensors(json.loads((folder / "config.json").read_text())) == written, arch


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _damaged_model(root: Path, tiny_model_dir: str, how: str) -> Path:
    import torch

    folder = root / f"model_{how}"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "missing_tensor":
        _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.experts.7.up_proj.weight"))
    elif how == "wrong_shape":
        _rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}))
    elif how == "vocab_size":
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    elif how == "tokenizer":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(3)])  # ids 128..130: no embedding row
        tokenizer.save_pretrained(folder)
    elif how == "nan":

        def poison(t):
            t["model.layers.1.mlp.gate.weight"][3, 5] = float("nan")

        _rewrite(folder, poison)
    elif how == "stray_file":
        from mcore_rl.preflight.inputs import _safetensors_header

        names = sorted(_safetensors_header(folder / "model.safetensors"))
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        shutil.copy(folder / "model.safetensors", folder / "model-old.safetensors")  # not in the index
    return folder


@pytest.mark.parametrize(
    "how, expected",
    [
        ("missing_tensor", "the weights lack model.layers.1.mlp.experts.7.up_proj.weight, which config.json"),
        ("wrong_shape", "model.layers.0.self_attn.k_proj.weight has shape [32, 64] but config.json implies [64, 64]"),
        ("vocab_size", "vocab_size = 256 but model.embed_tokens.weight in"),
        ("tokenizer", "the tokenizer has 131 tokens (ids up to 130) but config.json vocab_size = 128"),
        ("nan", "model.layers.1.mlp.gate.weight holds NaN/inf: the input model is damaged"),
        ("stray_file", "model-old.safetensors is not listed in"),
    ],
)
def test_model_folder_that_does_not_match_its_config(capsys, tmp_path, tiny_model_dir, task, how, expected):
    """Each passed the pre-flight before and then failed on every rank with a traceback (or was loaded)."""
    folder = _damaged_model(tmp_path, tiny_model_dir, how)
    line = refused_before_launch(capsys, train_argv(folder, task, tmp_path / "run"), tmp_path, expected)
    assert str(folder) in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- run directory
def _saved_run(run_dir: Path) -> None:
    from mcore_rl.run_dir import CheckpointManager

    CheckpointManager(run_dir).save(2, lambda tmp: (tmp / "weights.bin").write_bytes(b"w" * 1000))


def test_run_dir_not_usable(capsys, tmp_path, tiny_model_dir, task, mounts):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    refused_before_launch(
        capsys, train_argv(tiny_model_dir, task, a_file / "run"), tmp_path, f"{a_file} is a file, not a directory"
    )
    # read-only, fresh and on resume: a read-only bind mount (what root cannot write through either)
    for name, resume in (("fresh", "never"), ("resumed", "auto")):
        source, target = tmp_path / f"{name}_src", tmp_path / name
        source.mkdir()
        target.mkdir()
        if resume == "auto":
            _saved_run(source)
        if not mount("--bind", str(source), str(target)):
            pytest.skip("cannot bind-mount here (needs root)")
        mounts.append(target)
        assert mount("-o", "remount,bind,ro", str(target))
        run_dir = target / "run" if resume == "never" else target
        argv = train_argv(tiny_model_dir, task, run_dir, f"checkpoint.resume={resume}")
        refused_before_launch(capsys, argv, source, f"{target} is on a read-only filesystem")
    # no room for a checkpoint: the tiny model's needs ~4 MiB (weights + fp32 optimizer state)
    small = tmp_path / "small"
    small.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    mounts.append(small)
    line = refused_before_launch(
        capsys,
        train_argv(tiny_model_dir, task, small / "run"),
        tmp_path,
        "no space left for a checkpoint: one needs ~4.0 MiB",
    )
    assert "MiB are free on" in line and not (small / "run").exists()


# ---------------------------------------------------------------- checkpoints
def test_garbage_complete_marker(capsys, tmp_path, tiny_model_dir, task, caplog):
    """The newest checkpoint's COMPLETE marker is garbage: resume=auto falls back to the one before (like other
    damage), resume=PATH to it is refused before launch."""
    from mcore_rl.config import load_config
    from mcore_rl.run_dir import MARKER, CheckpointManager, resolve_verified_resume

    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=2)
    for step in (2, 4):
        manager.save(step, lambda tmp: (tmp / "weights.bin").write_bytes(b"w" * 1000))
    (manager.step_dir(4) / MARKER).write_bytes(b"\x00garbage{")
    cfg = load_config(None, [f"trainer.run_dir={run}", "checkpoint.resume=auto"])
    assert resolve_verified_resume(cfg, __import__("logging").getLogger("test")).step == 2
    assert f"{manager.step_dir(4) / MARKER} is damaged" in caplog.text
    argv = train_argv(tiny_model_dir, task, run, f"checkpoint.resume={manager.step_dir(4)}")
    refused_before_launch(
        capsys, argv, tmp_path, f"checkpoint.resume = {manager.step_dir(4)}: {manager.step_dir(4) / MARKER} is damaged"
    )


# ---------------------------------------------------------------- command line
def test_command_line_inputs(capsys, tmp_path, tiny_model_dir, mounts):
    config = tmp_path / "latin1.yaml"
    config.write_bytes(Path(PRESET).read_bytes() + "# r\xe9sum\xe9\n".encode("latin-1"))
    line = one_error_line(capsys, ["check", str(config)])
    assert f"config file {config} is not UTF-8 text (byte 0xe9 at offset" in line and "save it as UTF-8" in line
    for value in ("nan", "inf", "-inf"):
        argv = ["plan", PRESET, "--model-config", tiny_model_dir, f"--device-memory={value}"]
        assert f"--device-memory = {float(value)} must be a finite number of GiB > 0" in one_error_line(capsys, argv)

    run = tmp_path / "run"  # a run directory with metrics to plot
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in (1, 2)))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    line = one_error_line(capsys, ["plot", str(run), "--out", str(a_file)])
    assert f"--out {a_file} is a file: give a directory" in line and a_file.read_text() == "x"
    source, read_only = tmp_path / "plots_src", tmp_path / "plots_ro"
    source.mkdir()
    read_only.mkdir()
    if not (mount("--bind", str(source), str(read_only)) and mounts.append(read_only) is None):
        pytest.skip("cannot bind-mount here (needs root)")
    assert mount("-o", "remount,bind,ro", str(read_only))
    for out in (read_only, read_only / "sub"):
        assert f"--out {out}" in one_error_line(capsys, ["plot", str(run), "--out", str(out)])
    assert not list(source.iterdir())


def test_convert_of_another_architecture(capsys, tmp_path, tiny_model_dir):
    llama = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    for direction in ("hf-to-mcore", "mcore-to-hf"):
        ckpt = ["--ckpt", str(tmp_path)] if direction == "mcore-to-hf" else []
        (tmp_path / "metadata.json").write_text("{}")
        argv = ["convert", direction, "--hf", str(llama), *ckpt, "--out", str(tmp_path / "out")]
        line = one_error_line(capsys, argv, prog="mcore-rl convert")
        assert f"--hf {llama}: model_type 'llama' is not supported" in line
    assert not (tmp_path / "out").exists()


def test_convert_to_hf_with_another_architectures_config(capsys, tmp_path, tiny_model_dir, tiny_dense_dirs):
    """`convert mcore-to-hf` of a MoE checkpoint with a dense model's --hf died in the load with a KeyError
    traceback (the dense MLP's weights are not in the checkpoint): the checkpoint's tensor metadata is compared
    with config.json first, and the line names the field that differs, with both values from the two sources."""
    ckpts = {}
    for name, hf in (("moe", tiny_model_dir), ("dense", tiny_dense_dirs["qwen3"])):
        ckpts[name] = tmp_path / name
        argv = ["convert", "hf-to-mcore", "--hf", hf, "--out", ckpts[name], "--platform", "cpu"]
        proc = subprocess.run(
            [sys.executable, "-m", "mcore_rl.cli", *map(str, argv)], capture_output=True, text=True, cwd=REPO
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    moe_config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    experts = moe_config["num_local_experts"]
    out = tmp_path / "out"

    def refused(ckpt, hf) -> str:
        argv = ["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--hf", str(hf), "--out", str(out)]
        return one_error_line(capsys, argv, prog="mcore-rl convert")

    dense = tiny_dense_dirs["qwen3"]
    assert refused(ckpts["moe"], dense) == (
        f"mcore-rl convert: error: --ckpt {ckpts['moe']} holds a MoE model ({experts} routed experts), but --hf "
        f"{dense}/config.json describes a dense model (no experts): give the --hf folder of the model the "
        f"checkpoint was trained from"
    )
    assert (
        f"holds a dense model (no experts), but --hf {tiny_model_dir}/config.json describes a MoE model ({experts}"
        in (refused(ckpts["dense"], tiny_model_dir))
    )
    deeper = tmp_path / "deeper"
    shutil.copytree(tiny_model_dir, deeper)
    (deeper / "config.json").write_text(json.dumps({**moe_config, "num_hidden_layers": 4}))
    layers = moe_config["num_hidden_layers"]
    assert (
        f"holds a model with num_hidden_layers = {layers}, but --hf {deeper}/config.json has num_hidden_layers = 4"
        in (refused(ckpts["moe"], deeper))
    )
    assert not out.exists()
    from mcore_rl.convert import check_args, parse_args

    for name, hf in (("moe", tiny_model_dir), ("dense", dense)):  # each checkpoint with its own config passes
        check_args(parse_args(["mcore-to-hf", "--ckpt", str(ckpts[name]), "--hf", str(hf), "--out", str(out)]))


# ---------------------------------------------------------------- rewards
@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["in-process", "worker"])
def test_reward_that_raises_keyboard_interrupt_is_a_failed_reward(timeout_s):
    """Its own KeyboardInterrupt is the function's failure: counted (the run stops on the error rate with one
    line); in the worker process it used to kill the worker with a traceback."""
    from mcore_rl.rewards import RewardScorer

    scorer = RewardScorer("tests.faulty_reward:interrupts", max_new_tokens=8, timeout_s=timeout_s)
    try:
        batch = scorer(["a", "b"], ["1", "2"], ["task", "task"])
    finally:
        scorer.close()
    assert (batch.errors, batch.valid) == (2, [False, False])
    assert batch.first_error.startswith("KeyboardInterrupt")


def test_ctrl_c_twice_is_not_taken_for_a_reward_failure():
    from mcore_rl.rewards.registry import score_items
    from mcore_rl.safety import Interrupted

    def interrupted(*args):
        raise Interrupted

    with pytest.raises(Interrupted):
        score_items(interrupted, [("a", "1", "task", None)])


def test_every_reward_failing_stops_whatever_max_error_rate_allows():
    """max_error_rate=1.0 and every call failing used to end in Megatron's "global counts must be positive"."""
    from mcore_rl.safety import TrainingHalted, check_reward_errors, reward_errors_stop

    assert reward_errors_stop(16, 16, 1.0) and not reward_errors_stop(15, 16, 1.0)
    with pytest.raises(TrainingHalted) as err:
        check_reward_errors(16, 16, "ValueError: bad (on response 'x')", 1.0, 3)
    assert str(err.value).startswith("step 3: the reward function failed on all 16 samples, so there is nothing")
    assert "first error: ValueError: bad" in str(err.value)
