"""Layout invariance of the policy losses (run under torchrun by tests/test_layout_invariance.py).

Arguments: --out-dir --model-dir --tp --pp --ep --cp --n-micro (one value each, or comma-separated lists of one
value per layout: the job runs the layouts in turn in the same processes, dropping Megatron's groups between
them: `release_groups`), --losses (comma-separated names of ALGOS), --checks (comma-separated subset of CHECKS,
may be empty), --mode (ref = world-1 reference, one layout, writes OUT_DIR/ref.pt; check = compare with it),
--results (tests/workers/harness.py). For each layout and loss a fresh Actor takes one optimizer step on the same
global batch; every rank takes its data-parallel share split into N_MICRO micro-batches. Compared with the
reference: the forward-only log-probs, the global loss, and the update (after - before) of EVERY parameter,
exported with its Hugging Face name; any mismatch raises.
Check mode's --checks, all for gspo: "shortcut": the on-policy shortcut equals the two-pass path in that layout
(under R2). Under context parallelism (cp > 1) only: "unreduced": the same step with the CP reduction of the
sequence ratio patched out (`policy_loss.cp_row_sum` = identity), its measured differences (not asserted here);
"r3": the step under R3 with the batch's natural routes (recorded by the reference job) as the engine's routes,
mismatch 0 and the reference loss and update.

Then, in the same job, the packed path: another fresh Actor takes the step on the same global batch cut
by `split_for_rank(max_tokens=BUDGET)` (DP shares balanced by tokens, sequences packed into rows,
attention confined to each; the log-prob pass merges micro-batches up to a forward budget of 2 x BUDGET). Its
log-probs (per sequence, at response positions), loss and updates are compared with the same padded world-1
reference. The MoE load-balancing loss is off in both (mbridge's Qwen3-MoE config:
moe_router_load_balancing_type = "none"; asserted).

Result per rank: "layouts", one report per layout in the job's order: for each loss its value, the step's
metrics and the number of parameters, after check the measured differences, and under "packed" the packed
path's measurements; the results of the --checks under their names; "layout": the sizes and its seconds.

"step_data" (check mode, gspo): per-rank step data (mcore_rl.step_data) with the real collectives: each rank
holds the half of the batch it "generated" (with R3 routes), the metadata is all-reduced and each rank receives
only its DP rank's samples; its micro-batches must equal the all-gathered path's (pad_rollouts + split_for_rank
of the whole batch) field by field, and a fresh Actor's loss and update on them must equal the packed step's
just taken; result "step_data": those differences, the samples held / trained on / received, bytes received.
"""

import os
import time
from dataclasses import dataclass

import torch

from mcore_rl.megatron.parallel import release_groups
from tests.workers.harness import cpu_megatron, worker_args, write_result

B, S, GROUP = 8, 16, 4
MAX_NEW_TOKENS = S - 6  # the responses' budget: the longest prompt (6 tokens) plus it fills a row
REL_TOL = 1e-5
# a loss's absolute tolerance where its terms are summed in another order (packed rows; context parallel: each rank's
# part of a sequence, reduced over the CP group): gspo's loss (~ -0.008) is the difference of two terms ~ 0.015, so
# rounding alone moves it by ~1e-7, 2e-5 relative (measured at CP2 x TP2 x EP2; the update meets the usual bound)
LOSS_ABS_TOL = 1e-6
BUDGET = 2 * S  # packed micro-batches: the longest sequence (S tokens) fits, several per rank
# the extra checks of a check job (--checks): unreduced and r3 under cp > 1 only, all of them with gspo
CHECKS = ("unreduced", "r3", "shortcut", "step_data")
ALGOS = {
    # hard clips (dual clip too) + token-level rollout IS: clipping paths must be hit
    "grpo": dict(loss="grpo", agg_mode="token-mean", clip_low=0.2, clip_high=0.28, dual_clip=1.5, rollout_is="token"),
    # sequence ratio + k3 KL to a reference policy
    "gspo": dict(loss="gspo", agg_mode="seq-mean-token-mean", clip_low=0.1, clip_high=0.12, kl_coef=0.05),
    # soft gate + entropy bonus (exercises the entropy gradient through vocab-parallel logits) + temperature +
    # the geometric-mean sequence weight (a sequence mean: over the CP group under context parallelism), some
    # sequences rejected above rollout_is_high
    "sapo": dict(
        loss="sapo",
        agg_mode="seq-mean-token-sum-norm",
        entropy_coef=0.01,
        temperature=0.8,
        rollout_is="sequence_geomean",
        rollout_is_high=1.1,
    ),
    # the token-level gradient with the sequence ratio's value + sequence-level rollout IS: both reduce a
    # sequence's tokens (over the CP group under context parallelism); the proximal log-probs interpolated by each
    # token's version lag (loglinear: from the update's own log-probs, no proximal pass)
    "gspo_token": dict(
        loss="gspo_token",
        agg_mode="seq-mean-token-mean",
        clip_low=0.1,
        clip_high=0.12,
        rollout_is="sequence",
        proximal="loglinear",
    ),
}


def global_batch():
    """Deterministic prompts (3-6 tokens) + responses (1-10 tokens), right-padded: one response of a single token,
    longer draws and rows 2 and 7 cut at the budget MAX_NEW_TOKENS, row 7 then filling its row. Under CP2 a padded
    row's position 11, the last of CP rank 1's part of it, is then a response token's (issue 34: the multi-token
    preset's crash)."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    for i in range(B):
        prompt = 3 + i % 4
        resp = int(torch.randint(3, S - prompt + 1, (1,), generator=g))
        resp = 1 if i == 5 else MAX_NEW_TOKENS if i in (2, B - 1) else min(resp, MAX_NEW_TOKENS)
        tokens[i, : prompt + resp] = torch.randint(3, 128, (prompt + resp,), generator=g)
        loss_mask[i, prompt - 1 : prompt - 1 + resp] = 1.0  # position t predicts tokens[t + 1]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.5])
    noise = torch.randn(3, B, S, generator=g)
    return tokens, loss_mask, rewards, noise


def version_lag(loss_mask: torch.Tensor) -> torch.Tensor:
    """Each response token's weight-version lag (0, 1 or 2 by position: sequences that span versions)."""
    return (torch.arange(S) % 3).float() * loss_mask


def compare(tag, name, metrics, update, want, layout_text, loss_abs_tol=0.0, strict=True):
    """Loss within REL_TOL relative (or `loss_abs_tol` absolute), every update within REL_TOL x the largest
    (`strict=False`: measured only). Returns the measured differences."""
    rel_loss = abs(metrics["loss"] - want["loss"]) / abs(want["loss"])
    assert not strict or rel_loss <= REL_TOL or abs(metrics["loss"] - want["loss"]) <= loss_abs_tol, (
        f"{tag} {name} {layout_text}: loss {metrics['loss']} vs reference {want['loss']} (rel {rel_loss:.2e})"
    )
    assert set(update) == set(want["update"])
    scale = max(float(u.abs().max()) for u in want["update"].values())
    worst_name, worst = max(
        ((n, float((update[n] - want["update"][n]).abs().max())) for n in update), key=lambda x: x[1]
    )
    assert not strict or worst <= REL_TOL * scale, (
        f"{tag} {name} {layout_text}: update of {worst_name} differs by {worst:.3e} (largest update {scale:.3e})"
    )
    return dict(
        loss=metrics["loss"], rel_loss=rel_loss, update_diff=worst, worst_param=worst_name, largest_update=scale
    )


def packed_step(actor, algo, tokens, loss_mask, advantages, lp_full, fields, counts):
    """One step on packed token-budget micro-batches of the same global batch; returns (metrics, max
    |packed - padded log-prob| at response positions, the micro-batches' lengths)."""
    from mcore_rl.batch import RolloutBatch, pack_field, split_for_rank, unpack_rows
    from mcore_rl.megatron.policy_loss import make_policy_loss_fn

    layout = actor.layout
    prompt_lens = (loss_mask.argmax(-1) + 1).long()
    batch = RolloutBatch(
        tokens,
        loss_mask,
        fields["rollout"],
        advantages,
        torch.zeros(B),
        loss_mask.sum(-1).long(),
        prompt_lens,
        version_lag=version_lag(loss_mask),
    )
    (mini,) = split_for_rank(batch, 1, layout.dp, layout.ranks.dp, max_tokens=BUDGET, multiple=layout.seq_len_multiple)
    assert mini.counts == counts, (mini.counts, counts)
    mbs = mini.micro_batches
    # through log_probs: merged forwards under actor.max_tokens_per_forward_micro_batch, cut back per micro-batch
    lps = actor.log_probs(mbs, temperature=algo.temperature)
    lp_diff = 0.0
    for mb, lp in zip(mbs, lps):
        for row, piece in zip(mb.source_rows, unpack_rows(lp.cpu(), mb)):
            n = piece.shape[-1]
            lp_diff = max(lp_diff, float(((piece[0] - lp_full[row, :n]) * loss_mask[row, :n]).abs().max()))
        mb.old_log_prob = pack_field(fields["old"], mb)
        mb.ref_log_prob = pack_field(fields["ref"], mb)
    metrics = actor.train_step(mbs, make_policy_loss_fn(algo, mini.counts, layout.groups.tp))
    return metrics, lp_diff, [mb.tokens.shape[1] for mb in mbs]


# Per-rank step data (mcore_rl.step_data) through the real collectives, against today's all-gathered path
# (every rank packs every sample: pad_rollouts + split_for_rank): the same micro-batches, field by field,
# only this DP rank's samples received, and the same loss and update (compare's tolerances).
def check_per_rank_step_data(actor, algo, tokens, loss_mask, rewards, fields, before):
    """Returns (metrics, update, measurements) of a step on the micro-batches built from per-rank step data."""
    import dataclasses

    from mcore_rl.algos import group_advantages
    from mcore_rl.batch import RolloutSample, pack_field, pad_rollouts, plan_mini_batches, split_for_rank
    from mcore_rl.megatron.policy_loss import make_policy_loss_fn
    from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout
    from mcore_rl.step_data import ExchangeStats, dp_ranks, exchange_meta, local_mini_batches

    layout, rank, world = actor.layout, torch.distributed.get_rank(), torch.distributed.get_world_size()
    hf = actor.hf_config
    experts, top_k, layers = hf.num_experts, hf.num_experts_per_tok, hf.num_hidden_layers
    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(B):  # the test batch as the engine returns it, with R3 routes (exchanged, not trained on)
        p, r = int(loss_mask[i].argmax()) + 1, int(loss_mask[i].sum())
        routes = torch.randint(0, experts, (p + r, layers, top_k), generator=g).to(torch.int16)
        lp = fields["rollout"][i, p - 1 : p + r - 1].clone()
        samples.append(RolloutSample(tokens[i, :p].tolist(), tokens[i, p : p + r].tolist(), lp, "stop", routes))
    replicas = ReplicaLayout(rank, world, 1)  # the embedded engine: each rank generated B / world samples
    local = LocalRollout(replicas, B, 1, [[samples[i]] for i in replicas.share(B)])
    stats = ExchangeStats()
    meta = exchange_meta(local, [float(rewards[i]) for i in local.scored], [True] * len(local.scored), stats)
    advantages = group_advantages(meta.rewards, GROUP)
    plans = plan_mini_batches(
        meta.lengths, meta.loss_tokens, 1, layout.dp, max_tokens=BUDGET, multiple=layout.seq_len_multiple, max_len=S
    )
    multiple = layout.seq_len_multiple
    (mini,) = local_mini_batches(local, meta, plans, advantages, dp_ranks(layout.ranks.dp), 0, multiple, experts, stats)
    whole = pad_rollouts(samples, rewards, group_advantages(rewards, GROUP), 0, multiple)
    (today,) = split_for_rank(
        whole, 1, layout.dp, layout.ranks.dp, max_len=S, route_experts=experts, max_tokens=BUDGET, multiple=multiple
    )
    assert mini.counts == today.counts, (mini.counts, today.counts)
    assert len(mini.micro_batches) == len(today.micro_batches)
    for a, b in zip(mini.micro_batches, today.micro_batches):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            same = torch.equal(x, y) if torch.is_tensor(y) else x == y
            assert same, f"per-rank step data: micro-batch field {f.name} differs from the all-gathered path"
    trained = sorted(i for mb in mini.micro_batches for i in mb.source_rows)
    received = [i for i in trained if i not in local.held]
    # exactly this DP rank's samples that this rank did not generate reached it, nothing else
    assert stats.received_bytes == sum(meta.sample_nbytes(i) for i in received), stats
    for mb in mini.micro_batches:  # R3 is off in this test: train without routes
        mb.routed_experts = mb.route_valid = None
        mb.old_log_prob, mb.ref_log_prob = pack_field(fields["old"], mb), pack_field(fields["ref"], mb)
    metrics = actor.train_step(mini.micro_batches, make_policy_loss_fn(algo, mini.counts, layout.groups.tp))
    update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
    measured = dict(
        dp_rank=layout.ranks.dp,
        held=list(local.held),
        trained=trained,
        received=received,
        received_bytes=stats.received_bytes,
        step_bytes=sum(meta.sample_nbytes(i) for i in range(B)),
    )
    return metrics, update, measured


# The on-policy shortcut (AlgoConfig.old_from_update) against the two-pass path it replaces, under R2 (the
# shortcut's update records routes; the two-pass update replays the old pass's): the demo's GSPO clip range,
# token-level rollout IS. Same loss, entropy metric and update of every parameter, relative 1e-6.
SHORTCUT_TOL = 1e-6
SHORTCUT_ALGO = dict(
    loss="gspo", agg_mode="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4, rollout_is="token", routing_replay="r2"
)


def check_on_policy_shortcut(make_actor, micro_batches, counts, before):
    """Two fresh actors from the same weights: (a) old-policy pass (log-probs + entropy + R2 routes), then the
    update; (b) the update alone with on_policy=True. Raises on any difference beyond SHORTCUT_TOL; returns the measurements."""
    import dataclasses

    from mcore_rl.batch import MiniBatch
    from mcore_rl.config import AlgoConfig

    algo = AlgoConfig(**SHORTCUT_ALGO)
    runs = {}
    for path in ("two_pass", "shortcut"):
        actor = make_actor()
        actor.enable_routing_replay()
        mbs = [dataclasses.replace(mb) for mb in micro_batches]
        if path == "two_pass":
            for mb, out in zip(mbs, actor.log_probs(mbs, with_entropy=True, record_routes=True)):
                mb.old_log_prob, mb.entropy = out[0], out[1]
            entropy = actor.masked_sum([mb.entropy for mb in mbs], mbs) / counts.num_tokens
            metrics = actor.train_policy(MiniBatch(counts, mbs), algo)
        else:
            try:  # never under R3: the update would replay routes the old policy did not use
                actor.train_policy(
                    MiniBatch(counts, mbs), AlgoConfig(**{**SHORTCUT_ALGO, "routing_replay": "r3"}), True
                )
                raise AssertionError("on_policy=True was accepted under routing_replay=r3")
            except ValueError as err:
                assert "r3" in str(err), err
            metrics = actor.train_policy(MiniBatch(counts, mbs), algo, on_policy=True)
            entropy = metrics["entropy"]
            assert all(mb.old_log_prob is None and mb.replay_routes is not None for mb in mbs)
        update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
        runs[path] = (metrics, float(entropy), update)
        del actor
    (m2, e2, u2), (m1, e1, u1) = runs["two_pass"], runs["shortcut"]
    for key, a, b in (
        ("loss", m1["loss"], m2["loss"]),
        ("entropy", e1, e2),
        ("grad_norm", m1["grad_norm"], m2["grad_norm"]),
    ):
        assert abs(a - b) <= SHORTCUT_TOL * abs(b), f"on-policy shortcut: {key} {a} vs two-pass {b}"
    scale = max(float(u.abs().max()) for u in u2.values())
    worst_name, worst = max(((n, float((u1[n] - u2[n]).abs().max())) for n in u2), key=lambda x: x[1])
    assert scale > 0 and worst <= SHORTCUT_TOL * scale, (
        f"shortcut update of {worst_name} differs by {worst:.3e} ({scale:.3e})"
    )
    return dict(
        loss=m1["loss"],
        two_pass_loss=m2["loss"],
        entropy=e1,
        two_pass_entropy=e2,
        grad_norm=m1["grad_norm"],
        two_pass_grad_norm=m2["grad_norm"],
        update_diff=worst,
        largest_update=scale,
    )


# R3 under context parallelism: the engine's routes ([b, s, layers, k] per micro-batch) are split over the CP ranks
# like the tokens. Routes recorded at world 1 are the batch's natural routes, so replaying them must give the
# reference step (mismatch 0, the same loss and update).
def natural_routes(actor, tokens) -> torch.Tensor:
    """[B, S, moe_layers, k] the experts every router of the world-1 actor picks for the batch (R2 recording)."""
    from mcore_rl.batch import MicroBatch
    from mcore_rl.megatron.policy_loss import make_log_prob_fn

    actor.enable_routing_replay()
    with actor.replay.recording() as recorded:
        actor.forward_only([MicroBatch(tokens)], make_log_prob_fn(1.0, None))
    ids = recorded.routes.micro_batches[0].ids  # layer -> [S * B, k], Megatron's sequence-major order
    b, s = tokens.shape
    per_layer = [ids[layer].long().view(s, b, -1).transpose(0, 1) for layer in actor.replay.moe_layers]
    return torch.stack(per_layer, dim=2).to(torch.int16)


def check_r3_routes(actor, algo, micro_batches, routes):
    """One GSPO step under routing_replay=r3 with `routes` (this DP rank's rows) as the engine's routes."""
    import dataclasses

    from safetensors.torch import load_file

    from mcore_rl.algos import GlobalCounts
    from mcore_rl.batch import MiniBatch
    from mcore_rl.config import AlgoConfig

    actor.enable_routing_replay()
    mbs, start = [], 0
    for mb in micro_batches:
        n = mb.tokens.shape[0]
        part = routes[start : start + n]
        mbs.append(
            dataclasses.replace(mb, routed_experts=part, route_valid=torch.ones(part.shape[:2], dtype=torch.bool))
        )
        start += n
    counts = GlobalCounts.from_mask(global_batch()[1])
    metrics = actor.train_policy(MiniBatch(counts, mbs), AlgoConfig(**{**ALGOS["gspo"], "routing_replay": "r3"}))
    before = load_file(os.path.join(actor.cfg.model.path, "model.safetensors"))
    update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
    mismatch = metrics["routing/token_mismatch"]
    assert mismatch == 0.0, f"r3 under cp: the replayed natural routes mismatch the routers ({mismatch})"
    return dict(loss=metrics["loss"], token_mismatch=mismatch, update=update)


@dataclass(frozen=True)
class LayoutCase:
    """One layout of the job: its sizes and micro-batch count (the worker runs each in turn, same processes)."""

    tp: int
    pp: int
    ep: int
    cp: int
    n_micro: int

    @property
    def text(self) -> str:
        return f"tp{self.tp} pp{self.pp} ep{self.ep} cp{self.cp}"


def layout_cases(args) -> list[LayoutCase]:
    """--tp 2,1 --pp 1,2 ...: one layout per position (all lists the same length)."""
    lists = [[int(v) for v in str(getattr(args, k)).split(",")] for k in ("tp", "pp", "ep", "cp", "n_micro")]
    if len({len(values) for values in lists}) != 1:
        raise SystemExit(f"--tp --pp --ep --cp --n-micro need one value per layout each: {lists}")
    return [LayoutCase(*values) for values in zip(*lists)]


def main():
    args = worker_args(
        __doc__,
        out_dir=str,
        model_dir=str,
        tp=str,
        pp=str,
        ep=str,
        cp=str,
        n_micro=str,
        losses=str,
        checks=str,
        mode=("ref", "check"),
    )
    cases = layout_cases(args)
    checks = set(filter(None, args.checks.split(",")))
    if not checks <= set(CHECKS) or (args.mode == "ref" and len(cases) != 1):
        raise SystemExit(f"--checks: a comma-separated subset of {CHECKS} (or none); ref mode: one layout")
    platform = cpu_megatron()
    ref = torch.load(os.path.join(args.out_dir, "ref.pt")) if args.mode == "check" else {}
    reports = []
    for i, case in enumerate(cases):
        if i:  # Megatron's groups of the previous layout dropped: the next Actor creates this one's
            release_groups()
        start = time.perf_counter()
        results, report = run_layout(case, args, checks, ref, platform)
        reports.append(dict(report, layout=vars(case) | {"seconds": time.perf_counter() - start}))
    if args.mode == "ref" and torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(args.out_dir, "ref.pt"))
    torch.distributed.barrier()
    write_result(args.results, layouts=reports)


def run_layout(case: LayoutCase, args, checks: set, ref: dict, platform):
    """Every loss of --losses (and the --checks) in layout `case`; (results for ref.pt, this rank's report)."""
    model_dir, mode = args.model_dir, args.mode
    tp, pp, ep, cp, n_micro = case.tp, case.pp, case.ep, case.cp, case.n_micro

    from safetensors.torch import load_file

    from mcore_rl.algos import GlobalCounts, group_advantages
    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import AlgoConfig, Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor
    from mcore_rl.megatron.policy_loss import make_log_prob_fn, make_policy_loss_fn

    before = load_file(os.path.join(model_dir, "model.safetensors"))
    tokens, loss_mask, rewards, noise = global_batch()
    counts = GlobalCounts.from_mask(loss_mask)  # from the full global batch, before any split
    advantages = group_advantages(rewards, GROUP).unsqueeze(-1).expand(B, S).contiguous()
    results, report = {}, {}
    for name in args.losses.split(","):
        algo = AlgoConfig(**ALGOS[name])
        cfg = Config(platform="cpu", model=ModelConfig(path=model_dir))
        cfg.actor.parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1, cp=cp)
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
        diff = 0.0
        if mode == "check":
            diff = float(((lp_here - lp_full) * loss_mask[rows.start : rows.stop]).abs().max())
            assert diff < 1e-5, f"{name}: forward_only log-probs differ from the TP1 reference by {diff}"
        old = lp_full + 0.3 * noise[0, rows.start : rows.stop]  # ratios away from 1: clipping paths hit
        rollout = old + 0.2 * noise[1, rows.start : rows.stop]
        ref_lp = lp_full + 0.5 * noise[2, rows.start : rows.stop]
        if mode == "ref" and algo.rollout_is == "sequence_geomean":  # some sequences rejected, some weighted
            m = loss_mask[rows.start : rows.stop]
            geo = torch.exp(((old - rollout) * m).sum(-1) / m.sum(-1))
            assert 0 < int((geo > algo.rollout_is_high).sum()) < len(geo), geo
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
                    version_lag=version_lag(loss_mask[r0 : r0 + size]),
                )
            )
        assert actor.tf_config.moe_router_load_balancing_type == "none", actor.tf_config.moe_router_load_balancing_type
        metrics = actor.train_step(train_mbs, make_policy_loss_fn(algo, counts, tp_group))
        update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
        results[name] = {"loss": metrics["loss"], "metrics": metrics, "update": update, "log_prob_full": lp_here}
        report[name] = {"loss": metrics["loss"], "metrics": metrics, "params": len(update), "log_prob_diff": diff}
        layout_text = f"tp{tp} pp{pp} ep{ep} cp{cp} dp{dp}"
        tol = LOSS_ABS_TOL if cp > 1 else 0.0
        if mode == "check":
            report[name].update(
                compare("layout", name, metrics, update, ref[name], f"{layout_text} micro{n_micro}", tol)
            )
        if mode == "check" and cp > 1 and name == "gspo" and "unreduced" in checks:
            # the same step without the CP reduction of the sequence ratio: each CP rank's ratio from its own part
            # of the sequence only
            import mcore_rl.megatron.policy_loss as policy_loss_module

            reduced = policy_loss_module.cp_row_sum
            policy_loss_module.cp_row_sum = lambda values, group: values
            try:
                unreduced = Actor(cfg, platform)
                got = unreduced.train_step(train_mbs, make_policy_loss_fn(algo, counts, tp_group))
                got_update = {n: (t.float() - before[n].float()).clone() for n, t in unreduced.export_hf_weights()}
                del unreduced
            finally:
                policy_loss_module.cp_row_sum = reduced
            report["unreduced"] = compare("unreduced", name, got, got_update, ref[name], layout_text, strict=False)
        else:
            cf = metrics.get("clipfrac_upper", 0.0) + metrics.get("clipfrac_lower", 0.0)
            if name == "grpo":  # every clipping branch is exercised by this batch
                assert (
                    metrics["clipfrac_upper"] > 0 and metrics["clipfrac_lower"] > 0 and metrics["dual_clipfrac"] > 0
                ), metrics
            if name == "gspo":  # some sequences clipped, some not (so the gradient is not all zero)
                assert 0 < cf < 1, metrics
        del actor
        if name == "gspo" and mode == "ref":  # the batch's natural routes: R3 routes of the CP check below
            results["routes"] = natural_routes(Actor(cfg, platform), tokens)
        if name == "gspo" and mode == "check" and cp > 1 and "r3" in checks:
            report["r3"] = check_r3_routes(Actor(cfg, platform), algo, train_mbs, ref["routes"][rows.start : rows.stop])
            report["r3"].update(
                compare("r3", name, report["r3"], report["r3"].pop("update"), ref[name], layout_text, tol)
            )
        if name == "gspo" and mode == "check" and "shortcut" in checks:
            shortcut_mbs = [
                MicroBatch(
                    mb.tokens,
                    loss_mask=mb.loss_mask,
                    advantages=mb.advantages,
                    rollout_log_prob=lp + 0.05 * noise[1, r0 : r0 + size],
                )
                for mb, lp, r0 in zip(train_mbs, lp_here.split(size), range(rows.start, rows.stop, size))
            ]
            report["shortcut"] = check_on_policy_shortcut(
                lambda cfg=cfg: Actor(cfg, platform), shortcut_mbs, counts, before
            )

        # -- the packed path, same global batch, same reference
        cfg.actor.max_tokens_per_micro_batch, cfg.actor.max_tokens_per_forward_micro_batch = BUDGET, 2 * BUDGET
        actor = Actor(cfg, platform)
        lp_all = ref[name]["log_prob_full"] if mode == "check" else lp_here
        fields = {
            "old": lp_all + 0.3 * noise[0],
            "rollout": lp_all + 0.3 * noise[0] + 0.2 * noise[1],
            "ref": lp_all + 0.5 * noise[2],
        }
        metrics, lp_diff, lengths = packed_step(actor, algo, tokens, loss_mask, advantages, lp_all, fields, counts)
        assert lp_diff <= 1e-5, f"{name}: packed log-probs differ from the padded reference by {lp_diff:.2e}"
        update = {n: (t.float() - before[n].float()).clone() for n, t in actor.export_hf_weights()}
        want = ref[name] if mode == "check" else results[name]
        # Packed log-probs equal the padded ones to ~5e-7, not bit for bit (RoPE angles of the same relative
        # position are computed at other absolute positions of the row), and the loss averages them times
        # advantages of order 1: an absolute 1e-6 is what that allows (gspo's loss, ~-0.008, is a difference
        # of two terms ~0.015 and cannot meet 1e-5 relative from rounding alone). Updates: the usual bound.
        text = f"{layout_text} rows {lengths} (padded {B // dp}x{S}) lp {lp_diff:.1e}"
        packed = compare("packed", name, metrics, update, want, text, LOSS_ABS_TOL)
        report[name]["packed"] = dict(packed, log_prob_diff=lp_diff, rows=lengths, params=len(update))
        del actor
        if (
            name == "gspo" and mode == "check" and "step_data" in checks
        ):  # per-rank step data against the packed step just taken
            start = time.perf_counter()
            actor = Actor(cfg, platform)
            got, got_update, measured = check_per_rank_step_data(
                actor, algo, tokens, loss_mask, rewards, fields, before
            )
            same = compare("step_data", name, got, got_update, {"loss": metrics["loss"], "update": update}, "")
            report["step_data"] = dict(same, **measured, seconds=time.perf_counter() - start)
            del actor
    return results, report


if __name__ == "__main__":
    main()
