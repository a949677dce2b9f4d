"""Vocab-parallel log-probs and entropy vs full-vocabulary log_softmax (values and gradients)."""

import pytest
import torch

from mcore_rl.megatron.logprobs import vocab_parallel_log_probs
from tests.torchrun_util import REPO, run_worker


def reference(logits, target, temperature):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_log_softmax_values_and_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 50, generator=g, dtype=torch.float64) * 5
    target = torch.randint(0, 50, (3, 7), generator=g)
    g_lp, g_h = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(3, 7, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(a, target, temperature, with_entropy=True, chunk_tokens=chunk)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    b = logits.clone().requires_grad_(True)
    want_lp, want_ent = reference(b, target, temperature)
    ((want_lp * g_lp).sum() + (want_ent * g_h).sum()).backward()
    assert lp.shape == (3, 7) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_without_entropy_and_input_untouched():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(11, 40, generator=g).requires_grad_(True)
    before = logits.detach().clone()
    target = torch.randint(0, 40, (11,), generator=g)
    lp, ent = vocab_parallel_log_probs(logits, target, chunk_tokens=4)
    assert ent is None
    lp.sum().backward()
    want = reference(logits.detach(), target, 1.0)[0]
    torch.testing.assert_close(lp, want)
    assert torch.equal(logits.detach(), before)  # no in-place modification of the caller's logits
    onehot = torch.nn.functional.one_hot(target, 40).float()
    torch.testing.assert_close(logits.grad, onehot - torch.softmax(before, -1))


def test_bf16_logits_computed_in_fp32():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 64, generator=g) * 8).bfloat16().requires_grad_(True)
    target = torch.randint(0, 64, (9,), generator=g)
    lp, ent = vocab_parallel_log_probs(logits, target, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    want_lp, want_ent = reference(logits.detach(), target, 1.0)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    assert logits.grad.dtype == torch.bfloat16


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2])
def test_tp2_equals_full_vocab(nproc):
    results = run_worker(REPO / "tests/workers/loss_logprobs_tp.py", nproc, timeout=120).results
    for r in results:  # one per rank (run_worker fails unless all nproc ranks reported)
        assert r["world"] == nproc, r
        # each comparison within assert_close's bound (atol + rtol |want|): vocab-parallel vs full vocabulary
        assert set(r["checks"]) == {"log_prob", "entropy", "d_logits"}, r
        # fused_output_log_probs at TP2 (same job) vs today's path on the same shard and vs the full vocabulary
        assert len(r["fused"]) == 6, r
        assert all(c["excess"] <= 0 for c in [*r["checks"].values(), *r["fused"].values()]), r
        assert r["collectives_err"] <= 1e-12, r  # mcore_rl.platform.collectives on a live group


@pytest.mark.parametrize("temperature,dtype", [(1.0, torch.float32), (0.7, torch.float32)])
def test_fused_output_log_probs_equal_todays_path_tp1(temperature, dtype):
    """TP1: fused (hidden + output weight, chunked, recomputed in backward) == projection + today's path."""
    from mcore_rl.megatron.logprobs import LogProbOptions, fused_output_log_probs, vocab_parallel_log_probs

    g = torch.Generator().manual_seed(3)
    n, vocab, h = 41, 96, 16
    hidden = torch.randn(2, n, h, generator=g, dtype=dtype)
    weight = torch.randn(vocab, h, generator=g, dtype=dtype) * 0.7
    target = torch.randint(0, vocab, (2, n), generator=g)
    g_lp, g_h = torch.randn(2, n, generator=g), torch.randn(2, n, generator=g)

    def run(fused):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            lp, ent = fused_output_log_probs(
                x, w, target, LogProbOptions(temperature, with_entropy=True, chunk_tokens=7)
            )
        else:
            lp, ent = vocab_parallel_log_probs(x @ w.t(), target, temperature, with_entropy=True)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and without entropy: only log-probs, no entropy gradient path
    x = hidden.clone().requires_grad_(True)
    lp, ent = fused_output_log_probs(x, weight, target, LogProbOptions(temperature))
    assert ent is None
    lp.sum().backward()
    want = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp.detach(), want, rtol=1e-5, atol=1e-5)


def test_fused_output_log_probs_rejects_bad_shapes():
    from mcore_rl.megatron.logprobs import LogProbOptions, fused_output_log_probs

    with pytest.raises(ValueError, match=r"must be target"):
        fused_output_log_probs(torch.zeros(4, 8), torch.zeros(10, 6), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        LogProbOptions(temperature=0.0)  # checked when made, before any tensor work
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        LogProbOptions(chunk_tokens=0)


# ---------------------------------------------------------------- the actor's loss_fn (world 1)
def test_policy_loss_fn_equals_log_softmax_path():
    from mcore_rl.algos import GlobalCounts, LossInputs, policy_loss
    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import AlgoConfig
    from mcore_rl.megatron.logprobs import OutputHead
    from mcore_rl.megatron.policy_loss import make_log_prob_fn, make_policy_loss_fn

    g = torch.Generator().manual_seed(4)
    b, s, v = 3, 6, 32
    tokens = torch.randint(0, v, (b, s), generator=g)
    mask = torch.zeros(b, s)
    mask[0, 1:5] = 1
    mask[1, 2:3] = 1
    mask[2, 0:5] = 1
    old = -torch.rand(b, s, generator=g) * 3
    adv = torch.randn(b, 1, generator=g).expand(b, s)
    algo = AlgoConfig(loss="grpo", temperature=0.7, entropy_coef=0.05)
    counts = GlobalCounts.from_mask(mask)
    h = 8
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 2).requires_grad_(True)
    mb = MicroBatch(tokens, loss_mask=mask, old_log_prob=old, advantages=adv.contiguous())
    loss, metrics = make_policy_loss_fn(algo, counts, tp_group=None)(OutputHead(hidden, weight), mb)
    loss.backward()

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref_weight = weight.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(ref_hidden @ ref_weight.t() / 0.7, -1)
    next_tok = torch.roll(tokens, -1, 1)  # position t scores tokens[t + 1]; the wrapped last column is masked
    lp = logp_all.gather(-1, next_tok.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    want, want_metrics = policy_loss(LossInputs(lp, old, adv, mask, entropy=ent), algo, counts)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(metrics["entropy"], want_metrics["entropy"], rtol=1e-5, atol=1e-6)
    post = make_log_prob_fn(0.7, None)(OutputHead(hidden.detach(), weight.detach()), mb)
    torch.testing.assert_close(post * mask, lp.detach() * mask, rtol=1e-5, atol=1e-5)


def test_micro_batch_rejects_unshifted_mask_and_bad_shapes():
    from mcore_rl.batch import MicroBatch

    tokens = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"loss_mask\[:, -1\] is set"):
        MicroBatch(tokens, loss_mask=mask, old_log_prob=torch.zeros(2, 4), advantages=torch.zeros(2, 4))
    mask[:, -1] = 0
    with pytest.raises(ValueError, match="advantages has shape"):
        MicroBatch(tokens, loss_mask=mask, old_log_prob=torch.zeros(2, 4), advantages=torch.zeros(2, 3))
