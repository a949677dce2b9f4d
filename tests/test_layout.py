"""Layout rules: one test per rule, all without any process group (pure Python)."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from mcore_rl.config import ParallelConfig, load_config
from mcore_rl.preflight.architectures import ARCHITECTURES
from mcore_rl.preflight.engines import validate_rollout_tp
from mcore_rl.preflight.layout import LayoutError, ModelDims, validate_layout
from mcore_rl.preflight.run import validate_run

# Qwen3-30B-A3B
QWEN = ModelDims(
    num_layers=48,
    num_attention_heads=32,
    num_query_groups=4,
    num_experts=128,
    vocab_size=151936,
    hidden=2048,
    moe_ffn_hidden_size=768,
    moe_top_k=8,
    head_dim=128,
    ffn_hidden_size=6144,
    model_type="qwen3_moe",
    max_positions=40960,  # the published model's max_position_embeddings
)
DENSE = ModelDims(num_layers=4, num_attention_heads=8, num_query_groups=8, num_experts=0, vocab_size=1000, hidden=64)


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


def err(parallel: ParallelConfig, world: int, dims=QWEN, platform=None) -> str:
    with pytest.raises(LayoutError) as e:
        validate_layout(parallel, world, dims, platform=platform)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_valid_layout_derives_sizes():
    lay = validate_layout(ParallelConfig(tp=4, pp=4, ep=8, etp=1), 32, QWEN)
    assert (lay.dp, lay.edp, lay.etp) == (2, 1, 1)
    assert lay.layers_per_stage == (12, 12, 12, 12)
    assert lay.sequence_parallel and any("sequence_parallel turned on" in w for w in lay.warnings)
    assert lay.seq_len_multiple == 4 and lay.padded_vocab_size == 151936
    lay = validate_layout(ParallelConfig(tp=2, ep=8, etp=1), 8, QWEN)
    assert (lay.dp, lay.edp) == (4, 1)
    lay = validate_layout(ParallelConfig(tp=4, pp=2, ep=8, etp=1), 64, QWEN)
    assert (lay.dp, lay.edp, lay.seq_len_multiple) == (8, 4, 4)


def test_sizes_must_be_positive():
    assert "actor.parallel.micro_batch_size = 0" in err(ParallelConfig(micro_batch_size=0), 8)
    assert "actor.parallel.tp = 0" in err(ParallelConfig(tp=0), 8)
    assert "world_size = 0" in err(ParallelConfig(), 0)


def test_world_divisible_by_model_parallel():
    msg = err(ParallelConfig(tp=4, pp=4), 24)
    assert "world size 24 is not divisible by tp*pp*cp = 4*4*1 = 16" in msg and "multiple of 16" in msg


def test_tp_divides_query_groups():
    msg = err(ParallelConfig(tp=8), 8)
    assert "tp = 8 must divide the model's 4 query groups" in msg and "[1, 2, 4]" in msg


def test_tp_divides_heads():
    dims = ModelDims(num_layers=2, num_attention_heads=6, num_query_groups=2, num_experts=0, vocab_size=96, hidden=48)
    assert "tp = 4 must divide the model's 6 attention heads" in err(ParallelConfig(tp=4), 4, dims)


def test_pp_divides_layers():
    msg = err(ParallelConfig(pp=5), 5)
    assert "pp = 5 must divide the model's 48 layers" in msg and "num_layers_in_first_stage" in msg


def test_uneven_stages_allow_pp_not_dividing_layers():
    lay = validate_layout(ParallelConfig(pp=5, num_layers_in_first_stage=8, num_layers_in_last_stage=4), 5, QWEN)
    assert lay.layers_per_stage == (8, 12, 12, 12, 4) and sum(lay.layers_per_stage) == 48
    msg = err(ParallelConfig(pp=4, num_layers_in_first_stage=7), 4)
    assert "leaves 41 layers for 3 middle stages" in msg


def test_virtual_pp_refused_before_the_other_rules():
    """The actor cannot run interleaved pipeline stages: any virtual_pp but null / 1 is refused first, whatever
    else the layout says and on every megatron-core version; 1 is the plain pipeline (vpp None for Megatron)."""
    fix = "set actor.parallel.virtual_pp: null (or 1)"
    for parallel, world in ((ParallelConfig(pp=4, virtual_pp=3), 4), (ParallelConfig(pp=1, virtual_pp=2), 5)):
        msg = err(parallel, world)
        assert msg.startswith(f"actor.parallel.virtual_pp = {parallel.virtual_pp}: interleaved (virtual) pipeline")
        assert "every pass would need >= pp micro-batches" in msg and msg.endswith(fix) and "\n" not in msg
    assert validate_layout(ParallelConfig(pp=4), 4, QWEN).vpp is None
    lay = validate_layout(ParallelConfig(pp=4, virtual_pp=1), 4, QWEN)
    assert lay.vpp is None and "virtual_pp = 1 is the plain pipeline schedule: treated as null" in lay.warnings


def test_ep_divides_experts():
    assert "ep = 3 must divide the model's 128 experts" in err(ParallelConfig(ep=3), 3)
    assert "dense" in err(ParallelConfig(ep=2), 2, DENSE)


def test_etp_must_divide_expert_ffn_size():
    dims = ModelDims(
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=4,
        num_experts=8,
        vocab_size=128,
        hidden=64,
        moe_ffn_hidden_size=90,
    )
    assert "etp = 4 must divide the expert FFN size 90" in err(ParallelConfig(tp=4, etp=4), 4, dims)


def test_expert_parallel_folds_into_tp_cp_dp():
    # The 32-device recipe (TP4 PP4 EP8 ETP1) on 2 nodes x 8: DP 1, EP8 cannot fold into TP4 x DP1.
    msg = err(ParallelConfig(tp=4, pp=4, ep=8, etp=1), 16)
    assert "ep*etp = 8*1 = 8 must divide tp*cp*dp = 4*1*1 = 4" in msg
    assert "use ep in [1, 2, 4]" in msg and "multiple of 32" in msg


def test_vocab_divisible_by_tp_names_megatron_padding():
    dims = ModelDims(num_layers=2, num_attention_heads=4, num_query_groups=4, num_experts=0, vocab_size=130, hidden=64)
    msg = err(ParallelConfig(tp=4), 4, dims)
    assert "tp = 4 must divide the vocabulary size 130" in msg and "to 512" in msg and "128 x tp 4" in msg


def test_sequence_parallel_auto_on_for_moe_and_off_for_tp1():
    lay = validate_layout(ParallelConfig(tp=2, sequence_parallel=False), 2, QWEN)
    assert lay.sequence_parallel and lay.seq_len_multiple == 2
    lay = validate_layout(ParallelConfig(tp=1, sequence_parallel=True), 1, QWEN)
    assert not lay.sequence_parallel and "needs tp > 1" in lay.warnings[0]
    lay = validate_layout(ParallelConfig(tp=2, sequence_parallel=False), 2, DENSE)
    assert not lay.sequence_parallel and lay.warnings == ()


def test_context_parallel_pads_sequences_to_twice_cp():
    lay = validate_layout(ParallelConfig(cp=2), 2, QWEN, platform="cpu")
    assert lay.cp == 2 and lay.dp == 1 and lay.seq_len_multiple == 4


def test_context_parallel_refused_where_no_cp_attention_is_configured():
    """CUDA without Transformer Engine: the local spec's CP attention is the CPU path, refused. CUDA with TE (or TE
    not known yet, before launch) and NPU (MindSpeed's ring attention) run it."""
    assert validate_layout(ParallelConfig(cp=2), 2, QWEN, platform="npu").cp == 2
    with pytest.raises(LayoutError, match=r"on cuda: context parallelism on CUDA needs Transformer Engine"):
        validate_layout(ParallelConfig(cp=2), 2, QWEN, platform="cuda", transformer_engine=False)
    assert validate_layout(ParallelConfig(cp=2), 2, QWEN, platform="cuda").cp == 2


def test_expert_tp_refused_on_npu_only():
    assert "etp = 2 on NPU: MindSpeed" in err(ParallelConfig(tp=2, ep=2, etp=2), 4, platform="npu")
    assert validate_layout(ParallelConfig(tp=2, ep=2, etp=2), 4, QWEN, platform="cuda").etp == 2


def test_cpu_run_refuses_expert_tp_with_ep():
    """On CPU the layout builds (the weight export runs in it, tests/test_shm_gather.py) but a run cannot train:
    with experts split over EP the ETP ranks receive different token counts (gloo rejects the uneven all-gather)."""
    big = ["actor.parallel.tp=2", "actor.parallel.pp=2", "actor.parallel.cp=2", "actor.parallel.ep=2"]
    cfg = load_config(None, ["platform=cpu", *big, "actor.parallel.etp=2"])
    assert validate_layout(cfg.actor.parallel, 8, QWEN, platform="cpu").etp == 2
    with pytest.raises(LayoutError) as e:
        validate_run(cfg, 8, QWEN)
    assert str(e.value) == (
        "actor.parallel.etp = 2 with ep = 2 on CPU: gloo rejects the uneven all-gather of the alltoall "
        "dispatcher's expert tensor parallel step (the first MoE layer would abort); set actor.parallel.etp = 1"
    )
    validate_run(load_config(None, ["platform=cuda", *big, "actor.parallel.etp=2"]), 8, QWEN)
    for ok in (["actor.parallel.tp=2", "actor.parallel.etp=2"], [*big, "actor.parallel.etp=1"]):  # EP1 / no ETP
        validate_run(load_config(None, ["platform=cpu", *ok]), 2 if len(ok) == 2 else 8, QWEN)


NPU_VLLM = ["platform=npu", "rollout.engine=vllm", "rollout.tp=4"]


def test_npu_refuses_rollout_routing_replay():
    cfg = load_config(None, NPU_VLLM + ["algo.routing_replay=r3"])
    with pytest.raises(LayoutError, match="r3 replays the engine's routed experts, which vLLM-Ascend") as e:
        validate_run(cfg, 8, QWEN)
    # the first release that returns them, and why it cannot share the actor's process (mcore_rl.preflight.support)
    assert "first vLLM-Ascend release with it is 0.18.0, which needs torch 2.9.0" in str(e.value)
    assert "MindSpeed release (up to 26.1.0_core_r0.12.1) runs on PyTorch 2.7.1 or older" in str(e.value)
    validate_run(load_config(None, NPU_VLLM + ["algo.routing_replay=r2"]), 8, QWEN)
    validate_run(
        load_config(None, ["platform=cuda", "rollout.engine=vllm", "rollout.tp=4", "algo.routing_replay=r3"]), 8, QWEN
    )


@pytest.mark.parametrize("option", ["algo.rollout_is=token"])
def test_npu_refuses_engine_logprobs_at_temperature_other_than_1(option):
    hot = ["rollout.temperature=0.7", "algo.temperature=0.7"]
    cfg = load_config(None, NPU_VLLM + hot + [option])
    with pytest.raises(
        LayoutError, match=f"{option.split('=')[0]} uses the engine's sampling log-probs.*temperature 1"
    ) as e:
        validate_run(cfg, 8, QWEN)
    assert "first vLLM-Ascend release with it is 0.23.0, which needs torch 2.10.0" in str(e.value)
    validate_run(load_config(None, NPU_VLLM + [option]), 8, QWEN)  # temperature 1: raw = processed
    validate_run(load_config(None, NPU_VLLM + hot + [option, "rollout.engine=embedded"]), 8, QWEN)
    validate_run(load_config(None, ["platform=cuda", "rollout.engine=vllm", "rollout.tp=4"] + hot + [option]), 8, QWEN)


def test_model_dims_from_hf_config_object_and_files(tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    tiny = ModelDims.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    assert tiny == ModelDims.from_hf(tiny_model_dir) == ModelDims.from_hf(f"{tiny_model_dir}/config.json")
    assert (tiny.num_layers, tiny.num_attention_heads, tiny.num_query_groups, tiny.num_experts, tiny.vocab_size) == (
        2,
        4,
        2,
        8,
        128,
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 3, "num_attention_heads": 2, "vocab_size": 10, "hidden_size": 8})
    )
    dense = ModelDims.from_hf(tmp_path)
    assert dense.num_query_groups == 2 and dense.num_experts == 0
    with pytest.raises(LayoutError, match="does not exist"):
        ModelDims.from_hf(tmp_path / "missing")


def test_rollout_tp():
    assert validate_rollout_tp(4, 32, QWEN).dp == 8
    assert validate_rollout_tp(8, 32, QWEN).warnings  # replicates KV heads
    with pytest.raises(LayoutError, match="divide the world size 32"):
        validate_rollout_tp(3, 32, QWEN)
    with pytest.raises(LayoutError, match="above the 4 KV heads must be a multiple"):
        validate_rollout_tp(6, 12, ModelDims(2, 12, 4, 0, 8, 8))


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QWEN_JSON = CONFIGS / "qwen3_30b_a3b" / "config.json"
# Every real-model preset, with the config.json of its model next to it.
PRESETS = sorted(p for d in CONFIGS.iterdir() if (d / "config.json").is_file() for p in d.glob("*.yaml"))


def test_qwen_config_json_matches_known_dims():
    assert ModelDims.from_hf(QWEN_JSON) == QWEN


def test_dense_config_jsons_match_the_published_models():
    q8 = ModelDims.from_hf(CONFIGS / "qwen3_8b" / "config.json")
    assert (q8.num_layers, q8.hidden, q8.num_attention_heads, q8.num_query_groups, q8.num_experts) == (
        36,
        4096,
        32,
        8,
        0,
    )
    q3 = ModelDims.from_hf(CONFIGS / "qwen2_5_3b" / "config.json")
    assert (q3.num_layers, q3.hidden, q3.num_attention_heads, q3.num_query_groups, q3.num_experts) == (
        36,
        2048,
        16,
        2,
        0,
    )
    assert q8.vocab_size == q3.vocab_size == 151936 and (q8.model_type, q3.model_type) == ("qwen3", "qwen2")
    tied = {
        d: json.loads((CONFIGS / d / "config.json").read_text())["tie_word_embeddings"]
        for d in ("qwen3_8b", "qwen2_5_3b")
    }
    assert tied == {"qwen3_8b": False, "qwen2_5_3b": True}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_real_model_preset_valid_at_its_world_size(preset):
    cfg = load_config(preset)
    world = cfg.trainer.nnodes * cfg.trainer.nproc
    lay = validate_run(cfg, world, preset.parent / "config.json")
    # separate placement: the actor's layout spans the world less the rollout ranks
    assert lay.world_size + lay.rollout_ranks == world and lay.tp * lay.pp * lay.cp * lay.dp == lay.world_size
    assert lay.rollout_ranks == (cfg.rollout.ranks if cfg.rollout.placement == "separate" else 0)
    assert (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp) == 0


def test_architecture_table_rejects_unknown_types_and_replay_on_dense(tmp_path):
    assert {t: a.moe for t, a in ARCHITECTURES.items()} == {"qwen3_moe": True, "qwen3": False, "qwen2": False}
    llama = json.loads((CONFIGS / "qwen3_8b" / "config.json").read_text()) | {"model_type": "llama"}
    with pytest.raises(LayoutError, match=r"model_type 'llama' \(config.json\) is not supported: .*qwen3_moe \(MoE"):
        validate_run(load_config(None), 8, llama)
    dense = CONFIGS / "qwen3_8b" / "config.json"
    for replay in ("r2", "r3"):
        cfg = load_config(None, [f"algo.routing_replay={replay}"])
        with pytest.raises(LayoutError, match=f"routing_replay = {replay} .* is dense .* set algo.routing_replay=null"):
            validate_run(cfg, 8, dense)
        assert validate_run(cfg, 8, QWEN_JSON).dp == 8  # MoE: allowed
    moe_without_experts = json.loads(QWEN_JSON.read_text()) | {"num_experts": 0}
    with pytest.raises(LayoutError, match="should be MoE but config.json has 0 experts"):
        validate_run(load_config(None), 8, moe_without_experts)


def test_32_device_recipe_rejected_on_16_devices():
    cfg = load_config(QWEN_JSON.parent / "npu32_tp4_pp4_ep8.yaml")
    with pytest.raises(LayoutError, match=r"ep\*etp = 8\*1 = 8 must divide tp\*cp\*dp = 4\*1\*1 = 4"):
        validate_run(cfg, 2 * 8, QWEN_JSON)


def test_run_batch_split_rules():
    cfg = load_config(None, ["data.prompts_per_step=3", "rollout.n=2", "algo.mini_batches=1"])
    with pytest.raises(LayoutError, match=r"6 samples .* must split evenly over dp 4 x algo.mini_batches 1 = 4"):
        validate_run(cfg, 4, QWEN)
    cfg = load_config(None, ["data.prompts_per_step=4", "rollout.n=3", "actor.parallel.micro_batch_size=4"])
    with pytest.raises(
        LayoutError,
        match=r"mini-batch of 6 samples must split into micro-batches of .* = 4: use a micro_batch_size in \[1, 2, 3, 6\]",
    ):
        validate_run(cfg, 2, QWEN)
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.tp=3"])
    with pytest.raises(LayoutError, match="rollout.tp = 3"):
        validate_run(cfg, 6, QWEN)
    cfg = load_config(None, ["platform=npu", "actor.parallel.cp=2"])  # MindSpeed's ring attention: cp runs on NPU
    assert validate_run(cfg, 2, QWEN).cp == 2
