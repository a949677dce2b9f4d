"""Platform selection and the CPU adaptation of Megatron-Core (each patched call site, idempotence)."""

import pytest
import torch

from mcore_rl.platform import Platform, get_platform
from tests.torchrun_util import REPO, run_worker

SITES = [
    "idempotent",
    "factories",
    "seeding",
    "rotary",
    "streams",
    "clip_grads",
    "split_sizes",
    "eager_fusions",
    "checkpoint_writer",
]


def test_auto_picks_cpu_here():
    p = get_platform("auto")
    assert p == Platform("cpu") and p.dist_backend == "gloo" and p.device == torch.device("cpu")


def test_backends():
    # accelerators: the device backend for device tensors and gloo for CPU tensors (docs/devices.md)
    assert [Platform(n).dist_backend for n in ("cpu", "cuda", "npu")] == [
        "gloo",
        "cpu:gloo,cuda:nccl",
        "cpu:gloo,npu:hccl",
    ]


BACKENDS_WORKER = """
import torch.distributed as dist

from mcore_rl.platform import free_port
from tests.workers.harness import worker_args, write_result

args = worker_args(__doc__)
dist.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
from megatron.core import parallel_state as mpu

mpu.initialize_model_parallel()
groups = {
    "dp": mpu.get_data_parallel_group(),
    "tp": mpu.get_tensor_model_parallel_group(),
    "ep": mpu.get_expert_model_parallel_group(),
}
write_result(args.results, **{name: dist.get_backend(group) for name, group in groups.items()})
"""


def test_megatron_subgroups_inherit_the_default_backend(tmp_path):
    """Megatron's parallel_state creates its groups with backend=None; torch resolves that to the default
    group's backend string, so a multi-device default reaches every TP/PP/DP/EP group."""
    import inspect

    from megatron.core import parallel_state

    assert "backend=None" in inspect.getsource(parallel_state.create_group)
    script = tmp_path / "backends.py"
    script.write_text(BACKENDS_WORKER)
    (got,) = run_worker(script, 1, torchrun=False, timeout=120).results
    assert got == {"rank": 0, "dp": "cpu:gloo", "tp": "cpu:gloo", "ep": "cpu:gloo"}, got


def test_ascend_environment_is_set_once_and_user_values_win():
    env = {"HCCL_CONNECT_TIMEOUT": "600"}
    applied = Platform("npu").apply_environment(env)
    assert applied == {
        "VLLM_ASCEND_ENABLE_NZ": "0",
        "HCCL_CONNECT_TIMEOUT": "600",
        "HCCL_BUFFSIZE": "256",
        "CPU_AFFINITY_CONF": "1",
    }
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert Platform("cuda").apply_environment({}) == {}


def test_unknown_platform_is_rejected():
    with pytest.raises(ValueError, match="unknown"):
        get_platform("tpu")


def test_cuda_requested_without_cuda_is_rejected():
    with pytest.raises(RuntimeError, match="cuda"):
        get_platform("cuda")


@pytest.fixture(scope="module")
def site_outcome():
    """Every site's outcome from one plain-python world-1 process (the patches stay out of pytest)."""
    (outcome,) = run_worker(REPO / "tests" / "workers" / "actor_platform_sites.py", 1, torchrun=False).results
    return outcome


def test_cpu_adaptation_mode_comes_from_the_environment(monkeypatch):
    """MCORE_RL_CPU_ADAPT: unset or "all" - routing and speed-ups; "routing" - the routing alone (the GPU rehearsal);
    anything else is refused naming the choices."""
    from mcore_rl.platform import cpu_adapt

    monkeypatch.delenv(cpu_adapt.MODE_ENV, raising=False)
    assert cpu_adapt.mode() == "all"
    monkeypatch.setenv(cpu_adapt.MODE_ENV, "routing")
    assert cpu_adapt.mode() == "routing"
    monkeypatch.setenv(cpu_adapt.MODE_ENV, "fast")
    with pytest.raises(ValueError, match=r"MCORE_RL_CPU_ADAPT='fast' is not one of all, routing"):
        cpu_adapt.mode()


def test_every_site_was_checked(site_outcome):
    assert set(site_outcome) - {"rank"} == set(SITES), site_outcome


@pytest.mark.parametrize("site", SITES)
def test_cpu_adaptation_site(site_outcome, site):
    assert site_outcome[site] == "ok", f"{site}: {site_outcome[site]}"


def test_mindspeed_arguments_set_after_the_adaptor():
    """The decision of _adapt_npu: repatch only the MindSpeed arguments that differ (idempotent)."""
    from types import SimpleNamespace

    from mcore_rl.platform import MINDSPEED_ARGS, mindspeed_args_to_set

    assert MINDSPEED_ARGS["use_flash_attn"] is True
    assert mindspeed_args_to_set(SimpleNamespace(use_flash_attn=False)) == {"use_flash_attn": True}
    assert mindspeed_args_to_set(SimpleNamespace()) == {"use_flash_attn": True}  # absent from sys.argv
    assert mindspeed_args_to_set(SimpleNamespace(**MINDSPEED_ARGS)) == {}


def test_layer_spec_choice():
    """TE spec on NPU (MindSpeed) and on CUDA only where transformer_engine imports; local spec otherwise."""
    import importlib.util

    has_te = importlib.util.find_spec("transformer_engine") is not None
    assert Platform("npu").uses_transformer_engine and not Platform("cpu").uses_transformer_engine
    assert Platform("cuda").uses_transformer_engine == has_te
    assert not has_te  # this suite's venv has no Transformer Engine: CUDA here would use the local spec


@pytest.mark.parametrize(
    "name,te,spec,mode",
    [
        ("cpu", False, False, "segments"),
        ("cpu", True, False, "segments"),
        ("cuda", False, False, "segments"),  # the GPU smoke suite's machine: local spec, SegmentDotProductAttention
        ("cuda", True, True, "thd"),
        ("npu", False, True, "thd-ends"),  # MindSpeed's flash attention under TE's names, its cu_seqlens convention
    ],
)
def test_packed_attention_follows_the_layer_spec(name, te, spec, mode):
    """THD (PackedSeqParams) only where the TE spec is built; Megatron's local attention asserts on it."""
    from mcore_rl.platform import packed_attention_mode, uses_te_spec

    assert uses_te_spec(name, te_importable=te) is spec
    assert packed_attention_mode(spec, name) == mode


def test_packed_attention_of_the_platforms_here():
    assert [Platform(n).packed_attention for n in ("cpu", "cuda", "npu")] == ["segments", "segments", "thd-ends"]


def mindspeed_2_2_hand_off(packed_seq_params) -> list:
    """MindSpeed 2.2.0's flash-attention adaptor (`dot_product_attention_forward_impl`, TND): actual_seq_qlen is
    `packed_seq_params.cu_seqlens_q.tolist()` (docs/devices.md, "Packed micro-batches")."""
    return packed_seq_params.cu_seqlens_q.tolist()


def mindspeed_26_hand_off(packed_seq_params) -> list:
    """MindSpeed 26.0.0 / 26.1.0's MindSpeedTEDotProductAttention: every PackedSeqParams field as a keyword to its
    TE-style DotProductAttention.forward, whose thd check and core-attention call take cu_seqlens_q / _kv only;
    backend.FlashAttention then passes `cu_seqlens_q.tolist()` as actual_seq_qlen (docs/devices.md)."""
    import dataclasses

    kwargs = {f.name: getattr(packed_seq_params, f.name) for f in dataclasses.fields(packed_seq_params)}
    q, kv = kwargs["cu_seqlens_q"], kwargs["cu_seqlens_kv"]
    assert kwargs["qkv_format"] == "thd", "26.x takes the TND path for qkv_format thd only"
    assert q is not None and kv is not None and q.shape == kv.shape and q.dim() == kv.dim() == 1, "26.x's thd assert"
    return q if isinstance(q, list) else q.tolist()


def test_npu_fused_attention_gets_end_offsets_and_rope_the_bounds():
    """npu_fusion_attention's actual_seq_qlen is the cumulative ends (lengths 2 2 2 2 2 -> 2 4 6 8 10); MindSpeed
    hands it cu_seqlens_q.tolist() through 2.2.0's adaptor and through 26.x's MindSpeedTEDotProductAttention alike;
    Megatron's RoPE reads cu_seqlens_q_padded (set) as [0, ends]."""
    from mcore_rl.megatron.attention_inputs import model_inputs, packed_seq_params
    from mcore_rl.platform import npu_actual_seq_len

    lengths = [2, 2, 2, 2, 2]
    params = packed_seq_params(lengths, "cpu", ends_only=True)
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [2, 4, 6, 8, 10]
    rope = params.cu_seqlens_q_padded  # what Megatron's attention passes to apply_rotary_pos_emb when it is set
    assert rope.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 2, 4, 6, 8, 10]
    assert (rope[1:] - rope[:-1]).tolist() == lengths  # Megatron's _apply_rotary_pos_emb_thd reads lengths so
    assert params.max_seqlen_q == params.max_seqlen_kv == 2
    import inspect

    from megatron.core.transformer.attention import Attention

    # the installed Megatron's attention hands RoPE the padded bounds when they are set (0.12.1 and 0.16.1)
    assert "cu_seqlens_q = packed_seq_params.cu_seqlens_q_padded" in inspect.getsource(Attention.forward)
    # a trailing padding segment and unequal lengths: every end once, in order
    assert npu_actual_seq_len(torch.tensor([0, 7, 8, 20, 23], dtype=torch.int32)).tolist() == [7, 8, 20, 23]
    for bad in (torch.tensor([7, 8]), torch.tensor([0]), torch.zeros(2, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            npu_actual_seq_len(bad)

    from mcore_rl.batch import MicroBatch

    mb = MicroBatch(torch.zeros(1, 10, dtype=torch.long), seq_lengths=lengths)
    mask, extra = model_inputs(mb, Platform("npu").packed_attention)
    assert mask is None and extra["packed_seq_params"].cu_seqlens_q.tolist() == [2, 4, 6, 8, 10]
    # what reaches the op, by MindSpeed release: the ends (not Megatron's [0, ...]) either way
    for hand_off in (mindspeed_2_2_hand_off, mindspeed_26_hand_off):
        assert hand_off(extra["packed_seq_params"]) == [2, 4, 6, 8, 10], hand_off.__name__
    _, cuda = model_inputs(mb, "thd")  # CUDA with TE: Megatron's own convention, no padded copies
    assert cuda["packed_seq_params"].cu_seqlens_q.tolist() == [0, 2, 4, 6, 8, 10]
    assert cuda["packed_seq_params"].cu_seqlens_q_padded is None


def test_cuda_without_te_builds_the_segment_path(tiny_model_dir):
    """Platform("cuda") here (no TE): the bridge's spec has SegmentDotProductAttention in every layer, and a packed
    row gives each sequence's own logits through the segment bounds and through THD params alike, where Megatron's
    DotProductAttention refuses the params (tests/workers/packed_spec.py)."""
    (got,) = run_worker(
        REPO / "tests" / "workers" / "packed_spec.py", 1, torchrun=False, model_dir=tiny_model_dir
    ).results
    assert got["cuda_te"] is False and got["cuda_mode"] == "segments"
    assert got["cuda_spec"] and set(got["cuda_spec"]) == {"SegmentDotProductAttention"}, got["cuda_spec"]
    assert got["built"] == "SegmentDotProductAttention"
    assert "Packed sequence is not supported by DotProductAttention" in got["megatron_refuses"]
    for mode, diff in got["max_diff"].items():
        assert diff <= 1e-4 * got["scale"], (mode, diff, got["scale"])


def test_device_modules_are_used_only_in_the_platform_package():
    """`torch.cuda` / `torch.npu` (and torch_npu) appear in mcore_rl/platform/ only: device specifics have one home."""
    import ast

    found = []
    for path in sorted((REPO / "mcore_rl").rglob("*.py")):
        if path.relative_to(REPO / "mcore_rl").parts[0] == "platform":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("cuda", "npu")
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} torch.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                found += [
                    f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n and n.startswith("torch_npu")
                ]
    assert not found, f"device modules outside mcore_rl/platform/: {found}"


def test_memory_helpers_are_no_ops_or_plain_memory_on_cpu():
    p = get_platform("cpu")
    buf = p.host_buffer(16)
    assert buf.dtype == torch.uint8 and buf.numel() == 16 and not buf.is_pinned()
    p.synchronize()
    p.empty_cache()
    p.reset_peak_memory_stats()
