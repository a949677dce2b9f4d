"""Context parallelism on NPU through MindSpeed, checked here without an NPU or MindSpeed (docs/context-parallel.md,
"On NPU"; never run on an NPU): the actor's split is the one MindSpeed's ring attention (megatron_cp_algo, packed
TND path) computes with, and the MindSpeed arguments the platform sets for cp > 1 keep inside MindSpeed's rules.
One process, no device."""

import pytest
import torch

from mcore_rl.batch import MicroBatch
from mcore_rl.megatron.context_parallel import packed_params, plan_shard
from mcore_rl.platform import (
    MINDSPEED_ARGS,
    MINDSPEED_CP_ALGO,
    Platform,
    context_parallel_config,
    mindspeed_args,
    mindspeed_args_to_set,
    mindspeed_cp_args,
)


def _global_positions(plan, rank: int) -> list[list[int]]:
    """Rank `rank`'s local part of each segment, as positions inside the segment (the plan's own record)."""
    out, start = [], 0
    for n in plan.local_lengths:
        out.append(plan.positions[rank, start : start + n].tolist())
        start += n
    return out


def _ring_visible(q_rank: int, kv_rank: int, n: int) -> torch.Tensor:
    """Which of rank kv_rank's local tokens (one segment of local length n) rank q_rank's local tokens attend to in
    MindSpeed's causal packed ring attention, restated from its block rule: the own block is causal in local order;
    a block from a lower rank is seen whole by every query, but only its first half (the KV index of each segment);
    a block from a higher rank is seen whole, but only by the second half of the queries (the Q index)."""
    half = n // 2
    if q_rank == kv_rank:
        return torch.ones(n, n, dtype=torch.bool).tril()
    seen = torch.zeros(n, n, dtype=torch.bool)
    if kv_rank < q_rank:
        seen[:, :half] = True
    else:
        seen[half:, :] = True
    return seen


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 4), (8, 2)])
def test_the_split_is_the_one_mindspeeds_ring_attention_computes_with(cp, tp):
    """MindSpeed reads a sequence's local bounds as cu_seqlens_q_padded // cp and halves each local sequence; its
    block rule must then be causal attention by position in the sequence, for every pair of CP ranks."""
    lengths = [5, 17, 8, 1, 30, 64]
    mb = MicroBatch(tokens=torch.arange(sum(lengths)).unsqueeze(0), seq_lengths=lengths)
    plans = [plan_shard(mb, cp, rank, local_multiple=tp) for rank in range(cp)]
    for plan in plans:
        params = packed_params(plan, None, "cpu")
        padded = params.cu_seqlens_q_padded
        assert params.qkv_format == "thd" and padded.tolist()[0] == 0  # Megatron's RoPE needs the leading 0
        local = (padded // cp).tolist()  # what the ring takes as the local sequence ends
        assert [b - a for a, b in zip(local[:-1], local[1:])] == plan.local_lengths
        assert local[-1] == plan.local_tokens and plan.local_tokens % tp == 0  # sequence parallel scatters the row
        assert all(n >= 2 and n % 2 == 0 for n in plan.local_lengths)  # halves: the ring's Q / KV index split
    positions = [_global_positions(plan, rank) for rank, plan in enumerate(plans)]
    for seg, n in enumerate(plans[0].local_lengths):
        for q_rank in range(cp):
            q = torch.tensor(positions[q_rank][seg])
            for kv_rank in range(cp):
                k = torch.tensor(positions[kv_rank][seg])
                causal = q[:, None] >= k[None, :]  # by position inside the sequence
                assert torch.equal(causal, _ring_visible(q_rank, kv_rank, n)), (cp, seg, q_rank, kv_rank)


def test_mindspeed_cp_arguments():
    """cp 1: only the fused-attention flag (as before CP); cp > 1: the ring algorithm, its causal (per-sequence)
    mask type, one ring (cp_window_size 1, inside MindSpeed's range [1, cp) for every cp >= 2), no overlap group."""
    assert mindspeed_args(1) == MINDSPEED_ARGS and mindspeed_cp_args(1) == {}
    for cp in (2, 4, 8):
        args = mindspeed_args(cp)
        assert args["context_parallel_size"] == cp and args["context_parallel_algo"] == MINDSPEED_CP_ALGO
        assert MINDSPEED_CP_ALGO == "megatron_cp_algo" and args["attention_mask_type"] == "causal"
        assert 1 <= args["cp_window_size"] < cp and cp % args["cp_window_size"] == 0
        assert args["use_flash_attn"] is True and args["use_cp_send_recv_overlap"] is False


def test_only_the_cp_arguments_that_differ_are_repatched():
    from types import SimpleNamespace

    defaults = SimpleNamespace(use_flash_attn=True, context_parallel_algo="megatron_cp_algo", cp_window_size=1)
    assert mindspeed_args_to_set(defaults, 1) == {}  # cp 1: nothing to redo after the first repatch
    todo = mindspeed_args_to_set(defaults, 2)
    assert todo == {"context_parallel_size": 2, "attention_mask_type": "causal", "use_cp_send_recv_overlap": False}
    assert mindspeed_args_to_set(SimpleNamespace(**mindspeed_args(2)), 2) == {}  # idempotent


def test_npu_cp_needs_no_transformer_config_fields():
    """MindSpeed copies its arguments onto every TransformerConfig; the config gets no cp_comm_type (TE's) on NPU."""
    assert context_parallel_config("npu", True, 4) == {} and Platform("npu").context_parallel_config(4) == {}


def test_the_groups_are_created_as_mindspeeds_cp_wrapper_takes_them():
    """MindSpeed's wrapper of initialize_model_parallel takes megatron-core 0.12.1's parameters and builds its rings
    for the default rank order: the actor's call passes only parameters the wrapper has, and no `order`."""
    import ast
    import inspect

    from mcore_rl.megatron import parallel
    from tests.contract.facts import MINDSPEED_CP_WRAPPER_PARAMS

    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(parallel)))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "initialize_model_parallel"
    ]
    assert len(calls) == 1 and not calls[0].args
    keywords = {k.arg for k in calls[0].keywords}
    assert "context_parallel_size" in keywords and "order" not in keywords
    assert keywords <= set(MINDSPEED_CP_WRAPPER_PARAMS), keywords - set(MINDSPEED_CP_WRAPPER_PARAMS)
    # the platform's CP arguments reach MindSpeed before those groups: init_parallel adapts with the layout's cp
    assert "platform.adapt_megatron(layout.cp)" in inspect.getsource(parallel.init_parallel)
