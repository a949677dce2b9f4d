"""Worker: vocab-parallel log-probs + entropy at TP=world (gloo) vs full-vocab log_softmax on one rank.

Every rank builds the same full logits, keeps its vocabulary slice, and compares values and the
gradient of its slice with the plain-torch reference. Prints LOGPROB_TP_OK on success.
"""

import torch
import torch.distributed as dist

from mcore_rl.megatron.logprobs import vocab_parallel_log_probs


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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
