"""Weight sync from a real multi-process Megatron actor (via ModelBridge) into the embedded engine on rank 0.

Usage: torchrun --nproc_per_node=2 sync_megatron.py --layout tp2 --engine-ckpt DIR --actor-ckpt DIR --results DIR
  --layout: tp2 | ep2. The engine starts from ENGINE_CKPT, the actor from ACTOR_CKPT (different weights),
  so a sync must really move them. Only rank 0 holds an engine; every rank drives the exporter.
  MoE or dense (Qwen3, tied Qwen2): routes are compared for MoE only; step 5 corrupts layer 1's MLP.
Result per rank (tests/workers/harness.py): the measurements below (engine ones on rank 0); a failed check raises.
"""

import logging

import torch
import torch.distributed as dist

from mcore_rl.megatron.parallel import destroy_parallel
from mcore_rl.rollout.base import SamplingParams
from mcore_rl.rollout.embedded import EmbeddedEngine
from mcore_rl.weight_sync.buckets import sync_weights
from mcore_rl.weight_sync.exporter import HFExporter
from mcore_rl.weight_sync.verify import ProbeBatch, SyncVerificationError, verify_sync
from tests.workers.harness import worker_args, write_result
from tests.workers.sync_actor import actor_logprobs, build_actor, tp_group

TOL = 1e-4


class RouterTap:
    """Forward hooks on Megatron's routers: top-k expert ids per token and MoE layer (TP shards gathered)."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.maps = [None] * len(self.routers)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, output):
            self.maps[i] = output[1]  # routing_map [tokens, experts] bool

        return hook

    def routes(self, k: int) -> torch.Tensor:
        """[tokens, layers, k] sorted expert ids; sequence-parallel shards are gathered along tokens."""
        group, size = tp_group()
        per_layer = []
        for m in self.maps:
            ids = torch.stack([row.nonzero().squeeze(-1) for row in m])  # sorted ascending
            if size > 1 and m.shape[0] * size != 0:
                parts = [torch.empty_like(ids) for _ in range(size)]
                dist.all_gather(parts, ids.contiguous(), group=group)
                ids = torch.cat(parts, 0)
            per_layer.append(ids)
        return torch.stack(per_layer, 1)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@torch.no_grad()
def perturb(model) -> None:
    """A deterministic weight change that depends only on each local tensor's shape (identical on replicas)."""
    for p in model.parameters():
        p.add_(0.02 * torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37).view_as(p).to(p.dtype))


def main(layout: str, engine_ckpt: str, actor_ckpt: str, results: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    bridge, model, bound = build_actor(layout, actor_ckpt)
    rank = dist.get_rank()
    engine = EmbeddedEngine(engine_ckpt) if rank == 0 else None
    reference = actor_logprobs(model, bound.tp)
    exporter = HFExporter(bridge)
    export = lambda: exporter.export([model])  # noqa: E731
    probe = ProbeBatch.random(bridge.hf_config.vocab_size, num_seqs=3, prompt_len=6, response_len=18, seed=4)
    result = {"layout": layout}

    # 1. before any sync the engine is a different policy: verification must fail and name tensors
    try:
        verify_sync(engine, reference, probe, tol=TOL, fallback="error", export_fn=export)
        raise AssertionError("verification passed before the first sync")
    except SyncVerificationError as err:
        result["unsynced_error_names_tensors"] = "worst tensors: model." in str(err)

    # 2. sync with a bucket smaller than the largest tensor; engine == actor afterwards
    stats = sync_weights(export(), engine, bucket_mb=0.02)
    result.update(
        num_tensors=stats.num_tensors,
        num_buckets=stats.num_buckets,
        largest=stats.largest_tensor_bytes,
        bucket_bytes=int(0.02 * (1 << 20)),
    )
    report = verify_sync(engine, reference, probe, tol=TOL, fallback="error", export_fn=export)
    result["verify_max_diff"] = report.max_diff

    # 3. sampled log-probs and routes of the engine vs the actor on the sampled sequences
    samples = None
    if rank == 0:
        prompts = [[1, 5 + i, 20 + i, 7, 9 + i] for i in range(3)]
        groups = engine.generate(prompts, 2, SamplingParams(temperature=0.9, max_new_tokens=12, seed=1))
        samples = [
            (s.prompt_ids + s.response_ids, len(s.prompt_ids), s.logprobs, s.routed_experts) for g in groups for s in g
        ]
    box = [samples]
    dist.broadcast_object_list(box, src=0)
    samples = box[0]
    moe = bool(getattr(bridge.hf_config, "num_experts", 0))
    tap = RouterTap(model) if moe else None
    lp_diff, route_mismatch = 0.0, 0
    for seq, plen, engine_lp, engine_routes in samples:
        actor_lp = reference([seq], [plen], 0.9)[0]
        lp_diff = max(lp_diff, (actor_lp - engine_lp).abs().max().item())
        if moe:
            actor_routes = tap.routes(bridge.hf_config.num_experts_per_tok)[: len(seq)]
            route_mismatch += int((actor_routes != engine_routes.long().sort(-1).values).sum())
        else:
            assert engine_routes is None, "a dense model's samples carry routed experts"
    route_shape = list(samples[0][3].shape) if moe else None
    result.update(sample_logprob_diff=lp_diff, route_mismatches=route_mismatch, route_shape=route_shape)

    # 4. the actor's weights change: the stale engine fails verification, a new sync fixes it
    before = engine.score(probe.sequences, probe.prompt_lens) if engine else None
    perturb(model)
    try:
        verify_sync(engine, reference, probe, tol=TOL, fallback="error")
        raise AssertionError("a stale engine passed verification")
    except SyncVerificationError:
        pass
    sync_weights(export(), engine, bucket_mb=1.0)
    report = verify_sync(engine, reference, probe, tol=TOL)
    result["verify_after_change"] = report.max_diff
    if engine:
        after = engine.score(probe.sequences, probe.prompt_lens)
        result["engine_change"] = max_diff(after, before)

    # 5. an inexact reload (corrupted experts / MLP) is caught and the rebuild fallback repairs it
    if engine:
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if ("layers.1.mlp.experts" if moe else "layers.1.mlp.") in name:
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    report = verify_sync(engine, reference, probe, tol=TOL, fallback="rebuild", export_fn=export)
    result.update(corrupt_max_diff=report.max_diff, rebuilt=report.rebuilt, after_rebuild=report.max_diff_after_rebuild)
    destroy_parallel()
    write_result(results, **result)


if __name__ == "__main__":
    args = worker_args(__doc__, layout=("tp2", "ep2"), engine_ckpt=str, actor_ckpt=str)
    main(args.layout, args.engine_ckpt, args.actor_ckpt, args.results)
