"""Step data: pad_rollouts (padding, label alignment) and split_for_rank (mini-batches x DP x micro-batches)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_rl.algos import GlobalCounts
from mcore_rl.batch import (
    MicroBatch,
    RolloutSample,
    forward_groups,
    merge_packed,
    pad_rollouts,
    partition_by_tokens,
    segment_rows,
    split_for_rank,
    unpack_rows,
)

PAD = 0


def sample(prompt, response, routes=False):
    n = len(prompt) + len(response)
    return RolloutSample(
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=-torch.arange(1, len(response) + 1, dtype=torch.float32) / 10,
        finish_reason="stop",
        routed_experts=torch.arange(n * 2 * 2, dtype=torch.int16).view(n, 2, 2) % 8 if routes else None,
    )


def test_pad_rollouts_aligns_labels_and_pads_to_the_multiple():
    samples = [sample([5, 6, 7], [8, 9]), sample([5], [4, 3, 2, 1]), sample([9, 9], [7])]
    rewards = torch.tensor([1.0, 0.0, 0.5])
    adv = torch.tensor([0.7, -0.7, 0.1])
    batch = pad_rollouts(samples, rewards, adv, PAD, multiple=4)
    assert batch.tokens.shape == (3, 8)  # longest 5 tokens -> multiple of 4
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        assert batch.tokens[i, : len(ids)].tolist() == ids
        assert (batch.tokens[i, len(ids) :] == PAD).all()
        p, r = len(s.prompt_ids), len(s.response_ids)
        # column t is the prediction of tokens[t + 1]: exactly the response tokens are marked
        marked = batch.loss_mask[i].nonzero().squeeze(-1).tolist()
        assert [batch.tokens[i, t + 1].item() for t in marked] == s.response_ids
        assert marked == list(range(p - 1, p + r - 1))
        assert torch.equal(batch.rollout_log_prob[i, marked], s.logprobs)
        assert (batch.advantages[i, marked] == adv[i]).all() and batch.advantages[i].count_nonzero() == r
    assert batch.response_lengths.tolist() == [2, 4, 1] and batch.prompt_lengths.tolist() == [3, 1, 2]
    assert batch.routed_experts is None  # an engine without routes


def samples_of(lengths, routes=False):
    g = torch.Generator().manual_seed(0)
    out = []
    for p, r in lengths:
        ids = torch.randint(3, 100, (p + r,), generator=g).tolist()
        out.append(sample(ids[:p], ids[p:], routes))
    return out


def test_split_for_rank_covers_the_batch_once_with_global_counts():
    lengths = [(3, 2), (2, 5), (4, 1), (1, 3), (2, 2), (3, 4), (5, 1), (2, 6)]
    samples = samples_of(lengths)
    batch = pad_rollouts(samples, torch.zeros(8), torch.arange(8.0), PAD, multiple=2)
    seen = []
    for dp_rank in range(2):
        minis = split_for_rank(batch, num_mini_batches=2, dp_size=2, dp_rank=dp_rank, micro_batch_size=1, max_len=8)
        assert len(minis) == 2
        for m, mini in enumerate(minis):
            whole = batch.loss_mask[m * 4 : (m + 1) * 4]
            assert mini.counts == GlobalCounts.from_mask(whole, max_len=8)  # the whole mini-batch, not this rank's
            assert len(mini.micro_batches) == 2
            for mb in mini.micro_batches:
                assert isinstance(mb, MicroBatch) and mb.tokens.shape == (1, batch.tokens.shape[1])
                assert mb.old_log_prob is None and mb.ref_log_prob is None and mb.routed_experts is None
                row = next(i for i in range(8) if torch.equal(batch.tokens[i], mb.tokens[0]))
                assert torch.equal(mb.loss_mask[0], batch.loss_mask[row])
                assert torch.equal(mb.advantages[0], batch.advantages[row])
                assert torch.equal(mb.rollout_log_prob[0], batch.rollout_log_prob[row])
                seen.append((m, dp_rank, row))
    rows = sorted(r for _, _, r in seen)
    assert rows == list(range(8)), "every sequence must land on exactly one rank"
    # mini-batch m holds rows [4m, 4m + 4); DP rank d holds the d-th half of it
    assert all(4 * m + 2 * d <= r < 4 * m + 2 * d + 2 for m, d, r in seen)


def test_split_for_rank_packs_engine_routes_for_r3():
    samples = samples_of([(3, 2), (2, 3)], routes=True)
    batch = pad_rollouts(samples, torch.zeros(2), torch.zeros(2), PAD, multiple=4)
    (mini,) = split_for_rank(batch, 1, 1, 0, micro_batch_size=2, route_experts=8)
    (mb,) = mini.micro_batches
    assert mb.routed_experts.shape == (2, 8, 2, 2) and mb.route_valid.shape == (2, 8)
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert torch.equal(mb.routed_experts[i, :n], s.routed_experts)
        assert mb.route_valid[i].tolist() == [True] * n + [False] * (8 - n)
    no_routes = pad_rollouts(samples_of([(3, 2), (2, 3)]), torch.zeros(2), torch.zeros(2), PAD)
    with pytest.raises(ValueError, match="routing_replay=r3 needs the experts"):
        split_for_rank(no_routes, 1, 1, 0, 2, route_experts=8)


def test_split_for_rank_rejects_uneven_splits_with_the_fix():
    batch = pad_rollouts(samples_of([(2, 2)] * 6), torch.zeros(6), torch.zeros(6), PAD)
    # the pre-flight's rule and message (preflight.layout.check_step_split), with the fix
    with pytest.raises(ValueError, match=r"6 samples .* must split evenly over dp 4 x algo.mini_batches 1 = 4: make"):
        split_for_rank(batch, num_mini_batches=1, dp_size=4, dp_rank=0, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"micro_batch_size = 4: use a micro_batch_size in \[1, 3\]"):
        split_for_rank(batch, num_mini_batches=1, dp_size=2, dp_rank=0, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"6 samples .* must split evenly over algo.mini_batches 4 = 4"):
        split_for_rank(batch, num_mini_batches=4, dp_size=2, dp_rank=0, max_tokens=64)


def test_micro_batch_to_keeps_every_field():
    mb = MicroBatch(torch.ones(1, 4, dtype=torch.long), loss_mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    mb.replay_routes = "routes"
    moved = mb.to("cpu")
    assert torch.equal(moved.loss_mask, mb.loss_mask) and moved.replay_routes == "routes"
    assert moved.position_ids.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match=r"lacks \['old_log_prob'\]"):
        mb.require("loss_mask", "old_log_prob")


def test_trainer_imports_nothing_from_megatron():
    """The RL loop talks to Megatron only through the Actor: no megatron.* import, and from our
    Megatron-facing package only the Actor class."""
    tree = ast.parse(Path(__file__).resolve().parents[1].joinpath("mcore_rl/trainer.py").read_text())
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules += [(node.module or "", a.name) for a in node.names]
    assert not [m for m, _ in modules if m == "megatron" or m.startswith("megatron.")], modules
    ours = [(m, n) for m, n in modules if m.startswith("mcore_rl.megatron")]
    assert ours == [("mcore_rl.megatron.actor", "Actor")], ours


def test_importing_the_trainer_loads_no_megatron():
    """`trainer.run` quiets Megatron's import-time warnings before the actor (and with it Megatron) is imported, so
    importing the trainer module itself loads no Megatron, mbridge or vLLM."""
    code = "import sys, mcore_rl.trainer; print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'mbridge', 'vllm'}))"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- token-budget partition and packing ------------------------------------------------------


def seed_like_lengths(n, max_len, seed):
    """Long-tailed lengths with a few at the maximum (the shape of RL response lengths)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.distributions.Exponential(4.0 / max_len).sample((n,)) + 1).clamp(max=max_len).long()
    lengths[torch.randperm(n, generator=g)[: max(1, n // 16)]] = max_len
    return lengths.tolist()


@pytest.mark.parametrize("dp, budget, multiple", [(1, 64, 1), (2, 64, 2), (4, 100, 4), (3, 64, 8)])
def test_partition_respects_the_budget_and_balances_dp(dp, budget, multiple):
    torch.manual_seed(0)
    lengths = seed_like_lengths(61, 64, seed=dp)
    parts = partition_by_tokens(lengths, dp, budget, multiple)
    assert len(parts) == dp
    assert len({len(rank) for rank in parts}) == 1, "micro-batch count must be equal on every DP rank"
    flat = sorted(i for rank in parts for mb in rank for i in mb)
    assert flat == list(range(len(lengths))), "every sequence exactly once"
    for rank in parts:
        for mb in rank:
            assert mb == sorted(mb)
            assert -(-sum(lengths[i] for i in mb) // multiple) * multiple <= budget
    shares = [sum(lengths[i] for mb in rank for i in mb) for rank in parts]
    assert max(shares) - min(shares) <= max(lengths), f"DP shares unbalanced by tokens: {shares}"
    # no more micro-batches than needed by more than one: the count is near the lower bound
    lower = max(-(-s // budget) for s in shares)
    assert len(parts[0]) <= lower + 1, (len(parts[0]), lower)


def test_partition_gives_empty_micro_batches_to_ranks_with_fewer_sequences():
    # rank 0 gets the one long sequence, rank 1 the short ones: counts equalised with an empty micro-batch
    parts = partition_by_tokens([60, 10, 10, 10, 10, 10, 10], 2, max_tokens=64)
    assert [len(r) for r in parts] == [1, 1] or [len(r) for r in parts] == [2, 2]
    parts = partition_by_tokens([60, 60, 60, 5], 2, max_tokens=64)
    assert [len(r) for r in parts] == [2, 2]
    assert sorted(len(mb) for r in parts for mb in r) == [1, 1, 1, 1]
    parts = partition_by_tokens([60, 60, 60], 2, max_tokens=64)
    assert [len(r) for r in parts] == [2, 2] and [] in parts[0] + parts[1]


def test_partition_rejects_a_sequence_longer_than_the_budget_naming_both():
    with pytest.raises(
        ValueError, match=r"sequence of 70 tokens \(padded to 72\) exceeds actor.max_tokens_per_micro_batch = 64"
    ):
        partition_by_tokens([10, 70, 3], 2, max_tokens=64, multiple=8)
    with pytest.raises(ValueError, match=r"padded to 72\) exceeds .* = 70"):
        partition_by_tokens([70], 1, max_tokens=70, multiple=8)


def test_packed_split_equals_the_padded_rows_segment_by_segment():
    lengths = [(3, 1), (2, 9), (4, 1), (1, 3), (2, 2), (3, 4), (5, 1), (2, 6)]
    samples = samples_of(lengths, routes=True)
    batch = pad_rollouts(samples, torch.zeros(8), torch.arange(8.0), PAD, multiple=4)
    seen = []
    for dp_rank in range(2):
        minis = split_for_rank(batch, 2, 2, dp_rank, max_tokens=12, multiple=4, max_len=9, route_experts=8)
        padded = split_for_rank(batch, 2, 2, dp_rank, micro_batch_size=1, max_len=9)
        for m, (mini, ref) in enumerate(zip(minis, padded)):
            assert mini.counts == ref.counts == GlobalCounts.from_mask(batch.loss_mask[4 * m : 4 * m + 4], max_len=9)
            for mb in mini.micro_batches:
                assert mb.packed and mb.tokens.shape[0] == 1 and mb.tokens.shape[1] % 4 == 0
                assert mb.tokens.shape[1] <= 12 and sum(mb.seq_lengths) == mb.tokens.shape[1]
                start = 0
                for n in mb.seq_lengths:
                    seg = slice(start, start + n)
                    assert mb.position_ids[0, seg].tolist() == list(range(n))
                    row = [
                        i
                        for i in range(4 * m, 4 * m + 4)
                        if sum(lengths[i]) == n and torch.equal(batch.tokens[i, :n], mb.tokens[0, seg])
                    ]
                    if not row:  # the trailing padding segment
                        assert start + n == mb.tokens.shape[1] and n <= 4  # tail pad, or a filler micro-batch
                        assert (mb.tokens[0, seg] == PAD).all() and not mb.loss_mask[0, seg].any()
                        assert not mb.route_valid[0, seg].any()
                        assert (mb.routed_experts[0, seg, :, 0] != mb.routed_experts[0, seg, :, 1]).all()
                    else:
                        i = row[0]
                        for name in ("loss_mask", "advantages", "rollout_log_prob"):
                            assert torch.equal(getattr(mb, name)[0, seg], getattr(batch, name)[i, :n]), name
                        assert torch.equal(mb.routed_experts[0, seg], samples[i].routed_experts)
                        assert mb.route_valid[0, seg].all()
                        seen.append(i)
                    start += n
    assert sorted(seen) == list(range(8))


def test_segment_rows_and_unpack_rows_undo_packing():
    mb = MicroBatch(torch.arange(8).view(1, 8), seq_lengths=[3, 1, 4])
    values = torch.arange(8.0).view(1, 8).requires_grad_()
    rows = segment_rows(values, mb.seq_lengths)
    assert rows.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    rows.sum().backward()
    assert values.grad.tolist() == [[1.0] * 8]
    assert [p.tolist() for p in unpack_rows(values.detach(), mb)] == [[[0, 1, 2]], [[3]], [[4, 5, 6, 7]]]
    stacked = segment_rows(torch.stack([values.detach(), -values.detach()]), mb.seq_lengths)
    assert stacked.shape == (2, 3, 4) and stacked[1, 2].tolist() == [-4, -5, -6, -7]
    with pytest.raises(ValueError, match="sum\\(seq_lengths\\)"):
        MicroBatch(torch.zeros(1, 8, dtype=torch.long), seq_lengths=[3, 4])


def test_forward_groups_merge_consecutive_micro_batches_under_the_budget():
    mbs = [MicroBatch(torch.arange(n).view(1, n), seq_lengths=[n - 1, 1]) for n in (4, 8, 4, 4, 12)]
    assert forward_groups(mbs, 12) == [[0, 1], [2, 3], [4]]
    assert forward_groups(mbs, 100) == [[0, 1, 2, 3, 4]]
    merged = merge_packed(mbs[:2], multiple=4)
    assert merged.seq_lengths == [3, 1, 7, 1] and merged.tokens.tolist() == [[0, 1, 2, 3] + list(range(8))]
    assert merged.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 0]]
    filler = merge_packed([], multiple=4)
    assert filler.seq_lengths == [4] and filler.tokens.shape == (1, 4)
