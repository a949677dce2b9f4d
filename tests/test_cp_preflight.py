"""Context parallelism before launch: the rules of mcore_rl/preflight/context_parallel.py and the memory plan's
activations per CP rank (mcore_rl/preflight/memory_plan.py). Pure Python, no process.

The rule functions are tested directly, so these tests hold whether or not the layout still refuses cp > 1.
"""

import re
from dataclasses import replace

import pytest

from mcore_rl.config import load_config
from mcore_rl.preflight import context_parallel as cp_rules
from mcore_rl.preflight.layout import LayoutError, ModelDims, validate_layout
from mcore_rl.preflight.memory_plan import Tokens, layer_activation_bytes, micro_batch_tokens, plan_memory
from mcore_rl.preflight.run import validate_run
from tests.test_cli import QWEN_JSON


def test_rows_pad_to_two_chunks_per_cp_rank_times_tp_under_sequence_parallelism():
    assert [cp_rules.sequence_multiple(cp, 4, True) for cp in (1, 2, 4)] == [4, 16, 32]
    assert [cp_rules.sequence_multiple(cp, 4, False) for cp in (1, 2, 4)] == [1, 4, 8]
    assert [cp_rules.padded_length(n, 2) for n in (1, 4, 5, 34816)] == [4, 4, 8, 34816]
    assert [cp_rules.padded_length(n, 1) for n in (1, 5)] == [1, 5]


def test_the_layout_pads_rows_by_the_same_rule():
    cfg = load_config(None, ["actor.parallel.tp=2", "actor.parallel.ep=2", "actor.parallel.sequence_parallel=true"])
    lay = validate_layout(cfg.actor.parallel, 4, QWEN_JSON)
    assert lay.seq_len_multiple == cp_rules.sequence_multiple(1, 2, True) == 2


def test_cp_runs_where_a_cp_attention_is_configured():
    """CPU (the local spec's attention), CUDA with Transformer Engine (TE's, cp_comm_type p2p), NPU (MindSpeed's ring
    attention, megatron_cp_algo) and CUDA before launch (TE not known yet: judged as the matrix's stack, with TE) run
    cp > 1; CUDA without TE does not."""
    runs = [("cpu", None), ("cpu", False), (None, None), ("auto", None), ("cuda", True), ("cuda", None)]
    runs += [("npu", None), ("npu", True), ("npu", False)]  # NPU always builds the TE-named spec (MindSpeed's)
    for platform, te in runs:
        assert cp_rules.platform_problem(4, platform, te) is None and cp_rules.refusal(platform, te) is None
    problem = cp_rules.platform_problem(2, "cuda", False)
    assert problem.startswith("actor.parallel.cp = 2 on cuda: context parallelism on CUDA needs Transformer Engine")
    assert "cp_comm_type p2p" in problem and "install transformer-engine" in problem
    assert problem.endswith("set actor.parallel.cp = 1") and cp_rules.platform_problem(1, "cuda", False) is None


def test_check_refuses_cp_where_it_cannot_run_before_launch():
    cfg = load_config(None, ["actor.parallel.cp=2"])
    with pytest.raises(LayoutError, match=r"actor.parallel.cp = 2 on cuda: .*set actor.parallel.cp = 1"):
        validate_layout(cfg.actor.parallel, 8, QWEN_JSON, platform="cuda", transformer_engine=False)


@pytest.mark.parametrize("platform, te", [("cuda", None), ("cuda", True), ("npu", None), ("npu", True)])
def test_check_lets_cp_run_on_cuda_with_transformer_engine_and_on_npu(platform, te):
    cfg = load_config(None, ["actor.parallel.cp=2"])
    lay = validate_layout(cfg.actor.parallel, 8, QWEN_JSON, platform=platform, transformer_engine=te)
    assert lay.cp == 2 and lay.dp == 4


def test_cp_counts_in_the_world_and_in_the_expert_folding():
    """world = tp x pp x cp x dp; EP x ETP folds into TP x CP x DP; CP adds no rule on the heads (it splits
    tokens): TP's rule on the 4 KV heads of Qwen3-30B-A3B stays the only one."""

    def layout(world, **sizes):
        return validate_layout(
            load_config(None, [f"actor.parallel.{k}={v}" for k, v in sizes.items()]).actor.parallel,
            world,
            QWEN_JSON,
            platform="cpu",
        )

    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 2\*1\*2 = 4"):
        layout(6, tp=2, cp=2, ep=1)
    with pytest.raises(LayoutError, match=r"ep\*etp = 4\*1 = 4 must divide tp\*cp\*dp = 1\*2\*1 = 2"):
        layout(2, cp=2, ep=4, etp=1)
    lay = layout(16, tp=2, cp=4, ep=8, etp=1)
    assert (lay.tp, lay.cp, lay.dp, lay.edp) == (2, 4, 2, 2) and lay.tp * lay.pp * lay.cp * lay.dp == 16
    assert layout(8, cp=8, ep=1).cp == 8  # 8 CP ranks over 32 heads / 4 KV heads: no head rule for CP
    # PP with CP (as the 32k preset runs, PP2 x CP4): accepted, the stages' layers as without CP; PP's rule stays
    lay = layout(8, pp=2, cp=2, ep=2, etp=1)
    assert (lay.pp, lay.cp, lay.dp, lay.edp, lay.layers_per_stage) == (2, 2, 2, 2, (24, 24))
    with pytest.raises(LayoutError, match=r"pp = 5 must divide the model's 48 layers"):
        layout(10, pp=5, cp=2, ep=1)
    with pytest.raises(LayoutError, match="query groups"):
        layout(8, tp=8, ep=1)  # TP's: 4 KV heads do not split over 8


def test_the_split_summary_names_the_chunks_and_the_tokens_per_rank():
    line = cp_rules.split_summary(4, 4, True, 34816, 34816)
    assert line.startswith("context parallel: cp4, each sequence in 8 load-balanced chunks (padded to a multiple of 8")
    assert "rows to a multiple of 32" in line and "is 8704 tokens per CP rank" in line
    assert cp_rules.split_summary(1, 4, True, 34816, None) is None
    npu = cp_rules.split_summary(2, 4, True, 34816, 34816, "npu")
    assert npu.endswith("attention across CP ranks: MindSpeed's ring attention, context_parallel_algo megatron_cp_algo")
    assert "decided at start: CPU: K / V all-gathered" in line and "NPU: MindSpeed's ring attention" in line


def test_the_attention_named_is_the_one_the_platform_configures():
    from mcore_rl.platform import MINDSPEED_CP_ALGO, TE_CP_COMM_TYPE

    assert f"context_parallel_algo {MINDSPEED_CP_ALGO}" in cp_rules.cp_attention("npu")
    assert f"cp_comm_type {TE_CP_COMM_TYPE}" in cp_rules.cp_attention("cuda")
    assert set(cp_rules.CP_ATTENTION) == {"cpu", "cuda", "npu"}


# ------------------------------------------------------------------------------------------ the memory plan

# A dense toy model with numbers small enough to count by hand: hidden 32, 4 heads of 8 (q = 32), 2 KV
# groups (kv = 16), FFN 64; bf16 (b = 2), no TP.
TOY = ModelDims(2, 4, 2, 0, 64, 32, head_dim=8, ffn_hidden_size=64)


def _layout(cp: int):
    lay = validate_layout(load_config(None).actor.parallel, 4, TOY)
    return replace(lay, cp=cp, dp=4 // cp, seq_len_multiple=cp_rules.sequence_multiple(cp, 1, False))


def test_layer_activations_per_cp_rank_by_hand():
    # one sequence of 16 tokens; cp 2: each rank holds 8 (T), attends over all 16 keys
    one = layer_activation_bytes(TOY, _layout(1), Tokens(seq=16, attn=16, local=16), 2)
    two = layer_activation_bytes(TOY, _layout(2), Tokens(seq=16, attn=8, local=8), 2)
    norm_in = (4 + 2 + 2) * 32  # per token: fp32 input + normalised output + the QKV input
    qk_norm = (4 + 2) * (32 + 16)  # per token
    q_ctx = 2 * 2 * 32  # rotated q + the context, per token of this rank
    kv = 2 * 2 * 32  # GQA-expanded k and v, per token of the whole sequence
    mlp = (4 + 2) * 32 + 2 * 32 + 4 * 2 * 64  # pre-MLP norm, fc1 input, fc1 output + SiLU + product
    score = (4 + 2) * 4  # fp32 softmax + its cast, per score of the 4 heads
    assert one == 16 * (norm_in + qk_norm + q_ctx + mlp) + 16 * kv + score * 16 * 16 == 31232
    assert two == 8 * (norm_in + qk_norm + q_ctx + mlp) + 16 * kv + score * 8 * 16 == 16640


def test_micro_batch_tokens_split_by_cp():
    cfg = load_config(None, ["actor.max_tokens_per_micro_batch=1000", "rollout.max_new_tokens=500"])
    tok = micro_batch_tokens(cfg, _layout(2))
    assert (tok.seq, tok.attn, tok.local, tok.rows) == (1000, 500, 500, 1)  # 1000 is a multiple of 2 x cp
    tok = micro_batch_tokens(replace(cfg, actor=replace(cfg.actor, max_tokens_per_micro_batch=1001)), _layout(2))
    assert (tok.seq, tok.attn) == (1004, 502)


def test_the_plan_of_a_long_response_run_falls_with_cp():
    """Qwen3-30B-A3B with 32k responses: the update's activations per rank shrink as cp grows."""
    dims = ModelDims.from_hf(QWEN_JSON)
    cfg = load_config(
        QWEN_JSON.parent / "gpu64_tp4_pp2_ep8.yaml",
        ["rollout.max_new_tokens=32768", "data.max_prompt_len=2048", "actor.max_tokens_per_micro_batch=34816"],
    )
    base = validate_run(cfg, 64, dims)
    peaks = []
    for cp in (1, 2, 4):
        lay = replace(base, cp=cp, dp=base.dp // cp, seq_len_multiple=cp_rules.sequence_multiple(cp, base.tp, True))
        peaks.append(plan_memory(cfg, lay, dims, device_gib=141).phase("update").total)
    assert peaks[0] > peaks[1] > peaks[2]


def test_a_long_response_misfit_names_a_cp_layout_where_cp_runs():
    """Without CP the 32k run does not fit an 80 GB GPU; the plan's layout levers try 2x / 4x the CP size, so
    they name a CP layout exactly when the pre-flight lets cp > 1 run (every layout lever is one check passes)."""
    dims = ModelDims.from_hf(QWEN_JSON)
    long_run = ["rollout.max_new_tokens=32768", "data.max_prompt_len=2048", "actor.max_tokens_per_micro_batch=34816"]
    more = ["actor.offload=true", "rollout.gpu_memory_utilization=0.6", "algo.routing_replay=null", "platform=auto"]
    cfg = load_config(QWEN_JSON.parent / "gpu64_tp4_pp2_ep8.yaml", long_run + more)
    plan = plan_memory(cfg, validate_run(cfg, 64, dims), dims, device_gib=80)
    assert not plan.fits and plan.levers
    cp_levers = [lever for lever in plan.levers if " cp" in lever]
    try:
        validate_run(
            load_config(QWEN_JSON.parent / "gpu64_tp4_pp2_ep8.yaml", long_run + more + ["actor.parallel.cp=4"]),
            64,
            dims,
        )
        cp_runs = True
    except LayoutError:
        cp_runs = False
    assert bool(cp_levers) == cp_runs, plan.levers
    assert all(
        re.match(r"layout tp\d+ pp\d+ cp[24] ep\d+ etp1 \(dp\d+, edp\d+\) -> peak", lever) for lever in cp_levers
    )
