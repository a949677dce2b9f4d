"""Per-rank step data (mcore_rl.step_data), every rank of a world simulated in one process.

The collective glue (an all-reduce of the metadata, one all_to_all_single of bytes) is replayed here by
hand from the same pure pieces the trainer runs: each rank's metadata contribution, its send buffer and
split sizes, its decoding of what it receives. The reference is today's path: every rank holds every
sample, `pad_rollouts` + `split_for_rank` of the whole batch. The real collectives run in 2 processes
in tests/workers/loss_layouts.py (test_layout_invariance.py).
"""

import dataclasses

import pytest
import torch

from mcore_rl.algos import group_advantages
from mcore_rl.batch import RolloutSample, pad_rollouts, plan_mini_batches, split_for_rank
from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout, share
from mcore_rl.step_data import (
    assemble,
    collect_needed,
    decode_receives,
    decode_sample,
    encode_sample,
    encode_sends,
    local_meta,
    meta_from_tensors,
    needs_by_rank,
    plan_exchange,
    receive_sizes,
)

PAD = 0
LAYERS, TOP_K, EXPERTS = 3, 2, 8


def step_samples(prompts: int, n: int, seed: int, routes: bool) -> list[list[RolloutSample]]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(prompts):
        p = int(torch.randint(2, 9, (1,), generator=g))
        prompt = torch.randint(1, 50_000, (p,), generator=g).tolist()
        group = []
        for _ in range(n):
            r = int(torch.randint(1, 12, (1,), generator=g))
            route = torch.randint(0, EXPERTS, (p + r, LAYERS, TOP_K), generator=g).to(torch.int16) if routes else None
            group.append(
                RolloutSample(
                    prompt,
                    torch.randint(1, 150_000, (r,), generator=g).tolist(),
                    torch.randn(r, generator=g),
                    "length" if r == 11 else "stop",
                    route,
                )
            )
        groups.append(group)
    return groups


def simulate(groups, n, world, engine_tp, dp_of_rank, rewards, valid, **split):
    """Every rank's micro-batches by the per-rank path, and the bytes each sent."""
    locals_ = []
    for rank in range(world):
        replicas = ReplicaLayout(rank, world, engine_tp)
        mine = replicas.share(len(groups))
        locals_.append(LocalRollout(replicas, len(groups), n, [groups[i] for i in mine]))
    # the metadata all-reduce: each rank contributes the samples it scores
    parts = [local_meta(lr, [rewards[i] for i in lr.scored], [valid[i] for i in lr.scored]) for lr in locals_]
    meta = meta_from_tensors(sum(p[0] for p in parts), sum(p[1] for p in parts))
    advantages = group_advantages(meta.rewards, n, valid=meta.valid)
    plans = plan_mini_batches(meta.lengths, meta.loss_tokens, dp_size=max(dp_of_rank) + 1, **split)
    needs = needs_by_rank(plans, dp_of_rank)
    xplans = [plan_exchange(r, needs, locals_[r].holder_ranks) for r in range(world)]
    # the all_to_all_single: rank r's bytes for d follow its split sizes
    sends = [encode_sends(locals_[r], meta, xplans[r], world) for r in range(world)]
    chunks = [list(buf.split(sizes)) for buf, sizes in sends]
    out, sent = [], []
    for r in range(world):
        recv = torch.cat([chunks[src][r] for src in range(world)])
        assert [c.numel() for c in (chunks[src][r] for src in range(world))] == receive_sizes(meta, xplans[r], world)
        samples = collect_needed(locals_[r], xplans[r], decode_receives(recv, meta, xplans[r], world))
        route_experts = EXPERTS if meta.route_shape is not None else None
        out.append(assemble(samples, xplans[r].needed, meta, plans, advantages, dp_of_rank[r], PAD, 4, route_experts))
        sent.append(sum(sends[r][1]))
    return out, meta, advantages, xplans, sent


def assert_same_micro_batches(got, want):
    assert len(got) == len(want)
    for gm, wm in zip(got, want):
        assert gm.counts == wm.counts
        assert len(gm.micro_batches) == len(wm.micro_batches)
        for a, b in zip(gm.micro_batches, wm.micro_batches):
            for f in dataclasses.fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if torch.is_tensor(y):
                    assert x is not None and x.dtype == y.dtype and torch.equal(x, y), f.name
                else:
                    assert x == y, f.name


@pytest.mark.parametrize(
    "world, engine_tp, dp_of_rank, routes, split",
    [
        (2, 1, [0, 1], False, dict(max_tokens=40, multiple=4)),  # the demo: EP2 x DP2, packed
        (4, 1, [0, 0, 1, 1], True, dict(max_tokens=40, multiple=4)),  # TP2 x DP2: peers get the same data
        (
            4,
            2,
            [0, 1, 0, 1],
            True,
            dict(micro_batch_size=5, num_mini_batches=1, multiple=4),
        ),  # vLLM TP2 replicas, fixed
        (4, 2, [0, 0, 0, 0], False, dict(max_tokens=40, multiple=4)),  # DP1: everyone trains on everything
    ],
    ids=["ep2dp2-packed", "tp2dp2-r3", "vllm-tp2-fixed", "dp1"],
)
def test_each_rank_gets_exactly_its_share(world, engine_tp, dp_of_rank, routes, split):
    n, prompts = 4, 5  # 5 prompts over 2 or 4 replicas: uneven shares
    groups = step_samples(prompts, n, seed=world + engine_tp, routes=routes)
    flat = [s for g in groups for s in g]
    rewards = [float(i % 3) for i in range(len(flat))]
    valid = [i % 7 != 3 for i in range(len(flat))]  # failed rewards: no loss tokens, out of their group
    split = {"num_mini_batches": 2, **split, "max_len": 11}
    per_rank, meta, advantages, xplans, sent = simulate(
        groups, n, world, engine_tp, dp_of_rank, rewards, valid, **split
    )

    # reference: today's path, every rank holds every sample
    valid_t = torch.tensor(valid)
    want_adv = group_advantages(torch.tensor(rewards), n, valid=valid_t)
    assert torch.equal(advantages, want_adv)
    whole = pad_rollouts(flat, torch.tensor(rewards), want_adv, PAD, 4, valid=valid_t)
    for rank in range(world):
        want = split_for_rank(
            whole,
            split["num_mini_batches"],
            max(dp_of_rank) + 1,
            dp_of_rank[rank],
            split.get("micro_batch_size"),
            max_len=11,
            route_experts=EXPERTS if routes else None,
            max_tokens=split.get("max_tokens"),
            multiple=4,
        )
        assert_same_micro_batches(per_rank[rank], want)

    # only what a rank trains on reaches it, and nothing goes to a rank that already holds it
    for rank, plan in enumerate(xplans):
        received = [i for idx in plan.recvs.values() for i in idx]
        assert len(received) == len(set(received)) and set(received) <= set(plan.needed)
        held = range(0, 0)
        for q in range(world // engine_tp):
            if rank in range(q * engine_tp, (q + 1) * engine_tp):
                held = range(
                    share(prompts, q, world // engine_tp).start * n, share(prompts, q, world // engine_tp).stop * n
                )
        assert set(plan.needed) - set(held) == set(received)
    # each sample leaves its holders at most once per rank that trains on it and does not hold it
    assert sum(sent) == sum(meta.sample_nbytes(i) for plan in xplans for idx in plan.recvs.values() for i in idx)
    # every metadata value arrived
    assert meta.rewards.tolist() == rewards and meta.valid.tolist() == valid
    assert meta.truncated.tolist() == [s.finish_reason == "length" for s in flat]
    assert meta.route_shape == ((LAYERS, TOP_K) if routes else None)


def test_sample_bytes_round_trip():
    (group,) = step_samples(1, 1, seed=3, routes=True)
    sample = group[0]
    flat = [sample]
    ints, floats = local_meta(LocalRollout(ReplicaLayout(0, 1, 1), 1, 1, [flat]), [0.5], [True])
    meta = meta_from_tensors(ints, floats)
    data = encode_sample(sample, meta.route_shape)
    assert data.numel() == meta.sample_nbytes(0)
    back = decode_sample(data, meta, 0)
    assert back.prompt_ids == sample.prompt_ids and back.response_ids == sample.response_ids
    assert torch.equal(back.logprobs, sample.logprobs) and torch.equal(back.routed_experts, sample.routed_experts)
    assert back.finish_reason == sample.finish_reason


def test_each_sample_is_scored_by_exactly_one_rank():
    for world, tp, prompts in ((2, 1, 3), (4, 2, 5), (8, 4, 1), (4, 1, 2)):
        scored = []
        for rank in range(world):
            replicas = ReplicaLayout(rank, world, tp)
            mine = replicas.share(prompts)
            lr = LocalRollout(replicas, prompts, 3, [[None] * 3 for _ in mine])
            scored += list(lr.scored)
            for i in lr.held:
                assert rank in lr.holder_ranks(i)
        assert sorted(scored) == list(range(prompts * 3)), (world, tp, prompts)
