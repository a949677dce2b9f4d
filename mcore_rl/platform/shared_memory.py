"""Tensors that other processes of the same host can map and write: a CPU rollout engine's parameters, so that
the exporter's peer ranks write their shards straight into the engine (each byte of a weight sync moves once).

`SharedRegion.create(nbytes)`: an anonymous shared-memory file (memfd) reserved up front (posix_fallocate: a
full machine fails there with an error, not with SIGBUS at a later write) and mapped into this process. It
has no name in any file system, so it cannot outlive the processes that map it, even after a crash (nothing is
ever left in /dev/shm, and /dev/shm's size, 64 MB in a default Docker container, does not limit it). Another
process of the same host opens it through ``/proc/<pid>/fd/<fd>`` (`SharedRegion.open(handle)`): that needs
the same user and the same PID namespace. The region's first bytes hold a random token that the opener
checks, so a different process behind that pid (another container) is detected and `open` returns None (the
caller keeps its other transport). The owner closes its descriptor when the region is garbage-collected or
closed; mappings stay valid until every process dropped them.

`SharedTensors`: a region plus a table name -> `TensorSpec` (byte offset, shape, strides, dtype) of tensors
inside it. The owner writes the table into the file behind the mapped bytes (`publish`); an opener reads it
from there, so the handle exchanged between processes (`RegionHandle`) stays a few bytes.
`share_parameters(module)` moves a module's parameters into a new region (each parameter's data becomes a
view of the region; tied parameters stay tied): while it runs the module's weights exist twice.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_MAGIC = b"mcore_rl.shared_region.v1"
_HEADER = 4096  # magic, token, table offset, table length; tensors start here (page aligned)
_ALIGN = 64  # byte alignment of each tensor inside a region
_HEADER_FORMAT = "<32s32sQQ"  # magic (padded), token (hex), table offset, table length


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RegionHandle:
    """What another process of the host needs to open a region (picklable)."""

    pid: int
    fd: int
    nbytes: int  # bytes mapped (header + tensors; the table lies behind them in the file)
    token: str


@dataclass(frozen=True)
class TensorSpec:
    """A tensor inside a region: byte offset from the region's start, shape, strides (elements), dtype name."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def to_json(self) -> list:
        return [self.offset, list(self.shape), list(self.stride), self.dtype]

    @classmethod
    def from_json(cls, value: list) -> "TensorSpec":
        offset, shape, stride, dtype = value
        return cls(int(offset), tuple(shape), tuple(stride), str(dtype))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared region table: unknown dtype {name!r}")
    return dtype


class SharedRegion:
    """One shared mapping of `nbytes` bytes (see module doc). `bytes` is a uint8 tensor over all of it."""

    def __init__(self, fd: Optional[int], pid: int, nbytes: int, token: str, mapping: mmap.mmap):
        self.fd = fd  # the owner's descriptor (kept open so peers can open it); None in an opener
        self.pid = pid
        self.nbytes = nbytes
        self.token = token
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        self.base = self.bytes.data_ptr()
        self._closer = weakref.finalize(self, os.close, fd) if fd is not None else None

    @classmethod
    def create(cls, nbytes: int) -> "SharedRegion":
        """A new region of at least `nbytes` bytes for tensors (raises OSError where the host cannot)."""
        nbytes = _HEADER + _round_up(max(nbytes, 1), 1 << 12)
        if not hasattr(os, "memfd_create") or not hasattr(os, "posix_fallocate"):
            raise OSError("shared regions need Linux (memfd_create, posix_fallocate)")
        fd = os.memfd_create("mcore_rl_shared_region", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        token = uuid.uuid4().hex
        mapping[: struct.calcsize(_HEADER_FORMAT)] = struct.pack(_HEADER_FORMAT, _MAGIC, token.encode(), 0, 0)
        return cls(fd, os.getpid(), nbytes, token, mapping)

    @classmethod
    def open(cls, handle: RegionHandle) -> Optional[tuple["SharedRegion", dict[str, "TensorSpec"]]]:
        """Map another process's region and read its table, or None when this process cannot reach it (another
        host, another PID namespace, no permission, a different process behind the pid)."""
        if handle.pid == os.getpid():
            return None  # our own region: use the owner's object
        try:
            fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDWR)
        except OSError as e:
            logger.info("shared region of pid %d not reachable (%s)", handle.pid, e)
            return None
        try:
            magic, token, _, _ = _read_header(fd)
            if magic != _MAGIC or token != handle.token or os.fstat(fd).st_size < handle.nbytes:
                logger.info("shared region of pid %d: another file behind its descriptor", handle.pid)
                return None
            mapping = mmap.mmap(fd, handle.nbytes, flags=mmap.MAP_SHARED | _POPULATE)
            return cls(None, handle.pid, handle.nbytes, handle.token, mapping), _read_table(fd)
        except (OSError, struct.error) as e:  # a pipe, a socket, a short file behind that descriptor
            logger.info("shared region of pid %d: unreadable (%s)", handle.pid, e)
            return None
        finally:
            os.close(fd)

    @property
    def handle(self) -> RegionHandle:
        if self.fd is None or not self._closer.alive:
            raise ValueError("only the process that created a shared region can hand it out, until it closes it")
        return RegionHandle(self.pid, self.fd, self.nbytes, self.token)

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        """The tensor `spec` describes, over this region's memory."""
        dtype = _dtype(spec.dtype)
        if spec.offset % dtype.itemsize or spec.offset < _HEADER:
            raise ValueError(f"shared region: tensor at byte {spec.offset} is misaligned for {dtype}")
        extent = 1 + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride)) if all(spec.shape) else 0
        if spec.offset + extent * dtype.itemsize > self.nbytes:
            raise ValueError(f"shared region: tensor {spec} ends past the region's {self.nbytes} bytes")
        return self.bytes.view(dtype).as_strided(spec.shape, spec.stride, spec.offset // dtype.itemsize)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this region's memory (in this process)."""
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() == self.base

    def spec(self, tensor: torch.Tensor) -> TensorSpec:
        if not self.contains(tensor):
            raise ValueError("shared region: the tensor does not live in this region")
        return TensorSpec(tensor.data_ptr() - self.base, tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype))

    def publish(self, table: dict[str, TensorSpec]) -> None:
        """Write `table` into the file behind the mapped bytes, where `read_table` of an opener finds it."""
        data = json.dumps({name: spec.to_json() for name, spec in table.items()}).encode()
        os.ftruncate(self.fd, self.nbytes + len(data))
        os.pwrite(self.fd, data, self.nbytes)
        os.pwrite(self.fd, struct.pack(_HEADER_FORMAT, _MAGIC, self.token.encode(), self.nbytes, len(data)), 0)

    def read_table(self) -> dict[str, TensorSpec]:
        """The published table (owner side)."""
        return _read_table(self.fd)

    def close(self) -> None:
        """Close the owner's descriptor (no new opener can reach the region); the memory goes with the last
        tensor over it."""
        if self._closer is not None:
            self._closer()


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at mapping time, not at the first copies


def _read_table(fd: int) -> dict[str, TensorSpec]:
    _, _, offset, length = _read_header(fd)
    if not length:
        return {}
    data = json.loads(os.pread(fd, length, offset))
    return {name: TensorSpec.from_json(value) for name, value in data.items()}


def _read_header(fd: int) -> tuple[bytes, str, int, int]:
    raw = os.pread(fd, struct.calcsize(_HEADER_FORMAT), 0)
    magic, token, offset, length = struct.unpack(_HEADER_FORMAT, raw)
    return magic.rstrip(b"\0"), token.decode(errors="replace"), offset, length


class SharedTensors:
    """A region and the named tensors in it (see module doc); `view(name)` is the tensor or None."""

    def __init__(self, region: SharedRegion, table: dict[str, TensorSpec]):
        self.region = region
        self.table = table
        self._views: dict[str, torch.Tensor] = {}

    @property
    def token(self) -> str:
        return self.region.token

    @property
    def handle(self) -> RegionHandle:
        return self.region.handle

    @classmethod
    def describe(cls, region: SharedRegion, tensors: dict[str, torch.Tensor]) -> "SharedTensors":
        """The owner's table of `tensors` (views of `region`), published for openers."""
        shared = cls(region, {name: region.spec(t) for name, t in tensors.items()})
        region.publish(shared.table)
        return shared

    @classmethod
    def open(cls, handle: RegionHandle) -> Optional["SharedTensors"]:
        """Another process's tensors, mapped here (None where unreachable: see SharedRegion.open)."""
        opened = SharedRegion.open(handle)
        return cls(*opened) if opened is not None else None

    def view(self, name: str) -> Optional[torch.Tensor]:
        spec = self.table.get(name)
        if spec is None:
            return None
        if name not in self._views:
            self._views[name] = self.region.tensor(spec)
        return self._views[name]


def share_parameters(module: torch.nn.Module) -> SharedRegion:
    """Move every parameter of a CPU `module` into one new shared region (see module doc) and return it."""
    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for p in module.parameters():  # parameters() yields a tied parameter once
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if any(p.device.type != "cpu" for p in params):
        raise ValueError("share_parameters: the module's parameters must be on the CPU")
    offsets, used = [], 0
    for p in params:
        offsets.append(_HEADER + used)
        used = _round_up(used + p.numel() * p.element_size(), _ALIGN)
    region = SharedRegion.create(used)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = region.tensor(TensorSpec(offset, tuple(p.shape), _contiguous_strides(p.shape), str(p.dtype)))
            view.copy_(p.data)
            p.data = view
    return region


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))
