"""The direct-write transport: on one host every rank writes its own shards straight into the receiving engines.

A gather moves a peer's shard twice (into the peer's shared segment, out of it into the engine). When the
receiving engines keep their weights in shared-memory regions (`WeightReceiver.shared`, the CPU embedded engine's),
each rank of a TP / EP / ETP group maps every receiving rank's region and writes its own shards at the places
the in-place placement gives on that engine's table (the same placement code, run on the receiver's table):
nothing is staged and each byte moves once. The handshake per export and group: one object gather of the ranks'
region handles; the first time a set of regions is seen, every rank maps the others' and all agree that they
could. Per batch one small collective per group confirms that the writes are done and that all ranks wrote the
same tensors. Tensors whose destination is not entirely in the engine's memory (buffers, dropped padding rows,
the EP-then-ETP experts) take the shared-memory gather.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Optional

import torch

from mcore_rl.models.bridge import ModelBridge
from mcore_rl.platform import collectives
from mcore_rl.platform.shared_memory import SharedTensors
from mcore_rl.platform.shm_gather import GroupGather
from mcore_rl.weight_sync.placement import (
    GROUP_KINDS,
    Exported,
    PlaceContext,
    Placement,
    Placer,
    gather_kind,
    meta_buffer,
)
from mcore_rl.weight_sync.receiver import WeightBuffers, WeightReceiver
from mcore_rl.weight_sync.row_plan import RowPlan
from mcore_rl.weight_sync.shm_gather import SharedMemoryGather

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sinks:
    """The receiving engines of one gather group that its ranks write into directly: this rank's index in the
    group and, per receiving group rank, that engine's tensors as mapped in this process."""

    rank: int
    receivers: dict[int, SharedTensors]


class DirectWrite(SharedMemoryGather):
    """The shared-memory gather, plus direct writes into the receiving engines' shared regions (module doc)."""

    def __init__(self, bridge: ModelBridge, groups: Optional[GroupGather] = None):
        super().__init__(bridge.platform.device, groups)
        self.bridge = bridge
        # per gather group kind: the receiving engines' region tokens and whether all ranks mapped them
        self._agreed: dict[str, tuple[tuple[str, ...], bool]] = {}
        self._regions: dict[str, SharedTensors] = {}  # other processes' engine regions mapped here, by token
        self._state: Optional[tuple] = None  # the last export's (this rank's state, sinks, lighter kinds)
        self._sinks: dict[str, _Sinks] = {}  # of the export in progress

    def begin(self, receive: bool, receiver: Optional[WeightReceiver]) -> frozenset[str]:
        """The gather groups' sinks and the kinds whose batches may hold more bytes (direct tensors need no
        buffer), where every rank of the job has the same groups' sinks: batches must end in step across
        groups. Collective; when no rank's (receive, engine region) changed since the last export, one small
        all-reduce and the last export's answer."""
        shared = receiver.shared if receiver is not None and receive else None
        state = (receive, shared.token if shared is not None else None)
        changed = self._state is None or self._state[0] != state
        if collectives.max_ints([int(changed)])[0] == 0:
            self._sinks = self._state[1]
            return self._state[2]
        self._sinks = self._group_sinks_all(receive, shared)
        mask = sum(1 << k for k, kind in enumerate(GROUP_KINDS) if kind in self._sinks)
        lighter = frozenset(self._sinks) if collectives.all_agree([mask]) else frozenset()
        self._state = (state, self._sinks, lighter)
        return lighter

    def consumers(self) -> list[WeightBuffers]:
        return [t.view for s in self._sinks.values() for t in s.receivers.values()]

    def _group_sinks_all(self, receive: bool, shared: Optional[SharedTensors]) -> dict[str, _Sinks]:
        """Per gather group of more than one rank whose gathers go through shared memory: its sinks, if any."""
        layout = self.bridge.layout
        out = {}
        for kind, size in zip(GROUP_KINDS, (layout.tp, layout.ep, layout.etp)):
            group = getattr(layout.groups, kind)
            if size > 1 and self.groups.uses_shared_memory(group):
                sinks = self._group_sinks(kind, group, receive, shared)
                if sinks is not None:
                    out[kind] = sinks
        used = {t.token for sinks in out.values() for t in sinks.receivers.values()}
        self._regions = {token: t for token, t in self._regions.items() if token in used}  # unmap the others
        return out

    def _group_sinks(self, kind: str, group, receive: bool, shared: Optional[SharedTensors]) -> Optional[_Sinks]:
        me, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        every = [None] * world
        mine = shared.handle if shared is not None else None
        torch.distributed.all_gather_object(every, (receive, mine), group=group)
        receivers = [r for r, (takes, _) in enumerate(every) if takes]
        if not receivers or any(every[r][1] is None for r in receivers):
            self._agreed.pop(kind, None)
            return None
        for r in receivers:  # other ranks' regions: mapped once, kept while they receive
            token = every[r][1].token
            if r != me and token not in self._regions and (opened := SharedTensors.open(every[r][1])) is not None:
                self._regions[token] = opened
        mapped = {r: shared if r == me else self._regions.get(every[r][1].token) for r in receivers}
        key = tuple(every[r][1].token for r in receivers)  # the same on every rank of the group
        if self._agreed.get(kind, (None,))[0] != key:  # a new set of engines: do all ranks reach all of them?
            reachable = all(t is not None for t in mapped.values())
            agreed = collectives.sum_ints([int(not reachable)], group)[0] == 0
            if not agreed:
                logger.info("export: %s ranks cannot map every receiving engine; gathering instead", kind)
            self._agreed[kind] = (key, agreed)
        return _Sinks(me, mapped) if self._agreed[kind][1] else None

    def place_direct(self, batch: list[Exported], plans: dict[int, RowPlan], placer: Placer, stats) -> dict:
        """batch position -> (group kind, per receiving group rank its placement in that engine's memory) for
        every parameter whose destinations in every receiving engine lie entirely in its shared region. Every
        rank of the group decides the same: the same placement code on the same tables."""
        out, layout = {}, self.bridge.layout
        contexts = {  # per group kind and receiving rank: the placement in that engine's table
            kind: {q: PlaceContext(True, True, t.view, meta_buffer, None) for q, t in sinks.receivers.items()}
            for kind, sinks in self._sinks.items()
        }
        for i, x in enumerate(batch):
            kind = gather_kind(layout, x)
            if kind not in self._sinks:
                continue
            per_receiver = {}
            for q, tensors in self._sinks[kind].receivers.items():
                placed = Placement()
                placer.place_one(placed, i, x, plans.get(i), contexts[kind][q])
                if not placed.lands_in(tensors.region, kind):
                    break
                per_receiver[q] = placed
            else:
                out[i] = (kind, per_receiver)
                own = per_receiver.get(self._sinks[kind].rank)
                for _, _, name, t in own.outputs if own is not None else ():
                    stats.count(name, t.numel() * t.element_size(), True)
        return out

    def write_direct(self, direct: dict) -> None:
        """This rank's shard of each direct parameter into every receiving engine (its own engine included),
        then one small collective per group: every rank finished writing this batch (the receivers yield only
        after it), and every rank wrote the same parameters (else all raise)."""
        for kind, per_receiver in direct.values():
            me = self._sinks[kind].rank
            for placed in per_receiver.values():
                for shard, dsts in placed.items(kind):
                    dsts[me].copy_(shard)
        for kind in self._sinks:
            mine = sorted(i for i, (k, _) in direct.items() if k == kind)
            group = getattr(self.bridge.layout.groups, kind)
            if not collectives.all_agree([len(mine), zlib.crc32(repr(mine).encode())], group):
                raise RuntimeError(
                    f"export into shared engine memory: the {kind} ranks disagree on which tensors they wrote "
                    f"directly (this rank: {len(mine)}); every rank must see the same engine tables"
                )

    def own_outputs(self, direct: dict) -> list:
        return [o for kind, per_receiver in direct.values() for o in per_receiver[self._sinks[kind].rank].outputs]
