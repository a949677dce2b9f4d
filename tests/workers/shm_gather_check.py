"""Worker: GroupGather (shared memory, and the torch.distributed fallback) equals dist.all_gather.

    torchrun --nproc_per_node=N tests/workers/shm_gather_check.py --mode shm --results DIR
MODE "shm": the gatherer must choose shared memory (all ranks on this host); "fallback": every rank claims a
different host, so it must fall back to torch.distributed. Both compare every gathered shard bit-for-bit
with dist.all_gather of the same shards, for odd shapes, several dtypes, strided destinations, tensors split
over many rounds, several items per call, and segments that grow between calls. Result per rank
(tests/workers/harness.py): the mode, the transport chosen and the number of single-tensor cases.
"""

import os

import torch
import torch.distributed as dist

from mcore_rl.platform.shm_gather import SHM_DIR, GroupGather
from tests.workers.harness import init_gloo, worker_args, write_result


def shard_for(rank: int, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank-dependent values that exercise every bit pattern class of the dtype (negatives, fractions)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-(2**30), 2**30, shape, generator=gen, dtype=torch.int64).to(dtype)


def reference(shard: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(out, shard.contiguous())
    return out


def check_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}: rank {r} shard {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        )
        # compare raw bytes: bit-identical, NaN-safe
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (
            f"{what}: rank {r} shard differs"
        )


def main() -> None:
    args = worker_args(__doc__, mode=("shm", "fallback"))
    mode = args.mode
    rank, world = init_gloo()
    host_id = (lambda: f"host-of-rank-{rank}") if mode == "fallback" else None
    # A small chunk limit forces large tensors through many rounds and both segments.
    gather = GroupGather(max_chunk_bytes=4096, **({"host_id": host_id} if host_id else {}))
    assert gather.uses_shared_memory(None) == (mode == "shm"), f"transport choice wrong for mode {mode}"

    cases = [
        ((7, 13), torch.bfloat16),
        ((3,), torch.float32),
        ((1, 1, 5), torch.int32),
        ((), torch.float32),
        ((129, 33), torch.float32),
        ((2, 1000), torch.bfloat16),
        ((0, 4), torch.float32),
        ((17, 3), torch.int64),
        ((11,), torch.uint8),
        ((9, 5), torch.bool),
        ((301, 7), torch.float16),
    ]
    for seed, (shape, dtype) in enumerate(cases):
        shard = shard_for(rank, shape, dtype, seed)
        check_equal(gather.all_gather(shard, None), reference(shard), f"{dtype} {shape}")

    # Several items in one call, destinations that are strided views of one merged tensor (dim-1 split),
    # and a non-contiguous source.
    a = shard_for(rank, (6, 5), torch.bfloat16, 100)
    b = shard_for(rank, (5, 6), torch.float32, 101).t()  # non-contiguous (6, 5)
    c = shard_for(rank, (1000, 3), torch.float32, 102)  # bigger than one round
    merged_a = torch.empty(6, 5 * world, dtype=torch.bfloat16)
    merged_b = torch.empty(6 * world, 5, dtype=torch.float32)
    stacked_c = torch.empty(world, 1000, 3, dtype=torch.float32)
    gather.all_gather_into(
        [
            (a, list(merged_a.chunk(world, dim=1))),
            (b, list(merged_b.chunk(world, dim=0))),
            (c, list(stacked_c.unbind(0))),
        ],
        None,
    )
    check_equal([merged_a], [torch.cat(reference(a), dim=1)], "strided dim-1 destinations")
    check_equal([merged_b], [torch.cat(reference(b), dim=0)], "non-contiguous source")
    check_equal(list(stacked_c.unbind(0)), reference(c), "many rounds in a batch")

    # A rank's own shard as its own destination is used in place; ranks that pass receive=False only send.
    shard = shard_for(rank, (40, 9), torch.bfloat16, 150)
    want = reference(shard)
    receive = rank != 1  # rank 1 plays a rank without an engine replica
    dsts = [shard if r == rank else torch.empty_like(shard) for r in range(world)] if receive else None
    gather.all_gather_into([(shard, dsts)], None, receive=receive)
    if receive:
        check_equal(dsts, want, "receive=False on rank 1")
        assert dsts[rank] is shard
    # Now only rank 1 receives: at world 2 rank 0 saw nobody read its last shards and skipped writing, so it
    # must notice the new reader and write late (the extra barrier path).
    shard = shard_for(rank, (8, 3), torch.float32, 160)
    want = reference(shard)
    dsts = [torch.empty_like(shard) for _ in range(world)] if rank == 1 else None
    gather.all_gather_into([(shard, dsts)], None, receive=rank == 1)
    if rank == 1:
        check_equal(dsts, want, "late writer")

    # Ranks that disagree on the shape must all get the same clear error (shared memory checks it up front).
    if mode == "shm":
        bad = torch.zeros(3 + rank)
        try:
            gather.all_gather(bad, None)
        except ValueError as e:
            assert "gather different tensors" in str(e), e
        else:
            raise AssertionError("mismatched shapes did not raise")
        # Still usable afterwards, and nothing of ours is left in /dev/shm (files are unlinked once mapped).
        shard = shard_for(rank, (5, 5), torch.float32, 200)
        check_equal(gather.all_gather(shard, None), reference(shard), "after the error")
        dist.barrier()
        token = gather.transport(None, []).token
        leftovers = [f for f in os.listdir(SHM_DIR) if token in f]
        assert not leftovers, f"left in {SHM_DIR}: {leftovers}"

    # A subgroup (as the exporter uses TP / EP groups): decided and cached separately.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        shard = shard_for(rank, (33, 2), torch.bfloat16, 300)
        want = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(want, shard, group=sub)
        check_equal(gather.all_gather(shard, sub), want, "subgroup")
    shared_memory = gather.uses_shared_memory(None)
    gather.close()
    dist.barrier()
    dist.destroy_process_group()
    write_result(args.results, mode=mode, shared_memory=shared_memory, cases=len(cases))


if __name__ == "__main__":
    main()
