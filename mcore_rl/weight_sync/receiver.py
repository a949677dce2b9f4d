"""What a rollout engine offers a weight export, and where a gathered tensor may land in the engine's memory.

Every engine copies in the (Hugging Face name, full tensor) pairs it is given (`RolloutEngine.load_weights`).
An engine may offer more (a `WeightReceiver`):

- in-place buffers, `buffer(name)`: its own tensor holding a weight (a view where it fuses several). A
  gathered tensor whose Hugging Face tensors are plain views of one contiguous range of that memory is gathered
  straight into it (in_place.py `InPlaceTargets`, checked by pointer, shape and stride), so each byte moves once; the pair
  yielded then IS the engine's tensor, and `load_weights` skips a tensor that already is its own.
- a shared region, `shared`: its weights in shared memory that the other ranks of its host can map and write
  (mcore_rl/platform/shared_memory.py), named as `buffer` names them; the direct-write transport
  (direct_write.py) lets every rank write its own shards there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from mcore_rl.platform.shared_memory import SharedTensors

# A consumer's own tensor for a Hugging Face weight name, or None.
WeightBuffers = Callable[[str], Optional[torch.Tensor]]


@dataclass(frozen=True)
class WeightReceiver:
    """Where an engine lets a sync put its weights besides `load_weights` (the copy every engine takes).

    `buffer(name)`: the engine's own tensor holding Hugging Face weight `name` (a view where the engine fuses
    several; None for a name it does not hold), for an exporter that writes new weights straight into it. An
    engine that offers buffers skips, in `load_weights`, a given tensor that already IS its own.
    `shared`: those tensors in a shared-memory region other processes of the host map and write
    (mcore_rl/platform/shared_memory.py), named as `buffer` names them. Asked for at every sync: an engine that
    replaces its tensors (`rebuild_from`) offers new ones."""

    buffer: Optional[WeightBuffers] = None
    shared: Optional["SharedTensors"] = None

    @property
    def kind(self) -> str:
        """ "shared" (a region other processes write), "buffers" (in place, this process) or "copy" (load_weights)."""
        return "shared" if self.shared is not None else "buffers" if self.buffer is not None else "copy"


COPY_IN = WeightReceiver()  # load_weights only; also what a rank of a sync without an engine passes
