"""CPU plug-in: the export's gathers through shared segments in /dev/shm where a gloo group's ranks share a host
(mcore_rl/platform/shm_gather.py; torch.distributed otherwise), buffers carved from one reused arena (fresh buffers
would pay page faults on every byte), and row plans (row_plan.py): each shard's rows straight into the consumer's
q / k / v, gate / up, ... tensors. Taken on the CPU (`Platform.weight_transport` "shared-memory") by every export
whose engine offers no shared region.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mcore_rl.platform.shm_gather import Arena, GroupGather
from mcore_rl.weight_sync.collective import CollectiveGather


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
