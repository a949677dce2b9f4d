"""The context-parallel split (mcore_rl/megatron/context_parallel.py), in one process: which tokens each CP rank
holds, their targets, positions and the per-sequence attention layout. The CP passes themselves (attention over
gathered K / V, the reductions) run in real processes in tests/test_layout_invariance.py."""

import pytest
import torch

from mcore_rl.batch import MicroBatch
from mcore_rl.megatron.context_parallel import attention_index, plan_shard, shard


def packed(lengths: list[int]) -> MicroBatch:
    tokens = torch.arange(3, 3 + sum(lengths)).unsqueeze(0)
    mask = torch.zeros_like(tokens, dtype=torch.float32)
    start = 0
    for n in lengths:
        mask[0, start + 1 : start + n - 1] = 1.0  # a response inside each segment, never its last position
        start += n
    return MicroBatch(tokens=tokens, loss_mask=mask, advantages=mask * 2.0, seq_lengths=lengths)


@pytest.mark.parametrize("cp, tp", [(2, 1), (2, 2), (3, 1)])
def test_every_token_on_exactly_one_rank_with_its_target(cp, tp):
    mb = packed([5, 11, 8, 1])
    plans = [plan_shard(mb, cp, r, local_multiple=tp) for r in range(cp)]
    held = torch.cat([p.index[p.rank] for p in plans])
    assert sorted(held[held >= 0].tolist()) == list(range(mb.tokens.shape[1]))  # each real token once
    targets = mb.targets()[0]
    for plan in plans:
        local = shard(mb, plan)
        assert local.tokens.shape[1] == plan.local_tokens and plan.local_tokens % tp == 0
        assert all(n % (2 * cp) == 0 for n in plan.padded)
        inside = plan.index[plan.rank] >= 0
        rows = plan.index[plan.rank][inside]
        # targets are taken before the split: a chunk's last token keeps the next chunk's first token as target
        assert torch.equal(local.labels[0, inside], targets[rows])
        assert torch.equal(local.loss_mask[0, inside], mb.loss_mask[0, rows])
        assert float(local.loss_mask[0, ~inside].abs().sum()) == 0.0  # inserted padding is outside the loss
        assert local.seq_lengths == plan.local_lengths and sum(local.seq_lengths) == plan.local_tokens


def test_load_balanced_chunks_r_and_2cp_minus_1_minus_r():
    mb = MicroBatch(tokens=torch.arange(2 * 16).view(2, 16))  # two padded rows of 16: two sequences
    plan = plan_shard(mb, 2, 0)
    assert plan.padded == [16, 16]
    assert plan.index[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31]
    assert plan.index[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23, 24, 25, 26, 27]
    assert plan.positions[1].tolist()[:8] == [4, 5, 6, 7, 8, 9, 10, 11]


def test_attention_index_names_each_sequences_keys_in_order():
    """Gathered K / V are rank 0's tokens then rank 1's; key j of sequence i must be its position j."""
    mb = packed([6, 10])
    cp = 2
    plans = [plan_shard(mb, cp, r) for r in range(cp)]
    gathered_positions = torch.cat([p.positions[p.rank] for p in plans])
    gathered_segments = torch.cat(
        [torch.repeat_interleave(torch.arange(len(p.padded)), torch.tensor(p.local_lengths)) for p in plans]
    )
    for plan in plans:
        index = attention_index(plan)
        for i, length in enumerate(plan.padded):
            keys = index.key[i, :length]
            assert gathered_positions[keys].tolist() == list(range(length))
            assert bool((gathered_segments[keys] == i).all())
            queries = index.query[i, index.query_valid[i]]
            assert torch.equal(plan.positions[plan.rank][queries], index.query_pos[i, index.query_valid[i]])
