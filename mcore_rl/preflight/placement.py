"""The separate placement's split of the job (`rollout.placement: separate`), checked before any process starts.

The job's ranks split into actor ranks, which train with the Megatron layout over them, and rollout ranks
(`rollout.ranks`; None: half the world), which generate in engine replicas of `rollout.tp` ranks each (one rank
a replica for the embedded engine). The actor takes the first ranks, so rank 0, which writes the metrics and
the checkpoints, is an actor rank; with nnodes x nproc processes rank r runs on node r // nproc, so the roles
take whole nodes when both sizes are multiples of nproc.

`check_split` is the pre-flight of the split (sizes, the engine's TP over the rollout ranks, no actor.offload);
`validate_run` checks the actor's layout over `RoleSplit.actor_ranks` and `describe_roles` is what `check` and
`plan` print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mcore_rl.config import Config, RolloutConfig
from mcore_rl.preflight.engines import validate_rollout_tp
from mcore_rl.preflight.layout import LayoutError, ModelDims

SEPARATE = "separate"
MAX_LISTED_REPLICAS = 8  # `check` lists the replicas one by one up to this many, then the first and last


@dataclass(frozen=True)
class RoleSplit:
    """Which ranks of a world of `world` train and which generate."""

    world: int
    rollout_ranks: int
    engine_tp: int  # ranks of one engine replica

    @property
    def actor_ranks(self) -> int:
        return self.world - self.rollout_ranks

    @property
    def replicas(self) -> int:
        return self.rollout_ranks // self.engine_tp

    def role_of(self, rank: int) -> str:
        return "actor" if rank < self.actor_ranks else "rollout"

    def replica_ranks(self, replica: int) -> range:
        start = self.actor_ranks + replica * self.engine_tp
        return range(start, start + self.engine_tp)


def engine_tp(rollout: RolloutConfig) -> int:
    """Ranks of one engine replica: vLLM's rollout.tp; the embedded engine generates on one rank each."""
    return rollout.tp if rollout.engine == "vllm" else 1


def split_of(rollout: RolloutConfig, world: int) -> Optional[RoleSplit]:
    """The split of `world` ranks (None: colocated, every rank does both). Not checked: `check_split` is."""
    if rollout.placement != SEPARATE:
        return None
    ranks = rollout.ranks if rollout.ranks is not None else world // 2
    return RoleSplit(world, ranks, engine_tp(rollout))


def check_split(cfg: Config, world: int, dims: Any) -> tuple[Optional[RoleSplit], list[str]]:
    """The split of `world` ranks for cfg's placement and its warnings; a LayoutError naming the fix when it
    cannot run. The actor's layout over the actor ranks is `validate_run`'s (validate_layout)."""
    r = cfg.rollout
    if r.placement != SEPARATE:
        if r.ranks is None:
            return None, []
        return None, [
            f"rollout.ranks = {r.ranks} has no effect with rollout.placement={r.placement} (every rank generates, "
            f"then trains): remove it, or set rollout.placement=separate"
        ]
    if world < 2:
        raise LayoutError(
            f"rollout.placement=separate needs at least 2 ranks (one actor, one rollout), the world is {world}: "
            f"start more processes (trainer.nproc) or set rollout.placement=colocated"
        )
    split = split_of(r, world)
    if not 1 <= split.rollout_ranks < world:
        raise LayoutError(
            f"rollout.ranks = {split.rollout_ranks} must lie in 1 .. {world - 1} in a world of {world} (the other "
            f"ranks are the actor's): set rollout.ranks between 1 and {world - 1}, e.g. {world // 2}"
        )
    if cfg.actor.offload:
        raise LayoutError(
            "actor.offload with rollout.placement=separate: the actor's ranks hold no engine, so there is nothing "
            "to offload for; set actor.offload=false"
        )
    if r.engine != "vllm":
        return split, []  # streaming: the embedded replicas agree where they take each session (streaming.Agreement)
    if r.streaming and split.rollout_ranks != r.tp:
        raise LayoutError(
            f"rollout.streaming=true with rollout.engine=vllm takes new weights between decode steps on one engine "
            f"replica (several replicas agree on it with the embedded engine only); rollout.ranks = "
            f"{split.rollout_ranks} make {split.rollout_ranks // r.tp}: set rollout.ranks={r.tp}, "
            f"rollout.engine=embedded or rollout.streaming=false"
        )
    if r.streaming and cfg.algo.routing_replay == "r3":
        raise LayoutError(
            "rollout.streaming=true with rollout.engine=vllm and algo.routing_replay=r3: an interrupted vLLM request "
            "continues as a new one, which does not return the routes of the tokens before the update; use "
            "algo.routing_replay=r2 (routes recorded in the actor's old-log-prob pass) or rollout.engine=embedded"
        )
    if r.streaming and r.tp > 1:
        raise LayoutError(
            f"rollout.streaming=true with rollout.engine=vllm and rollout.tp = {r.tp}: the ranks of a tensor-parallel "
            f"replica would each read the doorbell and could take a session at different decode steps (not agreed "
            f"among them yet); set rollout.tp=1 (and rollout.ranks=1) or rollout.streaming=false"
        )
    ranks = validate_rollout_tp(r.tp, split.rollout_ranks, ModelDims.from_hf(dims), ranks_name="rollout.ranks")
    return split, list(ranks.warnings)


def _span(values: range | list[int]) -> str:
    values = sorted(set(values))
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _nodes(ranks: range, nproc: int) -> str:
    nodes = sorted({rank // nproc for rank in ranks})
    return f"node{'s' if len(nodes) > 1 else ''} {_span(nodes)}"


def describe_roles(split: RoleSplit, engine: str, nproc: int) -> list[str]:
    """What `check` / `plan` print for the separate placement: each role's ranks and nodes, the replicas, and
    a warning where a node holds both roles or a replica spans nodes."""
    actor, rollout = range(split.actor_ranks), range(split.actor_ranks, split.world)
    lines = [
        f"roles (separate placement): actor ranks {_span(actor)} ({_nodes(actor, nproc)}), "
        f"rollout ranks {_span(rollout)} ({_nodes(rollout, nproc)})",
    ]
    replicas = [split.replica_ranks(i) for i in range(split.replicas)]
    if len(replicas) > MAX_LISTED_REPLICAS:
        replicas = replicas[:2] + replicas[-1:]
    listed = ", ".join(f"ranks {_span(ranks)} ({_nodes(ranks, nproc)})" for ranks in replicas)
    ellipsis = " ..." if split.replicas > MAX_LISTED_REPLICAS else ""
    lines.append(f"rollout replicas: {split.replicas} x {engine} tp{split.engine_tp}: {listed}{ellipsis}")
    if split.world > nproc and split.actor_ranks % nproc:  # one machine: both roles share it anyway
        lines.append(
            f"warning: node {split.actor_ranks // nproc} holds both roles ({split.actor_ranks} actor ranks are not a "
            f"multiple of {nproc} processes per node): give each role whole nodes with rollout.ranks"
        )
    crossing = [i for i in range(split.replicas) if len({r // nproc for r in split.replica_ranks(i)}) > 1]
    if crossing:
        lines.append(
            f"warning: {len(crossing)} engine replica(s) span two nodes (replica {crossing[0]}: ranks "
            f"{_span(split.replica_ranks(crossing[0]))}): their tensor parallelism crosses the network; make the "
            f"actor ranks a multiple of rollout.tp {split.engine_tp} and nproc a multiple of it"
        )
    return lines
