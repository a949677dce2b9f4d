"""The rollout ranks' agreement on where a session is taken (mcore_rl/streaming.py, `Agreement`), in 3 real processes
over gloo, no model: 1 actor rank and 2 rollout ranks (2 replicas), the real bridge and doorbell. The leader's share
ends after 2 decode steps; the actor rings the doorbell only once the leader is settled (idle), and sends a session;
the other replica generates until it has taken the session and 3 decode steps more (a tick between every two decode
steps, none after the last: the engines' loop). Both take the session at the
same tick (the leader idle, the other mid-generation), the leader keeps ticking until the other is done, and only
then do both enter the round's gather. Reading the doorbell each on its own, the leader would sit in the gather while
the other sat in the session's broadcast: a deadlock (gloo's timeout here)."""

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from mcore_rl.ports import free_port

SHORT, AFTER = 2, 3  # the leader's decode steps; the other replica's after the session


def _generate(agreement, done) -> int:
    """Decode steps until `done(step)`, the agreement's tick between every two (the engines' loop); how many."""
    step = 1
    while not done(step):
        agreement.between_steps("in flight")
        step += 1
    return step


def _rollout(bridge, leader: bool) -> dict:
    import torch.distributed as dist

    from mcore_rl.streaming import Agreement

    took, served = [], [0]

    def take(generation) -> None:
        value = bridge.object(from_actor=True)  # the session: every bridge rank joins its broadcast
        served[0] += 1
        took.append({"tick": agreement.ticks, "generating": generation is not None, "value": value})

    agreement = Agreement(bridge, leader, lambda: served[0], take)
    if leader:
        steps = _generate(agreement, lambda step: step == SHORT)
        bridge.store.set("settled", "1")
    else:
        steps = _generate(agreement, lambda step: bool(took) and step == took[0]["tick"] + AFTER)
    agreement.settle()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, agreement.ticks)  # the round's gather
    return {"took": took, "steps": steps, "ticks": agreement.ticks, "gathered": parts, "rung": bridge.rung()}


def _worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3")
    from datetime import timedelta

    from mcore_rl.platform.split import init_split

    try:
        split, bridge = init_split("cpu", "gloo", torch.device("cpu"), 1, timedelta(seconds=60))
        if bridge.is_actor:
            bridge.store.wait(["settled"])
            bridge.ring()
            bridge.object("the weights of version 1", from_actor=True)
            got = {}
        else:
            got = _rollout(bridge, split.bridge_rank == 1)
        out.put((rank, got))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.slow
def test_replicas_take_a_session_at_the_same_tick_and_gather_only_when_none_generates():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for got in res.values():
        assert "error" not in got, got.get("error")
    leader, other = res[1], res[2]
    assert len(leader["took"]) == len(other["took"]) == 1, res
    tick = other["took"][0]["tick"]
    assert leader["took"][0]["tick"] == tick >= SHORT  # taken together, after the leader settled (its tick SHORT - 1)
    assert (leader["took"][0]["generating"], other["took"][0]["generating"]) == (False, True)
    assert leader["took"][0]["value"] == other["took"][0]["value"] == "the weights of version 1"
    assert leader["steps"] == SHORT and other["steps"] == tick + AFTER
    # the leader ticked idle until the other's last decode step, then both once more where none generates
    assert leader["ticks"] == other["ticks"] == other["steps"]
    assert leader["gathered"] == other["gathered"] == [leader["ticks"]] * 2
    assert leader["rung"] == other["rung"] == 1
