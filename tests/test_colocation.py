"""The colocation lifecycle (mcore_rl/colocation.py): its phases and transitions on recording fakes of the actor and
the engine and a recording Platform, the order of the cache release before every engine wake and before a rebuild
beside an awake engine in the trainer's real sync (tests/workers/wake_order.py), and `Platform.release_cache` itself."""

import dataclasses
import gc
import types
import weakref

import pytest
import torch

from mcore_rl.colocation import Colocation, ColocationError, Phase
from mcore_rl.platform import Platform
from mcore_rl.weight_sync.verify import ProbeBatch
from tests.torchrun_util import REPO, run_worker


@dataclasses.dataclass(frozen=True)
class Recording(Platform):
    events: list = dataclasses.field(default_factory=list, compare=False)

    def empty_cache(self) -> None:
        self.events.append("empty_cache")
        super().empty_cache()


@dataclasses.dataclass(frozen=True)
class SyncRecording(Recording):
    """Records `synchronize` too (without calling the device's: there is none here)."""

    def synchronize(self) -> None:
        self.events.append("synchronize")


@pytest.mark.parametrize(
    "name, events",
    [
        # no CUDA here: the device's synchronize is recorded, not called; torch's empty_cache is a no-op
        ("cuda", ["cycle alive", "synchronize", "empty_cache", "cycle gone"]),
        # nothing cached, no engine sleeps: no collection; the CPU's synchronize does nothing
        ("cpu", ["cycle alive", "synchronize", "empty_cache", "cycle alive"]),
    ],
)
def test_release_cache_collects_cycles_before_emptying_the_cache(name, events):
    class Cycle:
        pass

    platform = SyncRecording(name)
    a, b = Cycle(), Cycle()
    a.other, b.other = b, a  # unreachable once dropped, but freed only by the collector
    alive = weakref.ref(a)
    del a, b
    gc.disable()  # no collection on its own meanwhile
    try:
        platform.events.append("cycle alive" if alive() is not None else "cycle gone")
        platform.release_cache()
        platform.events.append("cycle alive" if alive() is not None else "cycle gone")
    finally:
        gc.enable()
    assert platform.events == events


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_release_cache_synchronises_the_device_before_emptying_its_cache(name, monkeypatch):
    """The device module's calls in order, through recording stand-ins of torch.cuda's / torch.npu's functions."""
    calls = []
    device = types.SimpleNamespace(
        synchronize=lambda: calls.append("synchronize"), empty_cache=lambda: calls.append("empty_cache")
    )
    if name == "cuda":
        monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
        monkeypatch.setattr(torch.cuda, "empty_cache", device.empty_cache)
    else:
        monkeypatch.setattr(torch, "npu", device, raising=False)
    monkeypatch.setattr(gc, "collect", lambda: calls.append("collect"))
    Platform(name).release_cache()
    assert calls == ["collect", "synchronize", "empty_cache"]


@pytest.mark.slow
def test_cache_released_before_each_wake_in_the_trainers_sync(tiny_model_dir, tmp_path):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path / "task", train_size=32, val_size=8, seed=0)
    (got,) = run_worker(
        REPO / "tests" / "workers" / "wake_order.py",
        1,
        torchrun=False,
        timeout=600,
        config=REPO / "configs" / "tiny" / "gspo_cpu.yaml",
        model_dir=tiny_model_dir,
        train=train,
        val=val,
        run_dir=tmp_path / "run",
    ).results
    phases = got["phases"]
    # actor.offload: two-phase wake; the actor's own offload empties the cache too, right before the KV-cache wake
    assert phases["sync_offload"] == [
        "sleep",
        "empty_cache",
        "wake_up(weights)",
        "empty_cache",
        "empty_cache",
        "wake_up(kv_cache)",
    ]
    assert phases["to_training"] == ["sleep"]
    assert phases["sync_resident"] == ["empty_cache", "wake_up(all)"]
    # the failed verification rebuilds beside the awake engine: the cache released first
    assert got["rebuilt"] == 1.0
    assert phases["sync_rebuild"] == ["empty_cache", "wake_up(all)", "empty_cache", "rebuild_from"]


class FakeActor:
    """Records offload / reload / the verification's reads; `offloaded` as the real actor keeps it."""

    def __init__(self, events: list):
        self.events, self.offloaded, self.host_bytes = events, False, 0

    def offload(self) -> int:
        self.events.append("offload")
        self.offloaded = True
        return 0

    def reload(self) -> int:
        self.events.append("reload")
        self.offloaded = False
        return 0

    def probe_log_probs(self, sequences, prompt_lens, temperature):
        self.events.append("probe_log_probs" + (" (offloaded)" if self.offloaded else ""))
        return [[-1.0]]


class FakeEngine:
    def __init__(self, events: list):
        self.events = events

    def sleep(self) -> None:
        self.events.append("sleep")

    def wake_up(self, tags=None) -> None:
        self.events.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def close(self) -> None:
        self.events.append("close")


def colocated(offload: bool):
    """A Colocation started the way the trainer starts it; its `sync` is a hand-over recorded as "transfer"."""
    platform = Recording("cpu")
    events = platform.events
    actor = FakeActor(events)

    def sync():
        with colocation.handover():
            events.append("transfer")

    colocation = Colocation.start(actor, platform, offload, lambda: FakeEngine(events), sync)
    return colocation, events


def moves(events: list, fn) -> list:
    """The events `fn` records."""
    start = len(events)
    fn()
    return events[start:]


def test_offload_round_trip_moves_the_device_once_each_way():
    colocation, events = colocated(offload=True)
    assert events == ["offload"] and colocation.phase is Phase.ROLLOUT  # the engine starts beside no actor state
    assert moves(events, lambda: colocation.ensure(Phase.ROLLOUT)) == []  # already there
    assert moves(events, lambda: colocation.ensure(Phase.TRAINING)) == ["sleep", "reload"]
    assert moves(events, lambda: colocation.ensure(Phase.TRAINING)) == []
    assert colocation.phase is Phase.TRAINING
    # the two-phase wake, each wake after the cache release; the actor leaves between the two
    assert moves(events, lambda: colocation.ensure(Phase.ROLLOUT)) == [
        "empty_cache",
        "wake_up(weights)",
        "transfer",
        "offload",
        "empty_cache",
        "wake_up(kv_cache)",
    ]
    assert colocation.phase is Phase.ROLLOUT


def test_resident_actor_wakes_everything_at_once_and_never_moves():
    colocation, events = colocated(offload=False)
    assert events == []
    assert moves(events, lambda: colocation.ensure(Phase.TRAINING)) == ["sleep"]
    assert moves(events, lambda: colocation.ensure(Phase.ROLLOUT)) == [
        "empty_cache",
        "wake_up(all)",
        "transfer",
    ]
    # a checkpoint or an export needs the actor's state, which never left the device: the engine stays awake
    assert moves(events, colocation.ensure_actor_state) == []
    assert colocation.phase is Phase.ROLLOUT


def test_actor_state_with_offload_is_the_training_phase():
    colocation, events = colocated(offload=True)
    assert moves(events, colocation.ensure_actor_state) == ["sleep", "reload"]
    assert colocation.phase is Phase.TRAINING
    assert moves(events, colocation.ensure_actor_state) == []


@pytest.mark.parametrize("offload", [True, False])
def test_loaded_weights_put_the_engine_behind(offload):
    colocation, events = colocated(offload)
    colocation.ensure_actor_state()
    colocation.weights_replaced()
    assert colocation.phase is Phase.TRAINING
    assert "transfer" in moves(events, lambda: colocation.ensure(Phase.ROLLOUT))


def test_verification_reads_the_actor_before_its_state_leaves():
    colocation, events = colocated(offload=True)
    colocation.ensure(Phase.TRAINING)
    with colocation.handover():
        reference, _ = colocation.actor_reads(ProbeBatch(sequences=[[1, 2]], prompt_lens=[1]))
    assert events[-4:] == ["probe_log_probs", "offload", "empty_cache", "wake_up(kv_cache)"]
    assert reference() == [[-1.0]] and events[-1] == "wake_up(kv_cache)"  # no second pass on the host
    with pytest.raises(ColocationError, match="actor_reads in the rollout phase: only from handover"):
        colocation.actor_reads(probe=None)


def test_a_failed_transfer_leaves_the_handover_unfinished():
    colocation, events = colocated(offload=True)
    with pytest.raises(OSError, match="transport"):
        with colocation.handover():
            raise OSError("transport")
    assert colocation.phase is Phase.HANDOVER and events[-1] == "wake_up(weights)"  # the KV cache stays asleep
    for ask in (lambda: colocation.ensure(Phase.TRAINING), lambda: colocation.ensure(Phase.ROLLOUT)):
        with pytest.raises(
            ColocationError, match=r"in the handover phase: .*\(a weight sync into the engine did not finish\)"
        ):
            ask()
    with pytest.raises(ColocationError, match="handover in the handover phase"):
        with colocation.handover():
            pass


def test_illegal_requests_raise():
    colocation, events = colocated(offload=False)
    for phase in (Phase.HANDOVER, Phase.CLOSED):
        with pytest.raises(ColocationError, match="only training or rollout can be asked for"):
            colocation.ensure(phase)
    colocation.close()
    assert events[-1] == "close" and colocation.phase is Phase.CLOSED
    for ask in (lambda: colocation.ensure(Phase.ROLLOUT), colocation.ensure_actor_state, colocation.close):
        with pytest.raises(ColocationError, match="in the closed phase"):
            ask()


def test_a_sync_that_does_not_hand_over_is_refused():
    platform = Recording("cpu")
    colocation = Colocation(FakeActor([]), FakeEngine([]), platform, False, sync=lambda: None, phase=Phase.TRAINING)
    with pytest.raises(ColocationError, match="did not hand over"):
        colocation.ensure(Phase.ROLLOUT)
