"""Full Hugging Face tensors out of this rank's Megatron model chunks, gathered over TP / PP / EP / ETP.

`HFExporter.export` yields (Hugging Face name, full tensor) for the whole model in the actor's layout (names,
fused formats and the TP geometry come from `ModelBridge` and models/shards.py). Shards are gathered several
parameters per collective call (a batch): placed (placement.py) into the receiving engine's own tensors where
they qualify (receiver.py), along a row plan (row_plan.py) where a conversion moves whole rows, or into
buffers, and moved by the transport chosen once (transports.py, direct_write.py).
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import torch

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.models.shards import merged_shape, shard_views
from mcore_rl.platform import collectives
from mcore_rl.platform.shm_gather import GroupGather
from mcore_rl.weight_sync.collective import CollectiveGather
from mcore_rl.weight_sync.direct_write import DirectWrite
from mcore_rl.weight_sync.in_place import InPlaceTargets
from mcore_rl.weight_sync.placement import (
    Exported,
    ExportStats,
    PlaceContext,
    Placer,
    Sizing,
    gather_factor,
    gather_kind,
)
from mcore_rl.weight_sync.receiver import WeightReceiver
from mcore_rl.weight_sync.row_plan import RowPlan, build_row_plan
from mcore_rl.weight_sync.shm_gather import SharedMemoryGather

DIRECT_BATCH_FACTOR = 8  # gather batches hold this many times more bytes written straight into the engines
_LAYER_NUMBER = re.compile(r"layers\.\d+\.")


class HFExporter:
    """The export side of one `ModelBridge` (built: `build_model` ran): its transports and row plans.

    `groups`: the shared-memory gather's state (tests pass one with small rounds, or one whose ranks claim
    different hosts to take the torch.distributed path)."""

    def __init__(self, bridge: ModelBridge, groups: Optional[GroupGather] = None):
        self.bridge = bridge
        device = bridge.platform.device
        self._gather: CollectiveGather = (
            SharedMemoryGather(device, groups)
            if bridge.platform.weight_transport == "shared-memory"
            else CollectiveGather(device)
        )
        self._into_engine: Optional[CollectiveGather] = None  # chosen at the first export into an engine
        self.targets = InPlaceTargets(bridge)
        self.placer = Placer(bridge, self.targets)
        self._row_plans: dict[tuple, Optional[RowPlan]] = {}  # (parameter kind, shard shape, tp, gated) -> plan
        self.stats = ExportStats()  # of the export in progress or the last one

    def transport_for(self, receiver: Optional[WeightReceiver]) -> CollectiveGather:
        """An export with no engine behind it (`receiver` None: saving, verification) takes the platform's gather;
        one into an engine takes the transport chosen at the first such export: on the CPU the direct writes when
        any engine of the job offers a shared region (one collective, that once), else the gather."""
        if receiver is None:
            return self._gather
        if self._into_engine is None:
            offered = isinstance(self._gather, SharedMemoryGather) and bool(
                collectives.max_ints([int(receiver.shared is not None)])[0]
            )
            self._into_engine = DirectWrite(self.bridge, self._gather.groups) if offered else self._gather
        return self._into_engine

    @torch.no_grad()
    def export(
        self,
        chunks: list[torch.nn.Module],
        gather_batch_mb: float = 64.0,
        receive: bool = True,
        receiver: Optional[WeightReceiver] = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, full tensor) for the whole model, one parameter at a time.

        Collective: EVERY rank of the job must iterate it to the end, in step, with `receiver` given on every
        rank or on none. Every rank receives every full tensor (pipeline stages broadcast theirs, TP/ETP/EP
        shards are all-gathered); data-parallel replicas compute identical copies independently. Tensors stay
        on the device; consumers that keep them should copy (`.cpu()`) since nothing here holds references.
        Shards are gathered several parameters per collective call (up to `gather_batch_mb` MB of gathered
        tensors, held until yielded). `receive=False`: this rank only contributes its shards and yields nothing
        (a rank without an engine replica; over shared memory it then skips reading its peers' shards).
        `receiver`: what the engine fed from this export offers (receiver.py; `COPY_IN` on a rank of the sync
        without one). A gathered tensor that qualifies for its in-place buffers is gathered straight into them:
        the pair yielded then IS the engine's tensor (an engine copying a tensor onto itself must skip it).
        Row-split TP parameters whose conversion moves rows (the fused QKV regrouped per query group, the gated
        fc1, the embedding / output layer) follow a row plan under the shared-memory gather. With a shared
        region, the direct writes (direct_write.py) put the peers' shards there too. The rest is gathered into
        reused buffers; `self.stats` says how many bytes went which way.
        """
        if gather_batch_mb <= 0:
            raise ValueError(f"gather_batch_mb={gather_batch_mb}; use a positive size in MB (e.g. 64)")
        layout = self.bridge.layout
        pp_group = layout.groups.pp
        pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
        local = []  # (info, tensor) on this pipeline stage
        for chunk in chunks:
            params = dict(compat_megatron.gpt_model(chunk).named_parameters())
            infos = self.bridge.param_infos(chunk).items()
            local += [(info, params[name]) for name, info in infos if not info.tied_copy]
        meta = [(i.canonical, i.is_expert, i.partition_dim, tuple(t.shape), t.dtype) for i, t in local]
        per_stage = [None] * len(pp_ranks)
        torch.distributed.all_gather_object(per_stage, meta, group=pp_group)
        transport = self.transport_for(receiver)
        lighter = transport.begin(receive, receiver)
        into = receiver.buffer if receiver is not None and receive else None
        self.targets.keep_only([into, *transport.consumers()])  # drop stale consumers
        self.placer.prepare()
        self.stats = ExportStats()
        limit = int(gather_batch_mb * (1 << 20))
        for stage, stage_meta in enumerate(per_stage):
            batch, batch_bytes = [], 0
            for k, (canonical, is_expert, pdim, shape, dtype) in enumerate(stage_meta):
                if stage == layout.ranks.pp:
                    tensor = local[k][1].detach()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=self.bridge.platform.device)
                if len(pp_ranks) > 1:
                    torch.distributed.broadcast(tensor, src=pp_ranks[stage], group=pp_group)
                x = Exported(canonical, is_expert, pdim, tensor)
                batch.append(x)
                weight = DIRECT_BATCH_FACTOR if gather_kind(layout, x) in lighter else 1
                batch_bytes += tensor.numel() * tensor.element_size() * gather_factor(layout, x) // weight
                if batch_bytes >= limit:
                    yield from self._export_batch(batch, receive, into, transport)
                    batch, batch_bytes = [], 0
            yield from self._export_batch(batch, receive, into, transport)

    def _export_batch(self, batch: list[Exported], receive: bool, into, transport: CollectiveGather):
        """Gather a batch's shards with one collective call per process group, then yield its HF tensors.

        Dense TP shards are gathered straight into their merged tensor, or, where a row plan exists (see
        `_row_plan`), block by block straight into the Hugging Face tensors; experts over EP, then ETP (see
        `Placer`). With receive=False this rank only contributes shards, yields nothing. The buffers (one
        reused arena on the CPU) are sized for exactly what does not go into the engine. Tensors the transport
        writes directly (DirectWrite) are written before the gathers."""
        layout = self.bridge.layout
        plans = {i: plan for i, x in enumerate(batch) if (plan := self._row_plan(x, transport)) is not None}
        direct = transport.place_direct(batch, plans, self.placer, self.stats)
        rest = [i for i in range(len(batch)) if i not in direct]
        # ETP gathers EP-gathered experts: with ETP > 1 a rank needs the EP step's data even if it yields nothing
        ep_receive = receive or (layout.etp > 1 and any(batch[i].is_expert and batch[i].pdim >= 0 for i in rest))
        sizing = Sizing()  # a dry run with meta tensors counts the buffers the batch needs
        self.placer.place(batch, rest, plans, PlaceContext(receive, ep_receive, into, sizing.empty, None))
        ctx = PlaceContext(receive, ep_receive, into, transport.allocator(sizing.needs), self.stats)
        placed = self.placer.place(batch, rest, plans, ctx)
        transport.write_direct(direct)
        transport.gather(placed.tp_items, layout.groups.tp, receive)
        transport.gather(placed.ep_items, layout.groups.ep, ep_receive)
        transport.gather(placed.etp_items, layout.groups.etp, receive)
        if not receive:
            return
        outputs = placed.outputs + transport.own_outputs(direct)  # ours: where our engine's tensors are
        outputs, placed, direct = sorted(outputs, key=lambda o: o[0], reverse=True), None, None
        while outputs:  # each gathered tensor dropped here once yielded
            _, converted, name, tensor = outputs.pop()
            if converted:
                yield name, tensor
            else:
                yield from zip(*self.bridge.backend.to_hf(name, tensor))

    def _row_plan(self, x: Exported, transport: CollectiveGather) -> Optional[RowPlan]:
        """Where the rows of a dense row-split TP parameter's shards go in its Hugging Face tensors, when the
        transport plans rows (`plans_rows`); None otherwise or when the conversion is not a move of whole rows.
        Computed once per parameter kind and shape (collective on the first call: the transport decision)."""
        layout = self.bridge.layout
        if x.is_expert or x.pdim != 0 or layout.tp == 1 or x.tensor.dim() == 0:
            return None
        if not transport.plans_rows(layout.groups.tp) or not x.tensor.is_contiguous():
            return None
        gated = self.bridge.backend.gated()
        key = (_LAYER_NUMBER.sub("layers.*.", x.canonical), tuple(x.tensor.shape), layout.tp, gated)
        if key not in self._row_plans:
            merged = merged_shape(x.tensor, layout.tp, 0)
            numbers = torch.arange(merged[0])
            shard_rows = [v.reshape(-1) for v in shard_views(x.canonical, numbers, layout.tp, 0, gated)]
            backend = self.bridge.backend
            self._row_plans[key] = build_row_plan(lambda t: backend.to_hf(x.canonical, t)[1], merged, shard_rows)
        return self._row_plans[key]
