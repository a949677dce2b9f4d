"""Weight-sync throughput: a ~1B-parameter Qwen3-MoE-shaped model from a 2-process Megatron actor to the engine.

    torchrun --nproc_per_node=2 benchmarks/weight_sync.py [--layout ep2|tp2|dp2] [--bucket-mb 256] [--trials 3] [--check]
                                                          [--baseline]

The model has random weights (Megatron's initialisation from a config; no checkpoint), bf16 everywhere:
hidden 1024, 13 layers, 16 heads x 64 (4 KV groups), 32 experts top-4 of FFN 512, vocabulary 151,936
(Qwen3's) -> ~0.99B parameters, ~2.0 GB. The embedded engine (transformers, bf16) lives on rank 0 only;
both ranks drive the exporter (collective gathers). Rank 0 also measures single-threaded memcpy in the same
run, the machine's ceiling for moving bytes from one tensor into another, two ways: right before each sync,
about the sync's volume (a 512 MB buffer copied 4 times) - the paired ratio is the median over the syncs of
the sync's rate over the memcpy rate of that moment (on a shared machine the load changes from second to
second); and the strict ratio: the best sync over the fastest memcpy seen in the whole run (best of 5 copies
of 512 MB before and after the syncs, and the paired ones).
The sync runs as the trainer's does: the engine's parameters live in a shared-memory region it offers the
export (`WeightReceiver.shared`, mcore_rl/weight_sync/receiver.py), so every rank writes its own shards straight
into them (mcore_rl/weight_sync/direct_write.py) and rank 0 copies only its own; `--baseline` also times, in the
same run, the gather-into-buffers-then-copy path (no receiver: the peer's shards travel through the gather's
shared segments and the engine copies every tensor). Prints the sync's GB/s, memcpy GB/s and their ratio (target >= 0.5), and the gloo all_gather rate between
the two processes (the transport the exporter's gathers use: on one CPU host it is the bottleneck) next to
the same gather through shared memory (/dev/shm), what a same-host transport in the exporter could reach. `--check` re-exports
through torch.distributed (whole split tensors gathered and converted by mbridge, an independent path) and compares
every engine tensor with it (bit-exact expected); the baseline runs first, so the check sees the direct path's result.
Also printed: how many of the direct sync's bytes went straight into the engine and how many through buffers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=13,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    vocab_size=151936,
)


def write_config(out_dir: str) -> None:
    """config.json of the benchmark model plus the tiny tokenizer (the engine only needs eos / pad ids)."""
    from mcore_rl.models.tiny import build_hf_config, build_tokenizer

    config = build_hf_config()
    for key, value in SHAPE.items():
        setattr(config, key, value)
    config.intermediate_size = 2 * SHAPE["moe_intermediate_size"]
    config.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)


def memcpy_gb_per_s(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / 1e9 / best


class PairedMemcpy:
    """memcpy of about one sync's volume right before each sync (a 512 MB buffer copied repeatedly, timed as a
    whole): on a shared machine the load changes from second to second, so each sync is compared with the
    memcpy rate of the same moment."""

    def __init__(self, nbytes: int = 512 << 20):
        self.src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # touch both: no page faults in the timed copies

    def gb_per_s(self, volume: int) -> float:
        repeats = max(1, round(volume / (self.src.numel() * 2)))
        start = time.perf_counter()
        for _ in range(repeats):
            self.dst.copy_(self.src)
        return repeats * self.src.numel() * 2 / 1e9 / (time.perf_counter() - start)


def gloo_all_gather_gb_per_s(nbytes: int = 128 << 20, chunk: int = 4 << 20) -> float:
    """Bytes per second arriving at one rank in all_gathers of `chunk`-sized shards (the exporter's transport)."""
    shard = torch.ones(chunk // 2, dtype=torch.bfloat16)
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(nbytes // chunk):
        dist.all_gather(out, shard)
    return nbytes * dist.get_world_size() / 1e9 / (time.perf_counter() - start)


def shm_gather_gb_per_s(nbytes: int = 128 << 20, chunk: int = 4 << 20) -> float:
    """The same all-gather through file-backed shared memory (/dev/shm): what a same-host transport could do.

    Each rank writes its shard into its own shared file, a barrier, then every rank copies all shards out.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    paths = [f"/dev/shm/mcore_rl_bench_{os.getppid()}_{r}" for r in range(world)]
    numel = chunk // 2
    mine = torch.from_file(paths[rank], shared=True, size=numel, dtype=torch.bfloat16)
    dist.barrier()
    peers = [torch.from_file(p, shared=True, size=numel, dtype=torch.bfloat16) for p in paths]
    shard = torch.ones(numel, dtype=torch.bfloat16)
    out = torch.empty(world * numel, dtype=torch.bfloat16)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(nbytes // chunk):
        mine.copy_(shard)
        dist.barrier()
        for r, peer in enumerate(peers):
            out[r * numel : (r + 1) * numel].copy_(peer)
        dist.barrier()  # a shard is overwritten only after every rank read it
    rate = nbytes * world / 1e9 / (time.perf_counter() - start)
    os.remove(paths[rank])
    return rate


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layout",
        choices=["ep2", "tp2", "dp2"],
        default="ep2",
        help="actor layout over the 2 processes; dp2 replicates the model (export needs no gathers)",
    )
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--check", action="store_true", help="compare every synced tensor with the export")
    parser.add_argument(
        "--baseline", action="store_true", help="also time the gather-then-copy path (no `into`) in this run"
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=3,
        help="syncs to time; the best is reported (a shared machine's noise only ever slows a run down)",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from mcore_rl.config import ModelConfig, ParallelConfig
    from mcore_rl.megatron.parallel import destroy_parallel, init_parallel
    from mcore_rl.models.bridge import ModelBridge
    from mcore_rl.platform import get_platform
    from mcore_rl.platform.shm_gather import GroupGather
    from mcore_rl.rollout.embedded import EmbeddedEngine
    from mcore_rl.weight_sync.buckets import sync_weights
    from mcore_rl.weight_sync.exporter import HFExporter
    from mcore_rl.weight_sync.receiver import COPY_IN

    platform = get_platform("cpu")
    platform.init_distributed()
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="sync_bench_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model_dir = box[0]
    if rank == 0:
        write_config(model_dir)
    dist.barrier()

    parallel = {
        "ep2": ParallelConfig(ep=2),
        "tp2": ParallelConfig(tp=2, sequence_parallel=True),
        "dp2": ParallelConfig(),
    }[args.layout]
    bridge = ModelBridge(model_dir, platform)
    layout = init_parallel(parallel, platform, bridge.hf_config)
    start = time.perf_counter()
    chunks = bridge.build_model(layout, ModelConfig(path=model_dir, dtype="bfloat16"))
    exporter = HFExporter(bridge)
    actor_params = sum(p.numel() for c in chunks for p in c.parameters())
    build_s = time.perf_counter() - start
    engine = None
    if rank == 0:
        start = time.perf_counter()
        engine = EmbeddedEngine(model_dir, dtype="bfloat16", config=bridge.hf_config)
        engine_params = sum(p.numel() for p in engine.model.parameters())
        print(
            f"actor ({args.layout}) built in {build_s:.1f} s, {actor_params / 1e9:.3f}B params on rank 0; "
            f"engine {engine_params / 1e9:.3f}B params (bf16) in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    # The models' Python objects (~millions: Megatron, transformers) are frozen out of the garbage collector, as
    # a long-running process should: otherwise a full collection (0.2-0.7 s here) lands in whichever sync happens
    # to trigger it, on either rank, and measures the collector rather than the sync.
    gc.collect()
    gc.freeze()
    dist.barrier()

    paired = PairedMemcpy() if rank == 0 else None
    volume = 2 << 30  # about the model's bytes

    def timed_syncs(direct: bool, label: str) -> list:
        out = []
        for trial in range(args.trials):  # the first pass also pays page faults of fresh buffers
            moment = paired.gb_per_s(volume) if paired is not None else 0.0
            dist.barrier()
            # ranks without an engine only contribute their shards (written into rank 0's engine, or its segments)
            receiver = (engine.capabilities.receiver if engine is not None else COPY_IN) if direct else None
            stats = sync_weights(
                exporter.export(chunks, receive=engine is not None, receiver=receiver),
                engine,
                bucket_mb=args.bucket_mb,
            )
            out.append((stats, moment))
            if rank == 0:
                print(f"{label} trial {trial}: {stats.summary()}; memcpy just before {moment:.2f} GB/s", flush=True)
        return out

    memcpy_before = memcpy_gb_per_s() if rank == 0 else 0.0
    # the baseline first, so that the engine holds what the direct path wrote when --check compares it
    baseline = timed_syncs(False, "baseline (gather, then copy)") if args.baseline else []
    results = timed_syncs(True, "into the engine")
    direct_stats = exporter.stats  # of the last sync into the engine
    dist.barrier()
    check = None
    if args.check:
        # the reference export takes the other transport (torch.distributed: ranks claim different hosts), where
        # every split tensor is gathered whole and converted by mbridge; it is compared with the engine's tensors
        # (a new exporter in the old one's place: the old one's buffers are freed, as a peak-memory baseline needs)
        exporter = HFExporter(bridge, GroupGather(host_id=lambda: f"bench-rank-{rank}"))
        diffs = engine.weight_diffs(exporter.export(chunks)) if engine else None
        if engine is None:
            for _ in exporter.export(chunks):
                pass
        check = max(diffs.values()) if diffs else None
    gloo = gloo_all_gather_gb_per_s()
    shm = shm_gather_gb_per_s()
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, round(peak_rss_gb(), 2))
    if rank == 0:
        memcpy = max(memcpy_before, memcpy_gb_per_s())  # the best of before and after the syncs: the stricter ratio
        moments = [m for _, m in results + baseline]
        memcpy = max([memcpy] + moments)  # the fastest memcpy seen in the run: the strict ratio's denominator
        best = max((s for s, _ in results), key=lambda s: s.gb_per_s)
        base = max((s for s, _ in baseline), key=lambda s: s.gb_per_s) if baseline else None
        paired_ratio = statistics.median(s.gb_per_s / m for s, m in results)
        paired_base = statistics.median(s.gb_per_s / m for s, m in baseline) if baseline else None
        summary = dict(
            layout=args.layout,
            bucket_mb=args.bucket_mb,
            params=engine_params,
            gigabytes=round(best.total_bytes / 1e9, 3),
            tensors=best.num_tensors,
            sync_s=round(best.seconds, 3),
            export_s=round(best.export_seconds, 3),
            load_s=round(best.load_seconds, 3),
            sync_gb_s=round(best.gb_per_s, 3),
            memcpy_gb_s=round(memcpy, 2),
            gloo_all_gather_gb_s=round(gloo, 2),
            shm_all_gather_gb_s=round(shm, 2),
            ratio=round(best.gb_per_s / memcpy, 3),
            paired_ratio=round(paired_ratio, 3),
            paired_baseline_ratio=round(paired_base, 3) if baseline else None,
            baseline_gb_s=round(base.gb_per_s, 3) if base else None,
            baseline_ratio=round(base.gb_per_s / memcpy, 3) if base else None,
            peak_rss_gb=rss,
            direct_gb=round(direct_stats.direct_bytes / 1e9, 3),
            buffered_gb=round(direct_stats.buffered_bytes / 1e9, 3),
            buffered_examples=sorted(direct_stats.buffered, key=direct_stats.buffered.get)[-3:],
            max_abs_diff=check,
        )
        print("RESULT " + json.dumps(summary), flush=True)
        print(
            f"sync {best.gb_per_s:.2f} GB/s vs memcpy {memcpy:.2f} GB/s = {best.gb_per_s / memcpy:.2f}x "
            f"(best sync / fastest memcpy of the run); each sync vs the memcpy just before it: median "
            f"{paired_ratio:.2f}x (target >= 0.5x)"
            + (
                f"; gather-then-copy baseline {base.gb_per_s:.2f} GB/s = {base.gb_per_s / memcpy:.2f}x, "
                f"paired {paired_base:.2f}x"
                if base
                else ""
            ),
            flush=True,
        )
    destroy_parallel()


if __name__ == "__main__":
    main()
