"""The export's transport is chosen once, from the platform and what the engine offers (mcore_rl/weight_sync/):
accelerators take the collective gather with no collective spent on the choice or on any sync's set-up; the
CPU takes the shared-memory gather, with the direct writes only when some engine offers a shared region, and
asks the job that once. The transports' data paths run in real processes in tests/test_shm_gather.py."""

from types import SimpleNamespace

import pytest

from mcore_rl.platform import Platform, collectives
from mcore_rl.platform.shared_memory import SharedRegion, SharedTensors
from mcore_rl.weight_sync.collective import CollectiveGather
from mcore_rl.weight_sync.direct_write import DirectWrite
from mcore_rl.weight_sync.exporter import HFExporter
from mcore_rl.weight_sync.receiver import COPY_IN, WeightReceiver
from mcore_rl.weight_sync.shm_gather import SharedMemoryGather


@pytest.fixture
def reductions(monkeypatch) -> list:
    """Every small all-reduce the code under test asks for (no process group here: each returns its input)."""
    calls = []
    real = collectives.all_reduce_small

    def counted(tensor, op=None, group=None):
        calls.append(tensor.tolist())
        return real(tensor, op=op, group=group)

    monkeypatch.setattr(collectives, "all_reduce_small", counted)
    return calls


@pytest.fixture
def shared_region():
    """A real (empty) shared-memory table, as an engine offers it."""
    region = SharedRegion.create(4096)
    yield SharedTensors.describe(region, {})
    region.close()


def exporter(platform: str) -> HFExporter:
    return HFExporter(SimpleNamespace(platform=Platform(platform)))


def test_accelerators_take_the_collective_gather_without_a_collective(reductions, shared_region):
    ex = exporter("cuda")  # (an "npu" device needs torch_npu; Platform.weight_transport is the same for both)
    assert Platform("npu").weight_transport == Platform("cuda").weight_transport == "collective"
    for receiver in (None, COPY_IN, WeightReceiver(shared=shared_region), WeightReceiver(shared=shared_region)):
        transport = ex.transport_for(receiver)
        assert type(transport) is CollectiveGather
        assert transport.begin(True, receiver) == frozenset() and transport.consumers() == []
    assert transport.place_direct([], {}, ex.placer, ex.stats) == {} and not transport.plans_rows(None)
    assert reductions == []  # neither the choice nor a sync's set-up asked the job anything


def test_the_cpu_takes_the_direct_writes_only_where_an_engine_offers_a_shared_region(reductions, shared_region):
    ex = exporter("cpu")
    assert type(ex.transport_for(None)) is SharedMemoryGather and reductions == []  # saving, verifying
    chosen = ex.transport_for(WeightReceiver(shared=shared_region))
    assert type(chosen) is DirectWrite and reductions == [[1]]  # one agreement over the job
    assert ex.transport_for(COPY_IN) is chosen and reductions == [[1]]  # once: later syncs keep it
    assert chosen.groups is ex.transport_for(None).groups  # one set of shared segments per exporter

    plain = exporter("cpu")
    assert type(plain.transport_for(WeightReceiver(buffer=lambda name: None))) is SharedMemoryGather
    assert reductions[-1] == [0]
    assert plain.transport_for(None).begin(True, COPY_IN) == frozenset() and len(reductions) == 2
