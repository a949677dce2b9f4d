"""All-gather through shared memory when every rank of a gloo group runs on the same host.

gloo carries an all_gather over TCP loopback (~1.2 GB/s measured on our CPU hosts) while the ranks of a
single-host job could simply read each other's memory (~4 GB/s and more). `GroupGather` gathers shards
straight into caller-given destination views (so a split tensor is reassembled without an extra copy) and
picks the transport once per process group:

- shared memory: the group's ranks are on one host (same host id) AND see the same /dev/shm (a probe file
  written by the first rank is visible to all; containers can share a host id but not /dev/shm);
- otherwise (other backends, accelerator tensors, several hosts): torch.distributed.all_gather.

Shared-memory protocol (collective over the group, every rank in step): each call's items are cut into
rounds of at most `max_chunk_bytes`. Per round every rank writes its shards into its own segment, then one
tiny all_gather of (call, round, bytes, shape/dtype digest, receives?, wrote?) serves as the "written"
barrier AND checks that all ranks gather the same thing (otherwise every rank raises the same error, none
is left hanging); then every receiving rank copies its peers' shards into the destinations. Rounds alternate
between two segments per rank (double buffering): a segment is rewritten two rounds later, after the
collective of the round in between, which every reader enters only after finishing its reads. Writing before
the collective lets a sender run one round ahead of a busy reader. A rank none of whose peers receive (a rank
without an engine replica passes receive=False) skips writing.
Segments are /dev/shm files named by a per-group random token (parallel jobs never collide), grown as
needed, and unlinked as soon as every rank has mapped them: nothing is left behind, even after a crash.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_ALIGN = 64  # byte offset alignment of every piece inside a segment (valid for any dtype's view)

# (this rank's shard, destination per group rank); destinations None: this rank only sends (see `receive`)
GatherItem = tuple[torch.Tensor, Optional[Sequence[torch.Tensor]]]


def default_host_id() -> str:
    """Hostname plus kernel boot id: equal for processes of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class _Piece:
    """A slice of one item that travels in one round: source slice and one destination slice per rank."""

    src: torch.Tensor
    dsts: Optional[list[torch.Tensor]]
    nbytes: int
    offset: int = 0  # byte offset inside the round's segment


def _pieces(shard: torch.Tensor, dsts: Optional[Sequence[torch.Tensor]], max_bytes: int) -> list[_Piece]:
    """Cut an item into slices of at most `max_bytes` (one slice at least) along its longest dimension."""
    src, shape = shard, shard.shape  # same slicing on every rank, receiver or not: dsts have the shard's shape
    nbytes = src.numel() * src.element_size()
    if nbytes <= max_bytes or src.dim() == 0:
        return [_Piece(src, None if dsts is None else list(dsts), nbytes)]
    dim = max(range(src.dim()), key=lambda d: shape[d])
    row_bytes = nbytes // shape[dim]
    rows = max(1, max_bytes // row_bytes)
    out = []
    for start in range(0, shape[dim], rows):
        n = min(rows, shape[dim] - start)
        out.append(
            _Piece(
                src.narrow(dim, start, n),
                None if dsts is None else [d.narrow(dim, start, n) for d in dsts],
                n * row_bytes,
            )
        )
    return out


def _rounds(pieces: list[_Piece], max_bytes: int) -> list[list[_Piece]]:
    """Pack pieces in order into rounds of at most `max_bytes` (a larger single piece travels alone)."""
    rounds: list[list[_Piece]] = []
    used = max_bytes + 1
    for piece in pieces:
        if used + piece.nbytes > max_bytes:
            rounds.append([])
            used = 0
        piece.offset = used
        rounds[-1].append(piece)
        used = _round_up(used + piece.nbytes, _ALIGN)
    return rounds


def _round_bytes(round_: list[_Piece]) -> int:
    last = round_[-1]
    return last.offset + last.nbytes


class _ShmSegments:
    """This rank's two shared segments for one group and its mappings of every peer's."""

    def __init__(self, group, token: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.token = token
        self.capacity = [0, 0]
        self.views: list[list[torch.Tensor]] = [[], []]
        self.generation = 0
        self.calls = 0  # gather calls, and rounds over all calls (which slot a round uses)
        self.turns = 0
        self.peers_receive = True  # whether some peer read the last round (if not, this rank skips writing)

    def _path(self, rank: int, slot: int, generation: int) -> str:
        return os.path.join(SHM_DIR, f"mcore_rl_gather_{self.token}_r{rank}_s{slot}_g{generation}")

    def grow(self, slot: int, nbytes: int, limit: int) -> None:
        """Collective: replace segment `slot` of every rank by one of at least `nbytes` (doubling up to `limit`)."""
        capacity = _round_up(max(nbytes, min(2 * self.capacity[slot], limit)), 1 << 20)
        self.generation += 1
        mine = self._path(self.rank, slot, self.generation)
        fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, capacity)
        finally:
            os.close(fd)
        try:
            dist.barrier(group=self.group)  # every rank's file exists
            self.views[slot] = [
                torch.from_file(self._path(r, slot, self.generation), shared=True, size=capacity, dtype=torch.uint8)
                for r in range(self.world)
            ]
            dist.barrier(group=self.group)  # every rank mapped every file: the names can go
        finally:
            os.unlink(mine)
        self.capacity[slot] = capacity

    def gather(self, items: list[GatherItem], max_chunk_bytes: int, receive: bool) -> None:
        self.calls += 1
        digest = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t, _ in items]).encode())
        pieces = [p for shard, dsts in items for p in _pieces(shard, dsts, max_chunk_bytes)]
        for i, round_ in enumerate(_rounds(pieces, max_chunk_bytes)):
            self._round(round_, i, digest, receive, max_chunk_bytes)

    def _round(self, round_: list[_Piece], index: int, digest: int, receive: bool, max_chunk_bytes: int) -> None:
        """Write this rank's pieces, one small all_gather (= 'written' barrier + agreement check), read.

        A sender writes BEFORE the collective, so it runs one round ahead of slower readers; its slot is free
        because every reader finished the round two back before entering the previous round's collective."""
        slot = self.turns % 2
        self.turns += 1
        nbytes = _round_bytes(round_)
        wrote = self.peers_receive and nbytes <= self.capacity[slot]
        if wrote:
            self._write(round_, slot)
        if receive:  # our own shards first: a peer still writing its shards meanwhile costs us no waiting
            self._copy_own(round_)
        mine = torch.tensor([self.calls, index, nbytes, digest, int(receive), int(wrote)], dtype=torch.int64)
        every = torch.empty(self.world * 6, dtype=torch.int64)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every = every.view(self.world, 6)
        if not bool((every[:, :4] == every[0, :4]).all()):
            rows = ", ".join(
                f"rank {r}: call {c} round {i} bytes {b}" for r, (c, i, b, *_) in enumerate(every.tolist())
            )
            raise ValueError(
                f"shared-memory all_gather: the group's ranks gather different tensors ({rows}; equal "
                f"bytes with a different digest means other shapes/dtypes); every rank must pass shards "
                f"of the same shapes and dtypes, in the same order"
            )
        receivers = every[:, 4].bool().tolist()
        self.peers_receive = any(receivers[r] for r in range(self.world) if r != self.rank)
        missing = [
            r for r in range(self.world) if not every[r, 5] and any(receivers[q] for q in range(self.world) if q != r)
        ]
        if missing:  # too small a segment (same on every rank) or a stale guess that nobody reads: write now
            if nbytes > self.capacity[slot]:
                self.grow(slot, nbytes, max_chunk_bytes)
            if self.rank in missing:
                self._write(round_, slot)
            dist.barrier(group=self.group)
        if receive:
            self._read(round_, slot)

    def _write(self, round_: list[_Piece], slot: int) -> None:
        own = self.views[slot][self.rank]
        for p in round_:
            own[p.offset : p.offset + p.nbytes].view(p.src.dtype).view(p.src.shape).copy_(p.src)

    def _copy_own(self, round_: list[_Piece]) -> None:
        for p in round_:
            dst = p.dsts[self.rank]
            if not _same_memory(dst, p.src):
                dst.copy_(p.src)

    def _read(self, round_: list[_Piece], slot: int) -> None:
        segments = self.views[slot]
        for p in round_:
            for r, dst in enumerate(p.dsts):
                if r != self.rank:
                    dst.copy_(segments[r][p.offset : p.offset + p.nbytes].view(p.src.dtype).view(p.src.shape))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are the same elements (a caller may pass its own shard as its own destination: no copy)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _storage_in_use(storage: torch.UntypedStorage) -> bool:
    """Whether anything besides `storage` itself (a tensor, a view) still references its memory.

    torch has no public use count; torch._C._storage_Use_Count exists in the releases we support (2.x), and
    without it we answer True, i.e. an arena is never reused (correct, only slower)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is None or use_count(storage._cdata) > 1


class BufferPool:
    """Reusable CPU byte arenas for gathered tensors.

    A fresh multi-MB CPU buffer pays a page fault per 4 KiB page on first write: copying into one ran at
    ~1.6 GB/s here against ~10 GB/s into touched memory, which made fresh outputs the exporter's largest
    cost. An arena is handed out again once nothing references its memory any more (the consumer dropped every
    tensor carved from it); at most `max_arenas` are kept."""

    def __init__(self, max_arenas: int = 8):
        self.max_arenas = max_arenas
        self._arenas: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> "Arena":
        free = [a for a in self._arenas if a.nbytes() >= nbytes and not _storage_in_use(a)]
        if free:
            return Arena(min(free, key=lambda a: a.nbytes()))
        storage = torch.UntypedStorage(_round_up(max(nbytes, 1), 1 << 20))
        if len(self._arenas) >= self.max_arenas:  # make room: forget a free one (the largest), else do not keep it
            idle = [a for a in self._arenas if not _storage_in_use(a)]
            if not idle:
                return Arena(storage)
            self._arenas.remove(max(idle, key=lambda a: a.nbytes()))
        self._arenas.append(storage)
        return Arena(storage)

    def clear(self) -> None:
        self._arenas.clear()


class Arena:
    """Tensors carved one after another out of one storage (64-byte aligned)."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage
        self.used = 0

    @staticmethod
    def bytes_for(shapes_dtypes: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
        return sum(_round_up(_numel(shape) * dtype.itemsize, _ALIGN) for shape, dtype in shapes_dtypes)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _numel(shape) * dtype.itemsize
        if self.used + nbytes > self.storage.nbytes():
            raise ValueError(
                f"arena of {self.storage.nbytes()} bytes cannot fit {nbytes} more after {self.used}; "
                f"size it with Arena.bytes_for"
            )
        out = torch.empty(0, dtype=torch.uint8).set_(self.storage, self.used, (nbytes,))
        self.used = _round_up(self.used + nbytes, _ALIGN)
        return out.view(dtype).view(tuple(shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _checked_items(items: Sequence[GatherItem], group, receive: bool) -> list[GatherItem]:
    """The items as a list, each with one destination per group rank of its shard's shape and dtype."""
    items = list(items)
    world = dist.get_world_size(group)
    for shard, dsts in items:
        if not receive and dsts is None:
            continue
        if dsts is None or len(dsts) != world or any(d.shape != shard.shape or d.dtype != shard.dtype for d in dsts):
            raise ValueError(
                f"all_gather_into: shard {tuple(shard.shape)} {shard.dtype} needs {world} destinations "
                f"of that shape and dtype (views of a merged tensor may be strided), got "
                f"{[(tuple(d.shape), d.dtype) for d in dsts]}"
            )
    return items


def collective_gather_into(items: Sequence[GatherItem], group, receive: bool = True) -> None:
    """`GroupGather.all_gather_into` through torch.distributed.all_gather alone (any backend, any device)."""
    _collective_gather(_checked_items(items, group, receive), group, receive)


def _collective_gather(items: list[GatherItem], group, receive: bool) -> None:
    world = dist.get_world_size(group)
    for shard, dsts in items:
        shard = shard.contiguous()
        out = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(out, shard, group=group)
        for dst, got in zip(dsts if receive else (), out):
            if not _same_memory(dst, shard):
                dst.copy_(got)


@dataclass
class GroupGather:
    """All-gather into destination views, through shared memory where a group allows it (see module doc).

    Keeps one transport decision (and, for shared memory, two segments per rank) per process group for its
    lifetime; `close()` drops the mappings. `host_id` says which machine this process runs on.
    """

    max_chunk_bytes: int = 64 << 20
    host_id: Callable[[], str] = default_host_id
    buffers: BufferPool = field(default_factory=BufferPool, repr=False)  # for callers' gathered outputs
    _transports: dict = field(default_factory=dict, repr=False)

    def all_gather_into(self, items: Sequence[GatherItem], group, receive: bool = True) -> None:
        """For each (shard, dsts): dsts[r] receives group rank r's shard (same shape and dtype, any strides).

        Collective over `group`: every rank calls it with items of the same shapes and dtypes, in order.
        `receive=False` (dsts None): this rank only contributes its shards; over shared memory it then reads
        nothing, and a rank whose peers all pass receive=False writes nothing."""
        items = _checked_items(items, group, receive)
        segments = self.transport(group, items)
        if segments is not None:
            segments.gather(items, self.max_chunk_bytes, receive)
        else:
            _collective_gather(items, group, receive)

    def all_gather(self, tensor: torch.Tensor, group) -> list[torch.Tensor]:
        """Like torch.distributed.all_gather: one tensor per group rank (views of one new buffer)."""
        out = torch.empty((dist.get_world_size(group),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
        views = list(out.unbind(0))
        self.all_gather_into([(tensor, views)], group)
        return views

    def uses_shared_memory(self, group) -> bool:
        """Whether gathers over `group` go through shared memory (decides it on first use; collective then)."""
        return self.transport(group, []) is not None

    def transport(self, group, items: Sequence[GatherItem]) -> Optional[_ShmSegments]:
        """The group's shared segments, or None for torch.distributed. Decided once per group (collective)."""
        key = group if group is not None else dist.group.WORLD
        if key not in self._transports:
            self._transports[key] = self._shared_segments(group)
        segments = self._transports[key]
        if segments is not None and any(s.device.type != "cpu" for s, _ in items):
            return None  # accelerator tensors: the collective backend is the fast path
        return segments

    def _shared_segments(self, group) -> Optional[_ShmSegments]:
        if dist.get_backend(group) != "gloo":
            return None
        world = dist.get_world_size(group)
        token = uuid.uuid4().hex[:16]
        probe = os.path.join(SHM_DIR, f"mcore_rl_gather_{token}_probe")
        first = dist.get_rank(group) == 0
        if first:
            try:
                with open(probe, "w") as f:
                    f.write(token)
            except OSError as e:
                logger.info("shared-memory gather off: cannot write %s (%s)", probe, e)
        ids = [None] * world
        dist.all_gather_object(ids, (self.host_id(), token), group=group)
        token = ids[0][1]
        probe = os.path.join(SHM_DIR, f"mcore_rl_gather_{token}_probe")
        same_host = all(host == ids[0][0] for host, _ in ids)
        sees_probe = False
        if same_host:
            try:
                with open(probe) as f:
                    sees_probe = f.read() == token
            except OSError:
                sees_probe = False
        votes = [None] * world
        dist.all_gather_object(votes, sees_probe, group=group)
        if first and os.path.exists(probe):
            os.unlink(probe)
        if not all(votes):
            logger.info("shared-memory gather off for group of %d ranks (same host: %s)", world, same_host)
            return None
        return _ShmSegments(group, token)

    def close(self) -> None:
        """Drop every mapping (the files were unlinked when mapped) and the cached output arenas."""
        self._transports.clear()
        self.buffers.clear()
