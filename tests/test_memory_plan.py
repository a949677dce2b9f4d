"""The memory plan (mcore_rl.preflight.memory_plan, `mcore-rl plan`): pure Python, no process.

Parameter counts are checked against real models (the tiny HF checkpoint, the Qwen3 config's known
size); the byte rules against hand-computed cases; the presets against the devices they name.
The plan's agreement with measured peaks is benchmarks/memory_plan.py (docs/benchmarks.md).
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.preflight.layout import ModelDims
from mcore_rl.preflight.memory_plan import plan_memory, stage_params, state_bytes, total_params
from mcore_rl.preflight.run import validate_run
from tests.test_cli import QWEN_JSON, cli

PRESETS = sorted(QWEN_JSON.parent.glob("*.yaml"))
# every preset written for devices: its model's config.json lies next to it (Qwen3-30B-A3B, Qwen3-8B, Qwen2.5-3B)
DEVICE_PRESETS = sorted(p for p in QWEN_JSON.parents[1].glob("*/*.yaml") if (p.parent / "config.json").is_file())


def test_total_params_equal_the_hf_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want = sum(p.numel() for p in hf.parameters())
    assert total_params(ModelDims.from_hf(tiny_model_dir)) == want
    # Qwen3-30B-A3B: 30.5B parameters (its model card)
    assert abs(total_params(ModelDims.from_hf(QWEN_JSON)) / 1e9 - 30.5) < 0.1


def test_stage_params_split_over_the_layout():
    dims = ModelDims.from_hf(QWEN_JSON)
    one = stage_params(dims, validate_run(load_config(None), 1, dims))[0]
    cfg = load_config(
        None, ["actor.parallel.tp=2", "actor.parallel.pp=2", "actor.parallel.ep=4", "actor.parallel.etp=1"]
    )
    first, last = stage_params(dims, validate_run(cfg, 16, dims))
    # experts split over EP x stages; embedding on the first stage, output layer on the last, both over TP
    assert first.expert + last.expert == one.expert // 4
    table = dims.vocab_size * dims.hidden
    assert first.dense - last.dense == table // 2 - (table // 2 + dims.hidden)


def test_state_bytes_follow_the_levers():
    dims = ModelDims.from_hf(QWEN_JSON)
    base = ["model.dtype=bfloat16", "actor.parallel.ep=2", "platform=cuda"]
    cfg = load_config(None, base)
    lay = validate_run(cfg, 4, dims)  # dp 4, edp 2
    sp = stage_params(dims, lay)[0]
    plain = state_bytes(cfg, lay, sp)
    assert plain.params == 2 * sp.total and plain.grads == 4 * sp.total
    assert plain.main_params == 4 * sp.total and plain.moments == 8 * sp.total and plain.main_grads == 0
    dist = state_bytes(load_config(None, base + ["actor.optim.use_distributed_optimizer=true"]), lay, sp)
    shard = -(-sp.dense // 4) + -(-sp.expert // 2)
    assert dist.moments == 8 * shard and dist.main_params == 4 * shard
    bf16_grads = state_bytes(
        load_config(
            None, base + ["actor.optim.use_distributed_optimizer=true", "actor.optim.grad_reduce_in_fp32=false"]
        ),
        lay,
        sp,
    )
    assert bf16_grads.grads == 2 * sp.total and bf16_grads.main_grads == 4 * shard
    off = state_bytes(
        load_config(
            None, base + ["actor.optim.use_distributed_optimizer=true", "actor.optim.optimizer_offload_fraction=1"]
        ),
        lay,
        sp,
    )
    assert off.optimizer == 0 and off.host == dist.optimizer


def test_recompute_and_budget_lower_the_update_peak():
    dims = ModelDims.from_hf(QWEN_JSON)
    cfg = load_config(QWEN_JSON.parent / "gpu8_tp2_ep8.yaml", ["model.recompute=false"])
    lay = validate_run(cfg, 8, dims)
    full = plan_memory(cfg, lay, dims).phase("update").total
    recompute = plan_memory(load_config(QWEN_JSON.parent / "gpu8_tp2_ep8.yaml"), lay, dims).phase("update").total
    shorter = load_config(
        QWEN_JSON.parent / "gpu8_tp2_ep8.yaml", ["rollout.max_new_tokens=1024", "actor.max_tokens_per_micro_batch=2048"]
    )
    budget = plan_memory(shorter, validate_run(shorter, 8, dims), dims).phase("update").total
    assert full > recompute > budget


def test_a_misfit_names_levers_that_fit():
    dims = ModelDims.from_hf(QWEN_JSON)
    cfg = load_config(QWEN_JSON.parent / "gpu8_tp2_ep8.yaml", ["actor.optim.optimizer_offload_fraction=0"])
    plan = plan_memory(cfg, validate_run(cfg, 8, dims), dims, device_gib=80)
    assert plan.fits is False and plan.levers
    assert any(lever.startswith("actor.optim.optimizer_offload_fraction=1.0 -> peak") for lever in plan.levers)
    # npu16 without the optimizer offload: other layouts of the same 16 devices fit a 64 GB NPU
    npu16 = ["actor.optim.optimizer_offload_fraction=0", "rollout.gpu_memory_utilization=0.35"]
    cfg = load_config(QWEN_JSON.parent / "npu16_tp4_ep4.yaml", npu16)
    plan = plan_memory(cfg, validate_run(cfg, 16, dims), dims, device_gib=64)
    layouts = [lever for lever in plan.levers if lever.startswith("layout tp")]
    assert plan.fits is False and layouts
    for lever in layouts:  # each suggested layout passes the pre-flight and fits when planned on its own
        sizes = {w[:2]: int(w[2:]) for w in lever.split()[1:] if w[:2] in ("tp", "pp", "cp", "ep") and w[2:].isdigit()}
        alt = load_config(
            QWEN_JSON.parent / "npu16_tp4_ep4.yaml",
            [
                *npu16,
                *(f"actor.parallel.{k}={sizes.get(k, 1)}" for k in ("tp", "pp", "cp", "ep")),
                "actor.parallel.etp=1",
            ],
        )
        assert plan_memory(alt, validate_run(alt, 16, dims), dims, device_gib=64).fits


def _named_devices(preset: Path) -> list[float]:
    """The devices a preset is written for: its `# devices: 64, 80` comment line (GiB)."""
    for line in preset.read_text().splitlines():
        if line.startswith("# devices:"):
            return [float(x) for x in line.split(":", 1)[1].replace("GiB", "").split(",")]
    raise AssertionError(f"{preset.name} has no '# devices: ...' line naming the devices it is sized for")


@pytest.mark.parametrize("preset", DEVICE_PRESETS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_preset_fits_the_devices_it_names(preset):
    cfg = load_config(preset)
    dims = ModelDims.from_hf(preset.parent / "config.json")
    lay = validate_run(cfg, cfg.trainer.nnodes * cfg.trainer.nproc, dims)
    for gib in _named_devices(preset):
        plan = plan_memory(cfg, lay, dims, device_gib=gib)
        assert plan.fits, f"{preset.name} does not fit {gib} GiB:\n{plan.table()}"
        if cfg.rollout.placement == "separate":  # each role on its own ranks: both plans fit, neither holds the other
            assert plan.actor.fits and plan.rollout.fits and lay.rollout_ranks == cfg.rollout.ranks
            assert "rollout" not in {p.name for p in plan.actor.phases} and plan.rollout.state.params == 0


@pytest.mark.parametrize("preset", DEVICE_PRESETS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_device_presets_size_micro_batches_by_tokens(preset):
    """Packed micro-batches of max_prompt_len + max_new_tokens tokens, as the reference runs size them (max
    tokens per device = prompt + response length), not micro_batch_size padded sequences."""
    cfg = load_config(preset)
    assert cfg.actor.max_tokens_per_micro_batch == cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, preset.name
    assert "micro_batch_size" not in preset.read_text(), (
        f"{preset.name}: micro_batch_size is unused with a token budget"
    )
    # the Qwen3-30B-A3B presets (two of them in the separate placement), the two dense ones and the reference
    # runs' presets (docs/from-verl.md)
    assert len(DEVICE_PRESETS) >= 10 and {
        "npu32_tp4_pp4_ep8_reference",
        "npu16_gspo_reference",
        "npu32_separate_tp4_ep4",
        "gpu8_separate_tp2_ep4",
    } <= {p.stem for p in DEVICE_PRESETS}


def test_plan_cli_prints_phases_and_verdict(tmp_path):
    preset = QWEN_JSON.parent / "gpu8_tp2_ep8.yaml"
    proc = cli("plan", preset, "--model-config", QWEN_JSON, "--device-memory", 141)
    assert proc.returncode == 0, proc.stderr
    for phase in ("rollout", "log-probs", "update", "save", "peak:", "verdict: fits on a 141.0 GiB device"):
        assert phase in proc.stdout
    proc = cli("plan", preset, "--model-config", QWEN_JSON, "--device-memory", 24)
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout and "to fit:" in proc.stdout
    proc = cli("plan", preset, "--model-config", QWEN_JSON, "--device-memory", -1)
    assert proc.returncode == 2 and "--device-memory" in proc.stderr
    # same inputs as `check`: a layout `check` rejects is rejected here, with the same message
    bad = cli(
        "plan",
        QWEN_JSON.parent / "npu32_tp4_pp4_ep8.yaml",
        "--nnodes",
        2,
        "--nproc-per-node",
        8,
        "--model-config",
        QWEN_JSON,
    )
    assert bad.returncode == 2 and "ep*etp = 8*1 = 8 must divide" in bad.stderr


def test_offload_fraction_is_checked_at_load_time():
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match="platform=cpu"):
        load_config(None, ["platform=cpu", "actor.optim.optimizer_offload_fraction=0.5"])
    with pytest.raises(ConfigError, match="use_distributed_optimizer=true"):
        load_config(None, ["platform=cuda", "actor.optim.optimizer_offload_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"must lie in \[0, 1\]"):
        load_config(None, ["actor.optim.optimizer_offload_fraction=2"])


def test_qwen_config_is_what_the_plan_reads():
    raw = json.loads(QWEN_JSON.read_text())
    dims = ModelDims.from_hf(QWEN_JSON)
    assert (dims.head_dim, dims.ffn_hidden_size, dims.tie_embeddings) == (128, raw["intermediate_size"], False)


def test_actor_offload_takes_the_actor_and_reference_off_the_rollout_phase():
    """actor.offload (mcore_rl/megatron/offload.py): during rollout neither the actor's state nor the reference
    model is on the device; the reference is there for its own pass (log-probs) only; the engine is unchanged."""
    dims = ModelDims.from_hf(QWEN_JSON)
    preset = QWEN_JSON.parent / "gpu8_tp2_ep8.yaml"
    on, off = (load_config(preset, [f"actor.offload={v}", "algo.kl_coef=0.01"]) for v in ("true", "false"))
    lay = validate_run(on, 8, dims)
    p_on, p_off = (plan_memory(c, lay, dims, device_gib=80) for c in (on, off))
    items = lambda plan, phase: {i.name: i.bytes for i in plan.phase(phase).items}
    st = p_off.state
    ref = stage_params(dims, lay)[0].total * 2  # bf16 reference parameters
    assert p_off.phase("rollout").total - p_on.phase("rollout").total == st.params + st.grads + st.optimizer + ref
    assert not any(name.startswith(("actor", "optimizer", "reference")) for name in items(p_on, "rollout"))
    assert items(p_on, "log-probs")["reference parameters"] == ref == items(p_off, "log-probs")["reference parameters"]
    assert items(p_on, "update")["reference parameters"] == 0 < items(p_off, "update")["reference parameters"]
    engine = lambda plan: sum(b for n, b in items(plan, "rollout").items() if n.startswith("engine"))
    assert engine(p_on) == engine(p_off)
    (note,) = [n for n in p_on.notes if n.startswith("actor.offload: host memory per rank")]
    from mcore_rl.preflight.host_chunks import pinned_bytes

    pinned = pinned_bytes(st.params + st.optimizer) + pinned_bytes(ref)  # whole 64 MiB chunks, actor and reference
    assert st.params + st.optimizer + ref <= pinned < st.params + st.optimizer + ref + 2 * 2**26
    assert f"pinned in 64 MiB chunks: {pinned / 2**30:.1f} GiB per rank" in note, note
    # a misfit names the offload as a lever when it alone makes the plan fit (the preset on a 64 GB device)
    tight = load_config(preset)
    plan = plan_memory(tight, lay, dims, device_gib=64)
    assert plan.fits is False and any(lever.startswith("actor.offload=true -> peak") for lever in plan.levers)
    assert plan_memory(replace(tight, actor=replace(tight.actor, offload=True)), lay, dims, device_gib=64).fits


def test_the_npu_long_response_preset_needs_its_cp():
    """The 32k-response Ascend preset: without CP the update does not fit a 64 GB NPU (one sequence's activations
    per layer); with its CP2 it does, and the misfit's layout levers name a CP layout on NPU (CP runs there)."""
    preset = QWEN_JSON.parent / "npu32_tp4_pp4_cp2_ep8_32k.yaml"
    assert preset in DEVICE_PRESETS
    cfg = load_config(preset)
    dims = ModelDims.from_hf(QWEN_JSON)
    lay = validate_run(cfg, 32, dims)
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.ep) == (4, 4, 2, 1, 8) and cfg.platform == "npu"
    with_cp = plan_memory(cfg, lay, dims, device_gib=64)
    no_cp = load_config(preset, ["actor.parallel.cp=1"])
    plan = plan_memory(no_cp, validate_run(no_cp, 32, dims), dims, device_gib=64)
    assert with_cp.fits and not plan.fits
    assert plan.phase("update").total > 64 * 2**30 > with_cp.phase("update").total
    assert any(" cp2 " in lever or " cp4 " in lever for lever in plan.levers), plan.levers


@pytest.mark.parametrize(
    "field, value, least",
    [("num_hidden_layers", 0, 1), ("hidden_size", -2048, 1), ("vocab_size", 0, 1), ("num_experts", -1, 0)],
)
def test_plan_refuses_a_model_config_with_impossible_sizes(tmp_path, field, value, least):
    """0 layers or a negative hidden size gave a plan that "fits" (negative GiB) and vocab_size 0 a
    ZeroDivisionError: the model config's sizes are checked before any planning, in one line naming the field."""
    config = json.loads(QWEN_JSON.read_text())
    config[field] = value
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(config))
    preset = QWEN_JSON.parent / "gpu8_tp2_ep8.yaml"
    for command in (["plan", "--device-memory", 141], ["check"]):
        proc = cli(*command, preset, "--model-config", bad)
        errors = [l for l in proc.stderr.splitlines() if l.startswith("mcore-rl: error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
        assert errors[0] == (
            f"mcore-rl: error: {bad}: {field} = {value} must be an integer >= {least}: fix the config.json (or "
            f"restore it from the model's release)"
        )
        assert "Traceback" not in proc.stderr and "verdict" not in proc.stdout
