"""Worker: the exporter over shared memory gives every HF tensor bit-identical to the checkpoint.

    torchrun --nproc_per_node=N tests/workers/shm_export_check.py --tiny-dir DIR --tp TP --ep EP --etp ETP --results DIR
Loads the tiny checkpoint into a real Megatron model in the given layout and exports it three ways, each
compared exactly (all names, shapes, dtypes, bits) with the checkpoint's safetensors: shared memory with tiny
gather batches and rounds (many batches, tensors split over rounds), shared memory where only rank 0
receives (the others must yield nothing), gathered straight into a random-weight embedded engine's own
tensors (its in-place buffers, every rank / rank 0 only: the engine ends bit-identical to the checkpoint), written straight
into engines whose parameters live in shared memory (the direct writes: every rank / rank 0 only, the engine scrambled
before each: the peers' shards must land in the engine with nothing staged in a gather segment), and the
torch.distributed fallback (ranks claim different hosts).
Result per rank (tests/workers/harness.py): the layout, the number of checkpoint tensors, the exports compared,
how many tensors were gathered in place into the engine's memory, which q / k / v / embedding / output-layer
tensors were not, and the exporter's account of bytes straight into the engine / through buffers; for the
shared-memory engines the same account and the bytes that went through the gather's segments.
"""

import glob
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from mcore_rl.config import ModelConfig, ParallelConfig
from mcore_rl.megatron.parallel import destroy_parallel, init_parallel
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.platform import get_platform
from mcore_rl.platform.shm_gather import GroupGather
from mcore_rl.weight_sync.direct_write import DirectWrite
from mcore_rl.weight_sync.exporter import HFExporter
from mcore_rl.weight_sync.receiver import COPY_IN, WeightReceiver
from tests.workers.harness import worker_args, write_result


def check_export(exporter, chunks, expected: dict, what: str, receive: bool = True, batch_mb: float = 0.01) -> None:
    got = {name: t.clone() for name, t in exporter.export(chunks, gather_batch_mb=batch_mb, receive=receive)}
    if not receive:
        assert not got, f"{what}: a rank with receive=False yielded {len(got)} tensors"
        return
    assert set(got) == set(expected), (
        f"{what}: missing {sorted(set(expected) - set(got))[:3]}, extra {sorted(set(got) - set(expected))[:3]}"
    )
    for name, want in expected.items():
        t = got[name]
        assert t.dtype == want.dtype and t.shape == want.shape, (
            f"{what}: {name} {t.dtype}{tuple(t.shape)} vs {want.dtype}{tuple(want.shape)}"
        )
        assert torch.equal(t.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"{what}: {name} differs"


def check_into_engine(exporter, chunks, expected: dict, tiny_dir: str, what: str, receive: bool = True) -> dict:
    """Export straight into an engine's own tensors (its in-place buffers, as the trainer syncs): a fresh engine with random
    weights ends bit-identical to the checkpoint. Returned (empty on a rank that does not receive): how many
    tensors were written in place, which tensors whose conversion moves rows (q / k / v, embedding, output
    layer) were not, and the exporter's own account (`HFExporter.stats`: bytes straight into the engine,
    names gathered into buffers, bytes staged between the EP and the ETP gather)."""
    from mcore_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, config=exporter.bridge.hf_config) if receive else None  # every weight must arrive
    receiver = WeightReceiver(buffer=engine.weight_buffer) if engine is not None else COPY_IN
    in_place = []
    for name, t in exporter.export(chunks, gather_batch_mb=0.01, receive=receive, receiver=receiver):
        if t.data_ptr() == engine.weight_buffer(name).data_ptr():
            in_place.append(name)
        engine.load_weights([(name, t)])
    if engine is None:
        return {}
    for name, want in expected.items():
        got = engine.weight_buffer(name)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"{what}: {name}"
    rows_moved = [n for n in expected if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    rows_moved += [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in expected]
    stats = exporter.stats
    return dict(
        in_place=len(in_place),
        rows_moved_not_in_place=sorted(set(rows_moved) - set(in_place)),
        direct_bytes=stats.direct_bytes,
        buffered=sorted(stats.buffered),
        staged_bytes=stats.staged_bytes,
    )


def check_shared_engine(bridge, chunks, expected: dict, tiny_dir: str, what: str) -> dict:
    """Export into engines whose parameters live in shared memory (the direct writes, as the trainer syncs on one host):
    every rank writes its own shards straight into every receiving engine. First every rank's engine receives;
    then, every engine scrambled, rank 0's alone (the others only write into it), so the peers' shards must land
    in rank 0's engine again. A fresh GroupGather shows what still went through its segments (their capacity:
    0 when nothing was staged). Returned per export (rank 0's result for the second): the exporter's account of
    bytes straight into the engine / names through buffers, and the segments' bytes."""
    from mcore_rl.rollout.embedded import EmbeddedEngine

    rank = dist.get_rank()
    engine = EmbeddedEngine(tiny_dir, config=bridge.hf_config)
    assert engine.capabilities.receiver.kind == "shared", f"{what}: the CPU engine has no shared-memory region"
    out = {}
    for attempt, receive in enumerate((True, rank == 0)):
        groups = GroupGather(max_chunk_bytes=4096)
        exporter = HFExporter(bridge, groups)  # its transport: the direct writes, chosen at its first export
        for p in engine.model.parameters():
            p.data.normal_()  # in place: the region stays, its bytes are garbage until the export rewrites them
        receiver = engine.capabilities.receiver if receive else COPY_IN
        for name, t in exporter.export(chunks, gather_batch_mb=0.05, receive=receive, receiver=receiver):
            engine.load_weights([(name, t)])
        assert isinstance(exporter.transport_for(receiver), DirectWrite), f"{what}: no direct writes chosen"
        segments = [s for s in groups._transports.values() if s is not None]
        assert segments, f"{what}: the gathers did not take shared memory"
        if not receive:
            continue
        for name, want in expected.items():
            got = engine.weight_buffer(name)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
                f"{what} (export {attempt}): {name}"
            )
        prefix = "shared_" if attempt == 0 else "rank0_only_shared_"
        out[prefix + "direct_bytes"] = exporter.stats.direct_bytes
        out[prefix + "buffered"] = sorted(exporter.stats.buffered)
        out[prefix + "segment_bytes"] = sum(sum(s.capacity) for s in segments)
    if dist.get_world_size() == 2:  # (with more ranks, a raise in one group leaves other groups' ranks waiting)
        out["disagreement"] = check_disagreement_raises(exporter, chunks, engine)
    return out


def check_disagreement_raises(exporter, chunks, engine) -> str:
    """Rank 1 maps rank 0's engine table with one gathered weight missing (rank 0's q_proj of layer 0, or an
    expert of layer 0 without TP): it would gather that tensor while rank 0 expects it written. The batch's
    confirmation must raise on both ranks, before anything is gathered. Returns the error message."""
    rank = dist.get_rank()
    if rank == 1:
        (peer,) = exporter.transport_for(COPY_IN)._regions.values()  # rank 0's, mapped by the last export (rank 0
        # alone received)
        suffix = (
            "layers.0.self_attn.q_proj.weight"
            if exporter.bridge.layout.tp > 1
            else "layers.0.mlp.experts.0.down_proj.weight"
        )
        victim = next(name for name in peer.table if name.endswith(suffix))
        del peer.table[victim]
        peer._views.pop(victim, None)
        exporter.targets.forget()
    receive = rank == 0
    receiver = engine.capabilities.receiver if receive else COPY_IN
    try:
        for _ in exporter.export(chunks, gather_batch_mb=0.05, receive=receive, receiver=receiver):
            pass
    except RuntimeError as e:
        assert "disagree on which tensors they wrote directly" in str(e), e
        return str(e)
    raise AssertionError("ranks that judged a tensor differently exported without an error")


def main() -> None:
    args = worker_args(__doc__, tiny_dir=str, tp=int, ep=int, etp=int)
    tiny_dir, tp, ep, etp = args.tiny_dir, args.tp, args.ep, args.etp
    platform = get_platform("cpu")
    platform.init_distributed()
    rank = dist.get_rank()
    parallel = ParallelConfig(tp=tp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    bridge = ModelBridge(tiny_dir, platform)
    layout = init_parallel(parallel, platform, bridge.hf_config)
    chunks = bridge.build_model(layout, ModelConfig(path=tiny_dir, dtype="float32"))
    bridge.load_hf_weights(chunks)
    expected = {}
    for f in sorted(glob.glob(os.path.join(tiny_dir, "*.safetensors"))):
        expected.update(load_file(f))
    expected = {k: v.to(torch.float32) for k, v in expected.items()}

    exporter = HFExporter(bridge, GroupGather(max_chunk_bytes=4096))  # many rounds per batch, tensors split
    compared = ["shm", "shm, large batches", "shm, rank 0 receives only", "shm again (arenas reused)"]
    check_export(exporter, chunks, expected, compared[0])
    check_export(exporter, chunks, expected, compared[1], batch_mb=64)
    check_export(exporter, chunks, expected, compared[2], receive=rank == 0)
    check_export(exporter, chunks, expected, compared[3])
    compared += ["shm into the engine", "shm into rank 0's engine only"]
    exporter = HFExporter(bridge, GroupGather(max_chunk_bytes=4096))  # engines without a shared region
    into_engine = check_into_engine(exporter, chunks, expected, tiny_dir, compared[4])
    check_into_engine(exporter, chunks, expected, tiny_dir, compared[5], receive=rank == 0)
    compared += ["every rank's shared-memory engine", "rank 0's shared-memory engine only"]
    into_shared = check_shared_engine(bridge, chunks, expected, tiny_dir, "shared-memory engines")
    groups = GroupGather(host_id=lambda: f"host-of-rank-{rank}")
    exporter = HFExporter(bridge, groups)
    compared.append("torch.distributed fallback")
    check_export(exporter, chunks, expected, compared[8])
    assert not groups.uses_shared_memory(None)
    dist.barrier()
    destroy_parallel()
    write_result(
        args.results, layout=[tp, ep, etp], tensors=len(expected), exports=compared, **into_engine, **into_shared
    )


if __name__ == "__main__":
    main()
