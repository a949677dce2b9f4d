"""mcore_rl.algos against independent references written from the formulas with per-sequence,
per-token Python loops (values and gradients w.r.t. log_prob), including edge cases."""

import math
import statistics
from dataclasses import replace

import pytest
import torch

from mcore_rl.algos import GlobalCounts, LossInputs, aggregate, group_advantages, kl_estimate, policy_loss
from mcore_rl.config import AlgoConfig

CLAMP = 20.0


# ---------------------------------------------------------------- references (loops, scalars)
def ref_advantages(rewards, g, estimator, eps=1e-6):
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        if g == 1 or max(grp) == min(grp):
            out += [0.0] * g
            continue
        mean = statistics.fmean(grp)
        std = statistics.stdev(grp)
        out += [(x - mean) / (std + eps) if estimator == "grpo" else x - mean for x in grp]
    return out


def ref_aggregate(values, mask, mode, n_tok, n_seq, max_len):
    """values: list of lists of scalar tensors (valid tokens only)."""
    total = 0.0
    for row, m in zip(values, mask):
        valid = [v for v, mm in zip(row, m) if mm]
        if not valid:
            continue
        s = sum(valid)
        if mode == "token-mean":
            total = total + s / n_tok
        elif mode == "seq-mean-token-mean":
            total = total + s / len(valid) / n_seq
        elif mode == "seq-mean-token-sum":
            total = total + s / n_seq
        else:
            total = total + s / max_len / n_seq
    return total


def clampf(x):
    return max(min(x, CLAMP), -CLAMP)


def ppo_scalar(r, a, cfg):
    """max(-A r, -A clip(r)) (ties -> unclipped branch), then dual clip min(., -cA) for A < 0."""
    clipped = -a * torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    unclipped = -a * r
    loss = unclipped if unclipped >= clipped else clipped
    if cfg.dual_clip is not None and a < 0 and loss > -cfg.dual_clip * a:
        loss = -cfg.dual_clip * a + 0 * r
    return loss


def ref_policy_loss(lp, old, adv, mask, cfg, counts, rollout=None, ref=None, ent=None):
    B, T = lp.shape
    rows = []
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        n = len(valid)
        seq_d = sum((lp[i, t] - old[i, t]) for t in valid) / n if n else None
        seq_a = sum(float(adv[i, t]) for t in valid) / n if n else None
        row = []
        for t in range(T):
            if not mask[i, t]:
                row.append(0.0)
                continue
            a = float(adv[i, t])
            d = lp[i, t] - old[i, t]
            if cfg.loss == "grpo":
                l = ppo_scalar(torch.exp(torch.clamp(d, -CLAMP, CLAMP)), a, cfg)
            elif cfg.loss == "gspo":
                s = torch.exp(torch.clamp(seq_d, -CLAMP, CLAMP))
                l = ppo_scalar(s, seq_a, cfg)
            elif cfg.loss == "gspo_token":
                s_val = math.exp(clampf(float(seq_d.detach())))
                s = torch.exp(lp[i, t] - float(lp[i, t].detach())) * s_val
                l = ppo_scalar(s, a, cfg)
            else:
                r = torch.exp(torch.clamp(d, -CLAMP, CLAMP))
                tau = cfg.tau_pos if a > 0 else cfg.tau_neg
                l = -(4.0 / tau) * torch.sigmoid(tau * (r - 1)) * a
            if cfg.rollout_is == "token":
                l = l * min(math.exp(clampf(float(old[i, t] - rollout[i, t]))), cfg.rollout_is_cap)
            elif cfg.rollout_is == "sequence":
                ls = sum(float(old[i, u] - rollout[i, u]) for u in valid)
                l = l * min(math.exp(clampf(ls)), cfg.rollout_is_cap)
            elif cfg.rollout_is == "icepop":
                w = math.exp(clampf(float(old[i, t] - rollout[i, t])))
                l = l * (w if cfg.rollout_is_low <= w <= cfg.rollout_is_high else 0.0)
            if cfg.kl_coef > 0:
                x = torch.clamp(ref[i, t] - lp[i, t], -CLAMP, CLAMP)
                kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1}[cfg.kl_type]
                l = l + cfg.kl_coef * kl
            if cfg.entropy_coef > 0:
                l = l - cfg.entropy_coef * ent[i, t]
            row.append(l)
        rows.append(row)
    return ref_aggregate(rows, mask.tolist(), cfg.agg_mode, counts.num_tokens, counts.num_seqs, counts.max_len)


def run_loss(lp, old, adv, mask, cfg, counts, **optional):
    """mcore_rl's policy_loss on these tensors (optional: rollout_log_prob, ref_log_prob, entropy)."""
    return policy_loss(LossInputs(lp, old, adv, mask, **optional), cfg, counts)


# ---------------------------------------------------------------- data
def make_batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well off 1: clipping active
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 4:] = 0
    mask[1, 1:] = 0  # a sequence with one valid token
    mask[2] = 0  # an all-masked row
    adv[3] = 0.0  # zero advantage
    old[4, 2] = lp[4, 2] + 45.0  # huge log-ratios hitting the clamp
    old[4, 3] = lp[4, 3] - 45.0
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return lp, old, adv, mask, rollout, ref, ent


def compare(cfg, seed=0, per_token_adv=False):
    lp, old, adv, mask, rollout, ref, ent = make_batch(seed)
    if per_token_adv:
        adv = adv + 0.3 * torch.randn(adv.shape, generator=torch.Generator().manual_seed(9), dtype=adv.dtype)
    counts = GlobalCounts.from_mask(mask)
    lp1 = lp.clone().requires_grad_(True)
    ent1 = ent.clone().requires_grad_(True)
    loss, _ = run_loss(lp1, old, adv, mask, cfg, counts, rollout_log_prob=rollout, ref_log_prob=ref, entropy=ent1)
    loss.backward()
    lp2 = lp.clone().requires_grad_(True)
    ent2 = ent.clone().requires_grad_(True)
    ref_loss = ref_policy_loss(lp2, old, adv, mask, cfg, counts, rollout, ref, ent2)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ent1.grad, ent2.grad, rtol=1e-9, atol=1e-12)
    assert lp1.grad.abs().sum() > 0
    return lp1.grad


# ---------------------------------------------------------------- advantages
@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_group_advantages_match_reference(estimator):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 2.0, 1.0, 3.0]
    got = group_advantages(torch.tensor(rewards), 4, estimator)
    torch.testing.assert_close(got, torch.tensor(ref_advantages(rewards, 4, estimator)), rtol=1e-6, atol=1e-6)
    assert torch.all(got[4:8] == 0)  # all-equal group: exactly zero


def test_group_of_one_has_no_signal():
    assert torch.all(group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1) == 0)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_failed_rewards_are_left_out_of_their_group(estimator):
    """A NaN (failed) reward gets advantage 0 and the rest of its group is scored as if it were absent:
    the same as the reference on the group without it."""
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    valid = ~torch.isnan(rewards)
    got = group_advantages(rewards, 4, estimator, valid=valid)
    assert torch.isfinite(got).all() and got[1] == 0
    kept = [1.0, 0.0, 1.0]
    torch.testing.assert_close(got[[0, 2, 3]], torch.tensor(ref_advantages(kept, 3, estimator)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[4:], group_advantages(rewards[4:], 4, estimator))  # other groups unchanged
    one_left = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, estimator, valid=torch.tensor([1, 0, 0, 0]))
    assert torch.all(one_left == 0)  # a single valid response has nothing to compare with


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)


# ---------------------------------------------------------------- aggregation
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregation_global_and_split_invariant(mode):
    _, _, _, mask, _, _, ent = make_batch(1)
    counts = GlobalCounts.from_mask(mask, max_len=9)
    assert counts == GlobalCounts(num_tokens=4 + 1 + 7 + 7, num_seqs=4, max_len=9)
    full = aggregate(ent, mask, mode, counts)
    ref = ref_aggregate(ent.tolist(), mask.tolist(), mode, counts.num_tokens, counts.num_seqs, counts.max_len)
    assert abs(float(full) - ref) < 1e-12
    # any split into micro-batches sums to the same value (the all-masked row alone, too)
    parts = sum(aggregate(ent[s], mask[s], mode, counts) for s in (slice(0, 2), slice(2, 3), slice(3, 5)))
    assert abs(float(parts) - ref) < 1e-12


# ---------------------------------------------------------------- losses vs reference
AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("loss", ["grpo", "gspo", "gspo_token", "sapo"])
@pytest.mark.parametrize("agg", AGG)
def test_losses_match_reference(loss, agg):
    compare(AlgoConfig(loss=loss, agg_mode=agg, clip_low=0.2, clip_high=0.28))


@pytest.mark.parametrize("loss", ["grpo", "gspo_token", "sapo"])
def test_losses_with_per_token_advantages(loss):
    compare(AlgoConfig(loss=loss, agg_mode="token-mean"), per_token_adv=True)


def test_gspo_small_paper_clip_range():
    compare(AlgoConfig(loss="gspo", clip_low=3e-4, clip_high=4e-4), seed=3)


@pytest.mark.parametrize("loss", ["grpo", "gspo_token"])
def test_dual_clip(loss):
    cfg = AlgoConfig(loss=loss, agg_mode="token-mean", dual_clip=1.5)
    compare(cfg, seed=2)
    # a negative-advantage token with ratio > c: loss -cA, no gradient
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    loss_v, m = run_loss(
        lp,
        torch.tensor([[-1.0]], dtype=torch.float64),
        torch.tensor([[-2.0]], dtype=torch.float64),
        torch.ones(1, 1),
        cfg,
        GlobalCounts(1, 1, 1),
    )
    loss_v.backward()
    assert float(loss_v.detach()) == pytest.approx(3.0) and float(lp.grad) == 0.0 and float(m["dual_clipfrac"]) == 1.0


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_penalty(kl_type):
    compare(AlgoConfig(loss="grpo", kl_coef=0.1, kl_type=kl_type))
    x = torch.tensor([-30.0, -1.0, 0.0, 0.5, 30.0], dtype=torch.float64)
    lp = torch.zeros_like(x)
    got = kl_estimate(lp, x, kl_type)
    xc = x.clamp(-20, 20)
    want = {"k1": -xc, "k2": xc**2 / 2, "k3": xc.exp() - xc - 1}[kl_type]
    torch.testing.assert_close(got, want)


def test_entropy_bonus():
    grad = compare(AlgoConfig(loss="sapo", entropy_coef=0.01, agg_mode="seq-mean-token-mean"))
    assert grad is not None


@pytest.mark.parametrize("mode", ["token", "sequence", "icepop"])
def test_rollout_importance_correction(mode):
    compare(
        AlgoConfig(loss="grpo", rollout_is=mode, rollout_is_cap=1.5, rollout_is_low=0.8, rollout_is_high=1.25), seed=4
    )


# ---------------------------------------------------------------- edge cases
def test_tie_at_clip_boundary_takes_unclipped_gradient():
    d = torch.tensor(0.2, dtype=torch.float32)
    r = float(torch.exp(d))  # the float32 ratio exactly at 1 + clip_high
    cfg = AlgoConfig(loss="grpo", agg_mode="token-mean", clip_high=r - 1.0)
    lp = torch.tensor([[0.2]], requires_grad=True)
    loss, m = run_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), cfg, GlobalCounts(1, 1, 1))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-r, rel=1e-7)
    assert float(lp.grad) == pytest.approx(-r, rel=1e-6)  # d(-A r)/d lp = -A r
    assert float(m["clipfrac_upper"]) == 0.0
    lp.grad = None
    run_loss(lp + 1e-3, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), cfg, GlobalCounts(1, 1, 1))[0].backward()
    assert float(lp.grad) == 0.0  # just outside: clipped, no gradient


def test_zero_advantages_give_zero_loss_and_gradient():
    lp, old, adv, mask, *_ = make_batch(5)
    for loss_name in ("grpo", "gspo", "gspo_token", "sapo"):
        x = lp.clone().requires_grad_(True)
        loss, _ = run_loss(
            x, old, torch.zeros_like(adv), mask, AlgoConfig(loss=loss_name), GlobalCounts.from_mask(mask)
        )
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.all(x.grad == 0)


def test_all_masked_micro_batch_contributes_nothing():
    lp, old, adv, mask, *_ = make_batch(6)
    x = lp.clone().requires_grad_(True)
    loss, metrics = run_loss(x, old, adv, torch.zeros_like(mask), AlgoConfig(loss="gspo"), GlobalCounts(5, 2, 7))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(x.grad == 0) and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_huge_log_ratios_stay_finite():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 200.0]])
    for loss_name in ("grpo", "gspo", "gspo_token", "sapo"):
        loss, metrics = run_loss(
            lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), AlgoConfig(loss=loss_name), GlobalCounts(2, 1, 2)
        )
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), loss_name
        assert all(torch.isfinite(v) for v in metrics.values())


def test_sapo_gradient_weight_is_sech2():
    r = torch.tensor([0.3, 0.8, 1.0, 1.2, 2.5, 0.5, 1.0, 1.7], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    cfg = AlgoConfig(loss="sapo", agg_mode="token-mean", tau_pos=1.0, tau_neg=1.05)
    lp = torch.zeros(1, 8, dtype=torch.float64, requires_grad=True)
    loss, _ = run_loss(lp, -r.log().view(1, 8), adv.view(1, 8), torch.ones(1, 8), cfg, GlobalCounts(8, 1, 8))
    (g,) = torch.autograd.grad(loss * 8, lp)
    weight = g[0] / (-adv * r)  # relative to the unclipped policy gradient -A r
    tau = torch.where(adv > 0, 1.0, 1.05).double()
    torch.testing.assert_close(weight, 1.0 / torch.cosh(tau * (r - 1) / 2) ** 2)
    assert float(weight[2]) == pytest.approx(1.0) and float(weight[6]) == pytest.approx(1.0)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    lp, old, adv, mask, *_ = make_batch(7)
    grads = []
    for name in ("gspo", "gspo_token"):
        x = lp.clone().requires_grad_(True)
        loss, _ = run_loss(x, old, adv, mask, AlgoConfig(loss=name), GlobalCounts.from_mask(mask))
        loss.backward()
        grads.append((loss.detach(), x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_metrics_match_reference_counts():
    lp, old, adv, mask, rollout, ref, ent = make_batch(5)
    cfg = AlgoConfig(loss="grpo", rollout_is="token", rollout_is_cap=1.5)
    counts = GlobalCounts.from_mask(mask)
    _, m = run_loss(lp, old, adv, mask, cfg, counts, rollout_log_prob=rollout, ref_log_prob=ref, entropy=ent)
    up = lo = ent_sum = kl_old = mism = w_sum = 0.0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            d = clampf(float(lp[i, t] - old[i, t]))
            r, a = math.exp(d), float(adv[i, t])
            up += a > 0 and r > 1.28
            lo += a < 0 and r < 0.8
            ent_sum += float(ent[i, t])
            kl_old += r - 1 - d
            x = float(rollout[i, t] - old[i, t])
            mism += math.exp(-x) + x - 1
            w_sum += min(math.exp(-x), 1.5)
    n = counts.num_tokens
    assert up > 0 and lo > 0
    for key, want in [
        ("clipfrac_upper", up / n),
        ("clipfrac_lower", lo / n),
        ("entropy", ent_sum / n),
        ("approx_kl_old", kl_old / n),
        ("rollout_mismatch_k3", mism / n),
        ("is_weight_mean", w_sum / n),
    ]:
        assert float(m[key]) == pytest.approx(want, rel=1e-9), key


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(loss="ppo"), "algo.loss = 'ppo' is not one of"),
        (dict(agg_mode="mean"), "algo.agg_mode = 'mean' is not one of"),
        (dict(dual_clip=0.5), "must be > 1"),
        (dict(loss="sapo", dual_clip=3.0), "has no clipping"),
        (dict(rollout_is="icepop", rollout_is_low=1.5), "icepop needs"),
    ],
)
def test_bad_config_is_rejected(bad, match):
    """Algorithm settings are validated once, when the config is loaded (not per micro-batch)."""
    from mcore_rl.config import Config, ConfigError, validate_config

    with pytest.raises(ConfigError, match=match):
        validate_config(replace(Config(), algo=replace(AlgoConfig(), **bad)))


@pytest.mark.parametrize(
    "bad, match",
    [(dict(kl_coef=0.1), "needs ref_log_prob"), (dict(rollout_is="token"), "needs rollout_log_prob")],
)
def test_missing_inputs_are_rejected(bad, match):
    lp, old, adv, mask, *_ = make_batch(0)
    with pytest.raises(ValueError, match=match):
        run_loss(lp, old, adv, mask, replace(AlgoConfig(), **bad), GlobalCounts.from_mask(mask))


def test_bad_shapes_and_counts_are_rejected():
    lp, old, adv, mask, *_ = make_batch(0)
    with pytest.raises(ValueError, match="advantages has shape"):
        run_loss(lp, old, adv[:, :3], mask, AlgoConfig(), GlobalCounts.from_mask(mask))
    with pytest.raises(ValueError, match="no valid response"):
        run_loss(lp, old, adv, mask, AlgoConfig(), GlobalCounts(0, 0, 7))


# ---------------------------------------------------------------- a loss registered from outside the package
def test_a_registered_loss_is_used_and_matches_its_formula():
    """algo.loss='tests.reinforce_loss:Reinforce' (a PolicyLoss defined in the tests) passes validation, is the
    loss policy_loss uses, and gives plain REINFORCE: -sum(A * log p) / n_tokens and its gradient -A / n_tokens."""
    from mcore_rl.config import load_config

    cfg = load_config(None, ["algo.loss=tests.reinforce_loss:Reinforce", "algo.agg_mode=token-mean"]).algo
    lp, old, adv, mask, *_ = make_batch(8)
    x = lp.clone().requires_grad_(True)
    counts = GlobalCounts.from_mask(mask)
    loss, metrics = run_loss(x, old, adv, mask, cfg, counts)
    loss.backward()
    n = float(mask.sum())
    want = sum(
        -float(adv[i, t]) * float(lp[i, t]) for i in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[i, t]
    )
    assert float(loss.detach()) == pytest.approx(want / n, rel=1e-12)
    torch.testing.assert_close(x.grad, -adv * mask / n)
    assert float(metrics["reinforce_tokens"]) == 1.0 and "clipfrac_upper" not in metrics


@pytest.mark.parametrize(
    "loss, match",
    [
        ("reinforce", "algo.loss = 'reinforce' is not one of: grpo, gspo, gspo_token, sapo (or 'package.module:Class'"),
        ("tests.no_such_module:Reinforce", "cannot load 'Reinforce' from 'tests.no_such_module'"),
        ("tests.reinforce_loss:Missing", "cannot load 'Missing'"),
        ("tests.reinforce_loss:NotALoss", "is not a subclass of mcore_rl.algos.losses.PolicyLoss"),
    ],
)
def test_unknown_or_bad_loss_is_named(loss, match):
    from mcore_rl.algos import build_loss
    from mcore_rl.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match=match.replace("(", r"\(").replace(".", r"\.")):
        build_loss(load_config(None, [f"algo.loss={loss}"]).algo)


def test_every_registered_loss_builds_its_class():
    from mcore_rl.algo_config import LOSSES
    from mcore_rl.algos import PolicyLoss, build_loss

    for name in LOSSES:
        loss = build_loss(AlgoConfig(loss=name))
        assert isinstance(loss, PolicyLoss) and type(loss) is not PolicyLoss, name
