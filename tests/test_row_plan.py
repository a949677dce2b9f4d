"""Row plans (mcore_rl/weight_sync/row_plan.py): writing every TP shard's rows through the plan gives exactly the
conversion of the merged tensor, for the conversions the exporter meets; other conversions get no plan.

The conversions below are written out in plain torch as references (the mbridge ones run in the TP2 export
job, tests/workers/shm_export_check.py, against the checkpoint's own tensors)."""

import pytest
import torch

from mcore_rl.weight_sync.row_plan import build_row_plan


def padded_vocab(vocab: int):
    return lambda merged: [merged[:vocab]]


def fused_qkv(groups: int, q_per_group: int, head_dim: int):
    """Megatron's fused QKV: per query group [q heads..., k, v] rows -> q_proj, k_proj, v_proj."""

    def convert(merged):
        per_group = merged.reshape(groups, (q_per_group + 2) * head_dim, *merged.shape[1:])
        q_rows = q_per_group * head_dim
        q = per_group[:, :q_rows].reshape(-1, *merged.shape[1:])
        k = per_group[:, q_rows : q_rows + head_dim].reshape(-1, *merged.shape[1:])
        v = per_group[:, q_rows + head_dim :].reshape(-1, *merged.shape[1:])
        return [q, k, v]

    return convert


def gated_fc1(merged):
    gate, up = merged.chunk(2)
    return [gate, up]


def chunk_rows(rows: int, tp: int) -> list[torch.Tensor]:
    return list(torch.arange(rows).chunk(tp))


def gated_rows(rows: int, tp: int) -> list[torch.Tensor]:
    """The gated fc1's TP split: rank r holds [gate_r; up_r]."""
    halves = torch.arange(rows).view(2, tp, rows // (2 * tp))
    return [halves[:, r].reshape(-1) for r in range(tp)]


def apply_plan(plan, merged: torch.Tensor, shard_rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """What receivers end with: each rank's shard written block by block into the outputs (NaN elsewhere)."""
    outputs = [torch.full(shape, float("nan"), dtype=merged.dtype) for shape in plan.shapes]
    for rank, rows in enumerate(shard_rows):
        shard = merged[rows].contiguous()
        for block in plan.blocks:
            dst = plan.destination(outputs, block, rank)
            if dst is not None:
                dst.copy_(plan.source(shard, block))
    return outputs


CASES = {
    # vocabulary 120 padded to 128 over TP2 / TP4 (rank 3 holds padding only at TP4 with vocabulary 90)
    "padded-vocab-tp2": (padded_vocab(120), (128, 8), chunk_rows(128, 2), 2),
    "padded-vocab-tp4": (padded_vocab(90), (128, 8), chunk_rows(128, 4), 2),
    "vocab-unpadded": (padded_vocab(128), (128, 8), chunk_rows(128, 2), 1),
    "qkv-tp2": (fused_qkv(4, 4, 8), (4 * 6 * 8, 16), chunk_rows(4 * 6 * 8, 2), 3),
    "qkv-tp4-one-group-each": (fused_qkv(4, 2, 8), (4 * 4 * 8, 16), chunk_rows(4 * 4 * 8, 4), 3),
    "qkv-bias": (fused_qkv(2, 3, 4), (2 * 5 * 4,), chunk_rows(2 * 5 * 4, 2), 3),
    "gated-fc1-tp2": (gated_fc1, (64, 8), gated_rows(64, 2), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_reproduces_the_conversion(case):
    convert, shape, shard_rows, max_blocks = CASES[case]
    plan = build_row_plan(convert, shape, shard_rows)
    assert plan is not None
    merged = torch.randn(shape, dtype=torch.float64)
    want = convert(merged)
    got = apply_plan(plan, merged, shard_rows)
    assert [tuple(w.shape) for w in want] == list(plan.shapes)
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # every output row written (no NaN left), each with its own shard row
    # the strided grouping keeps the item count small: one block per (output, rank pattern)
    assert len(plan.blocks) <= max_blocks, plan.blocks


def test_padding_rows_are_dropped_not_sent_anywhere():
    plan = build_row_plan(padded_vocab(90), (128, 4), chunk_rows(128, 4))
    kept = sum(b.count * b.length for b in plan.blocks for d in b.dsts if d is not None)
    assert kept == 90
    assert any(b.dropped_anywhere for b in plan.blocks)


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: [m.t().contiguous()],  # not row-wise
        lambda m: [m * 2],  # arithmetic on values
        lambda m: [m, m[:4]],  # a row used twice
        lambda m: [m.float()],  # a dtype cast
    ],
    ids=["transpose", "scaled", "row-twice", "cast"],
)
def test_conversions_that_are_not_row_moves_get_no_plan(convert):
    assert build_row_plan(convert, (16, 16), chunk_rows(16, 2)) is None


def test_reversed_rows_still_plan_exactly():
    """Descending destinations cannot be one strided view; they become more blocks, still exact."""
    convert = lambda m: [m.flip(0)]  # noqa: E731
    plan = build_row_plan(convert, (8, 3), chunk_rows(8, 2))
    merged = torch.randn(8, 3, dtype=torch.float64)
    assert torch.equal(apply_plan(plan, merged, chunk_rows(8, 2))[0], merged.flip(0))


def test_shard_rows_must_partition_the_merged_rows():
    with pytest.raises(ValueError, match="partition"):
        build_row_plan(padded_vocab(8), (8, 2), [torch.arange(4), torch.arange(4)])
