"""Layout invariance of the policy losses (run under torchrun by tests/test_layout_invariance.py).

argv: OUT_DIR MODEL_DIR TP PP EP N_MICRO MODE   (MODE: ref = world-1 reference, writes OUT_DIR/ref.pt;
check = compare with it). For each of grpo / gspo / sapo a fresh Actor takes one optimizer step on
the same global batch; every rank takes its data-parallel share split into N_MICRO micro-batches.
Compared with the reference: the global loss, and the update (after - before) of EVERY parameter,
exported with its Hugging Face name. Prints "LAYOUT_OK ..." lines; any mismatch raises.
"""

import os
import sys

import torch

B, S, GROUP = 8, 16, 4
REL_TOL = 1e-5
ALGOS = {
    # hard clips (dual clip too) + token-level rollout IS: clipping paths must be hit
    "grpo": dict(loss="grpo", agg_mode="token-mean", clip_low=0.2, clip_high=0.28, dual_clip=1.5, rollout_is="token"),
    # sequence ratio + k3 KL to a reference policy
    "gspo": dict(loss="gspo", agg_mode="seq-mean-token-mean", clip_low=0.1, clip_high=0.12, kl_coef=0.05),
    # soft gate + entropy bonus (exercises the entropy gradient through vocab-parallel logits) + temperature
    "sapo": dict(loss="sapo", agg_mode="seq-mean-token-sum-norm", entropy_coef=0.01, temperature=0.8),
}


def global_batch():
    """Deterministic prompts + responses, right-padded; one response of a single token."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    for i in range(B):
        prompt = 3 + i % 4
        resp = 1 if i == 5 else int(torch.randint(3, S - prompt + 1, (1,), generator=g))
        tokens[i, : prompt + resp] = torch.randint(3, 128, (prompt + resp,), generator=g)
        loss_mask[i, prompt - 1 : prompt - 1 + resp] = 1.0  # position t predicts tokens[t + 1]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.5])
    noise = torch.randn(3, B, S, generator=g)
    return tokens, loss_mask, rewards, noise


def main():
    out_dir, model_dir = sys.argv[1], sys.argv[2]
    tp, pp, ep, n_micro = map(int, sys.argv[3:7])
    mode = sys.argv[7]

    from safetensors.torch import load_file

    from mcore_rl.algos import GlobalCounts, group_advantages
    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import AlgoConfig, Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor
    from mcore_rl.megatron.policy_loss import make_log_prob_fn, make_policy_loss_fn
    from mcore_rl.platform import get_platform

    platform = get_platform("cpu")
    platform.adapt_megatron()

    before = load_file(os.path.join(model_dir, "model.safetensors"))
    tokens, loss_mask, rewards, noise = global_batch()
    counts = GlobalCounts.from_mask(loss_mask)  # from the full global batch, before any split
    advantages = group_advantages(rewards, GROUP).unsqueeze(-1).expand(B, S).contiguous()
    ref = torch.load(os.path.join(out_dir, "ref.pt")) if mode == "check" else {}
    results = {}
    for name, params in ALGOS.items():
        algo = AlgoConfig(**params)
        cfg = Config(platform="cpu", model=ModelConfig(path=model_dir))
        cfg.actor.parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1)
        # huge eps: Adam's first step ~ lr * grad / eps is linear in the gradient, so any error in
        # its scale (micro-batch or DP averaging) shows in the update, not only in grad_norm
        cfg.actor.optim = OptimConfig(lr=10.0, adam_eps=10.0, clip_grad=0.0)
        actor = Actor(cfg, platform)
        tp_group = actor.layout.groups.tp
        dp, dp_rank = actor.layout.dp, actor.layout.ranks.dp
        per_rank = B // dp
        size = per_rank // n_micro
        assert size * n_micro == per_rank, (B, dp, n_micro)
        rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)

        # current-policy log-probs at this layout; the loss uses the reference run's (identical inputs)
        mbs = [MicroBatch(tokens[r : r + size]) for r in range(rows.start, rows.stop, size)]
        lp_here = torch.cat(actor.forward_only(mbs, make_log_prob_fn(algo.temperature, tp_group)))
        lp_full = ref[name]["log_prob_full"][rows.start : rows.stop] if mode == "check" else lp_here
        if mode == "check":
            diff = float(((lp_here - lp_full) * loss_mask[rows.start : rows.stop]).abs().max())
            assert diff < 1e-5, f"{name}: forward_only log-probs differ from the TP1 reference by {diff}"
        old = lp_full + 0.3 * noise[0, rows.start : rows.stop]  # ratios away from 1: clipping paths hit
        rollout = old + 0.2 * noise[1, rows.start : rows.stop]
        ref_lp = lp_full + 0.5 * noise[2, rows.start : rows.stop]
        train_mbs = []
        for k in range(n_micro):
            sl = slice(k * size, (k + 1) * size)
            r0 = rows.start + k * size
            train_mbs.append(
                MicroBatch(
                    tokens[r0 : r0 + size],
                    loss_mask=loss_mask[r0 : r0 + size],
                    old_log_prob=old[sl],
                    advantages=advantages[r0 : r0 + size],
                    rollout_log_prob=rollout[sl],
                    ref_log_prob=ref_lp[sl],
                )
            )
        metrics = actor.train_step(train_mbs, make_policy_loss_fn(algo, counts, tp_group))
        update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
        results[name] = {"loss": metrics["loss"], "metrics": metrics, "update": update, "log_prob_full": lp_here}
        if mode == "check":
            want = ref[name]
            rel_loss = abs(metrics["loss"] - want["loss"]) / abs(want["loss"])
            assert rel_loss <= REL_TOL, (
                f"{name}: loss {metrics['loss']} vs reference {want['loss']} (rel {rel_loss:.2e})"
            )
            assert set(update) == set(want["update"])
            scale = max(float(u.abs().max()) for u in want["update"].values())
            worst_name, worst = max(
                ((n, float((update[n] - want["update"][n]).abs().max())) for n in update), key=lambda x: x[1]
            )
            assert worst <= REL_TOL * scale, (
                f"{name}: update of {worst_name} differs by {worst:.3e} (largest update {scale:.3e})"
            )
            print(
                f"LAYOUT_OK {name} tp{tp} pp{pp} ep{ep} dp{dp} micro{n_micro} rank{torch.distributed.get_rank()}: "
                f"loss {metrics['loss']:.8f} rel {rel_loss:.1e}; {len(update)} params, max |d update| {worst:.2e} "
                f"({worst_name}) vs largest update {scale:.2e}",
                flush=True,
            )
        else:
            cf = metrics.get("clipfrac_upper", 0.0) + metrics.get("clipfrac_lower", 0.0)
            if name == "grpo":  # every clipping branch is exercised by this batch
                assert (
                    metrics["clipfrac_upper"] > 0 and metrics["clipfrac_lower"] > 0 and metrics["dual_clipfrac"] > 0
                ), metrics
            if name == "gspo":  # some sequences clipped, some not (so the gradient is not all zero)
                assert 0 < cf < 1, metrics
            print(f"REF {name}: loss {metrics['loss']:.8f} clipfrac {cf:.3f} metrics {metrics}", flush=True)
        del actor
    if mode == "ref" and torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "ref.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
