"""Full Hugging Face tensors out of this rank's Megatron model chunks, gathered over TP / PP / EP / ETP.

`HFExporter.export` yields (Hugging Face name, full tensor) for the whole model in the actor's layout (the
names, the fused formats and the TP geometry come from `ModelBridge` and models/shards.py). Shards are gathered
several parameters per collective call: into the consumer's own tensors where they qualify (`into`), along a
row plan (row_plan.py) where a conversion moves whole rows, or into reused buffers; on one CPU host the peers
may write their shards straight into a receiving engine's shared memory (`shared`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import zlib
from typing import Callable, Hashable, Iterator, Optional

import torch

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.models.shards import as_shard_view, merged_shape, numel, shard_views
from mcore_rl.platform import collectives
from mcore_rl.platform.shared_memory import SharedRegion, SharedTensors
from mcore_rl.platform.shm_gather import Arena, GroupGather
from mcore_rl.weights.row_plan import RowPlan, build_row_plan

logger = logging.getLogger(__name__)

DIRECT_BATCH_FACTOR = 8  # gather batches hold this many times more bytes written straight into the engines
# A consumer's own tensor for a Hugging Face weight name, or None (see HFExporter.export `into`).
WeightBuffers = Callable[[str], Optional[torch.Tensor]]
_LAYER_NUMBER = re.compile(r"layers\.\d+\.")


class HFExporter:
    """The export side of one `ModelBridge` (built: `build_model` ran): its transport state and row plans."""

    def __init__(self, bridge: ModelBridge):
        self.bridge = bridge
        self._gather = GroupGather()  # export's all-gathers: shared memory between ranks of one host (gloo)
        # per consumer (`_consumer_key`): (canonical, shape, dtype) -> its direct destination, None if it has none
        self._direct_memo: dict[Hashable, dict[tuple, Optional[torch.Tensor]]] = {}
        # per gather group ("tp" / "ep" / "etp"): the receiving engines' region tokens and whether all ranks mapped them
        self._sinks: dict[str, tuple[tuple[str, ...], bool]] = {}
        self._regions: dict[str, SharedTensors] = {}  # other processes' engine regions mapped here, by token
        self._sinks_state: Optional[tuple] = None  # the last export's (this rank's state, sinks, lighter kinds)
        self._row_plans: dict[tuple, Optional[RowPlan]] = {}  # (parameter kind, shard shape, tp, gated) -> plan
        self.stats = ExportStats()  # of the export in progress or the last one

    @property
    def layout(self):
        return self.bridge.layout

    @property
    def platform(self):
        return self.bridge.platform

    @property
    def transformer_config(self):
        return self.bridge.transformer_config

    @torch.no_grad()
    def export(
        self,
        chunks: list[torch.nn.Module],
        gather_batch_mb: float = 64.0,
        receive: bool = True,
        into: Optional[WeightBuffers] = None,
        shared: Optional[SharedTensors] = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, full tensor) for the whole model, one parameter at a time.

        Collective: EVERY rank of the job must iterate it to the end, in step. Every rank receives
        every full tensor (pipeline stages broadcast theirs, TP/ETP/EP shards are all-gathered);
        data-parallel replicas compute identical copies independently. Tensors stay on the device;
        consumers that keep them should copy (`.cpu()`) since nothing here holds references.
        Shards are gathered several parameters per collective call (up to `gather_batch_mb` MB of gathered
        tensors, held until yielded), through shared memory when a gloo group's ranks share a host.
        `receive=False`: this rank only contributes its shards and yields nothing (a rank without an engine
        replica; over shared memory it then skips reading its peers' shards).
        `into(hf_name) -> tensor or None`: the consumer's own tensor for a weight (e.g. a rollout engine's
        parameter). A gathered tensor whose Hugging Face tensors are plain views of one contiguous range of the
        consumer's memory (checked by pointer, shape and stride; see `_direct_destination`) is gathered straight
        into it, so each byte moves once; the pair yielded then IS the consumer's tensor (a consumer copying a
        tensor onto itself must skip it). Row-split TP parameters whose conversion moves rows (the fused QKV
        regrouped per query group, the gated fc1, the embedding / output layer) follow a row plan when gathered
        through shared memory: each shard's rows go straight into the consumer's q / k / v, gate / up, ...
        tensors (row_plan.py). Anything else is gathered into reused buffers as without `into`; `self.stats`
        says how many bytes went which way.
        `shared`: the consumer's weights in a shared-memory region (`EngineCapabilities.receiver.shared`, the CPU
        embedded engine's), given by a receiving rank. Where every receiving rank of a TP / EP group gives one and
        every rank of the group can map them (one host; ETP likewise), each rank writes its own shards into every
        receiving engine, at the places `into` would give (the same placement code, run on the receiver's table):
        nothing is staged and each byte moves once, and one small collective per gather batch and group confirms
        that the writes are done and that all ranks wrote the same tensors. Tensors whose destination is not
        entirely in the engine's memory (buffers, dropped padding rows, ETP-split experts) take the gathers above.
        """
        backend = self.bridge.backend
        if gather_batch_mb <= 0:
            raise ValueError(f"gather_batch_mb={gather_batch_mb}; use a positive size in MB (e.g. 64)")
        pp_group = self.layout.groups.pp
        pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
        local = []  # (info, tensor) on this pipeline stage
        for chunk in chunks:
            params = dict(compat_megatron.gpt_model(chunk).named_parameters())
            local += [
                (info, params[name]) for name, info in self.bridge.param_infos(chunk).items() if not info.tied_copy
            ]
        meta = [(i.canonical, i.is_expert, i.partition_dim, tuple(t.shape), t.dtype) for i, t in local]
        per_stage = [None] * len(pp_ranks)
        torch.distributed.all_gather_object(per_stage, meta, group=pp_group)
        my_stage = self.layout.ranks.pp
        gated = backend.gated()
        limit = int(gather_batch_mb * (1 << 20))
        sinks, lighter = self._export_sinks(receive, shared)
        current = {_consumer_key(into)} | {_consumer_key(t.view) for s in sinks.values() for t in s.receivers.values()}
        self._direct_memo = {k: v for k, v in self._direct_memo.items() if k in current}  # drop stale consumers
        self.stats = ExportStats()
        for stage, stage_meta in enumerate(per_stage):
            batch, batch_bytes = [], 0
            for k, (canonical, is_expert, pdim, shape, dtype) in enumerate(stage_meta):
                if stage == my_stage:
                    tensor = local[k][1].detach()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=self.platform.device)
                if len(pp_ranks) > 1:
                    torch.distributed.broadcast(tensor, src=pp_ranks[stage], group=pp_group)
                x = _Exported(canonical, is_expert, pdim, tensor)
                batch.append(x)
                weight = DIRECT_BATCH_FACTOR if self._gather_kind(x) in lighter else 1
                batch_bytes += tensor.numel() * tensor.element_size() * self._gather_factor(is_expert, pdim) // weight
                if batch_bytes >= limit:
                    yield from self._export_batch(batch, gated, receive, into, sinks)
                    batch, batch_bytes = [], 0
            yield from self._export_batch(batch, gated, receive, into, sinks)

    def _gather_factor(self, is_expert: bool, pdim: int) -> int:
        """How many times a shard's bytes its gathered full tensor(s) hold."""
        layout = self.layout
        if is_expert:
            return layout.ep * (layout.etp if pdim >= 0 else 1)
        return layout.tp if pdim >= 0 else 1

    def _export_batch(
        self,
        batch: list["_Exported"],
        gated: bool,
        receive: bool,
        into: Optional[WeightBuffers],
        sinks: dict[str, "_Sinks"],
    ):
        """Gather a batch's shards with one collective call per process group, then yield its HF tensors.

        Dense TP shards are gathered straight into their merged tensor, or, where a row plan exists (see
        `_row_plan`), block by block straight into the Hugging Face tensors; experts first over EP (the same
        local expert of every EP rank, each with its global id; this rank's own is copied into the consumer
        during the gather where it qualifies, else used in place), then each of those over ETP into its merged
        tensor. With receive=False this rank only contributes shards, yields nothing. With `into`, a tensor whose consumer memory qualifies is gathered there instead of a buffer;
        the buffers (one reused arena) are sized for exactly the rest. With `sinks` (see export_hf_weights'
        `shared`), the tensors whose every destination lies in the receiving engines' shared memory are written
        there by their owners instead of gathered."""
        layout = self.layout
        plans = {i: plan for i, x in enumerate(batch) if (plan := self._row_plan(x, gated)) is not None}
        direct = self._direct_placements(batch, plans, gated, sinks) if sinks else {}
        rest = [i for i in range(len(batch)) if i not in direct]
        # ETP gathers EP-gathered experts: with ETP > 1 a rank needs the EP step's data even if it yields nothing
        ep_receive = receive or (layout.etp > 1 and any(batch[i].is_expert and batch[i].pdim >= 0 for i in rest))
        sizing = _Sizing()  # a dry run with meta tensors counts the buffers the batch needs
        self._place(batch, rest, plans, gated, receive, ep_receive, into, sizing.empty, None)
        placed = self._place(
            batch, rest, plans, gated, receive, ep_receive, into, self._allocator(sizing.needs), self.stats
        )
        self._write_direct(direct, sinks)
        self._confirm_direct(direct, sinks)
        self._all_gather_into(placed.tp_items, layout.groups.tp, receive)
        self._all_gather_into(placed.ep_items, layout.groups.ep, ep_receive)
        self._all_gather_into(placed.etp_items, layout.groups.etp, receive)
        if not receive:
            return
        outputs = placed.outputs
        for kind, per_receiver in direct.values():  # ours: where our engine's tensors are
            outputs = outputs + per_receiver[sinks[kind].rank].outputs
        outputs, placed, direct = sorted(outputs, key=lambda o: o[0], reverse=True), None, None
        while outputs:  # each gathered tensor dropped here once yielded
            _, converted, name, tensor = outputs.pop()
            if converted:
                yield name, tensor
            else:
                yield from zip(*self.bridge.backend.to_hf(name, tensor))

    def _place(
        self,
        batch: list["_Exported"],
        indices: list[int],
        plans: dict[int, RowPlan],
        gated: bool,
        receive: bool,
        ep_receive: bool,
        into: Optional[WeightBuffers],
        buffer: Callable,
        stats: Optional["ExportStats"],
    ) -> "_Placement":
        """Destinations of the gathers of `batch[i]` for i in `indices` and what to yield: consumer memory where
        it qualifies, else `buffer(shape, dtype)`. Every rank builds gather items of the same shapes in the same
        order (a row plan depends on names, shapes and the transport only; receive / into change destinations,
        never items)."""
        placed = _Placement()
        for i in indices:
            self._place_item(placed, i, batch[i], plans.get(i), gated, receive, ep_receive, into, buffer, stats)
        return placed

    def _place_item(
        self,
        placed: "_Placement",
        i: int,
        x: "_Exported",
        plan: Optional[RowPlan],
        gated: bool,
        receive: bool,
        ep_receive: bool,
        into: Optional[WeightBuffers],
        buffer: Callable,
        stats: Optional["ExportStats"],
    ) -> None:
        """`_place` for one parameter (batch position `i`), appended to `placed`."""
        layout = self.layout
        tp, ep, etp, ep_rank = layout.tp, layout.ep, layout.etp, layout.ranks.ep
        num_local = (self.transformer_config.num_moe_experts or 0) // ep

        def alloc(name: str, shape, dtype, final: bool = True) -> torch.Tensor:
            """Where the full tensor `name` is gathered: the consumer's memory when allowed, else a buffer."""
            direct = self._direct_destination(name, shape, dtype, into) if final and receive else None
            if stats is not None and not final:
                stats.staged_bytes += numel(shape) * dtype.itemsize
            elif stats is not None:
                stats.count(name, numel(shape) * dtype.itemsize, direct is not None)
            return direct if direct is not None else buffer(shape, dtype)

        if plan is not None:
            items, outputs = self._planned(x, plan, receive, into, buffer, stats)
            placed.tp_items += items
            placed.outputs += [(i, True, name, t) for name, t in outputs]
        elif x.is_expert:
            prefix, gid = x.canonical.rsplit(".weight", 1)
            names = [f"{prefix}.weight{e * num_local + int(gid) % num_local}" for e in range(ep)]
            # with ETP the EP step gathers intermediates, merged over ETP below
            final = receive and not (x.pdim >= 0 and etp > 1)
            full = []
            for e in range(ep):
                if e == ep_rank:  # own: into the consumer during the gather where it qualifies, else in place
                    own = final and ep > 1
                    full.append(self._own_expert(names[e], x.tensor, into, stats) if own else x.tensor)
                elif ep_receive:
                    full.append(alloc(names[e], x.tensor.shape, x.tensor.dtype, final))
                else:
                    full.append(x.tensor)
            if ep > 1:
                placed.ep_items.append((x.tensor, full if ep_receive else None))
            if x.pdim >= 0 and etp > 1:
                merged = [
                    alloc(name, merged_shape(shard, etp, x.pdim), shard.dtype) if receive else None
                    for name, shard in zip(names, full)
                ]
                for name, shard, m in zip(names, full, merged):
                    views = shard_views(name, m, etp, x.pdim, gated) if receive else None
                    placed.etp_items.append((as_shard_view(name, shard, gated), views))
                full = merged
            placed.outputs += [(i, False, name, t) for name, t in zip(names, full)]
        elif x.pdim >= 0 and tp > 1:
            merged = alloc(x.canonical, merged_shape(x.tensor, tp, x.pdim), x.tensor.dtype) if receive else None
            views = shard_views(x.canonical, merged, tp, x.pdim, gated) if receive else None
            placed.tp_items.append((as_shard_view(x.canonical, x.tensor, gated), views))
            placed.outputs.append((i, False, x.canonical, merged))
        else:
            placed.outputs.append((i, False, x.canonical, x.tensor))

    # ---- straight into the receiving engines' shared memory ------------------------------------------------
    def _export_sinks(self, receive: bool, shared: Optional[SharedTensors]) -> tuple[dict[str, "_Sinks"], set[str]]:
        """The gather groups' sinks (`_direct_sinks`) and the kinds whose batches may hold DIRECT_BATCH_FACTOR x
        more bytes (direct tensors need no buffer), where every rank of the job has the same groups' sinks:
        batches must end in step across groups. Collective; when no rank's (receive, engine region, transport)
        changed since the last export, one small all-reduce and the last export's answer."""
        state = (receive, shared.token if receive and shared is not None else None, id(self._gather))
        changed = self._sinks_state is None or self._sinks_state[0] != state
        if collectives.max_ints([int(changed)])[0] == 0:
            return self._sinks_state[1], self._sinks_state[2]
        sinks = self._direct_sinks(receive, shared)
        lighter = set(sinks) if collectives.all_agree([_kinds_mask(sinks)]) else set()
        self._sinks_state = (state, sinks, lighter)
        return sinks, lighter

    def _direct_sinks(self, receive: bool, shared: Optional[SharedTensors]) -> dict[str, "_Sinks"]:
        """Per gather group ("tp", "ep", "etp") whose ranks write straight into the receiving engines (see
        export_hf_weights' `shared`). Collective over each gather group of more than one rank on the CPU whose
        gathers go through shared memory: one object gather of the ranks' region handles; the first time a set
        of regions is seen, every rank maps the others' and all agree that they could."""
        layout = self.layout
        out = {}
        if self.platform.device.type != "cpu":
            return out
        for kind, size in (("tp", layout.tp), ("ep", layout.ep), ("etp", layout.etp)):
            group = self._group(kind)
            if size > 1 and self._gather.uses_shared_memory(group):
                sinks = self._group_sinks(kind, group, receive, shared)
                if sinks is not None:
                    out[kind] = sinks
        used = {t.token for sinks in out.values() for t in sinks.receivers.values()}
        self._regions = {token: t for token, t in self._regions.items() if token in used}  # unmap the others
        return out

    def _group_sinks(self, kind: str, group, receive: bool, shared: Optional[SharedTensors]) -> Optional["_Sinks"]:
        me, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        every = [None] * world
        mine = shared.handle if receive and shared is not None else None
        torch.distributed.all_gather_object(every, (receive, mine), group=group)
        receivers = [r for r, (takes, _) in enumerate(every) if takes]
        if not receivers or any(every[r][1] is None for r in receivers):
            self._sinks.pop(kind, None)
            return None
        for r in receivers:  # other ranks' regions: mapped once, kept while they receive
            token = every[r][1].token
            if r != me and token not in self._regions and (opened := SharedTensors.open(every[r][1])) is not None:
                self._regions[token] = opened
        mapped = {r: shared if r == me else self._regions.get(every[r][1].token) for r in receivers}
        key = tuple(every[r][1].token for r in receivers)  # the same on every rank of the group
        if self._sinks.get(kind, (None,))[0] != key:  # a new set of engines: do all ranks reach all of them?
            reachable = all(t is not None for t in mapped.values())
            agreed = collectives.sum_ints([int(not reachable)], group)[0] == 0
            if not agreed:
                logger.info("export: %s ranks cannot map every receiving engine; gathering instead", kind)
            self._sinks[kind] = (key, agreed)
        return _Sinks(me, mapped) if self._sinks[kind][1] else None

    def _gather_kind(self, x: "_Exported") -> Optional[str]:
        """The one group a parameter's shards are gathered over ("tp", "ep", "etp"), None when none or two (EP
        then ETP: the intermediate step stays a gather)."""
        layout = self.layout
        split = x.pdim >= 0 and (layout.etp if x.is_expert else layout.tp) > 1
        if not x.is_expert:
            return "tp" if split else None
        if layout.ep > 1:
            return None if split else "ep"
        return "etp" if split else None

    def _direct_placements(
        self, batch: list["_Exported"], plans: dict[int, RowPlan], gated: bool, sinks: dict[str, "_Sinks"]
    ) -> dict[int, tuple[str, dict[int, "_Placement"]]]:
        """batch position -> (group kind, per receiving group rank its placement in that engine's memory) for
        every parameter whose destinations in every receiving engine lie entirely in its shared region. Every
        rank of the group decides the same: the same placement code on the same tables."""
        out = {}
        for i, x in enumerate(batch):
            kind = self._gather_kind(x)
            if kind not in sinks:
                continue
            per_receiver = {}
            for q, tensors in sinks[kind].receivers.items():
                placed = _Placement()
                self._place_item(placed, i, x, plans.get(i), gated, True, True, tensors.view, _meta_buffer, None)
                if not placed.lands_in(tensors.region, kind):
                    break
                per_receiver[q] = placed
            else:
                out[i] = (kind, per_receiver)
                own = per_receiver.get(sinks[kind].rank)
                for _, _, name, t in own.outputs if own is not None else ():
                    self.stats.count(name, t.numel() * t.element_size(), True)
        return out

    def _write_direct(self, direct: dict, sinks: dict[str, "_Sinks"]) -> None:
        """This rank's shard of each direct parameter into every receiving engine (its own engine included)."""
        for kind, per_receiver in direct.values():
            me = sinks[kind].rank
            for placed in per_receiver.values():
                for shard, dsts in placed.items(kind):
                    dsts[me].copy_(shard)

    def _confirm_direct(self, direct: dict, sinks: dict[str, "_Sinks"]) -> None:
        """One small collective per group: every rank finished writing this batch (the receivers yield only
        after it), and every rank wrote the same parameters (else all raise)."""
        for kind in sinks:
            mine = sorted(i for i, (k, _) in direct.items() if k == kind)
            if not collectives.all_agree([len(mine), zlib.crc32(repr(mine).encode())], self._group(kind)):
                raise RuntimeError(
                    f"export into shared engine memory: the {kind} ranks disagree on which tensors they wrote "
                    f"directly (this rank: {len(mine)}); every rank must see the same engine tables"
                )

    def _group(self, kind: str):
        return getattr(self.layout.groups, kind)

    def _own_expert(
        self, name: str, shard: torch.Tensor, into: Optional[WeightBuffers], stats: Optional["ExportStats"]
    ) -> torch.Tensor:
        """Where this rank's own expert goes in the EP gather: the consumer's tensor when it qualifies (the gather
        copies it there while peers are still writing theirs, and the consumer's own copy is skipped), else the
        parameter itself (no copy; the consumer copies it)."""
        direct = self._direct_destination(name, tuple(shard.shape), shard.dtype, into)
        if direct is None:
            return shard
        if stats is not None:
            stats.count(name, shard.numel() * shard.element_size(), True)
        return direct

    def _row_plan(self, x: "_Exported", gated: bool) -> Optional[RowPlan]:
        """Where the rows of a dense row-split TP parameter's shards go in its Hugging Face tensors, when its
        shards travel through shared memory (elsewhere the collective backend gathers the merged tensor in one
        call, and a plan would multiply the calls); None otherwise or when the conversion is not a move of
        whole rows. Computed once per parameter kind and shape (collective on the first call: the transport)."""
        layout = self.layout
        if x.is_expert or x.pdim != 0 or layout.tp == 1 or x.tensor.dim() == 0:
            return None
        if not self._gather.uses_shared_memory(layout.groups.tp) or not x.tensor.is_contiguous():
            return None
        key = (_LAYER_NUMBER.sub("layers.*.", x.canonical), tuple(x.tensor.shape), layout.tp, gated)
        if key not in self._row_plans:
            merged = merged_shape(x.tensor, layout.tp, 0)
            numbers = torch.arange(merged[0])
            shard_rows = [v.reshape(-1) for v in shard_views(x.canonical, numbers, layout.tp, 0, gated)]
            backend = self.bridge.backend
            self._row_plans[key] = build_row_plan(lambda t: backend.to_hf(x.canonical, t)[1], merged, shard_rows)
        return self._row_plans[key]

    def _planned(
        self,
        x: "_Exported",
        plan: RowPlan,
        receive: bool,
        into: Optional[WeightBuffers],
        buffer: Callable,
        stats: Optional["ExportStats"],
    ) -> tuple[list, list[tuple[str, torch.Tensor]]]:
        """Gather items of a planned parameter (one per block: this rank's rows, each rank's destination rows)
        and its (Hugging Face name, tensor) pairs: the consumer's tensors where they qualify, else buffers.
        Rows the conversion drops (vocabulary padding) land in a small scratch buffer."""
        names = self.bridge.backend.hf_names(x.canonical)
        if len(names) != len(plan.shapes):
            raise RuntimeError(f"{x.canonical}: {len(names)} Hugging Face names but its row plan has {plan.shapes}")
        dtype, row_shape = x.tensor.dtype, tuple(x.tensor.shape[1:])
        outputs = []
        for name, shape in zip(names, plan.shapes) if receive else ():
            target = _consumer_tensor(into, name, shape, dtype, self.platform.device)
            if stats is not None:
                stats.count(name, numel(shape) * dtype.itemsize, target is not None)
            outputs.append(target if target is not None else buffer(shape, dtype))
        items = []
        for block in plan.blocks:
            if all(d is None for d in block.dsts):
                continue  # rows nobody keeps (the same on every rank)
            dsts = None
            if receive:
                dsts = [plan.destination(outputs, block, r) for r in range(len(block.dsts))]
                if block.dropped_anywhere:
                    scratch = buffer((block.count, block.length, *row_shape), dtype)
                    if stats is not None:
                        stats.dropped_bytes += scratch.numel() * dtype.itemsize
                    dsts = [scratch if d is None else d for d in dsts]
            items.append((plan.source(x.tensor, block), dsts))
        return items, list(zip(names, outputs))

    def _direct_destination(
        self, canonical: str, shape: tuple, dtype: torch.dtype, into: Optional[WeightBuffers]
    ) -> Optional[torch.Tensor]:
        """A tensor of `shape` over the consumer's memory that `to_hf` turns into exactly the consumer's own
        tensors for `canonical`'s Hugging Face names (same data pointers, shapes and strides), or None.

        The candidate starts where the consumer's tensor for the first HF name starts and spans `shape`
        contiguously inside that storage; `to_hf` is run on it (views only, when it qualifies) and every output
        must coincide with the consumer's tensor of that name. Conversions that copy or reorder (e.g. a fused
        QKV regrouped per head) fail the check. The answer is remembered per consumer (`_consumer_key`) until an
        export without that consumer: a consumer's weights keep their memory between syncs (an engine that
        replaces its tensors, e.g. `rebuild_from`, is a new region / a new bound owner)."""
        if into is None:
            return None
        memo = self._direct_memo.setdefault(_consumer_key(into), {})
        key = (canonical, tuple(shape), dtype)
        if key in memo:
            return memo[key]
        found = self._check_direct(canonical, shape, dtype, into)
        if found is None or isinstance(getattr(into, "__self__", None), SharedTensors):
            memo[key] = found  # a table's places never move; another consumer's tensors may be replaced
        return found

    def _check_direct(
        self, canonical: str, shape: tuple, dtype: torch.dtype, into: WeightBuffers
    ) -> Optional[torch.Tensor]:
        names = self.bridge.backend.hf_names(canonical)
        first = into(names[0]) if names else None
        count = numel(shape)
        if (
            first is None
            or first.dtype != dtype
            or first.device != self.platform.device
            or not first.is_contiguous()
            or first.storage_offset() + count > first.untyped_storage().nbytes() // dtype.itemsize
        ):
            return None
        candidate = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), tuple(shape))
        hf_names, hf_tensors = self.bridge.backend.to_hf(canonical, candidate)
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

    def _allocator(self, needs: list[tuple[tuple, torch.dtype]]) -> Callable:
        """`alloc(shape, dtype)` for a batch's buffers (`needs`: their shapes and dtypes, from the dry run):
        carved from one reused arena on CPU (fresh buffers would pay page faults on every byte), plain
        torch.empty elsewhere."""
        if self.platform.device.type != "cpu" or not needs:
            return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=self.platform.device)
        return self._gather.buffers.take(Arena.bytes_for(needs)).empty

    def _all_gather_into(self, items: list, group, receive: bool) -> None:
        if items:  # every rank of the group has the same batch structure, so all skip or none
            self._gather.all_gather_into(items, group, receive)


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
class _Placement:
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
        others = [item for k in ("tp", "ep", "etp") if k != kind for item in self.items(k)]
        return (
            bool(items)
            and not others
            and all(d is not None and region.contains(d) for _, dsts in items for d in dsts or [None])
            and all(t is not None and region.contains(t) for *_, t in self.outputs)
        )


@dataclasses.dataclass
class _Sinks:
    """The receiving engines of one gather group that its ranks write into directly: this rank's index in the
    group and, per receiving group rank, that engine's tensors as mapped in this process."""

    rank: int
    receivers: dict[int, SharedTensors]


def _kinds_mask(sinks: dict) -> int:
    return sum(1 << k for k, kind in enumerate(("tp", "ep", "etp")) if kind in sinks)


def _consumer_key(into: Optional[WeightBuffers]) -> Hashable:
    """Whose memory `into` hands out: a shared table's region and where it is mapped in this process (a region
    mapped again is another key), else the bound method's object (its id)."""
    owner = getattr(into, "__self__", into)
    return (owner.token, owner.region.base) if isinstance(owner, SharedTensors) else id(owner)


def _meta_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in buffer in no region (a placement that needs one does not go straight into an engine)."""
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclasses.dataclass
class _Sizing:
    """A dry-run allocator: records each requested buffer and hands out a meta tensor."""

    needs: list[tuple[tuple, torch.dtype]] = dataclasses.field(default_factory=list)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        self.needs.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype, device="meta")


def _consumer_tensor(
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


@dataclasses.dataclass
class _Exported:
    """One parameter (this rank's shard) on its way out of `export_hf_weights`."""

    canonical: str
    is_expert: bool
    pdim: int
    tensor: torch.Tensor
