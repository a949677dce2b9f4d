"""MoE routing replay for the Megatron actor: R2 (old-policy routes) and R3 (rollout-engine routes).

    replay = RoutingReplay.install(actor.chunks, layout)  # once, after the model is built
    with replay.recording() as rec:                       # old-log-prob pass (forward_only)
        old_lp = actor.forward_only(micro_all, post_fn)
    routes = rec.routes                                   # RecordedRoutes, one entry per micro-batch
    with replay.replaying(routes[a:b]):                   # training pass over micro-batches a..b-1
        actor.train_step(micro_all[a:b], loss_fn)
    metrics = replay.mismatch_metrics()                   # collective; recorded vs current router picks

(`Actor.log_probs(..., record_routes=True)` and `Actor.train_policy` do exactly this for the trainer.)
R3: the engine's per-sequence routes ([T, moe_layers, k], `RolloutSample.routed_experts`), packed per
micro-batch by `mcore_rl.batch.pad_rollout_routes`, become the same `RecordedRoutes` via
`replay.routes_from_rollout`.
`replay.with_valid(routes, masks)` restricts the mismatch metric to real tokens (R2 records pads too).

How: every MoE router instance of the chunks gets its `routing` method wrapped (no megatron-core
version has to ship a replay hook: 0.12's and 0.16's `routing` differ inside but share the
signature `routing(logits, ...) -> (probs [tokens, E], routing_map [tokens, E] bool)`). Replaying
still runs the router's own routing first (so aux / z losses and their gradients stay exactly as in
the normal path, and its natural choice gives the mismatch metric), then replaces the result: the
replayed experts get gate weights computed from the CURRENT logits with the router's own score
function and normalisation (Qwen3: top-k on logits then softmax over the k = softmax, top-k,
renormalise), so the router keeps learning. Aux losses and the expert-bias token counts follow the
router's natural choice (as Megatron's own RouterReplay does). Router fusion (0.16: moe_router_fusion)
is switched off inside `replaying()` and restored after: the replayed weights are plain torch, and
the natural path must use the same arithmetic for the replay of its own routes to be bit-identical.

Routes are stored as each router sees tokens: [s_local * b, k] in Megatron's sequence-major order
(s_local = s / tp under sequence parallelism), keyed by the global layer number; with PP a rank
holds only its own layers. So R2 routes are tied to the layout that recorded them (the actor's).
Under context parallelism the router sees this CP rank's part of the sequences: the actor hands
`routes_from_rollout` / `with_valid` the CP-local fields ([1, T / cp, ...], `context_parallel.take_local`),
so R3 routes are split like the tokens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from mcore_rl.batch import ROUTE_DTYPE
from mcore_rl.platform import collectives
from mcore_rl.preflight.layout import Layout

logger = logging.getLogger(__name__)


@dataclass
class MicroBatchRoutes:
    """Expert ids of one micro-batch: global layer number -> [tokens, k] (router's token order).

    `valid` marks real tokens ([tokens] bool); None means all. Padding rows carry dummy ids and are
    left out of the mismatch metric."""

    ids: dict[int, torch.Tensor]
    valid: Optional[torch.Tensor] = None


@dataclass
class RecordedRoutes:
    """Routes of consecutive micro-batches of this rank, in schedule order. Slicing gives a sub-range."""

    micro_batches: list[MicroBatchRoutes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, index: slice) -> "RecordedRoutes":
        if not isinstance(index, slice):
            raise TypeError(f"RecordedRoutes[{index!r}]: index with a slice of micro-batches, e.g. routes[0:4]")
        return RecordedRoutes(self.micro_batches[index])

    def __add__(self, other: "RecordedRoutes") -> "RecordedRoutes":
        return RecordedRoutes(self.micro_batches + other.micro_batches)


@dataclass
class _RouterSite:
    router: torch.nn.Module
    layer: int  # global 1-based layer number
    original: object  # the bound `routing` method before wrapping


def _moe_router_sites(chunks) -> list[_RouterSite]:
    """Every MoE router in the chunks, with the global number of the transformer layer holding it."""
    from megatron.core.transformer.moe.router import Router

    sites = []
    for chunk in chunks:
        for module in chunk.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(router, Router) and hasattr(module, "layer_number"):
                sites.append(_RouterSite(router, int(module.layer_number), router.routing))
    return sites


def _ids_from_map(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, E] bool -> [tokens, k] expert ids (ascending)."""
    counts = routing_map.sum(dim=1)
    if routing_map.numel() and not bool((counts == k).all()):
        raise RuntimeError(
            f"router chose {int(counts.min())}..{int(counts.max())} experts per token, expected "
            f"top-k = {k}: routing replay needs every token routed to exactly k experts "
            f"(no token dropping: set moe_expert_capacity_factor = None)"
        )
    return routing_map.to(torch.int8).topk(k, dim=1).indices.sort(dim=1).values


def _replayed_probs(router, logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate weights of the given experts from the current logits, normalised like the router does."""
    cfg = router.config
    k = ids.shape[1]
    gathered = logits.gather(1, ids)
    # order like torch.topk would (descending score), so the same experts give bit-identical sums
    order = gathered.argsort(dim=1, descending=True, stable=True)
    ids, gathered = ids.gather(1, order), gathered.gather(1, order)
    score_function = getattr(cfg, "moe_router_score_function", "softmax")
    if score_function == "softmax":
        if getattr(cfg, "moe_router_pre_softmax", False):
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs = scores.gather(1, ids)
        else:
            probs = torch.softmax(gathered, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits).gather(1, ids)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
    else:
        raise ValueError(f"routing replay: moe_router_score_function {score_function!r} unknown (softmax | sigmoid)")
    scaling = getattr(cfg, "moe_router_topk_scaling_factor", None)
    if scaling:
        probs = probs * scaling
    routing_probs = torch.zeros_like(logits).scatter(1, ids, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, ids, 1).bool()
    return routing_probs, routing_map


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recomputation calls forward from there)."""
    return torch._C._current_graph_task_id() != -1


class _Recording:
    """What one `recording()` block collected; `routes` is filled when the block exits."""

    def __init__(self, layers: list[int]):
        self.per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self.routes: Optional[RecordedRoutes] = None

    def finish(self) -> RecordedRoutes:
        counts = {layer: len(v) for layer, v in self.per_layer.items()}
        if len(set(counts.values())) > 1:
            raise RuntimeError(f"routing recording: layers saw different numbers of forward calls {counts}")
        n = next(iter(counts.values()), 0)
        self.routes = RecordedRoutes([MicroBatchRoutes({l: v[i] for l, v in self.per_layer.items()}) for i in range(n)])
        return self.routes


class _Replay:
    """Cursor state of one `replaying()` block."""

    def __init__(self, routes: RecordedRoutes, layers: list[int]):
        self.routes = routes
        self.next_forward = {layer: 0 for layer in layers}
        self.pending_recompute: dict[int, list[int]] = {layer: [] for layer in layers}
        self.mismatch: dict[int, torch.Tensor] = {}  # layer -> [differing token sets, differing experts, tokens]


class RoutingReplay:
    """Record / replay the experts chosen by every MoE router of this rank's model chunks."""

    def __init__(
        self,
        sites: list[_RouterSite],
        moe_layers: list[int],
        sequence_shard: tuple[int, int],
        top_k: int,
        recompute: bool,
    ):
        self.sites = sites
        self.layers = [s.layer for s in sites]
        self.moe_layers = moe_layers  # global numbers of all MoE layers of the model (every PP stage)
        self.sequence_shard = sequence_shard  # (parts, index): the routers' sequence shard under sequence parallel
        self.top_k = top_k
        self.recompute = recompute
        self._recording: Optional[_Recording] = None
        self._replay: Optional[_Replay] = None
        self._last_mismatch: dict[int, torch.Tensor] = {}

    @classmethod
    def install(cls, chunks, layout: Layout) -> "RoutingReplay":
        """Wrap the routing of every MoE router in `chunks` (DDP-wrapped or not), built in `layout`
        (bound to its process groups). Collective over PP."""
        sites = _moe_router_sites(chunks)
        if not sites:
            raise ValueError(
                "RoutingReplay.install: no MoE router found in the model chunks (dense model?): "
                "routing replay needs an MoE model"
            )
        cfg = sites[0].router.config
        if getattr(cfg, "moe_expert_capacity_factor", None) is not None:
            raise ValueError(
                f"routing replay needs dropless MoE, but moe_expert_capacity_factor = "
                f"{cfg.moe_expert_capacity_factor}: set it to None"
            )
        if getattr(cfg, "moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
            raise ValueError("routing replay supports top-k routers, not moe_router_load_balancing_type='sinkhorn'")
        if getattr(cfg, "moe_token_dispatcher_type", None) == "alltoall_seq":
            raise ValueError(
                "routing replay does not support moe_token_dispatcher_type='alltoall_seq' (its router "
                "gathers logits over TP inside routing): use 'alltoall' or 'allgather'"
            )
        replay = cls(
            sites,
            _all_moe_layers([s.layer for s in sites], layout),
            sequence_shard=(layout.tp, layout.ranks.tp) if layout.sequence_parallel else (1, 0),
            top_k=cfg.moe_router_topk,
            recompute=_recomputes_router(cfg),
        )
        for site in sites:
            if getattr(site.router, "_mcore_rl_replay", None) is not None:
                raise RuntimeError(f"router of layer {site.layer} already has a RoutingReplay installed")
            site.router._mcore_rl_replay = replay
            site.router.routing = functools.partial(replay._routing, site)
        return replay

    def uninstall(self) -> None:
        for site in self.sites:
            site.router.routing = site.original
            site.router._mcore_rl_replay = None

    # ---- modes -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[_Recording]:
        """Record the experts every router uses, one entry per forward call (= micro-batch)."""
        if self._recording is not None:
            raise RuntimeError("routing recording already active: recording() blocks do not nest")
        self._recording = _Recording(self.layers)
        try:
            yield self._recording
            self._recording.finish()
        finally:
            self._recording = None

    @contextlib.contextmanager
    def replaying(self, routes: RecordedRoutes) -> Iterator[None]:
        """Route with `routes` (one entry per micro-batch, consumed in order, each exactly once)."""
        if self._replay is not None:
            raise RuntimeError("routing replay already active: replaying() blocks do not nest")
        for i, mb in enumerate(routes.micro_batches):
            missing = sorted(set(self.layers) - set(mb.ids))
            if missing:
                raise ValueError(
                    f"routes of micro-batch {i} lack layers {missing} of this rank (have "
                    f"{sorted(mb.ids)}): record them with the same model layout"
                )
        self._replay = _Replay(routes, self.layers)
        config = self.sites[0].router.config
        fused = getattr(config, "moe_router_fusion", False)
        if fused:
            logger.info("routing replay: moe_router_fusion switched off while replaying")
            config.moe_router_fusion = False
        try:
            yield
            self._check_consumed(self._replay)
        finally:
            if fused:
                config.moe_router_fusion = True
            self._last_mismatch = self._replay.mismatch
            self._replay = None

    def _check_consumed(self, state: _Replay) -> None:
        n = len(state.routes)
        unused = {l: c for l, c in state.next_forward.items() if c != n}
        if unused:
            raise RuntimeError(
                f"routing replay: {n} micro-batches of routes given but layers consumed {unused}: "
                f"run exactly one forward per recorded micro-batch"
            )
        pending = {l: len(v) for l, v in state.pending_recompute.items() if v}
        if pending:
            raise RuntimeError(f"routing replay: recomputation did not consume routes {pending} (backward not run?)")

    # ---- the wrapped router ------------------------------------------------------------------
    def _routing(self, site: _RouterSite, logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = site.original(logits, *args, **kwargs)
        state = self._replay
        recomputing = _in_backward()
        if state is not None:
            flat = logits.reshape(-1, logits.shape[-1])
            mb = self._next_routes(state, site.layer, recomputing)
            ids = mb.ids[site.layer].to(device=flat.device, dtype=torch.long)
            if ids.shape != (flat.shape[0], self.top_k):
                raise ValueError(
                    f"routing replay, layer {site.layer}: routes have shape {tuple(ids.shape)} but the "
                    f"router sees {flat.shape[0]} tokens x top-k {self.top_k}: the micro-batch or "
                    f"layout differs from the one the routes were recorded / packed for"
                )
            natural = routing_map
            replayed_probs, routing_map = _replayed_probs(site.router, flat, ids)
            if not recomputing:
                self._count_mismatch(state, site.layer, natural, routing_map, mb.valid)
            # keep the natural probs in the graph at zero weight: aux-loss gradients attached to them still flow
            probs = replayed_probs + probs.sum() * 0.0 if probs.requires_grad else replayed_probs
        if self._recording is not None and not recomputing:
            self._recording.per_layer[site.layer].append(_ids_from_map(routing_map, self.top_k).to(ROUTE_DTYPE))
        return probs, routing_map

    def _next_routes(self, state: _Replay, layer: int, recomputing: bool) -> MicroBatchRoutes:
        if recomputing:
            if not state.pending_recompute[layer]:
                raise RuntimeError(f"routing replay, layer {layer}: recomputation asked for routes never used forward")
            return state.routes.micro_batches[state.pending_recompute[layer].pop(0)]
        i = state.next_forward[layer]
        if i >= len(state.routes):
            raise RuntimeError(
                f"routing replay, layer {layer}: forward call {i + 1} but only {len(state.routes)} "
                f"micro-batches of routes given: pass routes for every micro-batch of the pass"
            )
        state.next_forward[layer] = i + 1
        # the first forward of a recomputed layer runs under no_grad, so ask the router whether it trains
        if self.recompute and self._site(layer).router.training:
            state.pending_recompute[layer].append(i)
        return state.routes.micro_batches[i]

    def _site(self, layer: int) -> _RouterSite:
        return self.sites[self.layers.index(layer)]

    @staticmethod
    def _count_mismatch(
        state: _Replay, layer: int, natural: torch.Tensor, replayed: torch.Tensor, valid: Optional[torch.Tensor]
    ) -> None:
        """Accumulate [differing token sets, differing experts, tokens] as int64 on the router's device:
        no host synchronisation per router call (read once, in mismatch_metrics)."""
        with torch.no_grad():
            differ = natural & ~replayed  # experts the current router would pick but the replay did not
            if valid is not None:
                differ = differ[valid.to(differ.device)]
            tokens = torch.full((), differ.shape[0], dtype=torch.int64, device=differ.device)
            counts = torch.stack([differ.any(dim=1).sum(), differ.sum(), tokens]).to(torch.int64)
            previous = state.mismatch.get(layer)
            state.mismatch[layer] = counts if previous is None else previous + counts

    # ---- metrics -----------------------------------------------------------------------------
    def mismatch_metrics(self, prefix: str = "routing/") -> dict[str, float]:
        """Mismatch between replayed routes and the current router's own top-k, over the last replaying()
        block; collective over the whole job (every rank must call). Per layer and overall:
          token_mismatch  - fraction of (token, layer) whose top-k expert set differs
          expert_mismatch - fraction of chosen experts the current router would not choose
        """
        device = collectives.group_device()
        table = torch.zeros(len(self.moe_layers), 3, dtype=torch.int64, device=device)
        for layer, counts in self._last_mismatch.items():
            table[self.moe_layers.index(layer)] += counts.to(device)
        # TP ranks without sequence parallel count the same tokens: ratios are unaffected
        table = collectives.all_reduce_small(table).cpu().double()  # host-side ratios
        total = table.sum(0)
        k = self.top_k
        out = {
            f"{prefix}token_mismatch": float(total[0] / total[2].clamp(min=1)),
            f"{prefix}expert_mismatch": float(total[1] / (total[2] * k).clamp(min=1)),
        }
        for i, layer in enumerate(self.moe_layers):
            out[f"{prefix}token_mismatch_layer{layer}"] = float(table[i, 0] / table[i, 2].clamp(min=1))
        return out

    # ---- R3 and masks ------------------------------------------------------------------------
    def _router_order(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> [s_local * b, ...]: this rank's sequence shard, in the router's token order."""
        tp, rank = self.sequence_shard
        b, s = x.shape[:2]
        if s % tp:
            raise ValueError(
                f"sequence length {s} is not a multiple of tp = {tp} (sequence parallel): pad to a multiple"
            )
        local = x[:, rank * s // tp : (rank + 1) * s // tp].transpose(0, 1)  # Megatron's [s, b] order
        return local.reshape(-1, *x.shape[2:])

    def routes_from_rollout(self, packed: list[torch.Tensor], valid: list[torch.Tensor]) -> RecordedRoutes:
        """Rollout routes of this rank's micro-batches (from `pad_rollout_routes`) -> RecordedRoutes.

        packed[i]: [b, s, moe_layers, k] expert ids of micro-batch i (tokens right-padded to s);
        valid[i]: [b, s] bool, True at real tokens. Takes this rank's layers and sequence shard."""
        if len(packed) != len(valid):
            raise ValueError(f"routes_from_rollout: {len(packed)} route tensors but {len(valid)} masks")
        out = []
        for i, (routes, mask) in enumerate(zip(packed, valid)):
            b, s, num_layers, k = routes.shape
            if num_layers != len(self.moe_layers) or k != self.top_k:
                raise ValueError(
                    f"rollout routes of micro-batch {i} are [b, s, {num_layers} layers, top-{k}] but the "
                    f"model has {len(self.moe_layers)} MoE layers with top-{self.top_k}: the engine "
                    f"served a different model config"
                )
            if tuple(mask.shape) != (b, s):
                raise ValueError(f"valid mask of micro-batch {i} has shape {tuple(mask.shape)}, routes need {(b, s)}")
            local = self._router_order(routes)  # [s_local * b, L, k]
            ids = {layer: local[:, self.moe_layers.index(layer)].to(ROUTE_DTYPE) for layer in self.layers}
            out.append(MicroBatchRoutes(ids, self._router_order(mask.bool())))
        return RecordedRoutes(out)

    def with_valid(self, routes: RecordedRoutes, valid: list[torch.Tensor]) -> RecordedRoutes:
        """The same routes with [b, s] token masks (e.g. attention / response masks) per micro-batch, so the
        mismatch metric ignores padding (R2 records routes for every position, pads included)."""
        if len(valid) != len(routes):
            raise ValueError(f"with_valid: {len(valid)} masks for {len(routes)} micro-batches of routes")
        return RecordedRoutes(
            [MicroBatchRoutes(mb.ids, self._router_order(m.bool())) for mb, m in zip(routes.micro_batches, valid)]
        )


def _recomputes_router(cfg) -> bool:
    """Whether the training forward recomputes every router in backward (then each route is used twice)."""
    granularity = getattr(cfg, "recompute_granularity", None)
    if granularity == "full":
        if getattr(cfg, "recompute_method", None) != "uniform":
            raise ValueError(
                f"routing replay with full recomputation needs recompute_method='uniform' (every layer "
                f"recomputed), got {cfg.recompute_method!r}"
            )
        return True
    return granularity == "selective" and "moe" in (getattr(cfg, "recompute_modules", None) or [])


def _all_moe_layers(local_layers: list[int], layout: Layout) -> list[int]:
    """Global numbers of every MoE layer of the model, gathered over the pipeline stages."""
    if layout.pp == 1:
        return sorted(local_layers)
    group = layout.groups.pp
    gathered: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local_layers, group=group)
    return sorted({layer for part in gathered for layer in part})
