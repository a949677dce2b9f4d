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


def multitoken_rows(seed: int, max_new_tokens: int = 14) -> MicroBatch:
    """A packed row as the multi-token preset makes it (pad_rollouts + pack_sequences at CP2's multiple 4): odd and
    even prompt lengths, responses of 3-14 tokens, the first sequence's cut at max_new_tokens."""
    from mcore_rl.batch import RolloutSample, pack_sequences, pad_rollouts

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(int(torch.randint(2, 6, (1,), generator=g))):
        prompt = int(torch.randint(15, 24, (1,), generator=g))
        response = max_new_tokens if i == 0 else int(torch.randint(3, max_new_tokens + 1, (1,), generator=g))
        ids = torch.randint(3, 100, (prompt + response,), generator=g).tolist()
        reason = "length" if response == max_new_tokens else "stop"
        samples.append(RolloutSample(ids[:prompt], ids[prompt:], torch.zeros(response), reason))
    batch = pad_rollouts(samples, torch.zeros(len(samples)), torch.ones(len(samples)), pad_id=0)
    return pack_sequences(batch, multiple=4)


def test_a_rank_whose_row_ends_inside_a_response_keeps_that_tokens_target():
    """CP rank 1 of 2 holds chunks 1 and 2 of 4 of each sequence: with no padding segment after the last sequence
    its local row ends at 3/4 of that sequence, inside a response (the multi-token preset's step 2, issue 34). The
    local row's last position then has a next token (taken before the split), and is in the loss."""
    # prompts 17 and 15 tokens, responses 6 and 14 (the budget): 23 + 29 = 52 tokens, a multiple of 4, no padding
    # segment; sequence 2 is padded to 32, rank 1 holds its positions 8-15 and 16-23, its response's targets 14-27
    g = torch.Generator().manual_seed(0)
    lengths, prompts = [23, 29], [17, 15]
    tokens = torch.randint(3, 100, (1, 52), generator=g)
    mask = torch.zeros(1, 52)
    start = 0
    for n, p in zip(lengths, prompts):
        mask[0, start + p - 1 : start + n - 1] = 1.0
        start += n
    mb = MicroBatch(tokens=tokens, loss_mask=mask, advantages=mask, seq_lengths=lengths)
    local = shard(mb, plan_shard(mb, 2, 1))
    assert float(local.loss_mask[0, -1]) == 1.0  # the case: the local row's last position is a response token's
    assert int(local.labels[0, -1]) == int(tokens[0, 23 + 23 + 1])  # sequence 2's position 23 predicts 24


@pytest.mark.parametrize("seed", range(40))
def test_multitoken_rows_split_over_two_and_three_ranks(seed):
    """Every loss token of a multi-token packed row on exactly one CP rank, with its target and mask."""
    mb = multitoken_rows(seed)
    for cp in (2, 3):
        plans = [plan_shard(mb, cp, r) for r in range(cp)]
        held = torch.cat([p.index[p.rank] for p in plans])
        assert sorted(held[held >= 0].tolist()) == list(range(mb.tokens.shape[1]))
        for plan in plans:
            local = shard(mb, plan)
            inside = plan.index[plan.rank] >= 0
            rows = plan.index[plan.rank][inside]
            assert torch.equal(local.labels[0, inside], mb.targets()[0, rows])
            assert torch.equal(local.loss_mask[0, inside], mb.loss_mask[0, rows])


def test_the_layout_jobs_batch_has_a_cp_rank_ending_inside_a_response():
    """tests/test_layout_invariance.py's CP jobs reach the case above in both paths: padded (rows 4-7, the second
    micro-batch of every CP layout there) and packed (the token-budget split at CP2's multiple 4: CP2 x EP2, CP2 x
    PP2)."""
    from mcore_rl.batch import RolloutBatch, split_for_rank
    from tests.workers.loss_layouts import BUDGET, global_batch

    tokens, mask, _, _ = global_batch()

    def ends_in_response(mb: MicroBatch, local_multiple: int) -> bool:
        last = plan_shard(mb, 2, 1, local_multiple).index[1][-1]
        return bool(last >= 0 and mb.loss_mask.view(-1)[last] > 0)

    assert ends_in_response(MicroBatch(tokens[4:], loss_mask=mask[4:]), 1)
    prompts = (mask.argmax(-1) + 1).long()
    batch = RolloutBatch(tokens, mask, mask, mask, torch.zeros(len(mask)), mask.sum(-1).long(), prompts)
    (mini,) = split_for_rank(batch, 1, 1, 0, max_tokens=BUDGET, multiple=4)
    assert any(ends_in_response(mb, 1) for mb in mini.micro_batches)
