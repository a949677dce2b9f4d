"""Where a gathered tensor may land straight in a receiving engine's memory (its `WeightReceiver.buffer`)."""

from __future__ import annotations

from typing import Hashable, Iterable, Optional

import torch

from mcore_rl.models.bridge import ModelBridge
from mcore_rl.models.shards import numel
from mcore_rl.platform.shared_memory import SharedTensors
from mcore_rl.weight_sync.receiver import WeightBuffers


class InPlaceTargets:
    """Where a gathered tensor lands straight in a consumer's memory (`buffer`), checked once per consumer,
    parameter and shape while that consumer keeps receiving."""

    def __init__(self, bridge: ModelBridge):
        self.bridge = bridge
        # per consumer (`consumer_key`): (canonical, shape, dtype) -> its destination, None if it has none
        self._memo: dict[Hashable, dict[tuple, Optional[torch.Tensor]]] = {}

    def keep_only(self, consumers: Iterable[Optional[WeightBuffers]]) -> None:
        """Forget every consumer but these (at the start of an export: a consumer not in it may be gone)."""
        keys = {consumer_key(c) for c in consumers}
        self._memo = {k: v for k, v in self._memo.items() if k in keys}

    def forget(self) -> None:
        self._memo.clear()

    def destination(
        self, canonical: str, shape: tuple, dtype: torch.dtype, into: Optional[WeightBuffers]
    ) -> Optional[torch.Tensor]:
        """A tensor of `shape` over the consumer's memory that `to_hf` turns into exactly the consumer's own
        tensors for `canonical`'s Hugging Face names (same data pointers, shapes and strides), or None.

        The candidate starts where the consumer's tensor for the first HF name starts and spans `shape`
        contiguously inside that storage; `to_hf` is run on it (views only, when it qualifies) and every output
        must coincide with the consumer's tensor of that name. Conversions that copy or reorder (e.g. a fused
        QKV regrouped per head) fail the check. The answer is remembered per consumer (`consumer_key`) until an
        export without that consumer: a consumer's weights keep their memory between syncs (an engine that
        replaces its tensors, e.g. `rebuild_from`, is a new region / a new bound owner)."""
        if into is None:
            return None
        memo = self._memo.setdefault(consumer_key(into), {})
        key = (canonical, tuple(shape), dtype)
        if key in memo:
            return memo[key]
        found = self._check(canonical, shape, dtype, into)
        if found is None or isinstance(getattr(into, "__self__", None), SharedTensors):
            memo[key] = found  # a table's places never move; another consumer's tensors may be replaced
        return found

    def _check(self, canonical: str, shape: tuple, dtype: torch.dtype, into: WeightBuffers) -> Optional[torch.Tensor]:
        backend = self.bridge.backend
        names = backend.hf_names(canonical)
        first = into(names[0]) if names else None
        count = numel(shape)
        if (
            first is None
            or first.dtype != dtype
            or first.device != self.bridge.platform.device
            or not first.is_contiguous()
            or first.storage_offset() + count > first.untyped_storage().nbytes() // dtype.itemsize
        ):
            return None
        candidate = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), tuple(shape))
        hf_names, hf_tensors = backend.to_hf(canonical, candidate)
        for name, tensor in zip(hf_names, hf_tensors):
            target = into(name)
            if target is None or not (
                tensor.data_ptr() == target.data_ptr()
                and tensor.shape == target.shape
                and tensor.stride() == target.stride()
                and tensor.dtype == target.dtype
            ):
                return None
        if sum(t.numel() for t in hf_tensors) != count:  # the HF tensors must cover the whole candidate
            return None
        return candidate


def consumer_key(into: Optional[WeightBuffers]) -> Hashable:
    """Whose memory `into` hands out: a shared table's region and where it is mapped in this process (a region
    mapped again is another key), else the bound method's object (its id)."""
    owner = getattr(into, "__self__", into)
    return (owner.token, owner.region.base) if isinstance(owner, SharedTensors) else id(owner)


def consumer_tensor(
    into: Optional[WeightBuffers], name: str, shape: tuple, dtype: torch.dtype, device: torch.device
) -> Optional[torch.Tensor]:
    """The consumer's own tensor for `name` when a row plan can write into it (shape, dtype, device, contiguous)."""
    target = into(name) if into is not None else None
    if (
        target is None
        or tuple(target.shape) != tuple(shape)
        or target.dtype != dtype
        or target.device != device
        or not target.is_contiguous()
    ):
        return None
    return target
