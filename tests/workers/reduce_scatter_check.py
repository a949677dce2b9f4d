"""Worker: uneven reduce_scatter over gloo, as megatron's MoE dispatcher calls it, equals the reduction computed
independently on every rank.

    torchrun --nproc_per_node=N tests/workers/reduce_scatter_check.py --results DIR
After `compat.torch.apply_shims()`, `torch.distributed.reduce_scatter` (torch's own on >= 2.8, the padded
`reduce_scatter_tensor` on < 2.8) and `compat.torch.reduce_scatter_padded` itself must give each rank the sum
(and the max) over ranks of that rank's chunk, for uneven, equal and empty chunks; every rank recomputes all
ranks' inputs from their seeds for the reference. Result per rank: whether the shim is in force, cases run.
"""

import torch
import torch.distributed as dist

from mcore_rl.compat import torch as compat_torch
from tests.workers.harness import init_gloo, worker_args, write_result


def inputs_of(rank: int, sizes: list[int], width: int) -> list[torch.Tensor]:
    """Integer-valued float32 chunks (sums exact in any order), different on each rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(-50, 50, (n, width), generator=gen).float() for n in sizes]


def main() -> None:
    args = worker_args(__doc__)
    compat_torch.apply_shims()
    rank, world = init_gloo()
    cases = 0
    for sizes in ([3, 5], [4, 4], [0, 6], [7, 1]):
        sizes = (sizes * world)[:world]
        every = [inputs_of(r, sizes, width=6) for r in range(world)]
        for op, reduce in ((dist.ReduceOp.SUM, torch.sum), (dist.ReduceOp.MAX, torch.amax)):
            want = reduce(torch.stack([every[r][rank] for r in range(world)]), dim=0)
            for name, fn in (
                ("dist.reduce_scatter", dist.reduce_scatter),
                ("padded", compat_torch.reduce_scatter_padded),
            ):
                got = torch.full_like(want, float("nan"))
                fn(got, [t.clone() for t in every[rank]], op=op, group=None)
                assert torch.equal(got, want), f"{name} {op} sizes {sizes}: rank {rank} got {got} want {want}"
                cases += 1
    write_result(args.results, shim=compat_torch.gloo_lacks_reduce_scatter(), cases=cases)
    # leaving with the group up aborts the process at exit on torch 2.13 ("terminate called without an active
    # exception" from gloo's threads): fence, then take the group down as every other worker does
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
