"""Context parallelism on CUDA with Transformer Engine, checked here without a GPU or TE (docs/context-parallel.md,
"On CUDA"): the actor's split is the one TE's THD CP attention expects, the TransformerConfig the project builds
for a CUDA + TE CP layout carries the chosen cp_comm_type (and the real TransformerConfig takes it), and the
local spec's CP attention is not what CUDA + TE builds. One process, no device."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

import mcore_rl.platform as platform_module
from mcore_rl.batch import MicroBatch
from mcore_rl.config import ModelConfig, load_config
from mcore_rl.megatron.context_parallel import packed_params, plan_shard
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.platform import TE_CP_COMM_TYPE, Platform, context_parallel_config
from mcore_rl.preflight.layout import validate_layout
from tests.test_cli import PRESET_DIR, QWEN_JSON


def te_partitioned_indices(padded_bounds: list[int], cp: int, rank: int) -> list[int]:
    """TE's THD CP partition, restated from its `thd_get_partitioned_indices` kernel: local token t of sequence s
    (local bounds = global padded bounds / cp) is global token start_s + i + half x offset, with i its index in
    the sequence's local part, half = its local length / 2, offset = rank in the first half, 2cp-2-rank after."""
    out = []
    for start, end in zip(padded_bounds[:-1], padded_bounds[1:]):
        local = (end - start) // cp
        half = local // 2
        for i in range(local):
            offset = rank if i < half else 2 * cp - 2 - rank
            out.append(start + i + half * offset)
    return out


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 2)])
def test_the_split_is_the_partition_te_expects(cp, tp):
    lengths = [5, 17, 8, 1, 30]
    mb = MicroBatch(tokens=torch.arange(sum(lengths)).unsqueeze(0), seq_lengths=lengths)
    for rank in range(cp):
        plan = plan_shard(mb, cp, rank, local_multiple=tp)
        params = packed_params(plan, None, "cpu")  # what the model gets: the padded global bounds
        bounds = params.cu_seqlens_q_padded.tolist()
        assert all((b - a) % (2 * cp) == 0 for a, b in zip(bounds[:-1], bounds[1:]))  # TE's kernel asserts it
        global_index = te_partitioned_indices(bounds, cp, rank)
        assert len(global_index) == plan.local_tokens  # TE's local row: total / cp
        starts = [a for a, b in zip(bounds[:-1], bounds[1:]) for _ in range((b - a) // cp)]
        ours = [s + int(p) for s, p in zip(starts, plan.positions[rank])]  # each local token's padded global index
        assert ours == global_index
        assert params.qkv_format == "thd" and torch.equal(params.cu_seqlens_q, params.cu_seqlens_q_padded)


def test_cp_comm_type_only_where_te_attention_does_cp():
    assert context_parallel_config("cuda", True, 4) == {"cp_comm_type": "p2p"} and TE_CP_COMM_TYPE == "p2p"
    assert context_parallel_config("cuda", True, 1) == {}
    assert context_parallel_config("cuda", False, 4) == {}  # the local spec attends across CP itself
    assert context_parallel_config("cpu", False, 4) == {} and context_parallel_config("npu", True, 4) == {}


def _cuda_te_overrides(monkeypatch, cp: int) -> tuple[dict, Platform]:
    monkeypatch.setattr(platform_module, "transformer_engine_importable", lambda: True)  # the cluster's stack
    cuda = Platform("cuda")
    assert cuda.uses_transformer_engine and cuda.packed_attention == "thd"
    overrides = [f"actor.parallel.{k}={v}" for k, v in dict(tp=4, pp=2, cp=cp, ep=8, etp=1).items()]
    cfg = load_config(PRESET_DIR / "gpu64_tp4_pp2_ep8.yaml", overrides)
    layout = validate_layout(cfg.actor.parallel, 64, QWEN_JSON, platform="cuda", transformer_engine=True)
    bridge = ModelBridge(str(PRESET_DIR), cuda)  # reads config.json only; builds nothing
    return bridge.megatron_config_overrides(layout, ModelConfig(path=str(PRESET_DIR))), cuda


def test_the_transformer_config_of_a_cuda_te_cp_layout_names_the_comm_type(monkeypatch):
    extra, cuda = _cuda_te_overrides(monkeypatch, 4)
    assert extra["cp_comm_type"] == "p2p"
    assert "apply_rope_fusion" not in extra  # the TE spec's config: the local spec's no-fusion fields are absent
    assert "cp_comm_type" not in _cuda_te_overrides(monkeypatch, 1)[0]
    # the real TransformerConfig takes it (its __post_init__ checks cp_comm_type under cp > 1)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=4, **cuda.context_parallel_config(4)
    )
    assert config.cp_comm_type == "p2p"
