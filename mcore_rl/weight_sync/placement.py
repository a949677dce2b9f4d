"""Where each gathered shard of an export batch goes and what the batch yields (bookkeeping, no collectives).

A `Placement` lists one batch's gather items per process group, each (this rank's shard, a destination per
group rank), and its outputs, (batch position, already Hugging Face?, name, tensor). Destinations are the
consumer's memory where it qualifies (`InPlaceTargets`, row plans into its q / k / v, gate / up, ... tensors),
else buffers from the transport's allocator. Every rank builds items of the same shapes in the same order: a
row plan depends on names, shapes and the transport only; `receive` / `into` change destinations, never items.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from mcore_rl.models.bridge import ModelBridge
from mcore_rl.models.shards import as_shard_view, merged_shape, numel, shard_views
from mcore_rl.platform.shared_memory import SharedRegion
from mcore_rl.weight_sync.in_place import InPlaceTargets, consumer_tensor
from mcore_rl.weight_sync.receiver import WeightBuffers
from mcore_rl.weight_sync.row_plan import RowPlan

GROUP_KINDS = ("tp", "ep", "etp")


@dataclasses.dataclass
class ExportStats:
    """Where one export's gathered tensors went, for the receiving rank (bytes of full tensors)."""

    direct_bytes: int = 0  # gathered straight into the consumer's tensors (`into`)
    buffered: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> bytes gathered into buffers
    dropped_bytes: int = 0  # rows the conversion drops (vocabulary padding), into scratch buffers
    staged_bytes: int = 0  # ETP > 1: peers' expert shards gathered over EP, then gathered again over ETP

    def count(self, name: str, nbytes: int, direct: bool) -> None:
        if direct:
            self.direct_bytes += nbytes
        else:
            self.buffered[name] = self.buffered.get(name, 0) + nbytes

    @property
    def buffered_bytes(self) -> int:
        return sum(self.buffered.values())


@dataclasses.dataclass
class Exported:
    """One parameter (this rank's shard) on its way out of an export."""

    canonical: str
    is_expert: bool
    pdim: int
    tensor: torch.Tensor


@dataclasses.dataclass
class Placement:
    """A batch's gather items per process group and what it yields: (batch position, already Hugging Face?,
    name, tensor)."""

    tp_items: list = dataclasses.field(default_factory=list)
    ep_items: list = dataclasses.field(default_factory=list)
    etp_items: list = dataclasses.field(default_factory=list)
    outputs: list[tuple[int, bool, str, Optional[torch.Tensor]]] = dataclasses.field(default_factory=list)

    def items(self, kind: str) -> list:
        """The gather items over group `kind` ("tp", "ep", "etp")."""
        return getattr(self, f"{kind}_items")

    def lands_in(self, region: SharedRegion, kind: str) -> bool:
        """Whether this (one parameter's) placement gathers over group `kind` only, and every destination and
        every yielded tensor lies in `region`."""
        items = self.items(kind)
        others = [item for k in GROUP_KINDS if k != kind for item in self.items(k)]
        return (
            bool(items)
            and not others
            and all(d is not None and region.contains(d) for _, dsts in items for d in dsts or [None])
            and all(t is not None and region.contains(t) for *_, t in self.outputs)
        )


@dataclasses.dataclass(frozen=True)
class PlaceContext:
    """What placing a batch's parameters depends on besides the parameter itself."""

    receive: bool  # this rank yields the batch's tensors
    ep_receive: bool  # this rank needs the EP step's data (it yields, or it takes part in an ETP gather after it)
    into: Optional[WeightBuffers]  # the consumer's in-place buffers
    buffer: Callable  # buffer(shape, dtype) for a destination outside the consumer's memory
    stats: Optional[ExportStats]  # None: a dry run or a placement in another engine's memory (not counted)


@dataclasses.dataclass
class Sizing:
    """A dry-run allocator: records each requested buffer and hands out a meta tensor."""

    needs: list[tuple[tuple, torch.dtype]] = dataclasses.field(default_factory=list)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        self.needs.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype, device="meta")


def meta_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in buffer in no region (a placement that needs one does not go straight into an engine)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def gather_kind(layout, x: Exported) -> Optional[str]:
    """The one group a parameter's shards are gathered over ("tp", "ep", "etp"), None when none or two (EP
    then ETP: the intermediate step stays a gather)."""
    split = x.pdim >= 0 and (layout.etp if x.is_expert else layout.tp) > 1
    if not x.is_expert:
        return "tp" if split else None
    if layout.ep > 1:
        return None if split else "ep"
    return "etp" if split else None


def gather_factor(layout, x: Exported) -> int:
    """How many times a shard's bytes its gathered full tensor(s) hold."""
    if x.is_expert:
        return layout.ep * (layout.etp if x.pdim >= 0 else 1)
    return layout.tp if x.pdim >= 0 else 1


class Placer:
    """Places the parameters of one model's export (its bridge: layout, names, conversions)."""

    def __init__(self, bridge: ModelBridge, targets: InPlaceTargets):
        self.bridge = bridge
        self.targets = targets
        self._layout = None  # what every placement of an export reads, looked up once (`prepare`)
        self._gated = False
        self._num_local = 0

    def prepare(self) -> None:
        """Look up what placements read (the layout, the gated fc1, local experts) at the start of an export."""
        self._layout = self.bridge.layout
        self._gated = self.bridge.backend.gated()
        self._num_local = (self.bridge.transformer_config.num_moe_experts or 0) // self._layout.ep

    def place(self, batch: list[Exported], indices: list[int], plans: dict[int, RowPlan], ctx: PlaceContext):
        """The placement of `batch[i]` for i in `indices`."""
        placed = Placement()
        for i in indices:
            self.place_one(placed, i, batch[i], plans.get(i), ctx)
        return placed

    def place_one(self, placed: Placement, i: int, x: Exported, plan: Optional[RowPlan], ctx: PlaceContext) -> None:
        """One parameter (batch position `i`), appended to `placed`."""
        layout, gated = self._layout, self._gated
        if plan is not None:
            items, outputs = self._planned(x, plan, ctx)
            placed.tp_items += items
            placed.outputs += [(i, True, name, t) for name, t in outputs]
        elif x.is_expert:
            self._place_expert(placed, i, x, ctx, gated)
        elif x.pdim >= 0 and layout.tp > 1:
            tp = layout.tp
            merged = (
                self._alloc(x.canonical, merged_shape(x.tensor, tp, x.pdim), x.tensor.dtype, ctx)
                if ctx.receive
                else None
            )
            views = shard_views(x.canonical, merged, tp, x.pdim, gated) if ctx.receive else None
            placed.tp_items.append((as_shard_view(x.canonical, x.tensor, gated), views))
            placed.outputs.append((i, False, x.canonical, merged))
        else:
            placed.outputs.append((i, False, x.canonical, x.tensor))

    def _place_expert(self, placed: Placement, i: int, x: Exported, ctx: PlaceContext, gated: bool) -> None:
        """An expert: gathered over EP (the same local expert of every EP rank, each with its global id; this
        rank's own is copied into the consumer during the gather where it qualifies, else used in place), then
        each of those over ETP into its merged tensor."""
        layout, num_local = self._layout, self._num_local
        ep, etp, ep_rank = layout.ep, layout.etp, layout.ranks.ep
        prefix, gid = x.canonical.rsplit(".weight", 1)
        names = [f"{prefix}.weight{e * num_local + int(gid) % num_local}" for e in range(ep)]
        # with ETP the EP step gathers intermediates, merged over ETP below
        final = ctx.receive and not (x.pdim >= 0 and etp > 1)
        full = []
        for e in range(ep):
            if e == ep_rank:  # own: into the consumer during the gather where it qualifies, else in place
                full.append(self._own_expert(names[e], x.tensor, ctx) if final and ep > 1 else x.tensor)
            elif ctx.ep_receive:
                full.append(self._alloc(names[e], x.tensor.shape, x.tensor.dtype, ctx, final))
            else:
                full.append(x.tensor)
        if ep > 1:
            placed.ep_items.append((x.tensor, full if ctx.ep_receive else None))
        if x.pdim >= 0 and etp > 1:
            merged = [
                self._alloc(name, merged_shape(shard, etp, x.pdim), shard.dtype, ctx) if ctx.receive else None
                for name, shard in zip(names, full)
            ]
            for name, shard, m in zip(names, full, merged):
                views = shard_views(name, m, etp, x.pdim, gated) if ctx.receive else None
                placed.etp_items.append((as_shard_view(name, shard, gated), views))
            full = merged
        placed.outputs += [(i, False, name, t) for name, t in zip(names, full)]

    def _alloc(self, name: str, shape, dtype: torch.dtype, ctx: PlaceContext, final: bool = True) -> torch.Tensor:
        """Where the full tensor `name` is gathered: the consumer's memory when allowed, else a buffer."""
        direct = self.targets.destination(name, shape, dtype, ctx.into) if final and ctx.receive else None
        if ctx.stats is not None and not final:
            ctx.stats.staged_bytes += numel(shape) * dtype.itemsize
        elif ctx.stats is not None:
            ctx.stats.count(name, numel(shape) * dtype.itemsize, direct is not None)
        return direct if direct is not None else ctx.buffer(shape, dtype)

    def _own_expert(self, name: str, shard: torch.Tensor, ctx: PlaceContext) -> torch.Tensor:
        """Where this rank's own expert goes in the EP gather: the consumer's tensor when it qualifies (the gather
        copies it there while peers are still writing theirs, and the consumer's own copy is skipped), else the
        parameter itself (no copy; the consumer copies it)."""
        direct = self.targets.destination(name, tuple(shard.shape), shard.dtype, ctx.into)
        if direct is None:
            return shard
        if ctx.stats is not None:
            ctx.stats.count(name, shard.numel() * shard.element_size(), True)
        return direct

    def _planned(self, x: Exported, plan: RowPlan, ctx: PlaceContext) -> tuple[list, list[tuple[str, torch.Tensor]]]:
        """Gather items of a planned parameter (one per block: this rank's rows, each rank's destination rows)
        and its (Hugging Face name, tensor) pairs: the consumer's tensors where they qualify, else buffers.
        Rows the conversion drops (vocabulary padding) land in a small scratch buffer."""
        names = self.bridge.backend.hf_names(x.canonical)
        if len(names) != len(plan.shapes):
            raise RuntimeError(f"{x.canonical}: {len(names)} Hugging Face names but its row plan has {plan.shapes}")
        dtype, row_shape, stats = x.tensor.dtype, tuple(x.tensor.shape[1:]), ctx.stats
        outputs = []
        for name, shape in zip(names, plan.shapes) if ctx.receive else ():
            target = consumer_tensor(ctx.into, name, shape, dtype, self.bridge.platform.device)
            if stats is not None:
                stats.count(name, numel(shape) * dtype.itemsize, target is not None)
            outputs.append(target if target is not None else ctx.buffer(shape, dtype))
        items = []
        for block in plan.blocks:
            if all(d is None for d in block.dsts):
                continue  # rows nobody keeps (the same on every rank)
            dsts = None
            if ctx.receive:
                dsts = [plan.destination(outputs, block, r) for r in range(len(block.dsts))]
                if block.dropped_anywhere:
                    scratch = ctx.buffer((block.count, block.length, *row_shape), dtype)
                    if stats is not None:
                        stats.dropped_bytes += scratch.numel() * dtype.itemsize
                    dsts = [scratch if d is None else d for d in dsts]
            items.append((plan.source(x.tensor, block), dsts))
        return items, list(zip(names, outputs))
