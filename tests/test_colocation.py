"""The device cache is released before every engine wake and before a rebuild beside an awake engine: the trainer's
real sync on a recording Platform (tests/workers/wake_order.py), and `Platform.release_cache` itself."""

import dataclasses
import gc
import weakref

import pytest

from mcore_rl.platform import Platform
from tests.torchrun_util import REPO, run_worker


@dataclasses.dataclass(frozen=True)
class Recording(Platform):
    events: list = dataclasses.field(default_factory=list, compare=False)

    def empty_cache(self) -> None:
        self.events.append("empty_cache")
        super().empty_cache()


def test_release_cache_collects_cycles_before_emptying_the_cache():
    class Cycle:
        pass

    platform = Recording("cpu")
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
    assert platform.events == ["cycle alive", "empty_cache", "cycle gone"]


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
