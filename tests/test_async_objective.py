"""The decoupled objective with per-token behaviour versions (docs/async-objective.md), in one process.

A batch whose samples span weight versions - some carry `RolloutSample.token_versions` (a sequence continued across
weight updates), the others have their step's version - goes the trainer's way: step metadata, per-rank step data
(`local_mini_batches`, packed micro-batches, each token's `version_lag`), the actor's loss function
(`make_policy_loss_fn`) on a toy model (embedding -> output head, float64). Its loss and gradients are compared with
the decoupled objective written here in plain torch from the samples themselves:

- every `algo.rollout_is` mode weights each token by its own proximal / behaviour ratio (token, icepop) or its
  sequence's product (sequence) or geometric mean (sequence_geomean: rejection outside the bounds, truncation at the
  cap, each branch hit by the batch);
- `algo.proximal=loglinear` (no proximal pass): log pi_prox = log pi_b + d / (d + 1) (log pi_theta - log pi_b) with d
  each token's lag behind the update's starting weights.
Also: token versions survive the step-data wire and the bridge's plain form, and the config refuses loglinear where
every token is on-policy.
"""

import pytest
import torch

from mcore_rl.algos import group_advantages
from mcore_rl.batch import RolloutSample, plan_mini_batches
from mcore_rl.config import AlgoConfig, ConfigError, load_config, validate_config
from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout
from mcore_rl.step_data import decode_sample, encode_sample, local_meta, local_mini_batches, meta_from_tensors

VOCAB, HIDDEN, PAD, N, PROMPTS = 32, 8, 0, 4, 3
PROXIMAL_VERSION, STEP_VERSION = 5, 4  # the update starts from weights 5; untagged samples came from weights 4
CLIP = dict(clip_low=0.2, clip_high=0.28)


def make_batch(seed: int = 0):
    """Groups of samples, their rewards and the toy model: embedding, the policy's output weight (theta) and the
    proximal policy's. Behaviour log-probs are the proximal ones moved by noise that grows with the token's lag, so
    every token has its own proximal / behaviour ratio; every other sample carries token versions 2..5."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    proximal = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    theta = proximal + 0.3 * torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    groups, k = [], 0
    for _ in range(PROMPTS):
        p = int(torch.randint(2, 6, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        group = []
        for _ in range(N):
            r = int(torch.randint(2, 7, (1,), generator=g))
            response = torch.randint(1, VOCAB, (r,), generator=g).tolist()
            versions = sorted(torch.randint(2, PROXIMAL_VERSION + 1, (r,), generator=g).tolist()) if k % 2 else None
            lag = torch.tensor([PROXIMAL_VERSION - v for v in versions or [STEP_VERSION] * r], dtype=torch.float64)
            prox_lp = plain_log_probs(embed, proximal, prompt, response)
            behaviour = (prox_lp + 0.25 * lag * torch.randn(r, generator=g, dtype=torch.float64)).float()
            group.append(RolloutSample(prompt, response, behaviour, "stop", None, versions))
            k += 1
        groups.append(group)
    rewards = torch.rand(PROMPTS * N, generator=g).round().tolist()
    return groups, rewards, embed, proximal, theta


def plain_log_probs(embed, weight, prompt, response) -> torch.Tensor:
    """log pi(response token j | prefix), straight from the logits."""
    p, targets = len(prompt), torch.tensor(response)
    logits = embed[torch.tensor(prompt + response)] @ weight.t()
    log_probs = torch.log_softmax(logits[p - 1 : p - 1 + len(response)], dim=-1)
    return log_probs.gather(-1, targets[:, None])[:, 0]


def reference(groups, rewards, embed, proximal, theta, algo: AlgoConfig):
    """The decoupled objective (GRPO clip, token-mean) in plain torch: (loss, d embed, d theta, branches hit)."""
    embed, theta = embed.clone().requires_grad_(), theta.clone().requires_grad_()
    samples = [s for group in groups for s in group]
    advantages = group_advantages(torch.tensor(rewards), N)
    total, tokens, branches = 0.0, sum(len(s.response_ids) for s in samples), set()
    for s, adv in zip(samples, advantages.double()):
        lp = plain_log_probs(embed, theta, s.prompt_ids, s.response_ids)
        behaviour = s.logprobs.double()
        lag = torch.tensor([PROXIMAL_VERSION - v for v in s.token_versions or [STEP_VERSION] * len(lp)]).double()
        if algo.proximal == "loglinear":
            prox = behaviour + lag / (lag + 1) * (lp.detach() - behaviour)
        else:
            prox = plain_log_probs(embed, proximal, s.prompt_ids, s.response_ids).detach()
        ratio = torch.exp(lp - prox)
        token_loss = -torch.min(ratio * adv, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * adv)
        log_w = prox - behaviour
        if algo.rollout_is == "token":
            w = torch.exp(log_w).clamp(max=algo.rollout_is_cap)
        elif algo.rollout_is == "icepop":
            w = torch.exp(log_w) * (
                (torch.exp(log_w) >= algo.rollout_is_low) & (torch.exp(log_w) <= algo.rollout_is_high)
            )
        elif algo.rollout_is == "sequence":
            w = torch.exp(log_w.sum()).clamp(max=algo.rollout_is_cap).expand_as(lp)
        else:  # sequence_geomean
            geo = float(torch.exp(log_w.mean()))
            branch = "rejected" if not algo.rollout_is_low <= geo <= algo.rollout_is_high else "truncated"
            branch = "kept" if branch == "truncated" and geo <= algo.rollout_is_cap else branch
            branches.add(branch)
            w = torch.full_like(lp, 0.0 if branch == "rejected" else min(geo, algo.rollout_is_cap))
        total = total + (w.detach() * token_loss).sum() / tokens
    total.backward()
    return float(total.detach()), embed.grad, theta.grad, branches


def trainer_path(groups, rewards, embed, proximal, theta, algo: AlgoConfig):
    """The same step the trainer's way: metadata, per-rank step data with each token's lag, the proximal pass (unless
    loglinear), the actor's loss function; (loss, d embed, d theta, the micro-batches)."""
    from mcore_rl.megatron.logprobs import OutputHead
    from mcore_rl.megatron.policy_loss import make_log_prob_fn, make_policy_loss_fn

    local = LocalRollout(ReplicaLayout(0, 1, 1), len(groups), N, groups)
    meta = meta_from_tensors(*local_meta(local, rewards, [True] * len(rewards)))
    advantages = group_advantages(meta.rewards, N)
    plans = plan_mini_batches(meta.lengths, meta.loss_tokens, 1, 1, max_tokens=24, multiple=4, max_len=6)
    versions = (PROXIMAL_VERSION, STEP_VERSION)
    (mini,) = local_mini_batches(local, meta, plans, advantages, [0], PAD, 4, versions=versions)
    embed, theta = embed.clone().requires_grad_(), theta.clone().requires_grad_()
    loss_fn = make_policy_loss_fn(algo, mini.counts, tp_group=None)
    total = 0.0
    for mb in mini.micro_batches:
        if algo.proximal == "recompute":
            mb.old_log_prob = make_log_prob_fn(1.0, None)(OutputHead(embed[mb.tokens].detach(), proximal), mb)
        loss, _ = loss_fn(OutputHead(embed[mb.tokens], theta), mb)
        total = total + loss
    total.backward()
    return float(total.detach()), embed.grad, theta.grad, mini.micro_batches


def assert_same(got, want):
    """Loss within 1e-6 relative, every gradient within 1e-5 x its largest entry (the loss function takes the
    behaviour and proximal log-probs in float32)."""
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0]), (got[0], want[0])
    for a, b in zip(got[1:3], want[1:3]):
        assert float(b.abs().max()) > 0 and float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize(
    "mode, bounds",
    [
        ("token", dict(rollout_is_cap=1.2)),
        ("icepop", dict(rollout_is_low=0.8, rollout_is_high=1.25)),
        ("sequence", dict(rollout_is_cap=1.5)),
        ("sequence_geomean", dict(rollout_is_low=0.9, rollout_is_high=1.3, rollout_is_cap=1.05)),
    ],
)
def test_is_weight_uses_each_tokens_own_behaviour_log_prob(mode, bounds):
    batch = make_batch()
    algo = AlgoConfig(loss="grpo", agg_mode="token-mean", rollout_is=mode, **bounds, **CLIP)
    want = reference(*batch, algo)
    got = trainer_path(*batch, algo)
    assert_same(got, want)
    if mode == "sequence_geomean":  # rejected, truncated at the cap and kept as is: every branch in this batch
        assert want[3] == {"rejected", "truncated", "kept"}, want[3]


def test_version_lag_reaches_every_token():
    groups, rewards, *model = make_batch()
    algo = AlgoConfig(loss="grpo", agg_mode="token-mean", rollout_is="token", **CLIP)
    *_, micro_batches = trainer_path(groups, rewards, *model, algo)
    samples = [s for g in groups for s in g]
    seen = 0
    for mb in micro_batches:
        start = 0
        for row, n in zip(mb.source_rows, mb.seq_lengths):
            s = samples[row]
            p, r = len(s.prompt_ids), len(s.response_ids)
            want = [PROXIMAL_VERSION - v for v in s.token_versions or [STEP_VERSION] * r]
            assert mb.version_lag[0, start + p - 1 : start + p - 1 + r].tolist() == want
            assert float(mb.version_lag[0, start : start + n].sum()) == sum(want)  # nothing on prompts
            start, seen = start + n, seen + 1
    assert seen == len(samples)


@pytest.mark.parametrize("mode", ["token", "sequence_geomean"])
def test_loglinear_proximal_matches_the_formula(mode):
    batch = make_batch(seed=1)
    algo = AlgoConfig(loss="grpo", agg_mode="token-mean", rollout_is=mode, proximal="loglinear", **CLIP)
    want = reference(*batch, algo)
    got = trainer_path(*batch, algo)
    assert_same(got, want)
    # it is an approximation: the recomputed proximal policy gives another step
    recomputed = reference(*batch, AlgoConfig(loss="grpo", agg_mode="token-mean", rollout_is=mode, **CLIP))
    assert not torch.allclose(recomputed[2], want[2], rtol=1e-3)


def test_loglinear_needs_the_lag():
    from mcore_rl.algos import GlobalCounts
    from mcore_rl.batch import MicroBatch
    from mcore_rl.megatron.logprobs import OutputHead
    from mcore_rl.megatron.policy_loss import make_policy_loss_fn

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    mb = MicroBatch(torch.tensor([[1, 2, 3, 4]]), loss_mask=mask, advantages=mask, rollout_log_prob=-mask)
    algo = AlgoConfig(loss="grpo", rollout_is="token", proximal="loglinear")
    loss_fn = make_policy_loss_fn(algo, GlobalCounts.from_mask(mask), tp_group=None)
    with pytest.raises(ValueError, match="version_lag"):
        loss_fn(OutputHead(torch.randn(1, 4, HIDDEN), torch.randn(VOCAB, HIDDEN)), mb)


def test_token_versions_cross_the_wire_and_the_bridge():
    from mcore_rl.separate import _plain, _restored

    routes = torch.randint(0, 4, (7, 2, 2), dtype=torch.int16)
    tagged = RolloutSample(
        [5, 6, 7], [8, 9, 10, 11], torch.tensor([-0.5, -1.0, -2.0, -0.25]), "stop", routes, [3, 3, 4, 5]
    )
    plain = RolloutSample([5, 6], [8, 9], torch.tensor([-0.5, -1.0]), "length", torch.zeros(4, 2, 2, dtype=torch.int16))
    local = LocalRollout(ReplicaLayout(0, 1, 1), 2, 1, [[tagged], [plain]])
    meta = meta_from_tensors(*local_meta(local, [1.0, 0.0], [True, True]))
    assert meta.versioned.tolist() == [True, False] and meta.route_shape == (2, 2)
    for i, s in enumerate((tagged, plain)):
        data = encode_sample(s, meta.route_shape)
        assert data.numel() == meta.sample_nbytes(i)
        back = decode_sample(data, meta, i)
        assert back.token_versions == s.token_versions and torch.equal(back.routed_experts, s.routed_experts)
        assert back.response_ids == s.response_ids and torch.equal(back.logprobs, s.logprobs)
    assert _restored(_plain(tagged)).token_versions == [3, 3, 4, 5]
    with pytest.raises(ValueError, match="one per token"):
        RolloutSample([5], [8, 9], torch.tensor([-0.5, -1.0]), "stop", None, [3])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.proximal=loglinear"], "set algo.proximal=recompute, or rollout.placement=separate"),
        (
            ["algo.proximal=loglinear", "rollout.placement=separate", "rollout.max_staleness=0"],
            "rollout.max_staleness=0 every token is on-policy",
        ),
        (
            ["algo.proximal=loglinear", "rollout.placement=separate", "algo.routing_replay=r2"],
            "set algo.routing_replay=r3",
        ),
        (
            ["algo.rollout_is=sequence_geomean", "algo.rollout_is_high=0.9"],
            "needs rollout_is_low < 1 < rollout_is_high",
        ),
    ],
)
def test_config_refuses_loglinear_on_policy(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_config_accepts_loglinear_off_policy():
    base = ["algo.loss=grpo", "algo.proximal=loglinear", "rollout.placement=separate"]
    assert validate_config(load_config(None, [*base, "algo.rollout_is=token"])) == []
    (warning,) = validate_config(load_config(None, base, validate=False))
    assert "without algo.rollout_is" in warning
    from mcore_rl.preflight.check import _old_log_probs  # what `mcore-rl check` prints

    assert "interpolated by each token's version lag" in _old_log_probs(load_config(None, base, validate=False), True)
