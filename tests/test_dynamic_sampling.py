"""DAPO dynamic sampling (mcore_rl.dynamic_sampling) and overlong filtering, in one process.

- which groups carry signal: the same rule as the advantages (a group without signal has advantage 0 everywhere)
- rounds until enough groups, drawn from the one sampler (its position after the extra rounds is what a
  checkpoint saves); the round cap: the warning path (train on the groups there are, cut to the layout) and the
  error path
- the kept groups of several rounds give every simulated rank of a world exactly the micro-batches the
  whole-batch path gives for the kept samples alone (per-rank step data, equal micro-batch counts, R3 routes)
- the update (the trainer's loss function, `make_policy_loss_fn`, and its gradients) of a batch with known
  all-equal groups equals the update of the same batch without them; without dynamic sampling it does not
- overlong filtering: truncated samples leave the loss and its counts, not their group's advantages
The resume after steps with extra rounds runs for real in tests/test_trainer_e2e.py.
"""

import dataclasses

import pytest
import torch

from mcore_rl.algos import group_advantages
from mcore_rl.batch import RolloutSample, pad_rollouts, plan_mini_batches, split_for_rank
from mcore_rl.config import ConfigError, load_config
from mcore_rl.data import EpochSampler
from mcore_rl.dynamic_sampling import (
    CAP_WARN_EVERY,
    CapWarnings,
    MergedRollout,
    collect,
    feasible_groups,
    flat_outcomes,
    group_signal,
    overlong_filtered,
    single_round,
)
from mcore_rl.preflight.run import split_unit
from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout
from mcore_rl.safety import TrainingHalted
from mcore_rl.step_data import (
    assemble,
    collect_needed,
    decode_receives,
    encode_sends,
    local_meta,
    local_mini_batches,
    meta_from_tensors,
    needs_by_rank,
    plan_exchange,
)
from tests.test_step_data import assert_same_micro_batches

VOCAB, HIDDEN, PAD, N = 32, 8, 0, 4
LAYERS, TOP_K, EXPERTS = 2, 2, 4


def make_groups(prompts: int, seed: int, routes: bool = False) -> list[list[RolloutSample]]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(prompts):
        p = int(torch.randint(2, 6, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        group = []
        for _ in range(N):
            r = int(torch.randint(1, 6, (1,), generator=g))
            route = torch.randint(0, EXPERTS, (p + r, LAYERS, TOP_K), generator=g).to(torch.int16) if routes else None
            response = torch.randint(1, VOCAB, (r,), generator=g).tolist()
            group.append(
                RolloutSample(prompt, response, -torch.rand(r, generator=g), "length" if r == 5 else "stop", route)
            )
        groups.append(group)
    return groups


def one_rank_round(groups, rewards, valid=None):
    """A round in a world of one: the LocalRollout and its metadata (the exchange of one rank)."""
    valid = [True] * len(rewards) if valid is None else valid
    local = LocalRollout(ReplicaLayout(0, 1, 1), len(groups), N, groups)
    return local, meta_from_tensors(*local_meta(local, rewards, valid))


def test_signal_is_the_advantage_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rewards = torch.randint(0, 3, (6 * N,), generator=g).float()
        valid = torch.rand(6 * N, generator=g) > 0.2
        adv = group_advantages(rewards, N, valid=valid).view(-1, N)
        assert group_signal(rewards, valid, N).tolist() == (adv != 0).any(dim=1).tolist()
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4 + [0, 1, 1, 1] + [1.0, 9.0, 0.0, 0.0])
    valid = torch.tensor([True] * 16 + [True, False, True, True])
    assert group_signal(rewards, valid, N).tolist() == [False, False, False, True, True]
    assert flat_outcomes(rewards, valid, N) == (1, 1)  # group 0 all-correct, 1 all-wrong, 2 (all 0.5) neither
    # group 4 with only its two 0.0 rewards valid: all-wrong
    valid = torch.tensor([True] * 16 + [False, False, True, True])
    assert flat_outcomes(rewards, valid, N) == (1, 2)


def test_feasible_groups_and_split_unit():
    assert split_unit(2, 4, 2) == 16 and split_unit(2, 4, None) == 2
    assert feasible_groups(7, 4, 16) == 4 and feasible_groups(3, 4, 16) == 0 and feasible_groups(5, 4, 2) == 5
    assert feasible_groups(3, 3, 2) == 2


def rounds_from_sampler(sampler, all_groups, reward_of):
    """generate(round): the sampler's next prompts, their groups and rewards (reward_of(prompt, j))."""
    drawn = []

    def generate(round_index):
        prompts = sampler.next_batch()
        drawn.append(prompts)
        rewards = [reward_of(p, j) for p in prompts for j in range(N)]
        return one_rank_round([all_groups[p] for p in prompts], rewards)

    return generate, drawn


def signal_reward(p, j):
    """Prompts divisible by 3 have signal (j % 2), the others are flat (1.0 for even prompts, else 0.0)."""
    if p % 3 == 0:
        return float(j % 2)
    return 1.0 if p % 2 == 0 else 0.0


def test_rounds_until_enough_groups_and_the_sampler_position():
    all_groups = make_groups(30, seed=1)
    sampler = EpochSampler(30, 4, seed=5)
    generate, drawn = rounds_from_sampler(sampler, all_groups, signal_reward)
    sel = collect(generate, want=4, n=N, max_rounds=10, unit=1, at_cap="train", step=1)
    signal_prompts = [p for batch in drawn for p in batch if p % 3 == 0]
    assert len(signal_prompts) >= 4
    # it stopped at the first round that completed the step
    assert len([p for batch in drawn[:-1] for p in batch if p % 3 == 0]) < 4
    assert sel.rounds == len(drawn) and sel.kept == 4 and sel.short is None
    assert sel.dropped == 4 * len(drawn) - 4
    assert isinstance(sel.local, MergedRollout) and sel.meta.size == 4 * N
    # the first four signal groups in round and group order, samples and rewards intact
    for k, p in enumerate(signal_prompts[:4]):
        for j in range(N):
            assert sel.local.sample(k * N + j) is all_groups[p][j]
            assert float(sel.meta.rewards[k * N + j]) == float(j % 2)
    correct = sum(1 for b in drawn for p in b if p % 3 and p % 2 == 0)
    wrong = sum(1 for b in drawn for p in b if p % 3 and p % 2)
    assert sel.flat == (correct, wrong)
    m = sel.metrics(N, dynamic=True)
    assert m["groups/rounds"] == len(drawn) and m["groups/all_correct"] == correct / (4 * len(drawn))
    # the sampler moved by every round's prompts: a checkpoint saves this position, a resume continues from it
    state = sampler.state_dict()
    fresh = EpochSampler(30, 4, seed=5)
    for _ in drawn:
        fresh.next_batch()
    assert fresh.state_dict() == state
    resumed = EpochSampler(30, 4, seed=5)
    resumed.load_state_dict(state)
    assert resumed.next_batch() == sampler.next_batch()


def test_a_full_first_round_is_the_round_itself():
    groups = make_groups(4, seed=2)
    local, meta = one_rank_round(groups, [float(j % 2) for _ in range(4) for j in range(N)])
    sel = collect(lambda r: (local, meta), want=4, n=N, max_rounds=3, unit=1, at_cap="error", step=1)
    assert sel.local is local and sel.meta is meta and sel.rounds == 1 and sel.dropped == 0
    plain = single_round(local, meta, N)
    assert plain.local is local and plain.kept == 4 and "groups/kept" not in plain.metrics(N, dynamic=False)


def test_round_cap_warns_and_trains_on_what_the_layout_splits():
    all_groups = make_groups(40, seed=3)
    # 3 signal groups in 2 rounds of 4 prompts: prompts 0, 3, 6 among the first 8 (no shuffling)
    sampler = EpochSampler(40, 4, seed=1, shuffle=False)
    generate, drawn = rounds_from_sampler(sampler, all_groups, signal_reward)
    sel = collect(generate, want=4, n=N, max_rounds=2, unit=1, at_cap="train", step=7)
    assert sel.rounds == 2 and sel.kept == 3 and sel.meta.size == 3 * N and sel.dropped == 5
    assert "step 7: 3 of data.prompts_per_step = 4 groups" in sel.short and "training on 3 of them" in sel.short
    # a layout that splits 8 samples at a time (2 groups of 4) trains on 2
    sampler = EpochSampler(40, 4, seed=1, shuffle=False)
    generate, _ = rounds_from_sampler(sampler, all_groups, signal_reward)
    sel = collect(generate, want=4, n=N, max_rounds=2, unit=8, at_cap="train", step=7)
    assert sel.kept == 2 and sel.meta.size == 2 * N and "(the layout splits 8 samples at a time)" in sel.short
    # none the layout can split: the first round as generated (what training without dynamic sampling does)
    sampler = EpochSampler(40, 4, seed=1, shuffle=False)
    generate, _ = rounds_from_sampler(sampler, all_groups, signal_reward)
    sel = collect(generate, want=4, n=N, max_rounds=2, unit=16, at_cap="train", step=7)
    assert isinstance(sel.local, LocalRollout) and sel.meta.size == 4 * N and sel.rounds == 2
    assert sel.kept == 2 and "training on the first round as generated" in sel.short


def test_round_cap_warns_first_then_every_fifty_steps_with_a_count():
    warnings = CapWarnings()
    lines = {step: warnings.line(None if step % 2 else "short", step) for step in range(1, 2 * CAP_WARN_EVERY + 5)}
    shown = {step: line for step, line in lines.items() if line is not None}
    # every even step ends at the cap: the first one is said plainly, then one line per CAP_WARN_EVERY steps
    assert shown == {
        2: "short",
        2 + CAP_WARN_EVERY: f"short ({CAP_WARN_EVERY // 2 + 1} steps at the cap so far)",
        2 + 2 * CAP_WARN_EVERY: f"short ({CAP_WARN_EVERY + 1} steps at the cap so far)",
    }


def test_round_cap_error():
    all_groups = make_groups(40, seed=3)
    sampler = EpochSampler(40, 4, seed=1, shuffle=False)
    generate, _ = rounds_from_sampler(sampler, all_groups, signal_reward)
    with pytest.raises(
        TrainingHalted,
        match="step 2: 3 of data.prompts_per_step = 4 groups with reward signal "
        "after algo.dynamic_sampling_max_rounds = 2 generation rounds; raise algo.dynamic",
    ):
        collect(generate, want=4, n=N, max_rounds=2, unit=1, at_cap="error", step=2)


def test_config_keys():
    cfg = load_config(None, ["algo.dynamic_sampling=true", "algo.dynamic_sampling_max_rounds=3"])
    assert cfg.algo.dynamic_sampling and cfg.algo.dynamic_sampling_at_cap == "train"
    assert not load_config(None).algo.dynamic_sampling and not load_config(None).algo.overlong_filtering
    with pytest.raises(ConfigError, match="algo.dynamic_sampling_max_rounds = 0 must be >= 1"):
        load_config(None, ["algo.dynamic_sampling_max_rounds=0"])
    with pytest.raises(ConfigError, match="algo.dynamic_sampling_at_cap = 'stop' is not one of: train, error"):
        load_config(None, ["algo.dynamic_sampling_at_cap=stop"])


# ---- several rounds, several ranks --------------------------------------------------------------------


def world_rounds(rounds_groups, rounds_rewards, world, engine_tp):
    """Per round: every rank's LocalRollout and the summed metadata (the all-reduce replayed by hand)."""
    out = []
    for groups, rewards in zip(rounds_groups, rounds_rewards):
        locals_ = []
        for rank in range(world):
            replicas = ReplicaLayout(rank, world, engine_tp)
            locals_.append(LocalRollout(replicas, len(groups), N, [groups[i] for i in replicas.share(len(groups))]))
        parts = [local_meta(lr, [rewards[i] for i in lr.scored], [True] * len(lr.scored)) for lr in locals_]
        out.append((locals_, meta_from_tensors(sum(p[0] for p in parts), sum(p[1] for p in parts))))
    return out


@pytest.mark.parametrize(
    "world, engine_tp, dp_of_rank, routes, split",
    [
        (2, 1, [0, 1], False, dict(max_tokens=24, multiple=4)),  # the demo's EP2 x DP2, packed
        (4, 2, [0, 1, 0, 1], True, dict(micro_batch_size=2, num_mini_batches=2, multiple=4)),  # vLLM TP2, R3
    ],
    ids=["dp2-packed", "tp2-engine-r3-fixed"],
)
def test_kept_groups_of_several_rounds_on_every_rank(world, engine_tp, dp_of_rank, routes, split):
    rounds_groups = [make_groups(4, seed=10 + r, routes=routes) for r in range(3)]
    # signal: round 0 groups 1, 3; round 1 none; round 2 groups 0, 2, 3 (one more than needed)
    signal = [{1, 3}, set(), {0, 2, 3}]
    rounds_rewards = [[float(j % 2) if g in signal[r] else 1.0 for g in range(4) for j in range(N)] for r in range(3)]
    rounds = world_rounds(rounds_groups, rounds_rewards, world, engine_tp)
    split = {"num_mini_batches": 1, **split, "max_len": 5}
    dp = max(dp_of_rank) + 1
    unit = split_unit(split["num_mini_batches"], dp, split.get("micro_batch_size"))
    sels = [
        collect(lambda r, rank=rank: (rounds[r][0][rank], rounds[r][1]), 4, N, 3, unit, "train", 1)
        for rank in range(world)
    ]
    kept = [(0, 1), (0, 3), (2, 0), (2, 2)]
    assert all(s.local.picks == kept and s.rounds == 3 and s.dropped == 8 for s in sels)
    meta = sels[0].meta
    assert all(torch.equal(s.meta.rewards, meta.rewards) for s in sels)  # the same decision on every rank
    advantages = group_advantages(meta.rewards, N, valid=meta.valid)
    plans = plan_mini_batches(meta.lengths, meta.loss_tokens, dp_size=dp, **split)
    needs = needs_by_rank(plans, dp_of_rank)
    xplans = [plan_exchange(r, needs, sels[r].local.holder_ranks) for r in range(world)]
    sends = [encode_sends(sels[r].local, meta, xplans[r], world) for r in range(world)]
    chunks = [list(buf.split(sizes)) for buf, sizes in sends]
    # reference: the kept samples alone, packed whole and split
    flat = [s for r, g in kept for s in rounds_groups[r][g]]
    rewards = torch.tensor([rounds_rewards[r][g * N + j] for r, g in kept for j in range(N)])
    whole = pad_rollouts(flat, rewards, group_advantages(rewards, N), PAD, 4)
    counts = set()
    for r in range(world):
        recv = torch.cat([chunks[src][r] for src in range(world)])
        samples = collect_needed(sels[r].local, xplans[r], decode_receives(recv, meta, xplans[r], world))
        got = assemble(
            samples, xplans[r].needed, meta, plans, advantages, dp_of_rank[r], PAD, 4, EXPERTS if routes else None
        )
        want = split_for_rank(
            whole,
            split["num_mini_batches"],
            dp,
            dp_of_rank[r],
            split.get("micro_batch_size"),
            max_len=5,
            route_experts=EXPERTS if routes else None,
            max_tokens=split.get("max_tokens"),
            multiple=4,
        )
        assert_same_micro_batches(got, want)
        counts.add(tuple(len(m.micro_batches) for m in got))
    assert len(counts) == 1  # equal micro-batch counts over data-parallel ranks


# ---- the update --------------------------------------------------------------------------------------


def update_of(local, meta, algo, seed=0):
    """The loss and gradients of one mini-batch by the trainer's loss function on a toy model (embedding ->
    output head), from the micro-batches the trainer's step-data path builds (one rank)."""
    from mcore_rl.megatron.logprobs import OutputHead
    from mcore_rl.megatron.policy_loss import make_policy_loss_fn

    advantages = group_advantages(meta.rewards, N, valid=meta.valid)
    plans = plan_mini_batches(meta.lengths, meta.loss_tokens, 1, 1, max_tokens=64, multiple=4, max_len=5)
    (mini,) = local_mini_batches(local, meta, plans, advantages, [0], PAD, 4)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64).requires_grad_()
    loss_fn = make_policy_loss_fn(algo, mini.counts, tp_group=None, on_policy=True)
    total = 0.0
    for mb in mini.micro_batches:
        loss, _ = loss_fn(OutputHead(embed[mb.tokens], weight), mb)
        total = total + loss
    total.backward()
    return float(total.detach()), embed.grad, weight.grad


@pytest.mark.parametrize("agg_mode", ["seq-mean-token-mean", "token-mean"])
def test_all_equal_groups_do_not_change_the_update(agg_mode):
    from mcore_rl.config import AlgoConfig

    algo = AlgoConfig(loss="gspo", agg_mode=agg_mode, clip_low=3e-4, clip_high=4e-4)
    groups = make_groups(6, seed=4)
    with_signal = [0, 2, 5]
    rewards = [float(j % 2 == g % 2) if g in with_signal else float(g % 2) for g in range(6) for j in range(N)]
    # the batch with its all-equal groups (1, 3: all 1.0, 4: all 0.0), through dynamic sampling
    local, meta = one_rank_round(groups, rewards)
    sel = collect(lambda r: (local, meta), want=3, n=N, max_rounds=1, unit=1, at_cap="train", step=1)
    assert sel.kept == 3 and sel.meta.size == 3 * N
    # the same batch without them
    alone = one_rank_round(
        [groups[g] for g in with_signal], [rewards[g * N + j] for g in with_signal for j in range(N)]
    )
    got, want = update_of(sel.local, sel.meta, algo), update_of(*alone, algo)
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert want[2].abs().sum() > 0
    # without dynamic sampling the flat groups dilute the update: the check can fail
    plain = update_of(local, meta, algo)
    assert not torch.allclose(plain[2], want[2])


def test_overlong_filtering_masks_truncated_samples_out_of_the_loss():
    groups = make_groups(3, seed=6)
    rewards = [float(j % 2) for _ in range(3) for j in range(N)]
    local, meta = one_rank_round(groups, rewards)
    truncated = meta.truncated
    assert 0 < int(truncated.sum()) < meta.size
    advantages = group_advantages(meta.rewards, N, valid=meta.valid)  # before filtering: truncated count
    filtered = overlong_filtered(meta, 1, 5)
    assert filtered.loss_tokens == [0 if t else n for t, n in zip(truncated.tolist(), meta.loss_tokens)]
    plans = plan_mini_batches(filtered.lengths, filtered.loss_tokens, 1, 1, micro_batch_size=meta.size, max_len=5)
    (mini,) = local_mini_batches(local, filtered, plans, advantages, [0], PAD, 4)
    (mb,) = mini.micro_batches
    assert mini.counts.num_seqs == int((~truncated).sum())
    assert mini.counts.num_tokens == int(meta.response_lengths[~truncated].sum())
    rows = mb.loss_mask.sum(-1)
    assert torch.equal(rows == 0, truncated) and torch.equal(
        rows[~truncated], meta.response_lengths[~truncated].float()
    )
    # the advantages of the kept samples are those of the full groups
    for i in (~truncated).nonzero().flatten().tolist():
        p = int(meta.prompt_lengths[i])
        assert float(mb.advantages[i, p - 1]) == float(advantages[i])
    assert dataclasses.replace(filtered, valid=meta.valid).loss_tokens == meta.loss_tokens


def test_overlong_filtering_of_a_step_without_any_finished_sample_stops():
    groups = [[dataclasses.replace(s, finish_reason="length") for s in g] for g in make_groups(2, seed=7)]
    _, meta = one_rank_round(groups, [float(j % 2) for _ in range(2) for j in range(N)])
    with pytest.raises(TrainingHalted, match="step 3: every sample was cut by rollout.max_new_tokens = 5 and "):
        overlong_filtered(meta, 3, 5)
