"""The device path's gather (CUDA / NPU, and every export without an engine behind it off the CPU):
torch.distributed.all_gather per tensor over the collective backend (NCCL / HCCL), into the consumer's memory where
it qualifies (in_place.py), else into fresh buffers; a row-split TP parameter is gathered whole and converted (a row
plan would multiply the calls).

It is also the base of every transport plug-in (the strategy `HFExporter.transport_for` picks once): the CPU's
shared-memory gather (shm_gather.py) and the direct writes (direct_write.py) override its hooks. The hooks `begin`
... `own_outputs` are the direct writes: no-ops (and no collective) here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mcore_rl.platform.shm_gather import collective_gather_into
from mcore_rl.weight_sync.placement import Exported, Placer
from mcore_rl.weight_sync.receiver import WeightBuffers, WeightReceiver
from mcore_rl.weight_sync.row_plan import RowPlan


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
