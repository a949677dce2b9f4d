"""Where each tensor-parallel shard's rows land in the Hugging Face tensors of one parameter.

Megatron splits several parameters over TP by rows (partition dim 0), and their conversion to Hugging Face
tensors moves whole rows around rather than handing out plain views of the merged tensor: the embedding and
the output layer drop the rows of the padded vocabulary (Megatron pads it to a multiple of 128 x TP), the
fused QKV splits each query group's ``[q..., k, v]`` rows into ``q_proj`` / ``k_proj`` / ``v_proj``, the gated
fc1 splits ``[gate; up]``. A `RowPlan` records, for every row of every TP rank's shard, the Hugging Face tensor
and the row of it that the row becomes, grouped into a few strided blocks; the exporter then gathers each
block of each shard straight into the consumer's tensors, so each byte moves once (`ModelBridge`).

The plan is derived from the conversion itself, not re-implemented next to it: `build_row_plan` runs the
conversion once on a tensor of row numbers (a stride-0 expansion along the other dimensions, so it costs
little memory) and reads off where every row went. Rows the conversion drops (vocabulary padding) go to a
scratch destination that nobody reads. A conversion that is not row-wise (mixes values inside a row, repeats a
row, changes the dtype) or would take more than `MAX_BLOCKS` blocks gets no plan (None): the caller then
gathers the merged tensor and converts it as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

MAX_BLOCKS = 64  # more blocks than this per parameter: not worth the extra gather items (no plan)

# (Hugging Face output index, first row, row step) of one block on one TP rank; None: the rows are dropped
Destination = Optional[tuple[int, int, int]]


@dataclass(frozen=True)
class RowBlock:
    """`count` runs of `length` shard rows each: the runs start at shard row `start` and lie `step` rows apart
    (the same on every TP rank). On TP rank r they become rows ``first + c * step_r + i`` of Hugging Face
    output ``dsts[r][0]`` (with ``(first, step_r) = dsts[r][1:]``), or nothing when ``dsts[r]`` is None."""

    start: int
    step: int
    count: int
    length: int
    dsts: tuple[Destination, ...]

    def view(self, tensor: torch.Tensor, first: int, step: int) -> torch.Tensor:
        """The block's rows of a contiguous `tensor` as a (count, length, *row shape) view."""
        return strided_rows(tensor, first, step, self.count, self.length)

    @property
    def dropped_anywhere(self) -> bool:
        return any(d is None for d in self.dsts)


@dataclass(frozen=True)
class RowPlan:
    """The Hugging Face outputs' shapes (in the conversion's order) and the blocks covering every shard row."""

    shapes: tuple[tuple[int, ...], ...]
    blocks: tuple[RowBlock, ...]

    def source(self, shard: torch.Tensor, block: RowBlock) -> torch.Tensor:
        return block.view(shard, block.start, block.step)

    def destination(self, outputs: Sequence[torch.Tensor], block: RowBlock, rank: int) -> Optional[torch.Tensor]:
        """Where TP rank `rank`'s rows of `block` go among `outputs` (contiguous, `shapes`); None: dropped."""
        dst = block.dsts[rank]
        if dst is None:
            return None
        index, first, step = dst
        return block.view(outputs[index], first, step)


def strided_rows(tensor: torch.Tensor, first: int, step: int, count: int, length: int) -> torch.Tensor:
    """Rows ``first + c * step + i`` (c < count, i < length) of a contiguous tensor, as a (count, length, ...) view."""
    if not tensor.is_contiguous():
        raise ValueError(f"strided_rows needs a contiguous tensor, got strides {tensor.stride()}")
    row = tensor.stride(0) if tensor.dim() else 1
    return tensor.as_strided(
        (count, length, *tensor.shape[1:]),
        (step * row, row, *tensor.stride()[1:]),
        tensor.storage_offset() + first * row,
    )


def _row_numbers(out: torch.Tensor, row_shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """The row numbers an output of the conversion holds, one per output row; None if not row-wise."""
    if out.dtype != torch.int64 or tuple(out.shape[1:]) != row_shape or out.dim() == 0:
        return None
    rows = out[(slice(None),) + (0,) * len(row_shape)]
    expanded = all(s == 0 for s in out.stride()[1:])
    if row_shape and not expanded and not torch.equal(out, rows.view(-1, *[1] * len(row_shape)).expand_as(out)):
        return None
    return rows.clone()


def _targets(outputs: list[torch.Tensor], merged_rows: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per merged row: (the output index it goes to, -1 if dropped; the row inside that output)."""
    which = torch.full((merged_rows,), -1, dtype=torch.int64)
    where = torch.full((merged_rows,), -1, dtype=torch.int64)
    for k, rows in enumerate(outputs):
        if rows.numel() and (rows.min() < 0 or rows.max() >= merged_rows):
            return None
        if rows.unique().numel() != rows.numel() or bool((which[rows] >= 0).any()):
            return None  # a row used twice: not a move of rows
        which[rows] = k
        where[rows] = torch.arange(rows.numel())
    return which, where


@dataclass
class _Open:
    """A block being extended: its segments so far."""

    start: int
    length: int
    count: int
    step: int
    firsts: tuple[Optional[tuple[int, int]], ...]  # per rank: (output, first row) of the first run
    steps: tuple[int, ...]

    def extends(self, start: int, dsts: tuple[Optional[tuple[int, int]], ...]) -> bool:
        if self.count == 1:  # same outputs per rank (the caller's key): any later run in every output will do
            return start > self.start and all(d is None or d[1] > f[1] for d, f in zip(dsts, self.firsts))
        return start == self.start + self.count * self.step and all(
            d is None or d[1] == f[1] + self.count * s for d, f, s in zip(dsts, self.firsts, self.steps)
        )

    def add(self, start: int, dsts: tuple[Optional[tuple[int, int]], ...]) -> None:
        if self.count == 1:
            self.step = start - self.start
            self.steps = tuple(0 if d is None else d[1] - f[1] for d, f in zip(dsts, self.firsts))
        self.count += 1

    def block(self) -> RowBlock:
        return RowBlock(
            self.start,
            self.step if self.count > 1 else self.length,
            self.count,
            self.length,
            tuple(
                None if f is None else (f[0], f[1], s if self.count > 1 else self.length)
                for f, s in zip(self.firsts, self.steps)
            ),
        )


def _segments(which: list[torch.Tensor], where: list[torch.Tensor]) -> list[tuple[int, int, tuple]]:
    """Maximal runs of shard rows that every rank maps to consecutive rows of one output (or drops):
    (start, length, per rank (output, first row) or None)."""
    length = which[0].numel()
    breaks = torch.zeros(length, dtype=torch.bool)
    breaks[0] = True
    for k, j in zip(which, where):
        breaks[1:] |= (k[1:] != k[:-1]) | ((k[1:] >= 0) & (j[1:] != j[:-1] + 1))
    starts = breaks.nonzero().flatten().tolist()
    ends = starts[1:] + [length]
    out = []
    for a, b in zip(starts, ends):
        dsts = tuple(None if int(k[a]) < 0 else (int(k[a]), int(j[a])) for k, j in zip(which, where))
        out.append((a, b - a, dsts))
    return out


def build_row_plan(
    convert: Callable[[torch.Tensor], list[torch.Tensor]],
    merged_shape: Sequence[int],
    shard_rows: Sequence[torch.Tensor],
) -> Optional[RowPlan]:
    """The plan of a conversion of a row-split parameter, or None when it is not a move of whole rows.

    `convert(merged)` returns the Hugging Face tensors of a merged tensor (e.g. mbridge's to_hf); it must
    accept int64 tensors of `merged_shape`. `shard_rows[r]` lists, for each row of TP rank r's shard in order,
    the merged row it is (the TP split: ``chunk`` by rows, or the gated fc1's ``[gate_r; up_r]``)."""
    merged_shape = tuple(int(s) for s in merged_shape)
    rows, row_shape = merged_shape[0], merged_shape[1:]
    every = torch.cat(list(shard_rows))
    if every.numel() != rows or not torch.equal(every.sort().values, torch.arange(rows)):
        raise ValueError(f"shard rows must partition the {rows} merged rows")
    numbers = torch.arange(rows).view(rows, *[1] * len(row_shape)).expand(merged_shape)
    try:
        outputs = convert(numbers)
    except (RuntimeError, ValueError, AssertionError, TypeError):
        return None  # a conversion that cannot run on row numbers (e.g. a dtype cast or arithmetic)
    found = [_row_numbers(o, row_shape) for o in outputs]
    if any(f is None for f in found):
        return None
    targets = _targets(found, rows)
    if targets is None:
        return None
    which, where = targets
    per_rank = [(which[r], where[r]) for r in shard_rows]
    blocks: list[RowBlock] = []
    open_: dict[tuple, _Open] = {}
    for start, length, dsts in _segments([k for k, _ in per_rank], [j for _, j in per_rank]):
        key = (length, tuple(-1 if d is None else d[0] for d in dsts))
        current = open_.get(key)
        if current is not None and current.extends(start, dsts):
            current.add(start, dsts)
            continue
        if current is not None:
            blocks.append(current.block())
        open_[key] = _Open(start, length, 1, 0, dsts, tuple(0 for _ in dsts))
    blocks += [o.block() for o in open_.values()]
    if len(blocks) > MAX_BLOCKS:
        return None
    return RowPlan(tuple(tuple(o.shape) for o in outputs), tuple(sorted(blocks, key=lambda b: b.start)))
