"""Worker: vocab-parallel log-probs + entropy at TP=world (gloo) vs full-vocab log_softmax on one rank.

Every rank builds the same full logits, keeps its vocabulary slice, and compares values and the
gradient of its slice with the plain-torch reference.
Then the fused path (`fused_output_log_probs`: hidden states + this rank's output-weight shard, no
logits tensor) against today's path on the same shard (projection + `vocab_parallel_log_probs`):
log-probs, entropy, d hidden (this rank's partial sum) and d weight shard, and the summed d hidden
against the full-vocabulary plain-torch reference. Then mcore_rl.platform.collectives on the live group.
A mismatch raises. Arguments: --results (tests/workers/harness.py).

Result per rank: for every comparison the largest |got - want| and its excess over torch.testing.assert_close's
bound (atol + rtol * |want|, <= 0 when it passes), and the small collectives' largest error.
"""

import torch
import torch.distributed as dist

from mcore_rl.megatron.logprobs import LogProbOptions, fused_output_log_probs, vocab_parallel_log_probs
from tests.workers.harness import init_gloo, worker_args, write_result


def measured(got, want, rtol, atol) -> dict:
    """assert_close(got, want, rtol, atol), and what it measured: the largest difference and its excess over
    the allowed atol + rtol * |want| (<= 0)."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    gap = (got.detach() - want.detach()).abs()
    return {"max_diff": float(gap.max()), "excess": float((gap - (atol + rtol * want.detach().abs())).max())}


def reference(logits, target, temperature, g_lp, g_h):
    x = logits.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def main():
    args = worker_args(__doc__)
    rank, world = init_gloo()
    g = torch.Generator().manual_seed(0)
    n, vocab, temperature = 37, 128, 0.7
    logits = torch.randn(n, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    want_lp, want_ent, want_grad = reference(logits, target, temperature, g_lp, g_h)

    shard = vocab // world
    mine = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        mine, target, temperature, group=dist.group.WORLD, with_entropy=True, chunk_tokens=8
    )
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    checks = {
        "log_prob": measured(lp, want_lp, 1e-5, 1e-5),
        "entropy": measured(ent, want_ent, 1e-5, 1e-5),
        "d_logits": measured(mine.grad, want_grad[:, rank * shard : (rank + 1) * shard], 1e-5, 1e-6),
    }
    fused = check_fused(rank, world)
    collectives_err = check_small_collectives(rank, world)
    dist.destroy_process_group()
    write_result(args.results, world=world, checks=checks, fused=fused, collectives_err=collectives_err)


def check_fused(rank, world) -> dict:
    """The fused path against today's on the same shard and against the full-vocabulary reference."""
    g = torch.Generator().manual_seed(1)
    n, vocab, h, temperature = 29, 128, 24, 0.8
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(vocab, h, generator=g) / h**0.5 * 3
    target = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    shard = vocab // world
    w_mine = weight[rank * shard : (rank + 1) * shard]

    def run(fused):
        x = hidden.clone().requires_grad_(True)
        w = w_mine.clone().requires_grad_(True)
        if fused:
            opts = LogProbOptions(temperature, dist.group.WORLD, with_entropy=True, chunk_tokens=6)
            lp, ent = fused_output_log_probs(x, w, target, opts)
        else:
            lp, ent = vocab_parallel_log_probs(x @ w.t(), target, temperature, dist.group.WORLD, True, chunk_tokens=6)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    got, today = run(True), run(False)
    checks = {}
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), got, today):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"fused {name}: {m}")
        checks[f"{name}_vs_today"] = measured(a, b, 1e-5, 1e-5)
    # independent reference: the full-vocabulary projection + log_softmax on one rank
    x = hidden.clone().requires_grad_(True)
    want_lp, want_ent, _ = reference(x @ weight.t(), target, temperature, g_lp, g_h)
    checks["log_prob_vs_full_vocab"] = measured(got[0], want_lp, 1e-5, 1e-5)
    x = hidden.clone().requires_grad_(True)
    logp_all = torch.log_softmax(x @ weight.t() / temperature, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    summed = got[2].clone()
    dist.all_reduce(summed)  # what the tensor-parallel region op does with the partial sums
    checks["d_hidden_summed_vs_full_vocab"] = measured(summed, x.grad, 1e-5, 1e-5)
    return checks


def check_small_collectives(rank: int, world: int) -> float:
    """mcore_rl.platform.collectives on a live gloo group vs plain Python references (test_collectives.py);
    returns the float sums' largest relative error."""
    import math

    from mcore_rl.platform import collectives
    from mcore_rl.platform.collectives import CollectiveRuleError

    # values whose float32 sum is visibly wrong: 2**40 + small parts (float32 keeps 24 bits)
    values = [[2.0**40 + 0.125 * (r + 1), 1e-3 * (r + 1), -3.5 * r] for r in range(world)]
    got = collectives.sum_floats(values[rank])
    want = [math.fsum(v[i] for v in values) for i in range(3)]
    err = max(abs(g - w) / max(1.0, abs(w)) for g, w in zip(got, want))
    assert err <= 1e-12, (got, want)
    f32 = float(torch.tensor([v[0] for v in values], dtype=torch.float32).sum())
    assert abs(f32 - want[0]) > 0.1, "the test values do not show float32's error"
    assert collectives.sum_ints([rank + 1, 2**40]) == [world * (world + 1) // 2, world * 2**40]
    assert collectives.max_floats([float(rank), -float(rank)]) == [float(world - 1), 0.0]
    assert collectives.max_ints([rank]) == [world - 1]
    assert collectives.all_agree([7, 8]) and not collectives.all_agree([rank])
    assert collectives.any_true(rank == world - 1) and not collectives.any_true(False)
    for bad, match in ((torch.zeros(2, dtype=torch.float64), "float64"), (torch.zeros(2, device="meta"), "meta")):
        try:
            collectives.all_reduce_small(bad)
        except CollectiveRuleError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"{bad.dtype} on {bad.device} was not refused")
    return err


if __name__ == "__main__":
    main()
