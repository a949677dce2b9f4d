"""The device path, which every engine takes: the actor's Hugging Face export streamed in buckets into
`RolloutEngine.load_weights` (the copy every engine offers; vLLM, the embedded engine, the separate placement's
bridge). What the export writes straight into the engine's memory on the way (the plug-ins: in_place.py,
direct_write.py) the engine's `load_weights` recognises as its own and skips.

Multi-rank contract: every rank of the actor iterates the exporter to the end, because the exporter gathers each full
tensor with collectives over TP / PP / EP groups; only ranks that hold an engine replica (``engine`` is not None)
load what they receive, the others drop each tensor as soon as it is yielded.

Memory: a bucket holds at most ``bucket_mb`` of tensors (a single larger tensor travels alone), so the extra
memory of a sync is about one bucket plus the one tensor the exporter is gathering.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from mcore_rl.platform import collectives
from mcore_rl.weight_sync.fingerprints import fingerprint

log = logging.getLogger(__name__)

WeightStream = Iterable[tuple[str, torch.Tensor]]
# A RolloutEngine (mcore_rl/rollout/base.py), called by its protocol's methods: rollout/ imports this package.
Engine = Any


@dataclass
class SyncStats:
    num_tensors: int
    num_buckets: int
    total_bytes: int
    largest_tensor_bytes: int
    max_bucket_bytes: int  # the largest bucket actually held (>= bucket size only for a single oversized tensor)
    seconds: float  # wall time of the whole sync (export + load)
    export_seconds: float  # time spent inside the exporter (gathers)
    load_seconds: float  # time spent in engine.load_weights
    fingerprints: Optional[dict[str, torch.Tensor]] = None  # name -> sampled values sent (weight-level check)

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / 1e9 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        return (
            f"weight sync: {self.num_tensors} tensors, {self.total_bytes / 1e9:.3f} GB in {self.num_buckets} "
            f"buckets (largest {self.max_bucket_bytes / 1e6:.1f} MB) in {self.seconds:.3f} s = "
            f"{self.gb_per_s:.2f} GB/s (export {self.export_seconds:.3f} s, load {self.load_seconds:.3f} s)"
        )


def _timed(stream: WeightStream, clock: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield from `stream`, adding the time spent producing each item to clock[0]."""
    it = iter(stream)
    while True:
        start = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            clock[0] += time.perf_counter() - start
            return
        clock[0] += time.perf_counter() - start
        yield item


def sync_weights(
    export_iter: WeightStream,
    engine: Optional[Engine],
    bucket_mb: float,
    group=None,
    fingerprints: bool = True,
) -> SyncStats:
    """Stream (HF name, full tensor) pairs from the exporter into `engine` in buckets of `bucket_mb` MB.

    `engine` is None on ranks without an engine replica (they still drive the exporter; see module doc).
    After the stream, an engine that knows its weight names checks that every one of them arrived; the
    outcome is agreed over `group` (default: all ranks), so a missing weight raises on every rank.
    `fingerprints`: sample each tensor for the weight-level check (SyncStats.fingerprints; only a verified
    sync reads them, and they cost a seeded generator per tensor).
    """
    if bucket_mb <= 0:
        raise ValueError(f"rollout.sync_bucket_mb={bucket_mb}; use a positive bucket size in MB (e.g. 256)")
    limit = int(bucket_mb * (1 << 20))
    export_clock = [0.0]
    load_seconds = 0.0
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_bytes = 0
    stats = dict(num_tensors=0, num_buckets=0, total_bytes=0, largest_tensor_bytes=0, max_bucket_bytes=0)
    seen: set[str] = set()
    prints: dict[str, torch.Tensor] = {}

    def flush() -> None:
        nonlocal bucket, bucket_bytes, load_seconds
        if not bucket:
            return
        stats["num_buckets"] += 1
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], bucket_bytes)
        if engine is not None:
            start = time.perf_counter()
            engine.load_weights(bucket)
            load_seconds += time.perf_counter() - start
        bucket, bucket_bytes = [], 0  # drop references so the bucket's memory is freed before the next fills

    start = time.perf_counter()
    for name, tensor in _timed(export_iter, export_clock):
        size = tensor.numel() * tensor.element_size()
        stats["num_tensors"] += 1
        stats["total_bytes"] += size
        stats["largest_tensor_bytes"] = max(stats["largest_tensor_bytes"], size)
        seen.add(name)
        if engine is not None and fingerprints:
            prints[name] = fingerprint(name, tensor)  # stays on the device: no host sync per tensor
        if bucket and bucket_bytes + size > limit:
            flush()
        bucket.append((name, tensor))
        bucket_bytes += size
        del tensor
        if bucket_bytes >= limit:  # a tensor at least as big as a bucket goes alone
            flush()
    flush()
    result = SyncStats(
        seconds=time.perf_counter() - start,
        export_seconds=export_clock[0],
        load_seconds=load_seconds,
        fingerprints=_to_host(prints),
        **stats,
    )
    _check_complete(engine, seen, group)
    log.info(result.summary())
    return result


def _to_host(prints: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One device-to-host copy for all fingerprints of a sync (float32 holds bf16 / fp16 values exactly)."""
    if not prints:
        return {}
    flat = torch.cat([v.float() for v in prints.values()]).cpu()
    return dict(zip(prints, flat.split([v.numel() for v in prints.values()])))


def _check_complete(engine: Optional[Engine], seen: set[str], group) -> None:
    """Raise on every rank (so none waits in a later collective) when an engine missed some of its weights."""
    expected = engine.weight_names() if engine is not None else None
    missing = sorted(expected - seen) if expected is not None else []
    count = collectives.max_ints([len(missing)], group)[0]
    if count:
        example = f" (e.g. {missing[:3]})" if missing else " on another rank"
        raise ValueError(
            f"weight sync delivered {len(seen)} tensors but an engine did not receive {count} of its "
            f"weights{example}; its copies of those are stale - the exporter must yield every Hugging "
            f"Face weight"
        )
