"""Small collectives: sums, maxima and agreement of a few numbers over a process group.

The one place for the rules every metric / decision reduction follows (docs/devices.md, "Small collectives"):

* **The tensor lives on a device the group's backend serves.** A backend string maps device types to
  backends (`gloo` serves cpu, `nccl` cuda, `hccl` npu; `cpu:gloo,cuda:nccl` serves both); a CPU tensor on
  an nccl-only group raises "No backend type associated with device type cpu". The helpers below create
  their tensors on `group_device(group)` (the accelerator when the backend has one, else the CPU);
  `all_reduce_small` raises on a tensor whose device the backend does not serve.
* **Never float64.** MindSpeed wraps `torch.distributed.all_reduce` so that a float64 tensor is reduced
  as a float32 copy that is never written back: the call silently does nothing. Counts travel as int64;
  float sums that need more than float32's 24 bits travel as two float32 words per value (hi + lo),
  gathered and added on the host in float64 arithmetic in rank order, so every rank gets the same result.

Large-tensor and object collectives (weight export, vocabulary-parallel log-prob reductions, pipeline
broadcasts) are not "small" and stay where they are; tests/test_collectives.py lists each with its reason.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

# Backend name -> the device type it serves. Multi-device strings ("cpu:gloo,cuda:nccl") name it per device.
_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu", "mpi": "cpu", "ucc": "cuda"}
MAX_SMALL_NUMEL = 4096  # a "small" collective moves at most this many elements


class CollectiveRuleError(RuntimeError):
    """A small collective was called with a tensor the group's backend cannot reduce correctly."""


def backend_device_types(backend: str) -> frozenset[str]:
    """Device types a torch.distributed backend string serves: 'gloo' -> {cpu}; 'cpu:gloo,cuda:nccl' ->
    {cpu, cuda}; 'nccl' -> {cuda}."""
    kinds = set()
    for part in str(backend).lower().split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            kinds.add(part.split(":", 1)[0])
        elif part in _BACKEND_DEVICE:
            kinds.add(_BACKEND_DEVICE[part])
        else:
            raise CollectiveRuleError(f"backend {backend!r}: unknown backend {part!r}; name its device as 'dev:{part}'")
    return frozenset(kinds)


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized()


def _current_device(kind: str) -> torch.device:
    module = getattr(torch, kind)  # torch.cuda / torch.npu (registered by torch_npu)
    return torch.device(kind, module.current_device())


def group_device(group=None) -> torch.device:
    """Where a small collective's tensor goes for `group`: its accelerator if the backend serves one, else
    the CPU (also without torch.distributed)."""
    if not _active(group):
        return torch.device("cpu")
    kinds = backend_device_types(dist.get_backend(group))
    accelerators = sorted(kinds - {"cpu"})
    return _current_device(accelerators[0]) if accelerators else torch.device("cpu")


def check_tensor(tensor: torch.Tensor, group=None) -> None:
    """Raise CollectiveRuleError unless `tensor` may travel in a small collective on `group`."""
    if tensor.dtype == torch.float64:
        raise CollectiveRuleError(
            "float64 in a collective: MindSpeed reduces a float32 copy and drops it (a silent no-op); "
            "use int64 counts or mcore_rl.platform.collectives.sum_floats (two float32 words per value)"
        )
    if tensor.numel() > MAX_SMALL_NUMEL:
        raise CollectiveRuleError(
            f"{tensor.numel()} elements is not a small collective (limit {MAX_SMALL_NUMEL}); "
            f"large tensors use torch.distributed directly (see tests/test_collectives.py's allow-list)"
        )
    if _active(group):
        backend = dist.get_backend(group)
        if tensor.device.type not in backend_device_types(backend):
            raise CollectiveRuleError(
                f"a {tensor.device.type} tensor on a group with backend {backend!r}: that backend cannot reduce it; "
                f"create it on collectives.group_device(group) ({group_device(group)})"
            )


def all_reduce_small(tensor: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """In-place all-reduce (default SUM) of a small int / float32 tensor, after `check_tensor`."""
    check_tensor(tensor, group)
    if _active(group):
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


def sum_ints(values: Sequence[int], group=None) -> list[int]:
    """Exact sums of integers (counts) over the group, as int64."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=group_device(group))
    return [int(v) for v in all_reduce_small(t, group=group).cpu().tolist()]


def max_ints(values: Sequence[int], group=None) -> list[int]:
    """Maxima of integers over the group, as int64."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=group_device(group))
    return [int(v) for v in all_reduce_small(t, op=dist.ReduceOp.MAX, group=group).cpu().tolist()]


def max_floats(values: Sequence[float], group=None) -> list[float]:
    """Maxima over the group; float32 (rounded up, so a maximum never shrinks below a local value)."""
    t = torch.tensor([_up32(v) for v in values], dtype=torch.float32, device=group_device(group))
    return [float(v) for v in all_reduce_small(t, op=dist.ReduceOp.MAX, group=group).cpu().tolist()]


def min_floats(values: Sequence[float], group=None) -> list[float]:
    """Minima over the group (float32)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float32, device=group_device(group))
    return [float(v) for v in all_reduce_small(t, op=dist.ReduceOp.MIN, group=group).cpu().tolist()]


def _split(value: float) -> tuple[float, float]:
    """value = hi + lo with hi, lo float32: ~48 significant bits for float32 transport."""
    hi = float(torch.tensor(value, dtype=torch.float32))
    if not math.isfinite(hi):
        return hi, 0.0
    return hi, float(torch.tensor(value - hi, dtype=torch.float32))


def sum_floats(values: Sequence[float], group=None) -> list[float]:
    """Sums over the group to ~1e-14 relative: each value travels as two float32 words, every rank gathers
    every rank's words and adds them with math.fsum, so the result is the same on every rank."""
    words = [w for v in values for w in _split(float(v))]
    t = torch.tensor(words, dtype=torch.float32, device=group_device(group))
    if not _active(group) or dist.get_world_size(group) == 1:
        rows = [t.cpu().tolist()]
    else:
        world = dist.get_world_size(group)
        out = torch.empty(world * t.numel(), dtype=torch.float32, device=t.device)
        check_tensor(out, group)
        dist.all_gather_into_tensor(out, t, group=group)
        rows = out.view(world, -1).cpu().tolist()
    return [math.fsum([row[2 * i] for row in rows] + [row[2 * i + 1] for row in rows]) for i in range(len(values))]


def all_agree(values: Sequence[int], group=None) -> bool:
    """Whether every rank passed the same integers (e.g. a decision code); collective, same answer on all."""
    both = [int(v) for v in values] + [-int(v) for v in values]  # one MAX gives the maxima and minus the minima
    t = torch.tensor(both, dtype=torch.int64, device=group_device(group))
    high, minus_low = all_reduce_small(t, op=dist.ReduceOp.MAX, group=group).cpu().view(2, -1)
    return bool(torch.equal(high, -minus_low))


def any_true(flag: bool, group=None) -> bool:
    """Whether any rank passed True (same answer on every rank)."""
    return sum_ints([int(bool(flag))], group)[0] > 0


def from_rank0(value, group=None):
    """Rank 0's small picklable value (a failure message, None when it had none) on every rank of `group`;
    `value` itself without a process group. For the outcome of work only rank 0 does (writing a file)."""
    if not _active(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def first_given(value, group=None):
    """The lowest rank's small picklable value that is not None (a failure message), or None, on every rank of
    `group`; `value` itself without a process group. For the outcome of work every rank does its share of."""
    if not _active(group):
        return value
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return next((v for v in values if v is not None), None)


def _up32(value: float) -> float:
    """The smallest float32 >= value (max over float32 must not round a local maximum down)."""
    v = torch.tensor(value, dtype=torch.float32)
    if math.isfinite(value) and float(v) < value:
        v = torch.nextafter(v, torch.tensor(math.inf, dtype=torch.float32))
    return float(v)
