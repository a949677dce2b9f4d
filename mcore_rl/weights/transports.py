"""How an export moves shards between the ranks of its gather groups: one strategy, chosen once.

- `CollectiveGather`, the default (CUDA / NPU): torch.distributed.all_gather per tensor over the collective
  backend (NCCL / HCCL), into the consumer's memory where it qualifies, else into fresh buffers; a row-split
  TP parameter is gathered whole and converted (a row plan would multiply the calls).
- `SharedMemoryGather`, on the CPU: the same items through shared segments in /dev/shm where a gloo group's
  ranks share a host (mcore_rl/platform/shm_gather.py; torch.distributed otherwise), buffers carved from one
  reused arena (fresh buffers would pay page faults on every byte), and row plans (row_plan.py): each shard's
  rows straight into the consumer's q / k / v, gate / up, ... tensors.
- `DirectWrite` (direct_write.py), on the CPU when an engine offers a shared region (`WeightReceiver.shared`): the
  shared-memory gather plus every rank writing its own shards straight into every receiving engine.

The exporter chooses once per purpose (weights/exporter.py `HFExporter.transport_for`): exports with no engine
behind them (saving, verification) take the platform's gather; the first export into an engine picks the
engine transport from the platform and, on the CPU only, one agreement over the job on whether any engine
offers a shared region. The hooks `begin` ... `own_outputs` are the direct writes: no-ops (and no collective)
for the gathers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mcore_rl.platform.shm_gather import Arena, GroupGather, collective_gather_into
from mcore_rl.weights.placement import Exported, Placer
from mcore_rl.weights.receiver import WeightBuffers, WeightReceiver
from mcore_rl.weights.row_plan import RowPlan


class CollectiveGather:
    """torch.distributed.all_gather into the placed destinations; buffers are fresh tensors on the device."""

    def __init__(self, device: torch.device):
        self.device = device

    def gather(self, items: list, group, receive: bool) -> None:
        if items:  # every rank of the group has the same batch structure, so all skip or none
            collective_gather_into(items, group, receive)

    def plans_rows(self, group) -> bool:
        """Whether row-split TP parameters over `group` follow row plans (cheap only without a collective call
        per block)."""
        return False

    def allocator(self, needs: list[tuple[tuple, torch.dtype]]) -> Callable:
        """`alloc(shape, dtype)` for a batch's buffers (`needs`: their shapes and dtypes, from the dry run)."""
        return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=self.device)

    # ---- direct writes into the receiving engines (DirectWrite); none here --------------------------------
    def begin(self, receive: bool, receiver: Optional[WeightReceiver]) -> frozenset[str]:
        """Set up one export; the group kinds whose batches may hold more bytes (their tensors need no buffer)."""
        return frozenset()

    def consumers(self) -> list[WeightBuffers]:
        """The receiving engines' tables this export writes into (their in-place answers stay remembered)."""
        return []

    def place_direct(self, batch: list[Exported], plans: dict[int, RowPlan], placer: Placer, stats) -> dict:
        """batch position -> what this rank writes into the receiving engines, for the tensors written directly."""
        return {}

    def write_direct(self, direct: dict) -> None:
        """Write this rank's shards of `direct` and confirm that every rank of each group did."""

    def own_outputs(self, direct: dict) -> list:
        """The outputs of `direct` in this rank's own engine (what it yields for them)."""
        return []


class SharedMemoryGather(CollectiveGather):
    """The CPU gather: shared segments where a gloo group's ranks share a host, arena buffers, row plans."""

    def __init__(self, device: torch.device, groups: Optional[GroupGather] = None):
        super().__init__(device)
        self.groups = groups if groups is not None else GroupGather()

    def gather(self, items: list, group, receive: bool) -> None:
        if items:
            self.groups.all_gather_into(items, group, receive)

    def plans_rows(self, group) -> bool:
        return self.groups.uses_shared_memory(group)  # decided once per group (collective the first time)

    def allocator(self, needs: list[tuple[tuple, torch.dtype]]) -> Callable:
        if not needs:
            return super().allocator(needs)
        return self.groups.buffers.take(Arena.bytes_for(needs)).empty
