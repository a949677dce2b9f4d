"""The separate placement's process groups (mcore_rl/platform/split.py), in 3 real processes over gloo, no Megatron:
2 actor ranks and 1 rollout rank, each role with its own default process group; the bridge (actor rank 0 + the
rollout rank) carries objects both ways and a weight bucket's bytes; a rollout rank that dies makes the actor's next
bridge call raise one line naming the rollout ranks."""

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from mcore_rl.ports import free_port


def _worker(rank: int, world: int, port: int, die: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from datetime import timedelta

    import torch.distributed as dist

    from mcore_rl.platform.split import PeerLost, init_split
    from mcore_rl.weight_sync.bridge import bucket_header, bucket_tensors

    try:
        split, bridge = init_split("cpu", "gloo", torch.device("cpu"), 2, timedelta(seconds=60))
        got = {"role": split.role, "role_world": dist.get_world_size(), "role_rank": dist.get_rank()}
        total = torch.ones(1)
        dist.all_reduce(total)  # within the role only
        got["role_sum"] = float(total)
        if bridge is not None:
            got["hello"] = bridge.object({"from": "actor"} if bridge.is_actor else None, from_actor=True)
            bucket = [
                ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
                ("b", torch.tensor([1, 2], dtype=torch.int16)),
            ]
            header = bucket_header(bucket)
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]) if bridge.is_actor else None
            received = bucket_tensors(header, bridge.tensors(header, flat, from_actor=True))
            got["bucket_ok"] = all(torch.equal(x, y) for (_, x), (_, y) in zip(bucket, received))
            got["reply"] = bridge.object(None if bridge.is_actor else [1.5, "ok"], from_actor=False)
            if die and not bridge.is_actor:
                out.put((rank, got))
                out.close()
                out.join_thread()  # the result is out before the process is
                os._exit(9)  # the rollout rank goes away
            if die:
                try:
                    bridge.object(from_actor=False)
                except PeerLost as e:
                    got["lost"] = str(e)
        out.put((rank, got))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


def _run(die: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 3, port, die, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


@pytest.mark.slow
def test_roles_have_their_own_worlds_and_the_bridge_carries_both_ways():
    res = _run(die=False)
    for got in res.values():
        assert "error" not in got, got.get("error")
    assert [res[r]["role"] for r in range(3)] == ["actor", "actor", "rollout"]
    assert [(res[r]["role_world"], res[r]["role_rank"], res[r]["role_sum"]) for r in range(3)] == [
        (2, 0, 2.0),
        (2, 1, 2.0),
        (1, 0, 1.0),
    ]
    assert "hello" not in res[1]  # actor rank 1 is not on the bridge
    for r in (0, 2):
        assert res[r]["hello"] == {"from": "actor"} and res[r]["bucket_ok"] and res[r]["reply"] == [1.5, "ok"]


@pytest.mark.slow
def test_a_dead_rollout_rank_is_named_on_the_actor():
    res = _run(die=True)
    lost = res[0].get("lost", res[0].get("error", ""))
    assert "rollout ranks 2..2 (global) stopped answering" in lost, lost
    assert "\n" not in lost


def test_role_split_arithmetic():
    from mcore_rl.platform.split import RoleSplit

    roles = [RoleSplit(r, 5, 3) for r in range(5)]
    assert [(s.role, s.role_rank, s.role_world, s.bridge_rank) for s in roles] == [
        ("actor", 0, 3, 0),
        ("actor", 1, 3, None),
        ("actor", 2, 3, None),
        ("rollout", 0, 2, 1),
        ("rollout", 1, 2, 2),
    ]
    assert roles[0].describe_rollout() == "rollout ranks 3..4 (global)"


def test_split_sizes_and_staleness_defaults():
    from mcore_rl.config import RolloutConfig
    from mcore_rl.separate import resolved_staleness, split_sizes

    assert split_sizes(RolloutConfig(placement="separate"), 4) == 2  # rollout.ranks None: half the world
    assert split_sizes(RolloutConfig(placement="separate", ranks=1), 2) == 1
    with pytest.raises(ValueError, match="set rollout.ranks between 1 and 1"):
        split_sizes(RolloutConfig(placement="separate", ranks=2), 2)
    assert resolved_staleness(RolloutConfig(placement="separate")) == 1
    assert resolved_staleness(RolloutConfig(placement="separate", max_staleness=0)) == 0
    assert resolved_staleness(RolloutConfig()) == 0


def test_a_bucket_survives_the_byte_stream_whatever_its_dtypes():
    """Tensors of 2-, 4- and 8-byte types packed back to back (odd element counts: offsets not aligned to the next
    tensor's element size) come out equal, with their shapes."""
    from mcore_rl.weight_sync.bridge import bucket_header, bucket_tensors

    bucket = [
        ("h", torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)),
        ("f", torch.randn(3, 5)),
        ("i", torch.arange(7, dtype=torch.int64).reshape(7, 1)),
        ("s", torch.tensor([[1, 2, 3]], dtype=torch.int16)),
    ]
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
    out = bucket_tensors(bucket_header(bucket), flat)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    assert all(t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(bucket, out))
