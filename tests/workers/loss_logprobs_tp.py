"""Worker: vocab-parallel log-probs + entropy at TP=world (gloo) vs full-vocab log_softmax on one rank.

Every rank builds the same full logits, keeps its vocabulary slice, and compares values and the
gradient of its slice with the plain-torch reference. Prints LOGPROB_TP_OK on success.
Then the fused path (`fused_output_log_probs`: hidden states + this rank's output-weight shard, no
logits tensor) against today's path on the same shard (projection + `vocab_parallel_log_probs`):
log-probs, entropy, d hidden (this rank's partial sum) and d weight shard, and the summed d hidden
against the full-vocabulary plain-torch reference. Prints FUSED_TP_OK on success.
"""

import torch
import torch.distributed as dist

from mcore_rl.megatron.logprobs import fused_output_log_probs, vocab_parallel_log_probs


def reference(logits, target, temperature, g_lp, g_h):
    x = logits.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
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
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.grad, want_grad[:, rank * shard : (rank + 1) * shard], rtol=1e-5, atol=1e-6)
    err = (mine.grad - want_grad[:, rank * shard : (rank + 1) * shard]).abs().max()
    print(
        f"rank {rank}: LOGPROB_TP_OK max|dlp|={float((lp.detach() - want_lp).abs().max()):.2e} max|dgrad|={float(err):.2e}",
        flush=True,
    )
    check_fused(rank, world)
    check_small_collectives(rank, world)
    dist.destroy_process_group()


def check_fused(rank, world):
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
            lp, ent = fused_output_log_probs(x, w, target, temperature, dist.group.WORLD, True, chunk_tokens=6)
        else:
            lp, ent = vocab_parallel_log_probs(x @ w.t(), target, temperature, dist.group.WORLD, True, chunk_tokens=6)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    got, today = run(True), run(False)
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), got, today):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"fused {name}: {m}")
    # independent reference: the full-vocabulary projection + log_softmax on one rank
    x = hidden.clone().requires_grad_(True)
    want_lp, want_ent, _ = reference(x @ weight.t(), target, temperature, g_lp, g_h)
    torch.testing.assert_close(got[0], want_lp, rtol=1e-5, atol=1e-5)
    x = hidden.clone().requires_grad_(True)
    logp_all = torch.log_softmax(x @ weight.t() / temperature, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    summed = got[2].clone()
    dist.all_reduce(summed)  # what the tensor-parallel region op does with the partial sums
    torch.testing.assert_close(summed, x.grad, rtol=1e-5, atol=1e-5)
    err = max(float((a - b).abs().max()) for a, b in zip(got, today))
    print(f"rank {rank}: FUSED_TP_OK max|fused - today|={err:.2e}", flush=True)


def check_small_collectives(rank: int, world: int) -> None:
    """mcore_rl.platform.collectives on a live gloo group vs plain Python references (test_collectives.py)."""
    import math

    from mcore_rl.platform import collectives
    from mcore_rl.platform.collectives import CollectiveRuleError

    # values whose float32 sum is visibly wrong: 2**40 + small parts (float32 keeps 24 bits)
    values = [[2.0**40 + 0.125 * (r + 1), 1e-3 * (r + 1), -3.5 * r] for r in range(world)]
    got = collectives.sum_floats(values[rank])
    want = [math.fsum(v[i] for v in values) for i in range(3)]
    assert all(abs(g - w) <= 1e-12 * max(1.0, abs(w)) for g, w in zip(got, want)), (got, want)
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
    print(f"rank {rank}: SMALL_COLLECTIVES_OK", flush=True)


if __name__ == "__main__":
    main()
