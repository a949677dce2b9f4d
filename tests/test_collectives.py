"""The small-collectives rule: one module, device matches the backend, never float64.

The multi-process half (2 ranks over gloo: exact two-float sums, maxima, agreement, refusals on a live
group) runs inside the existing torchrun job of tests/workers/loss_logprobs_tp.py (test_logprobs.py).
"""

import ast
from pathlib import Path

import pytest
import torch

from mcore_rl.platform import Platform, collectives
from mcore_rl.platform.collectives import CollectiveRuleError, backend_device_types, check_tensor

PACKAGE = Path(__file__).resolve().parents[1] / "mcore_rl"

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
}

# (file under mcore_rl/, enclosing function, collective) -> why it is not a small collective.
ALLOWED = {
    ("platform/collectives.py", "all_reduce_small", "all_reduce"): "the small-collectives module itself",
    ("platform/collectives.py", "sum_floats", "all_gather_into_tensor"): "the small-collectives module itself",
    ("platform/collectives.py", "from_rank0", "broadcast_object_list"): "the small-collectives module itself: "
    "rank 0's outcome of a write only it does (a failure message or None)",
    ("platform/collectives.py", "first_given", "all_gather_object"): "the small-collectives module itself: the "
    "lowest rank's outcome of work every rank does its share of (the split plots' failure message or None)",
    ("compat/torch.py", "reduce_scatter_padded", "all_reduce"): "torch < 2.8 gloo shim of Megatron's list "
    "reduce_scatter (uneven TP splits of MoE tokens): one padded all_reduce of the activation tensors",
    ("platform/shm_gather.py", "grow", "barrier"): "shared-memory gather: fence after creating files, no tensor",
    ("platform/shm_gather.py", "grow", "barrier#2"): "shared-memory gather: fence after mapping files, no tensor",
    ("platform/shm_gather.py", "_round", "all_gather_into_tensor"): "shared-memory gather: per-round "
    "digests of what each rank wrote (gloo-only path: the transport exists only on gloo groups)",
    ("platform/shm_gather.py", "_round", "barrier"): "shared-memory gather: round fence, no tensor",
    ("platform/shm_gather.py", "_collective_gather", "all_gather"): "export gather: full weight shards "
    "(the torch.distributed fallback of the shared-memory gather)",
    ("platform/shm_gather.py", "_shared_segments", "all_gather_object"): "object gather: host ids at set-up",
    ("platform/shm_gather.py", "_shared_segments", "all_gather_object#2"): "object gather: shared-memory "
    "probe votes at set-up",
    ("rollout/data_parallel.py", "generate_global", "all_gather_object"): "object gather: rollout samples "
    "(every sample to every rank; the trainer moves step data with mcore_rl.step_data instead)",
    ("weight_sync/verify.py", "_worst_tensors", "all_gather_object"): "object gather: names of the worst "
    "tensors for an error message",
    ("weight_sync/verify.py", "shared_probe", "broadcast_object_list"): "object broadcast: rank 0's few rollout "
    "sequences, the probe every rank scores after the next sync",
    ("rollout/vllm_engine.py", "_gather", "all_gather_object"): "object gather: generations of the TP ranks",
    ("separate.py", "_fingerprints", "all_gather_object"): "object gather: every rollout replica's weight "
    "fingerprints (one small tensor per weight), compared on the rollout leader after a verified sync",
    ("megatron/logprobs.py", "_all_reduce", "all_reduce"): "vocabulary-parallel log-prob reductions "
    "(max / sums of [tokens] tensors in the compute dtype on the device)",
    ("megatron/actor.py", "_from_last_stage", "broadcast_object_list"): "pipeline broadcast of results",
    ("megatron/context_parallel.py", "unshard", "all_gather"): "context parallel: forward-only outputs "
    "([tokens] per CP rank) back into whole sequences",
    ("megatron/context_parallel.py", "forward", "all_reduce"): "context parallel: per-sequence partial sums "
    "(GSPO's sequence ratio, lengths) over the CP group, differentiable",
    ("megatron/context_parallel.py", "backward", "all_reduce"): "context parallel: the backward of those sums",
    ("models/segment_attention.py", "forward", "all_gather"): "context parallel attention: K / V of every CP rank",
    ("models/segment_attention.py", "backward", "all_reduce"): "context parallel attention: the K / V gradients "
    "of every CP rank's queries",
    ("megatron/routing_replay.py", "_all_moe_layers", "all_gather_object"): "object gather: MoE layer ids",
    ("megatron/checkpoint.py", "save_checkpoint", "barrier"): "checkpoint fence, no tensor",
    ("megatron/checkpoint.py", "save_checkpoint", "barrier#2"): "checkpoint fence, no tensor",
    ("weight_sync/exporter.py", "export", "all_gather_object"): "object gather: per-stage tensor metadata",
    ("separate.py", "begin_step", "broadcast_object_list"): "object broadcast: the step's samples actor rank 0 "
    "received over the bridge, to every actor rank (each runs the same rounds)",
    ("separate.py", "validation_reward", "broadcast_object_list"): "object broadcast: the validation reward actor "
    "rank 0 received over the bridge",
    ("separate.py", "round", "all_gather_object"): "object gather: every rollout rank's groups and rewards of a "
    "round, for the samples message over the bridge",
    ("trainer.py", "_end_process_group", "barrier"): "fence before destroying the process group at the run's end "
    "(the separate placement's roles end together), no tensor",
    ("weight_sync/exporter.py", "export", "broadcast"): "pipeline broadcast of exported weights",
    ("weight_sync/direct_write.py", "_group_sinks", "all_gather_object"): "object gather: the receiving engines' "
    "shared-memory region handles, once per export and gather group",
    ("convert.py", "convert", "barrier"): "end-of-conversion fence, no tensor",
    (
        "run_dir/checkpoints.py",
        "gather",
        "all_gather_object",
    ): "object gather: each rank's checkpoint verification outcome",
    ("safety.py", "check_weights_finite", "all_gather_object"): "object gather: names of non-finite weights "
    "(only after a rank found one)",
    ("step_data.py", "exchange_meta", "all_reduce"): "step metadata: [B, 6] int64 per-sample lengths and "
    "flags (more than a small collective's elements for large steps), CPU on the default group",
    ("step_data.py", "exchange_meta", "all_reduce#2"): "step metadata: [B] float32 rewards",
    ("step_data.py", "exchange_samples", "all_to_all_single"): "step data: sample tokens / log-probs / routes "
    "to the ranks that train on them (bytes, CPU on the default group)",
    ("step_data.py", "first_reward_error", "all_gather_object"): "object gather: the first reward error "
    "message (only when the error rate stops the run)",
}


def _is_dist(node: ast.AST) -> bool:
    """`dist` / `torch.distributed` (the names the package uses for torch.distributed)."""
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def direct_collective_calls(root: Path = PACKAGE) -> dict[tuple[str, str, str], int]:
    """(file, enclosing function, collective[#n]) -> line, for every torch.distributed collective call."""
    found: dict[tuple[str, str, str], int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, func: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
                if (
                    isinstance(child, ast.Call)
                    and isinstance(child.func, ast.Attribute)
                    and child.func.attr in COLLECTIVES
                    and _is_dist(child.func.value)
                ):
                    key, n = (rel, func, child.func.attr), 1
                    while key in found:
                        n += 1
                        key = (rel, func, f"{child.func.attr}#{n}")
                    found[key] = child.lineno
                visit(child, name, rel)

        visit(tree, "<module>")
    return found


def test_no_collective_outside_the_module_and_the_allow_list():
    found = direct_collective_calls()
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unexpected, (
        "direct torch.distributed collectives outside mcore_rl/platform/collectives.py: "
        + ", ".join(f"{f}:{line} {fn}() {op}" for (f, fn, op), line in unexpected.items())
        + " - use collectives.sum_ints / sum_floats / max_floats / all_agree, or add a large-tensor / object "
        "collective to ALLOWED with its reason"
    )
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allow-list entries that no longer match a call (remove them): {stale}"


def test_the_scan_sees_a_planted_collective(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.distributed as dist\n"
        "def f(x):\n    dist.all_reduce(x)\n    torch.distributed.broadcast(x, 0)\n"
        "def g(x):\n    x.all_reduce()\n"  # not torch.distributed: ignored
    )
    assert set(direct_collective_calls(tmp_path)) == {("m.py", "f", "all_reduce"), ("m.py", "f", "broadcast")}


@pytest.mark.parametrize(
    "backend, kinds",
    [
        ("gloo", {"cpu"}),
        ("nccl", {"cuda"}),
        ("hccl", {"npu"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
        ("cpu:gloo,npu:hccl", {"cpu", "npu"}),
    ],
)
def test_backend_device_types(backend, kinds):
    assert backend_device_types(backend) == kinds


def test_platform_backends_serve_cpu_and_the_device():
    for name, device in (("cpu", "cpu"), ("cuda", "cuda"), ("npu", "npu")):
        assert backend_device_types(Platform(name).dist_backend) == {"cpu", device}


def test_float64_is_refused_before_any_collective():
    with pytest.raises(CollectiveRuleError, match="float64.*MindSpeed"):
        check_tensor(torch.zeros(3, dtype=torch.float64))


def test_large_tensor_is_refused():
    with pytest.raises(CollectiveRuleError, match="not a small collective"):
        check_tensor(torch.zeros(collectives.MAX_SMALL_NUMEL + 1))


def test_without_process_group_results_are_local():
    assert collectives.group_device() == torch.device("cpu")
    assert collectives.sum_ints([3, 4]) == [3, 4]
    assert collectives.max_floats([0.1]) == [pytest.approx(0.1, rel=1e-7)]
    assert collectives.max_floats([0.1])[0] >= 0.1  # rounded up to float32, never down
    big = 2**40 + 0.123456
    assert collectives.sum_floats([big]) == [pytest.approx(big, rel=1e-14)]
    assert collectives.all_agree([1, 2])
