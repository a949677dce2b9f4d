"""Padding removal + token-budget micro-batches against fixed-size padded micro-batches, in the same run.

    torchrun --nproc_per_node=2 benchmarks/packing.py [--sequences 32] [--max-prompt 64] [--max-response 256]

One RL step's actor work (old-policy log-probs + entropy, then one GSPO optimizer step) on the same global
batch, two processes (EP2: experts split, attention data-parallel), both paths on the same Actor (lr = 0, so
the weights do not move between them):
  padded: `pad_rollouts` pads every sequence to the longest of the batch, `split_for_rank`
          cuts each DP share into micro-batches of --micro-batch-size sequences;
  packed: `split_for_rank(max_tokens=B)` with B = micro-batch-size x padded length (the same activation
          memory per micro-batch as the padded path): DP shares balanced by tokens, sequences packed.
Prints computed tokens / useful tokens (micro-batch tokens incl. padding, over both ranks / real tokens)
and the seconds of each path, best of --trials (the paths interleaved), and their ratio. Targets: packed computed/useful <= 1.1,
packed at least 2x faster.

Length mix ("seed-shaped", scaled down from prompts <= 2k and responses <= 8k by 1/32): prompt lengths
uniform in [max_prompt / 4, max_prompt]; response lengths drawn from an exponential with mean
max_response / 5 (a long tail: most responses far shorter than the longest), plus 1 in 8 responses cut
at max_response (truncated generations), clipped to [1, max_response]. Seeded.

Model: a random Qwen3-MoE (hidden 512, 2 layers, 8 heads x 64, 8 experts top-2 of FFN 1024, the tiny
128-token vocabulary), so the linear and MoE layers dominate the compute. On CPU the packed path attends
within each segment (`SegmentDotProductAttention`), as the THD path does on devices.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout


def seed_shaped_samples(n: int, max_prompt: int, max_response: int, seed: int):
    from mcore_rl.batch import RolloutSample

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(max_prompt // 4, max_prompt + 1, (n,), generator=g)
    exp = -torch.log(torch.rand(n, generator=g)) * (max_response / 5)
    responses = exp.long().clamp(1, max_response)
    responses[torch.rand(n, generator=g) < 1 / 8] = max_response
    responses[0] = max_response  # at least one at the maximum
    out = []
    for p, r in zip(prompts.tolist(), responses.tolist()):
        ids = torch.randint(3, 128, (p + r,), generator=g).tolist()
        out.append(RolloutSample(ids[:p], ids[p:], -torch.rand(r, generator=g), "stop"))
    return out


def one_step(actor, mini, algo) -> tuple[float, float]:
    """Seconds of the old-log-prob pass + the update, and the gradient norm (the same in both paths)."""
    dist.barrier()
    start = time.perf_counter()
    outputs = actor.log_probs(mini.micro_batches, with_entropy=True)
    for mb, out in zip(mini.micro_batches, outputs):
        mb.old_log_prob, mb.entropy = out[0], out[1]
    metrics = actor.train_policy(mini, algo)
    dist.barrier()
    return time.perf_counter() - start, metrics["grad_norm"]


def computed_tokens(mini) -> int:
    local = torch.tensor([sum(mb.tokens.numel() for mb in mini.micro_batches)], dtype=torch.float64)
    dist.all_reduce(local)
    return int(local)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()

    from mcore_rl.algos import group_advantages
    from mcore_rl.batch import pad_rollouts, split_for_rank
    from mcore_rl.config import AlgoConfig, Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor
    from mcore_rl.models.tiny import TinyModelShape, make_tiny_checkpoint
    from mcore_rl.platform import get_platform

    platform = get_platform("cpu")
    platform.init_distributed()
    platform.adapt_megatron()
    rank = dist.get_rank()
    shape = TinyModelShape(
        hidden_size=args.hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=2 * args.hidden,
        max_position_embeddings=4 * (args.max_prompt + args.max_response),
    )
    model_dir = os.path.join(tempfile.gettempdir(), f"mcore_rl_packing_bench_h{args.hidden}")
    if rank == 0 and not os.path.exists(os.path.join(model_dir, "mcore_rl_tiny.json")):
        make_tiny_checkpoint(model_dir, seed=0, shape=shape)
    dist.barrier()

    cfg = Config(platform="cpu", model=ModelConfig(path=model_dir))
    cfg.actor.parallel = ParallelConfig(ep=2)
    cfg.actor.optim = OptimConfig(lr=0.0, min_lr=0.0, clip_grad=0.0)
    algo = AlgoConfig(loss="gspo")
    actor = Actor(cfg, platform)
    layout = actor.layout

    samples = seed_shaped_samples(args.sequences, args.max_prompt, args.max_response, seed=0)
    rewards = torch.rand(len(samples), generator=torch.Generator().manual_seed(1))
    batch = pad_rollouts(samples, rewards, group_advantages(rewards, 8), 0, layout.seq_len_multiple)
    padded_len = batch.tokens.shape[1]
    budget = args.micro_batch_size * padded_len
    useful = sum(batch.lengths)

    def build(path):
        if path == "padded":
            mbs = dict(micro_batch_size=args.micro_batch_size)
        else:
            mbs = dict(max_tokens=budget, multiple=layout.seq_len_multiple)
        (mini,) = split_for_rank(batch, 1, layout.dp, layout.ranks.dp, max_len=args.max_response, **mbs)
        return mini

    actor.log_probs(build("packed").micro_batches[:1])  # warm-up (allocations, first-call costs)
    results = {path: dict(seconds=float("inf")) for path in ("padded", "packed")}
    for _ in range(args.trials):  # interleaved, so a change of the machine's load hits both paths
        for path, r in results.items():
            mini = build(path)
            seconds, grad_norm = one_step(actor, mini, algo)
            r.update(seconds=min(r["seconds"], seconds), grad_norm=grad_norm)
            r.update(computed=computed_tokens(mini), micro=len(mini.micro_batches))
    if rank == 0:
        lengths = torch.tensor(batch.lengths, dtype=torch.float)
        print(
            f"{len(samples)} sequences, lengths mean {lengths.mean():.0f} median {lengths.median():.0f} "
            f"max {int(lengths.max())}; padded length {padded_len}, micro-batch {args.micro_batch_size} seqs "
            f"vs budget {budget} tokens; useful tokens {useful}"
        )
        print("| path | micro-batches per rank | computed / useful tokens | seconds | grad norm |")
        print("|---|---|---|---|---|")
        for path, r in results.items():
            print(
                f"| {path} | {r['micro']} | {r['computed'] / useful:.3f} | {r['seconds']:.2f} | {r['grad_norm']:.6f} |"
            )
        speedup = results["padded"]["seconds"] / results["packed"]["seconds"]
        print(
            f"packed: computed/useful {results['packed']['computed'] / useful:.3f} (target <= 1.1), "
            f"{speedup:.2f}x faster than padded (target >= 2x)"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
