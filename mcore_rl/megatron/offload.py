"""Device storages to host memory and back, bit-exactly (actor.offload: the actor around rollout, the reference
model outside its own pass).

The unit is the untyped storage, not the tensor: a parameter of the distributed optimizer's actor is a view into
DDP's flat parameter buffer, `main_grad` a view into the flat gradient buffer, a main-parameter shard of an fp32
model a view into the parameter buffer again. Moving each distinct storage once, and resizing it to 0 bytes in
place, keeps every view (and every reference Megatron holds to it) valid: after `reload` the same storage has its
bytes back at a new address, and views read through the storage. Resizing to 0 frees the memory (the caching
allocator's block; `Platform.empty_cache` then returns it to the device), which is what a colocated engine needs.

Gradients (DDP's gradient buffers, the main parameters' `.grad`) are released without a copy and come back as
zeros: `Actor.train_step` zeroes them before they are read again, so their content between steps is dead and
copying it would cost host memory (4 bytes per parameter with fp32 gradient reduction) and transfer time.

Host copies go into pinned chunks of one power-of-two size, not one pinned tensor per storage
(mcore_rl/preflight/host_chunks.py: the caching host allocator's rounding would cost up to 2x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from mcore_rl.platform import Platform
from mcore_rl.preflight.host_chunks import HOST_CHUNK_BYTES, chunk_bytes, layout


@dataclass(frozen=True)
class HostCopy:
    """One storage's bytes on the host: views into the pinned chunks, in storage order."""

    views: tuple[torch.Tensor, ...]

    def numel(self) -> int:
        return sum(v.numel() for v in self.views)

    def is_pinned(self) -> bool:
        return all(v.is_pinned() for v in self.views)


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: Optional[HostCopy]  # None: released without a copy (comes back as zeros)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (for copying it as raw bytes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _on(platform: Platform, t: torch.Tensor) -> bool:
    return t.device.type == platform.device.type and not t.is_meta


class HostOffload:
    """Holds the storages of one set of tensors while they are on the host.

    `read_only`: the tensors never change while on the device (the frozen reference model): the storages and
    their host copies are taken once and kept; later offloads only release the device storages.
    """

    def __init__(self, platform: Platform, read_only: bool = False, largest_chunk: int = HOST_CHUNK_BYTES):
        self.platform = platform
        self.read_only = read_only
        self.largest_chunk = largest_chunk
        self._held: list[_Held] = []
        self._chunks: list[torch.Tensor] = []  # the pinned host chunks the copies live in
        self.offloaded = False

    def _storages(self, kept: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor]) -> list[_Held]:
        """Distinct device storages with content; a storage that is in both lists is kept."""
        found: dict[int, torch.UntypedStorage] = {}
        keep: set[int] = set()
        for is_kept, tensors in ((True, kept), (False, gradients)):
            for t in tensors:
                if not _on(self.platform, t) or t.untyped_storage().nbytes() == 0:
                    continue
                s = t.untyped_storage()
                found.setdefault(s.data_ptr(), s)
                if is_kept:
                    keep.add(s.data_ptr())
        copied = [s for key, s in found.items() if key in keep]
        hosts = dict(zip((s.data_ptr() for s in copied), self._host_copies(copied)))
        return [_Held(s, s.nbytes(), hosts.get(key)) for key, s in found.items()]

    def _host_copies(self, storages: list[torch.UntypedStorage]) -> list[HostCopy]:
        """Start copying each storage into fresh pinned chunks; per storage its host views, in order."""
        sizes = [s.nbytes() for s in storages]
        chunk = chunk_bytes(sum(sizes), self.largest_chunk)
        places = layout(sizes, chunk)
        count = max((pieces[-1][0] + 1 for pieces in places if pieces), default=0)
        self._chunks = [self.platform.host_buffer(chunk) for _ in range(count)]
        copies = []
        for storage, pieces in zip(storages, places):
            views, start, device = [], 0, _bytes_of(storage)
            for index, offset, length in pieces:
                view = self._chunks[index][offset : offset + length]
                view.copy_(device[start : start + length], non_blocking=True)
                views.append(view)
                start += length
            copies.append(HostCopy(tuple(views)))
        return copies

    def offload(self, kept: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor] = ()) -> int:
        """Copy the storages of `kept` to the host, release those of `kept` and `gradients` on the device;
        returns the bytes released. A second call while offloaded does nothing."""
        if self.offloaded:
            return 0
        if not (self.read_only and self._held):
            self._held = self._storages(kept, gradients)
        self.platform.synchronize()  # the copies are complete before the device memory goes
        for h in self._held:
            h.storage.resize_(0)
        self.platform.empty_cache()
        self.offloaded = True
        return sum(h.nbytes for h in self._held)

    def reload(self) -> int:
        """Give every released storage its bytes back (gradients: zeros); returns the bytes restored."""
        if not self.offloaded:
            return 0
        for h in self._held:
            h.storage.resize_(h.nbytes)
            device = _bytes_of(h.storage)
            if h.host is None:
                device.zero_()
                continue
            start = 0
            for view in h.host.views:
                device[start : start + view.numel()].copy_(view, non_blocking=True)
                start += view.numel()
        self.platform.synchronize()
        restored = sum(h.nbytes for h in self._held)
        if not self.read_only:
            self._held, self._chunks = [], []  # the host copies go; the next offload copies the state as it is then
        self.offloaded = False
        return restored

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held now."""
        return sum(h.host.numel() for h in self._held if h.host is not None)

    @property
    def pinned_bytes(self) -> int:
        """Host memory the copies hold now: their whole chunks (host_chunks.pinned_bytes of host_bytes)."""
        return sum(c.numel() for c in self._chunks)
