"""`mcore-rl from-verl`: verl launch scripts -> checked presets (mcore_rl/from_verl). Fast, one process.

The shell reader is compared with bash itself (the scripts run under bash with `python3` replaced by a function
that prints its arguments); the mapping with the settings the reference runs are known by (docs/from-verl.md)
and with the checked-in presets; the key names with verl's schema as recorded in verl_schema.yaml.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mcore_rl.cli import main as cli_main
from mcore_rl.config import config_to_dict, load_config
from mcore_rl.from_verl import check_preset, convert_launch, preset_text
from mcore_rl.from_verl.hydra import parse_command, parse_value
from mcore_rl.from_verl.keys import ADDITIONS, KNOWN, doc_table, load_schema
from mcore_rl.from_verl.shell import ShellError, arithmetic, read_script
from tests.torchrun_util import REPO

DATA = REPO / "tests" / "data" / "verl"
SCRIPTS = sorted(DATA.glob("*.sh"))
CONFIGS = REPO / "configs"
# script -> (the preset it must give, extra script arguments, the model config.json it is checked against)
REFERENCE_RUNS = {
    "qwen3_30b_a3b_gspo_npu32.sh": ("qwen3_30b_a3b/npu32_tp4_pp4_ep8_reference.yaml", ["trainer.nnodes=4"]),
    "qwen3_8b_sapo_npu8.sh": ("qwen3_8b/npu8_sapo.yaml", []),
    "qwen2_5_3b_gspo_npu16.sh": ("qwen2_5_3b/npu16_gspo_reference.yaml", []),
}
MODEL_OF = {"qwen3_30b": "qwen3_30b_a3b", "qwen3_8b": "qwen3_8b", "qwen2_5_3b": "qwen2_5_3b"}


def model_config(script: Path) -> Path:
    for prefix, folder in MODEL_OF.items():
        if prefix in script.name:
            return CONFIGS / folder / "config.json"
    raise AssertionError(f"{script.name}: no model config for it")


def words(text: str, *args: str) -> list[str]:
    return read_script(text, args).argv[3:]  # after "python3 -m verl.trainer.main_ppo"


LAUNCH = "python3 -m verl.trainer.main_ppo"


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def converted(script: Path, tmp_path: Path, *args: str) -> tuple[dict, object]:
    conv = convert_launch(str(script), args)
    out = tmp_path / f"{script.stem}.yaml"
    out.write_text(preset_text(conv, str(out)))
    return flat(config_to_dict(load_config(out))), conv


# ---------------------------------------------------------------------------------------- shell constructs


def test_assignments_and_parameter_forms():
    script = f"""
A=1
B=${{A}}0 C=$A$A
E=
{LAUNCH} a=$A b=$B c=$C d=${{UNSET:-dflt}} e=${{E:-empty}} f=${{E-kept}} g=${{NEW:=made}} h=$NEW i=${{A:+alt}} j=${{UNSET:+alt}}
"""
    assert words(script) == ["a=1", "b=10", "c=11", "d=dflt", "e=empty", "f=", "g=made", "h=made", "i=alt", "j="]


def test_default_takes_the_assigned_value_when_set():
    assert words(f"NNODES=4\nN=${{NNODES:-2}}\n{LAUNCH} trainer.nnodes=$N") == ["trainer.nnodes=4"]
    assert words(f"N=${{NNODES:-2}}\n{LAUNCH} trainer.nnodes=$N") == ["trainer.nnodes=2"]


@pytest.mark.parametrize(
    "expr, value",
    [
        ("1024 * 8", 8192),
        ("(a + b) * 1", 10240),
        ("(a + b) / 4", 2560),
        ("(a + b) * 3", 30720),
        ("-7 / 2", -3),  # truncation toward zero, as the shell does
        ("-7 % 2", -1),
        ("2 ** 10", 1024),
        ("c", 12),  # a variable holding an expression
        ("unset + 1", 1),  # unset is 0
    ],
)
def test_arithmetic(expr, value):
    variables = {"a": "2048", "b": "8192", "c": "3 * 4"}
    assert arithmetic(expr, variables, 1) == value
    assert words(f"a=2048\nb=8192\nc='3 * 4'\n{LAUNCH} x=$(({expr}))") == [f"x={value}"]


def test_arithmetic_refuses_what_is_not_integer_arithmetic():
    with pytest.raises(ShellError, match=r"line 2: \$\(\( 1 / 0 \)\)|division by zero"):
        read_script(f"A=1\n{LAUNCH} x=$((1 / 0))")
    with pytest.raises(ShellError, match="not integer arithmetic"):
        read_script(f"{LAUNCH} x=$((open('f')))")


def test_line_continuations_and_comments():
    script = f"""# a comment line
X=5 # a trailing comment
{LAUNCH} \\
    a=$X \\
    b=c#d \\
    # c=not-an-argument
"""
    assert words(script) == ["a=5", "b=c#d"]


def test_export_forms():
    assert words(f"export A=1 B=2\nexport C\nreadonly D=3\n{LAUNCH} x=$A$B$D") == ["x=123"]


def test_quoting():
    script = f"""P=/data
T="['$P/a.parquet']"
{LAUNCH} 'q=$P' "d=$P" e=\\$P data.val_files="$T" w="a b" logger='["console","wandb"]'
"""
    assert words(script) == [
        "q=$P",
        "d=/data",
        "e=$P",
        "data.val_files=['/data/a.parquet']",
        "w=a b",
        'logger=["console","wandb"]',
    ]
    with pytest.raises(ShellError, match='line 2: the " quote opened here is never closed'):
        read_script('A=1\nB="x\n')


def test_unquoted_expansion_splits_into_words():
    script = f"""CONFIG="a=1 \\
    b=2"
{LAUNCH} $CONFIG "$CONFIG" c=3"""
    assert words(script) == ["a=1", "b=2", "a=1     b=2", "c=3"]


def test_ray_job_submit_and_other_launchers():
    for prefix in (
        "ray job submit --address=http://127.0.0.1:8265 --runtime-env-json='{\"a\": 1}' --no-wait --",
        "srun --nodes=1 --ntasks=1",
        "HYDRA_FULL_ERROR=1",
    ):
        assert read_script(f"{prefix} {LAUNCH} a=1 b=2").argv[-2:] == ["a=1", "b=2"]
    assert read_script("python3 verl/trainer/main_ppo.py a=1").argv == ["python3", "verl/trainer/main_ppo.py", "a=1"]


def test_trailing_positional_parameters():
    assert words(f"{LAUNCH} a=1 $@", "b=2", "c=3") == ["a=1", "b=2", "c=3"]
    assert words(f'{LAUNCH} a=1 "$@"', "b=2 x", "c=3") == ["a=1", "b=2 x", "c=3"]
    assert words(f"{LAUNCH} a=$1 n=$#", "first") == ["a=first", "n=1"]
    assert words(f"{LAUNCH} a=1 $@") == ["a=1"]


def test_redirections_are_not_arguments():
    assert words(f"{LAUNCH} a=1 2>&1 | tee log.txt") == ["a=1"]
    assert words(f"{LAUNCH} a=1 > out.log") == ["a=1"]


def test_what_is_not_evaluated_is_said():
    script = f"""MODE=fsdp
if [ "$MODE" = megatron ]; then
    CONFIG=ppo_megatron_trainer
fi
NAME=$(hostname)
{LAUNCH} --config-name=$CONFIG name=$NAME y=${{MODE//f/g}}
"""
    read = read_script(script)
    assert read.argv[3:] == ["--config-name=", "name=$(hostname)", "y=${MODE//f/g}"]
    notes = "\n".join(read.notes)
    assert "line 3: CONFIG assigned inside the control-flow block from line 2" in notes
    assert "command substitution $(hostname) is not run" in notes and "${MODE//f/g} is not evaluated" in notes


def test_here_documents_are_text():
    script = f"A=1\ncat > notes.txt <<EOF\nA=2\n{LAUNCH} wrong=1\nEOF\n{LAUNCH} a=$A\n"
    read = read_script(script)
    assert read.argv[3:] == ["a=1"] and read.line == 6


def test_no_trainer_command():
    with pytest.raises(ShellError, match="no verl trainer command found"):
        read_script("echo hello\npython3 train.py a=1\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is the reference")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_reader_gives_what_bash_gives(script, tmp_path):
    """Run the script under bash with the launchers replaced by functions that print their arguments."""
    shim = (
        'python3() { printf \'%s\\0\' python3 "$@" > "$ARGV_OUT"; exit 0; }\n'
        'ray() { while [ "$1" != -- ]; do shift; done; shift; "$@"; }\n'
    )
    (tmp_path / "run.sh").write_text(shim + script.read_text())
    args = ["trainer.nnodes=4", "x=a b"]
    env = {"PATH": "/usr/bin:/bin", "ARGV_OUT": str(tmp_path / "argv")}
    proc = subprocess.run(["bash", str(tmp_path / "run.sh"), *args], capture_output=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    expected = (tmp_path / "argv").read_text().split("\0")[:-1]
    argv = read_script(script.read_text(), tuple(args)).argv
    assert argv[argv.index("python3") :] == expected


# ----------------------------------------------------------------------------------------- Hydra overrides


def test_override_forms():
    cmd = parse_command(
        [
            "--config-path",
            "config",
            "--config-name=ppo_megatron_trainer",
            "a.b=1",
            "+c.d=x",
            "++e=3e-4",
            "~f",
            "-cn",
            "other",
            "loose",
            "--flag",
            "a.b=2",
        ]
    )
    assert cmd.config_name == "other" and cmd.config_path == "config"
    assert {k: (o.form, o.value) for k, o in cmd.overrides.items()} == {
        "a.b": ("", 2),
        "c.d": ("+", "x"),
        "e": ("++", 3e-4),
        "f": ("~", None),
    }
    assert cmd.other_args == ["loose", "--flag"] and cmd.repeated == ["a.b"]


@pytest.mark.parametrize(
    "raw, value",
    [
        ("null", None),
        ("True", True),
        ("false", False),
        ("16", 16),
        ("1e-6", 1e-6),
        ("0.80", 0.8),
        ("'x'", "x"),
        ("[a, 'b c',3]", ["a", "b c", 3]),
        ('["console","wandb"]', ["console", "wandb"]),
        ("fp32", "fp32"),
    ],
)
def test_values(raw, value):
    assert parse_value(raw) == value


# --------------------------------------------------------------------------------------------------- mapping


def test_reference_30b_gspo_gives_the_settings_it_ran_with(tmp_path):
    got, conv = converted(DATA / "qwen3_30b_a3b_gspo_npu32.sh", tmp_path, "trainer.nnodes=4")
    expected = {  # issue / docs: the Qwen3-30B-A3B GSPO reference run
        "actor.parallel.tp": 4,
        "actor.parallel.pp": 4,
        "actor.parallel.ep": 8,
        "actor.parallel.etp": 1,
        "rollout.tp": 4,
        "trainer.nnodes": 4,
        "trainer.nproc": 8,
        "data.prompts_per_step": 32,
        "rollout.n": 2,
        "algo.mini_batches": 8,
        "data.max_prompt_len": 2048,
        "rollout.max_new_tokens": 8192,
        "actor.max_tokens_per_micro_batch": 10240,
        "reward.overlong_buffer": 4096,
        "reward.overlong_penalty": 1.0,
        "algo.clip_low": 3e-4,
        "algo.clip_high": 4e-4,
        "actor.optim.lr": 1e-6,
        "actor.optim.warmup_steps": 10,
        "actor.optim.weight_decay": 0.1,
        "actor.optim.clip_grad": 1.0,
        "actor.offload": True,
        "model.recompute": True,
        "model.moe_router_dtype": "fp32",
        "rollout.gpu_memory_utilization": 0.8,
        "trainer.steps": 300,
        "algo.loss": "gspo",
        "algo.agg_mode": "seq-mean-token-mean",
        "algo.dual_clip": None,
        "platform": "npu",
        "algo.routing_replay": None,
        "actor.optim.use_distributed_optimizer": True,
    }
    assert {k: got[k] for k in expected} == expected
    rows = conv.conversion.rows
    for key in ("actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.clip_ratio_c"):
        assert rows[key].status == "no effect in verl", rows[key]
    assert rows["actor_rollout_ref.actor.ppo_mini_batch_size"].status == "mapped"
    assert {r.status for r in rows.values()} <= {"mapped", "not needed", "no effect in verl"}  # nothing lost


@pytest.mark.parametrize("script", list(REFERENCE_RUNS), ids=lambda s: s.removesuffix(".sh"))
def test_reference_scripts_give_the_reference_presets(script, tmp_path):
    preset, args = REFERENCE_RUNS[script]
    got, _ = converted(DATA / script, tmp_path, *args)
    want = flat(config_to_dict(load_config(CONFIGS / preset)))
    assert {k: (got[k], want[k]) for k in want if got[k] != want[k]} == {}


# second preset -> (the reference preset, the keys it may differ in; each must be named in its comments)
SECOND_PRESETS = {
    "qwen3_30b_a3b/npu32_tp4_pp4_ep8.yaml": "qwen3_30b_a3b/npu32_tp4_pp4_ep8_reference.yaml",
    "qwen2_5_3b/npu8_gspo.yaml": "qwen2_5_3b/npu16_gspo_reference.yaml",
    "qwen3_30b_a3b/npu32_tp4_pp4_cp2_ep8_32k.yaml": "qwen3_30b_a3b/npu32_tp4_pp4_ep8_reference.yaml",  # long responses
}


@pytest.mark.parametrize("second", list(SECOND_PRESETS), ids=lambda s: s.removesuffix(".yaml"))
def test_second_presets_name_each_difference_from_the_reference(second):
    ref = flat(config_to_dict(load_config(CONFIGS / SECOND_PRESETS[second])))
    other = flat(config_to_dict(load_config(CONFIGS / second)))
    comments = "\n".join(l for l in (CONFIGS / second).read_text().splitlines() if l.lstrip().startswith("#"))
    differing = [k for k in ref if ref[k] != other[k] and k not in ("trainer.run_dir", "trainer.wandb_project")]
    assert differing
    derived = {
        "actor.parallel.sequence_parallel": "TP2",
        "actor.parallel.tp": "TP2",
        "actor.max_tokens_per_micro_batch": "token budget",
    }
    for key in differing:
        name = derived.get(key, key.split(".")[-1])
        assert name in comments, f"{second}: differs from the reference in {key} without naming it"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_override_gets_a_row(script):
    """Nothing dropped: every word after the trainer module is an override with a row, or listed as unknown."""
    conv = convert_launch(str(script), REFERENCE_RUNS.get(script.name, (None, []))[1])
    argv = read_script(script.read_text(), tuple(REFERENCE_RUNS.get(script.name, (None, []))[1])).argv
    cmd = parse_command(argv[argv.index("-m") + 2 :])
    assert set(conv.conversion.rows) == set(cmd.overrides) | set(cmd.other_args)
    assert all(r.status and (r.why or r.target) for r in conv.conversion.rows.values())


def test_gspo_and_sapo_take_what_verl_runs(tmp_path):
    got, conv = converted(DATA / "qwen3_8b_sapo_npu8.sh", tmp_path)
    assert got["algo.loss"] == "sapo" and got["algo.agg_mode"] == "seq-mean-token-mean"
    assert (got["algo.tau_pos"], got["algo.tau_neg"]) == (1.0, 1.05)
    # the script's loss_agg_mode there is seq-mean-token-mean already: still no effect in verl (the loss fixes it)
    assert conv.conversion.rows["actor_rollout_ref.actor.loss_agg_mode"].status == "no effect in verl"


def test_grpo_megatron_rules(tmp_path):
    got, conv = converted(DATA / "grpo_megatron_qwen3_8b_tp2_pp2.sh", tmp_path)
    rows = conv.conversion.rows
    assert got["algo.loss"] == "grpo" and got["algo.agg_mode"] == "token-mean"  # verl's default aggregation
    assert got["algo.dual_clip"] == 3.0  # verl's vanilla loss always applies its dual clip (default 3)
    # clip_ratio=0.3 has no effect: clip_ratio_low keeps verl's default 0.2, clip_ratio_high is set
    assert (got["algo.clip_low"], got["algo.clip_high"]) == (0.2, 0.28)
    assert rows["actor_rollout_ref.actor.clip_ratio"].status == "no effect in verl"
    assert got["algo.adv_estimator"] == "drgrpo" and got["algo.kl_coef"] == 0.001 and got["algo.kl_type"] == "k3"
    assert (got["actor.parallel.tp"], got["actor.parallel.pp"]) == (2, 2)
    assert (got["actor.parallel.num_layers_in_first_stage"], got["actor.parallel.num_layers_in_last_stage"]) == (17, 19)
    assert got["actor.max_tokens_per_micro_batch"] is None and got["actor.parallel.micro_batch_size"] == 4
    assert got["algo.mini_batches"] == 4  # 128 prompts / 32 prompts per mini-batch
    assert got["actor.optim.warmup_steps"] == 20 and got["actor.optim.decay_style"] == "cosine"  # 0.1 x 200 steps
    assert got["actor.optim.weight_decay"] == 0.01  # verl's default, not this project's 0
    assert (
        got["model.recompute"] is True
        and "selective"
        in rows["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity"].why
    )
    assert got["rollout.top_k"] == -1 and got["trainer.wandb"] is True and got["checkpoint.save_every"] == 0
    assert got["trainer.val_every"] == 5 and got["trainer.run_dir"] == "runs/qwen3_8b_grpo"
    assert got["actor.optim.lr"] == 2e-6  # the here-document's "lr=9" is text, not an assignment


def test_virtual_pipeline_is_not_supported_and_the_preset_runs_the_plain_pipeline(tmp_path):
    """verl's virtual pipeline size > 1: listed as not supported with the pre-flight's reason (the actor cannot
    train interleaved stages), the preset keeps virtual_pp null and passes check; 1 is the plain pipeline."""
    script, key = DATA / "grpo_megatron_qwen3_8b_tp2_pp2.sh", "actor_rollout_ref.actor.megatron."
    key += "virtual_pipeline_model_parallel_size"
    for size, status in ((2, "not supported"), (1, "mapped")):
        got, conv = converted(script, tmp_path, f"{key}={size}")
        row = conv.conversion.rows[key]
        assert (row.status, row.target, got["actor.parallel.virtual_pp"]) == (status, "actor.parallel.virtual_pp", None)
        out = tmp_path / f"vpp{size}.yaml"
        out.write_text(preset_text(conv, str(out)))
        passed, message = check_preset(out, conv.conversion.world, str(model_config(script)))
        assert passed, message
    assert conv.conversion.rows[key].why == "1: the plain pipeline (null)"
    got, conv = converted(script, tmp_path, f"{key}=2")
    assert conv.conversion.rows[key].why == (
        "2: interleaved (virtual) pipeline stages are not supported by the actor yet (every pass would need >= pp "
        "micro-batches); the plain pipeline instead (virtual_pp: null)"
    )


DAPO = DATA / "dapo_qwen3_8b_megatron_tp2_pp2.sh"


def test_dapo_script_turns_dynamic_sampling_on_and_passes_check(tmp_path):
    """The DAPO recipe's keys: group filtering -> algo.dynamic_sampling with verl's prompt budget as the round cap
    (6 batches of 192 prompts = 18 rounds of 64) and verl's stop at the cap; its overlong buffer form."""
    got, conv = converted(DAPO, tmp_path)
    expected = {
        "algo.dynamic_sampling": True,
        "algo.dynamic_sampling_max_rounds": 18,
        "algo.dynamic_sampling_at_cap": "error",
        "algo.overlong_filtering": False,  # verl has none
        "data.prompts_per_step": 64,
        "reward.overlong_buffer": 1024,
        "reward.overlong_penalty": 1.0,
    }
    assert {k: got[k] for k in expected} == expected
    rows = conv.conversion.rows
    metric = rows["algorithm.filter_groups.metric"]
    assert metric.status == "mapped" and "differs: verl compares acc before the overlong penalty" in metric.why
    assert rows["data.gen_batch_size"].status == "not supported"
    assert rows["reward_model.overlong_buffer.len"].status == "mapped"
    out = tmp_path / "dapo.yaml"
    out.write_text(preset_text(conv, str(out)))
    passed, message = check_preset(out, conv.conversion.world, str(model_config(DAPO)))
    assert passed, message


def test_dapo_keys_where_verl_differs(tmp_path):
    no_cap = ["algorithm.filter_groups.max_num_gen_batches=0", "algorithm.filter_groups.metric=seq_reward"]
    got, conv = converted(DAPO, tmp_path, *no_cap, "data.gen_batch_size=64")
    assert (got["algo.dynamic_sampling_max_rounds"], got["algo.dynamic_sampling_at_cap"]) == (8, "train")
    rows = conv.conversion.rows
    assert rows["algorithm.filter_groups.max_num_gen_batches"].status == "not supported"
    assert rows["algorithm.filter_groups.metric"].status == "mapped"
    assert "differs" not in rows["algorithm.filter_groups.metric"].why
    assert rows["data.gen_batch_size"].status == "mapped"
    buffer_cfg = ["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"]
    buffer_cfg += ["+reward_model.reward_kwargs.overlong_buffer_cfg.len=512", "algorithm.filter_groups.metric=score"]
    got, conv = converted(DAPO, tmp_path, *buffer_cfg)
    assert got["reward.overlong_buffer"] == 512  # verl's own form wins over the recipe's
    assert conv.conversion.rows["reward_model.overlong_buffer.len"].status == "no effect in verl"
    assert "differs" in conv.conversion.rows["algorithm.filter_groups.metric"].why
    got, conv = converted(DAPO, tmp_path, "algorithm.filter_groups.enable=False")
    assert got["algo.dynamic_sampling"] is False
    assert conv.conversion.rows["algorithm.filter_groups.max_num_gen_batches"].status == "no effect in verl"


def test_fsdp_actor_maps_to_data_parallelism_and_ulysses_is_listed(tmp_path):
    got, conv = converted(DATA / "qwen2_5_3b_gspo_npu16.sh", tmp_path)
    rows = conv.conversion.rows
    assert conv.conversion.strategy == "fsdp" and conv.conversion.world == 16
    assert (got["actor.parallel.tp"], got["actor.parallel.pp"], got["actor.parallel.ep"]) == (1, 1, 1)
    row = rows["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]  # NPU runs CP (MindSpeed's ring attention)
    assert row.status == "mapped" and row.target == "actor.parallel.cp" and got["actor.parallel.cp"] == 4
    assert got["actor.max_tokens_per_micro_batch"] == 2560 * 4  # the Ulysses group's budget, split over CP
    assert got["reward.overlong_buffer"] == 0 and got["trainer.steps"] == 500 and got["model.recompute"] is True


def test_ulysses_maps_to_context_parallelism_where_cp_runs(tmp_path):
    """The same run on every platform where CP runs (CPU, CUDA with Transformer Engine, NPU with MindSpeed's ring
    attention): Ulysses SP 4 -> actor.parallel.cp 4 (Megatron CP, said so in the comment), the SP group's budget
    split over the CP group."""
    script = tmp_path / "qwen2_5_3b_gspo_16.sh"
    script.write_text(
        (DATA / "qwen2_5_3b_gspo_npu16.sh").read_text().replace("trainer.device=npu", "trainer.device=cpu")
    )
    got, conv = converted(script, tmp_path)
    rows, settings = conv.conversion.rows, conv.conversion.settings
    assert got["platform"] == "cpu" and got["actor.parallel.cp"] == 4
    row = rows["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert row.status == "mapped" and row.target == "actor.parallel.cp"
    comment = settings["actor.parallel.cp"].source
    assert "Megatron context parallelism of the same size" in comment and "not Ulysses' all-to-all" in comment
    assert got["actor.max_tokens_per_micro_batch"] == 2560 * 4
    assert "split over the CP group" in settings["actor.max_tokens_per_micro_batch"].source
    text = (tmp_path / "qwen2_5_3b_gspo_16.yaml").read_text()
    assert "cp: 4  # actor_rollout_ref.actor.ulysses_sequence_parallel_size=4: Megatron context parallelism" in text
    script.write_text(script.read_text().replace("    trainer.device=cpu \\\n", ""))
    got, conv = converted(script, tmp_path)
    assert got["actor.parallel.cp"] == 4  # verl's default device, cuda: Transformer Engine's CP attention
    script.write_text((DATA / "qwen2_5_3b_gspo_npu16.sh").read_text())
    got, conv = converted(script, tmp_path)
    row = conv.conversion.rows["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert got["platform"] == "npu" and got["actor.parallel.cp"] == 4 and row.status == "mapped"
    assert got["actor.max_tokens_per_micro_batch"] == 2560 * 4


def test_fsdp_grpo_with_unsupported_keys(tmp_path):
    got, conv = converted(DATA / "grpo_fsdp_qwen2_5_3b.sh", tmp_path)
    rows = conv.conversion.rows
    assert got["actor.offload"] is True and got["algo.agg_mode"] == "seq-mean-token-sum-norm"
    assert got["data.train_path"] == "data/math/train.parquet" and rows["data.train_files"].status == "not supported"
    assert rows["custom_reward_function.path"].status == "not supported"
    assert "reward.fn=MODULE:score" in rows["custom_reward_function.path"].why
    assert rows["trainer.val_before_train"].key == "++trainer.val_before_train"


def test_interpolations_deletions_and_unreadable_values(tmp_path, capsys):
    conv = convert_launch(
        f"{LAUNCH} data.max_prompt_length=256 actor_rollout_ref.rollout.prompt_length='${{data.max_prompt_length}}' "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu='${actor_rollout_ref.rollout.prompt_length}' "
        "actor_rollout_ref.actor.use_dynamic_bsz=true ~trainer.logger"
    )
    assert conv.conversion.settings["actor.max_tokens_per_micro_batch"].value == 256  # interpolations followed
    assert conv.conversion.rows["trainer.logger"].status == "not supported"  # ~key: a deletion
    assert cli_main(["from-verl", f"{LAUNCH} data.max_prompt_length=long", "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "mcore-rl: error:" in err and "data.max_prompt_length=long: expected an integer, got 'long'" in err


def test_a_file_from_verl_did_not_write_is_kept(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    out.write_text("# my own preset\n")
    assert cli_main(["from-verl", f"{LAUNCH} trainer.nnodes=1", "--out", str(out)]) == 2
    assert "exists and was not written by mcore-rl from-verl" in capsys.readouterr().err
    assert out.read_text() == "# my own preset\n"
    out.unlink()
    for _ in range(2):  # its own output is replaced
        assert cli_main(["from-verl", f"{LAUNCH} trainer.nnodes=1", "--out", str(out)]) == 0
    assert list(tmp_path.iterdir()) == [out]


def test_global_micro_batch_size_is_divided_by_dp():
    conv = convert_launch(
        f"{LAUNCH} --config-name ppo_megatron_trainer trainer.n_gpus_per_node=8 "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
        "actor_rollout_ref.actor.ppo_micro_batch_size=16"
    )
    assert conv.conversion.settings["actor.parallel.micro_batch_size"].value == 4  # 16 / dp 4


def test_mini_batch_rule_counts_prompts():
    conv = convert_launch(
        f"{LAUNCH} data.train_batch_size=48 actor_rollout_ref.rollout.n=8 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=16"
    )
    assert conv.conversion.settings["algo.mini_batches"].value == 3  # 48 / 16 prompts, not 48 * 8 / 16 samples
    conv = convert_launch(f"{LAUNCH} data.train_batch_size=48 actor_rollout_ref.actor.ppo_mini_batch_size=20")
    assert conv.conversion.settings["algo.mini_batches"].value == 3  # 48 / 20 is not whole: rounded up, listed
    assert conv.conversion.rows["actor_rollout_ref.actor.ppo_mini_batch_size"].status == "not supported"


# ------------------------------------------------------------------------------------------ schema and docs


def test_every_known_key_is_in_verls_schema():
    schema = load_schema()
    prefixes = {p.split("#")[0].strip() for p in schema["prefixes"]}
    for entry in KNOWN:
        where = schema["prefixes"] if entry.key.endswith(".*") else schema["keys"]
        if entry.key.endswith(".*"):
            assert entry.key in prefixes, entry.key
        elif entry.key in ADDITIONS:
            assert entry.key in schema["additions"], entry.key
        else:
            assert entry.key in where and where[entry.key], f"{entry.key} is not in verl_schema.yaml"
    assert schema["verl_version"] == "0.8.0.dev" and len(schema["verl_commit"]) == 40


def test_doc_table_matches_the_mapper():
    doc = (REPO / "docs" / "from-verl.md").read_text()
    assert doc_table() in doc, "docs/from-verl.md: regenerate the table with mcore_rl.from_verl.keys.doc_table()"


# ------------------------------------------------------------------------------------------ command and check


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_converted_presets_pass_check_at_their_sizes(script, tmp_path):
    args = REFERENCE_RUNS.get(script.name, (None, []))[1]
    conv = convert_launch(str(script), args)
    out = tmp_path / "preset.yaml"
    out.write_text(preset_text(conv, str(out)))
    passed, message = check_preset(out, conv.conversion.world, str(model_config(script)))
    assert passed, message
    # one comment per setting, naming where it came from
    lines = [l for l in out.read_text().splitlines() if not l.startswith("#") and ": " in l]
    assert all("  # " in l for l in lines), [l for l in lines if "  # " not in l]


def test_check_failure_is_printed_and_strict_fails(tmp_path, capsys):
    script, out = DATA / "qwen3_30b_a3b_gspo_npu32.sh", tmp_path / "ref.yaml"
    qwen = str(CONFIGS / "qwen3_30b_a3b" / "config.json")
    assert cli_main(["from-verl", str(script), "--out", str(out), "--model-config", qwen]) == 0
    text = capsys.readouterr().out
    assert out.is_file() and "check at world 16 (2 x 8): FAILED" in text
    assert (
        "ep*etp = 8*1 = 8 must divide tp*cp*dp = 4*1*1 = 4" in text and "a world size that is a multiple of 32" in text
    )
    assert cli_main(["from-verl", str(script), "--out", str(out), "--model-config", qwen, "--strict"]) == 1
    assert (
        cli_main(["from-verl", str(script), "trainer.nnodes=4", "--out", str(out), "--model-config", qwen, "--strict"])
        == 0
    )
    assert "check at world 32 (4 x 8): OK" in capsys.readouterr().out


def test_unknown_override_is_listed_and_strict_fails(tmp_path, capsys):
    command = (
        f"{LAUNCH} trainer.nnodes=1 trainer.n_gpus_per_node=8 actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.made_up_key=7 +my.own.key=1 data.train_batch_size=8 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.name=vllm"
    )
    out = tmp_path / "p.yaml"
    qwen = str(CONFIGS / "qwen3_8b" / "config.json")
    assert cli_main(["from-verl", command, "--out", str(out), "--model-config", qwen]) == 0
    text = capsys.readouterr().out
    unsupported = text.split("not supported (2, 2 of them unknown keys):")[1].split("check at")[0]
    assert "actor_rollout_ref.actor.made_up_key=7: unknown key - " in unsupported
    assert "+my.own.key=1: unknown key - not a key this converter knows: not carried over" in unsupported
    assert out.is_file() and "check at world 8 (1 x 8): OK" in text
    assert cli_main(["from-verl", command, "--out", str(out), "--model-config", qwen, "--strict"]) == 1
    assert yaml.safe_load(out.read_text())["rollout"]["n"] == 4


def test_bad_source_is_one_error_line(tmp_path, capsys):
    assert cli_main(["from-verl", str(tmp_path / "missing.sh")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcore-rl: error:") and "does not exist" in err
    (tmp_path / "s.sh").write_text("echo nothing here\n")
    assert cli_main(["from-verl", str(tmp_path / "s.sh")]) == 2
    assert "no verl trainer command found" in capsys.readouterr().err


def test_a_binary_file_or_a_folder_is_one_error_line(tmp_path, capsys):
    """A binary file gave a UnicodeDecodeError traceback and a folder "does not exist": each is named for what
    it is."""
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes([0x80, 0xFF, 0x00, 0x41]))
    with pytest.raises(UnicodeDecodeError):  # the reference: the bytes are not UTF-8 text
        binary.read_text(encoding="utf-8")
    assert cli_main(["from-verl", str(binary)]) == 2
    assert capsys.readouterr().err == (
        f"mcore-rl: error: {binary}: not a text file (byte 0x80 at offset 0 is not UTF-8): give the launch "
        f"script (a shell script), or the command line in quotes\n"
    )
    nul = tmp_path / "nul.sh"
    nul.write_bytes(b"ABC\x00DEF")
    assert cli_main(["from-verl", str(nul)]) == 2
    assert f"{nul}: not a text file (a NUL byte at offset 3)" in capsys.readouterr().err
    assert cli_main(["from-verl", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"mcore-rl: error: {tmp_path}: this is a directory: give the launch script inside it (e.g. {tmp_path}/run.sh)\n"
    )


UNSET_SCRIPT = (
    "MODEL=$MODEL_DIR/Qwen3-8B\n"
    "ray job submit --address=$RAY_ADDRESS -- python3 -m verl.trainer.main_ppo trainer.nnodes=1 "
    "trainer.n_gpus_per_node=8 actor_rollout_ref.rollout.n=4 data.train_batch_size=8 "
    "actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.name=vllm "
    "actor_rollout_ref.model.path=$MODEL data.train_files=${TRAIN_FILE} trainer.project_name=${PROJECT:-demo}\n"
)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is the reference")
def test_an_unset_variable_in_a_value_is_named_and_strict_refuses(tmp_path, capsys):
    """An unset $VAR made model.path empty and the conversion exited 0 without a word: the trainer's values
    that read an unset variable (also through an assignment) name it; --strict exits 1. A default form
    (${PROJECT:-demo}) and a wrapper's argument (ray's --address) are not the trainer's unset values."""
    script = tmp_path / "run.sh"
    script.write_text(UNSET_SCRIPT)
    shim = 'ray() { while [ "$1" != -- ]; do shift; done; shift; "$@"; }\npython3() { printf \'%s\\0\' "$@"; }\n'
    (tmp_path / "bash.sh").write_text(shim + UNSET_SCRIPT)
    proc = subprocess.run(["bash", str(tmp_path / "bash.sh")], capture_output=True, env={"PATH": "/usr/bin:/bin"})
    bash_argv = proc.stdout.decode().split("\0")[:-1]
    assert "actor_rollout_ref.model.path=/Qwen3-8B" in bash_argv and "data.train_files=" in bash_argv
    shell = read_script(UNSET_SCRIPT)
    assert shell.argv[shell.argv.index("python3") + 1 :] == bash_argv  # expanded as bash does, and said so
    assert shell.unset_reads == {"MODEL_DIR": 1, "TRAIN_FILE": 2}
    out = tmp_path / "p.yaml"
    qwen = str(CONFIGS / "qwen3_8b" / "config.json")
    assert cli_main(["from-verl", str(script), "--out", str(out), "--model-config", qwen]) == 0
    notes = capsys.readouterr().out.split("notes (")[1]
    for name, line in (("MODEL_DIR", 1), ("TRAIN_FILE", 2)):
        assert f"line {line}: ${name} is not set in the script (an environment variable is not read here)" in notes
    assert "RAY_ADDRESS" not in notes and "PROJECT" not in notes
    assert cli_main(["from-verl", str(script), "--out", str(out), "--model-config", qwen, "--strict"]) == 1
    script.write_text("MODEL_DIR=/models\nTRAIN_FILE=/data/train.parquet\n" + UNSET_SCRIPT)
    assert read_script(script.read_text()).unset_reads == {}
    assert cli_main(["from-verl", str(script), "--out", str(out), "--model-config", qwen, "--strict"]) == 0
