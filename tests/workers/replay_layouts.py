"""Routing replay (R2 / R3) on one layout of the real Megatron actor (run by tests/test_routing_replay.py).

Arguments: --model-dir --tp --pp --ep --recompute (0/1), --results (tests/workers/harness.py).
Checks, on every rank:
  1. replaying routes recorded from the same weights: forward logits, train loss and every gradient
     equal the normal path bit for bit; mismatch 0; router fusion is off while replaying, restored after.
  2. routes recorded with a PERTURBED last router: under replay the routers use exactly those experts
     (recorded again during the replay), logits differ from the normal path, the mismatch metric equals
     the fraction computed here from the two route sets, and the router weights still get gradient.
  3. R3: the embedded engine's routed_experts (same weights) packed with padding: mismatch 0, logits at
     real tokens equal the normal path (<= 1e-5: expert GEMMs then see different row counts).
  4. misuse (too few routes, unused routes) raises.
  5. packed micro-batches (token budget, padding removed): R3 from the same engine routes packed at their
     sequences' offsets gives mismatch 0 and the packed logits equal the padded path's at every real token
     (<= 1e-5); R2 recorded on the packed old-policy pass and replayed in the packed update gives the same
     loss and gradients bit for bit, mismatch 0.
Result per rank: the mismatch metrics of 2. (and their independent counts) and of 3.; under "packed" those of 5.
"""

import torch

from tests.workers.actor_common import full_logits, global_batch, my_micro_batches, nll_loss
from tests.workers.harness import cpu_megatron, worker_args, write_result


def grads(actor) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for m in actor.model for n, p in m.named_parameters()}


def set_sets(routes) -> torch.Tensor:
    """All routes of a RecordedRoutes as a [N, k] sorted tensor (layers and micro-batches concatenated)."""
    return torch.cat([mb.ids[l].long().sort(-1).values for mb in routes.micro_batches for l in sorted(mb.ids)])


def world_sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t)


def packed_checks(actor, replay, samples, layout, full_logits):
    from mcore_rl.batch import MicroBatch, pad_rollouts, split_for_rank, unpack_rows

    n = len(samples)
    batch = pad_rollouts(samples, torch.zeros(n), torch.zeros(n), 0, layout.seq_len_multiple)
    (mini,) = split_for_rank(
        batch, 1, layout.dp, layout.ranks.dp, max_tokens=24, multiple=layout.seq_len_multiple, route_experts=8
    )
    mbs = mini.micro_batches
    assert any(len(mb.source_rows) > 1 for mb in mbs) or layout.dp > 1, [mb.seq_lengths for mb in mbs]
    padded = actor.forward_only([MicroBatch(batch.tokens)], full_logits)[0]  # every sequence, on every rank
    plain = actor.forward_only(mbs, full_logits)
    r3_routes = replay.routes_from_rollout([mb.routed_experts for mb in mbs], [mb.route_valid for mb in mbs])
    with replay.replaying(r3_routes):
        r3_logits = actor.forward_only(mbs, full_logits)
    r3 = replay.mismatch_metrics()
    assert r3["routing/token_mismatch"] == 0.0, f"packed R3 routes misaligned: {r3}"
    gap = r3_gap = 0.0
    for mb, a, b in zip(mbs, plain, r3_logits):
        for row, piece, replayed in zip(
            mb.source_rows, unpack_rows(a.transpose(1, 2), mb), unpack_rows(b.transpose(1, 2), mb)
        ):
            length = int(batch.lengths[row])
            gap = max(gap, float((piece[0].t() - padded[row, :length]).abs().max()))
            r3_gap = max(r3_gap, float((replayed[0] - piece[0]).abs().max()))
    assert gap < 1e-5 and r3_gap < 1e-5, (gap, r3_gap)
    # R2 on the packed path: record in the old-policy pass, replay in the update
    for mb in mbs:
        mb.loss_mask = mb.loss_mask.float()
    loss_fn = nll_loss(float(batch.loss_mask.sum()))
    with replay.recording() as rec:
        actor.forward_only(mbs, full_logits)
    normal = actor.train_step(mbs, loss_fn)
    normal_grads = grads(actor)
    with replay.replaying(replay.with_valid(rec.routes, [mb.loss_mask > 0 for mb in mbs])):
        replayed = actor.train_step(mbs, loss_fn)
    r2 = replay.mismatch_metrics()
    assert normal["loss"] == replayed["loss"] and r2["routing/token_mismatch"] == 0.0, (normal, replayed, r2)
    for name, g in grads(actor).items():
        assert torch.equal(g, normal_grads[name]), f"packed R2: grad of {name} differs"
    return dict(
        rows=[mb.seq_lengths for mb in mbs],
        logit_gap=gap,
        r3_logit_gap=r3_gap,
        r3_token_mismatch=r3["routing/token_mismatch"],
        r2_token_mismatch=r2["routing/token_mismatch"],
        r2_loss_diff=abs(normal["loss"] - replayed["loss"]),
    )


def main():
    args = worker_args(__doc__, model_dir=str, tp=int, pp=int, ep=int, recompute=int)
    model_dir, tp, pp, ep, recompute = args.model_dir, args.tp, args.pp, args.ep, args.recompute

    from mcore_rl.batch import MicroBatch, pad_rollout_routes
    from mcore_rl.config import Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor

    platform = cpu_megatron()
    from mcore_rl.megatron.routing_replay import RoutingReplay

    cfg = Config(platform="cpu", model=ModelConfig(path=model_dir, recompute=bool(recompute)))
    cfg.actor.parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1)
    cfg.actor.optim = OptimConfig(lr=0.0, min_lr=0.0, clip_grad=0.0, weight_decay=0.0)  # weights never move
    actor = Actor(cfg, platform)
    layout = actor.layout
    replay = RoutingReplay.install(actor.chunks, layout)
    assert replay.moe_layers == [1, 2], replay.moe_layers
    want_shard = (tp, layout.ranks.tp) if tp > 1 else (1, 0)  # MoE with tp > 1 runs sequence parallel
    assert replay.sequence_shard == want_shard and replay.recompute == bool(recompute), (
        replay.sequence_shard,
        replay.recompute,
    )
    tokens, loss_mask = global_batch()
    mbs = my_micro_batches(tokens, loss_mask, 2)
    loss_fn = nll_loss(loss_mask.sum())

    # -- 1. same weights: replay is the identity
    with replay.recording() as rec:
        normal_logits = actor.forward_only(mbs, full_logits)
    routes = rec.routes
    assert len(routes) == len(mbs) and all(set(mb.ids) == set(replay.layers) for mb in routes.micro_batches)
    with replay.replaying(routes):
        replay_logits = actor.forward_only(mbs, full_logits)
    for a, b in zip(normal_logits, replay_logits):
        assert torch.equal(a, b), f"replayed logits differ by {(a - b).abs().max()}"
    assert replay.mismatch_metrics()["routing/token_mismatch"] == 0.0
    tf_config = replay.sites[0].router.config
    if hasattr(tf_config, "moe_router_fusion"):  # megatron-core >= 0.15
        tf_config.moe_router_fusion = True  # needs Transformer Engine: fails on CPU unless replay turns it off
        with replay.replaying(routes):
            unfused = actor.forward_only(mbs, full_logits)
        assert tf_config.moe_router_fusion is True, "replaying() did not restore moe_router_fusion"
        tf_config.moe_router_fusion = False
        assert all(torch.equal(a, b) for a, b in zip(normal_logits, unfused))
    normal = actor.train_step(mbs, loss_fn)
    normal_grads = grads(actor)
    with replay.replaying(routes):
        replayed = actor.train_step(mbs, loss_fn)
    replayed_grads = grads(actor)
    assert normal["loss"] == replayed["loss"], (normal["loss"], replayed["loss"])
    for name, g in normal_grads.items():
        assert torch.equal(g, replayed_grads[name]), (
            f"grad of {name} differs by {(g - replayed_grads[name]).abs().max()}"
        )
    router_names = [n for n in normal_grads if n.endswith("router.weight")]
    assert router_names and all(normal_grads[n].abs().sum() > 0 for n in router_names)

    # -- 2. routes from perturbed router weights
    saved = [s.router.weight.detach().clone() for s in replay.sites]
    # Perturb only the last MoE layer: earlier layers keep their routes, so under replay the last router
    # sees the normal path's hidden states and its own choice is exactly `routes` (an independent reference).
    for site in [s for s in replay.sites if s.layer == replay.moe_layers[-1]]:  # same noise on every rank
        noise = torch.randn(site.router.weight.shape, generator=torch.Generator().manual_seed(site.layer))
        site.router.weight.data.add_(noise * 0.5 * site.router.weight.abs().mean())
    with replay.recording() as rec:
        actor.forward_only(mbs, full_logits)
    perturbed = rec.routes
    for site, w in zip(replay.sites, saved):
        site.router.weight.data.copy_(w)
    with replay.recording() as rec, replay.replaying(perturbed):
        perturbed_logits = actor.forward_only(mbs, full_logits)
    assert torch.equal(set_sets(rec.routes), set_sets(perturbed)), "routers did not use the replayed experts"
    a, b = set_sets(routes), set_sets(perturbed)
    differ_rows = world_sum(float((a != b).any(-1).sum()))
    differ_experts = world_sum(float(sum((~torch.isin(row_a, row_b)).sum() for row_a, row_b in zip(a, b))))
    rows = world_sum(float(a.shape[0]))
    metrics = replay.mismatch_metrics()
    assert differ_rows > 0, "perturbation changed no route: the test would prove nothing"
    assert abs(metrics["routing/token_mismatch"] - differ_rows / rows) < 1e-12, (metrics, differ_rows, rows)
    assert abs(metrics["routing/expert_mismatch"] - differ_experts / (rows * replay.top_k)) < 1e-12, metrics
    # the same over masked tokens only (with_valid), against a mask put into router order here
    masks = [mb.loss_mask > 0 for mb in mbs]
    with replay.replaying(replay.with_valid(perturbed, masks)):
        actor.forward_only(mbs, full_logits)
    masked = replay.mismatch_metrics()["routing/token_mismatch"]
    shard = (lambda m: m.chunk(tp, dim=1)[layout.ranks.tp]) if tp > 1 else (lambda m: m)
    keep = torch.cat([shard(m).t().reshape(-1) for m in masks for _ in replay.layers])
    want = world_sum(float((a != b).any(-1)[keep].sum())) / world_sum(float(keep.sum()))
    assert abs(masked - want) < 1e-12 and masked != metrics["routing/token_mismatch"], (masked, want)
    logit_gap = world_sum(max(float((x - y).abs().max()) for x, y in zip(normal_logits, perturbed_logits)))
    assert logit_gap > 0, "replaying different experts left the logits unchanged"
    with replay.replaying(perturbed):
        actor.train_step(mbs, loss_fn)
    perturbed_grads = grads(actor)
    for n in router_names:
        g = perturbed_grads[n]
        assert g.abs().sum() > 0 and not torch.equal(g, normal_grads[n]), f"router {n} got no / unchanged gradient"

    # -- 3. R3 from the embedded engine's routes (same weights)
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 8, 6, 7)]
    samples = [s for group in engine.generate(prompts, 1, SamplingParams(max_new_tokens=6, seed=3)) for s in group]
    seq_len = 16
    r3_tokens = torch.zeros(len(samples), seq_len, dtype=torch.long)
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        r3_tokens[i, : len(ids)] = torch.tensor(ids)
    dp, dp_rank = layout.dp, layout.ranks.dp
    per = len(samples) // dp
    mine = range(dp_rank * per, (dp_rank + 1) * per)
    r3_mbs = [MicroBatch(r3_tokens[list(mine)])]
    ids, valid = pad_rollout_routes([samples[i].routed_experts for i in mine], seq_len, 8)
    assert not bool(valid.all()), "no padding in the R3 batch: the dummy-id path would be untested"
    r3_routes = replay.routes_from_rollout([ids], [valid])
    plain = actor.forward_only(r3_mbs, full_logits)[0]
    with replay.replaying(r3_routes):
        r3_logits = actor.forward_only(r3_mbs, full_logits)[0]
    r3 = replay.mismatch_metrics()
    assert r3["routing/token_mismatch"] == 0.0, r3
    # not bit-equal: padding rows with dummy experts change each expert's GEMM row count (blocking)
    r3_gap = float((plain[valid] - r3_logits[valid]).abs().max())
    assert r3_gap < 1e-5, r3_gap

    # -- 4. misuse is an error, not silence (under PP one stage would raise while the other waits)
    for bad, what in ((routes[0:1], "forward call"), (routes + routes, "consumed")) if pp == 1 else ():
        try:
            with replay.replaying(bad):
                actor.forward_only(mbs, full_logits)
        except RuntimeError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"replaying {len(bad)} micro-batches of routes over {len(mbs)} forwards was accepted")
    packed = packed_checks(actor, replay, samples, layout, full_logits)
    torch.distributed.barrier()
    write_result(
        args.results,
        token_mismatch=metrics["routing/token_mismatch"],
        expert_mismatch=metrics["routing/expert_mismatch"],
        token_mismatch_counted=differ_rows / rows,
        expert_mismatch_counted=differ_experts / (rows * replay.top_k),
        masked_token_mismatch=masked,
        masked_token_mismatch_counted=want,
        r3_token_mismatch=r3["routing/token_mismatch"],
        r3_logit_gap=r3_gap,
        packed=packed,
    )


if __name__ == "__main__":
    main()
