"""torchrun worker: every rank writes its shard into one checkpoint; rank 0 publishes after all are done.

Arguments: --run-dir, --results (tests/workers/harness.py). Result per rank: the steps left complete, and the step a verified resume chose after one shard of the newest
checkpoint was damaged (the previous one).
"""

import time
from pathlib import Path

import torch.distributed as dist

from mcore_rl.run_dir import CheckpointManager
from tests.workers.harness import init_gloo, worker_args, write_result


def main() -> None:
    args = worker_args(__doc__, run_dir=str)
    run_dir = args.run_dir
    rank, world = init_gloo()
    manager = CheckpointManager(run_dir, keep_last=2)
    for step in (1, 2, 3):

        def write(tmp: Path, step=step) -> None:
            if rank == world - 1:
                time.sleep(0.5)  # the slowest rank: rank 0 must not publish before it is done
            (tmp / f"shard_{rank}.txt").write_text(f"step {step} rank {rank}")

        ckpt = manager.save(step, write, meta={"world_size": world})
        # Right after save returns, every rank sees the same complete checkpoint with all shards.
        assert manager.latest() == ckpt and ckpt.meta["world_size"] == world, (manager.latest(), ckpt)
        for r in range(world):
            assert (ckpt.path / f"shard_{r}.txt").read_text() == f"step {step} rank {r}"
    complete = [c.step for c in manager.complete()]
    assert complete == [2, 3], complete
    # Checksums: each rank hashed its own shard at save; at load each rank verifies its share, and a
    # shard damaged on one rank makes every rank fall back to the previous checkpoint.
    import json

    from mcore_rl.config import load_config
    from mcore_rl.run_dir import CHECKSUMS, resolve_verified_resume

    assert sorted(json.loads((manager.step_dir(3) / CHECKSUMS).read_text())) == [f"shard_{r}.txt" for r in range(world)]
    dist.barrier()
    if rank == world - 1:
        (manager.step_dir(3) / f"shard_{rank}.txt").write_text(f"step 3 rank {rank}, damaged")
    dist.barrier()
    cfg = load_config(None, [f"trainer.run_dir={run_dir}"])
    resumed = resolve_verified_resume(cfg).step
    assert resumed == 2, resumed
    dist.barrier()
    dist.destroy_process_group()
    write_result(args.results, world=world, complete=complete, resumed_after_damage=resumed)


if __name__ == "__main__":
    main()
