"""The separate placement's process groups: the job's ranks split into actor ranks and rollout ranks.

torchrun starts one world of `WORLD_SIZE` ranks. Here its store (torchrun's rendezvous, `env://`) is shared three ways
by key prefix:

  role/actor    the actor ranks' own default process group (global ranks 0 .. A-1): Megatron's parallel_state, the
                step data and every collective of the loop run in it unchanged, as in a job of A ranks
  role/rollout  the rollout ranks' default process group (global ranks A .. W-1): the engine replicas' own exchanges
  bridge        actor rank 0 and every rollout rank (bridge rank 0 and 1 .. W-A): the weights, the samples and the
                verification cross here. A group made for it, never the default group's world: gloo on cpu; on
                cuda / npu the device's own (`ProcessGroupNCCL`, torch_npu's `ProcessGroupHCCL`) over the same store,
                so the weights go device to device (written against those constructors; never run on a device)
  bridge-doorbell  one counter: the sessions actor rank 0 has begun, which a streaming rollout rank reads between
                decode steps without blocking (rollout.streaming, mcore_rl/streaming.py)

Every message on the bridge is a broadcast from bridge rank 0 (the actor's) or 1 (the rollout leader's), so the two
roles call the same sequence of broadcasts (mcore_rl.separate defines the sequence). A peer that went away makes
gloo raise; `Bridge` turns that into one line naming the role and the ranks that stopped answering.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

ACTOR, ROLLOUT = "actor", "rollout"


class PeerLost(RuntimeError):
    """The other role stopped answering on the bridge (its process died or raised)."""


@dataclass(frozen=True)
class RoleSplit:
    """Where this process sits in a separate-placement job."""

    global_rank: int
    global_world: int
    actor_ranks: int  # global ranks 0 .. actor_ranks - 1 are actor ranks, the rest rollout ranks

    @property
    def role(self) -> str:
        return ACTOR if self.global_rank < self.actor_ranks else ROLLOUT

    @property
    def rollout_ranks(self) -> int:
        return self.global_world - self.actor_ranks

    @property
    def role_rank(self) -> int:
        return self.global_rank if self.role == ACTOR else self.global_rank - self.actor_ranks

    @property
    def role_world(self) -> int:
        return self.actor_ranks if self.role == ACTOR else self.rollout_ranks

    @property
    def bridge_rank(self) -> Optional[int]:
        """0 for actor rank 0, 1 + i for rollout rank i, None for the other actor ranks (not on the bridge)."""
        if self.role == ROLLOUT:
            return 1 + self.role_rank
        return 0 if self.global_rank == 0 else None

    def describe_rollout(self) -> str:
        return f"rollout ranks {self.actor_ranks}..{self.global_world - 1} (global)"


def _bridge_group(name: str, store, rank: int, size: int, timeout: timedelta):
    """The bridge's process group: gloo on cpu; the device's collective library elsewhere."""
    prefixed = dist.PrefixStore("bridge", store)
    if name == "cpu":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    if name == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # npu: torch_npu's c10d backend

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(prefixed, rank, size, options)


def init_split(
    platform_name: str, backend: str, device: torch.device, actor_ranks: int, timeout: timedelta
) -> "tuple[RoleSplit, Optional[Bridge]]":
    """Start this rank's role group as the default process group and, on the bridge's ranks, the bridge. Returns
    (RoleSplit, Bridge or None). The environment is torchrun's (MASTER_ADDR / MASTER_PORT, RANK, WORLD_SIZE)."""
    store, global_rank, world = next(dist.rendezvous("env://", timeout=timeout))
    split = RoleSplit(global_rank, world, actor_ranks)
    role_store = dist.PrefixStore(f"role/{split.role}", store)
    dist.init_process_group(
        backend=backend, store=role_store, rank=split.role_rank, world_size=split.role_world, timeout=timeout
    )
    bridge = None
    if split.bridge_rank is not None:
        group = _bridge_group(platform_name, store, split.bridge_rank, 1 + split.rollout_ranks, timeout)
        bridge = Bridge(group, split, device, dist.PrefixStore("bridge-doorbell", store))
    return split, bridge


class Bridge:
    """Broadcasts between actor rank 0 (bridge rank 0) and the rollout ranks (bridge ranks 1..R, leader 1)."""

    def __init__(self, group, split: RoleSplit, device: torch.device, store=None):
        self.group, self.split, self.device = group, split, device
        self.store = store  # the doorbell: a counter actor rank 0 raises before each session (rung / ring)

    def ring(self) -> None:
        """Actor rank 0: a session begins; a streaming rollout rank sees it between decode steps (`rung`)."""
        if self.store is not None:
            self.store.add("sessions", 1)

    def rung(self) -> int:
        """The sessions actor rank 0 has begun (one store round trip, never blocks)."""
        return self.store.add("sessions", 0)

    @property
    def is_actor(self) -> bool:
        return self.split.role == ACTOR

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        try:
            self.group.broadcast([tensor], opts).wait()
        except RuntimeError as e:
            other = self.split.describe_rollout() if self.is_actor else "actor rank 0 (global rank 0)"
            raise PeerLost(
                f"the {other} stopped answering on the weight/sample bridge ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); its own error or exit is in the job's log "
                f"(RUN_DIR/torchrun.log): fix that, then resume"
            ) from None

    def _root(self, from_actor: bool) -> int:
        return 0 if from_actor else 1

    def _sends(self, from_actor: bool) -> bool:
        return self.split.bridge_rank == self._root(from_actor)

    def object(self, value: Any = None, *, from_actor: bool) -> Any:
        """`value` from the sending side to every bridge rank (pickled; tensors inside go along as bytes)."""
        root, device = self._root(from_actor), self.device  # NCCL / HCCL move device tensors only
        if self._sends(from_actor):
            buf = io.BytesIO()
            pickle.dump(value, buf, protocol=pickle.HIGHEST_PROTOCOL)
            data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8).to(device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self._broadcast(size, root)
        if not self._sends(from_actor):
            data = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
        self._broadcast(data, root)
        if self._sends(from_actor):
            return value
        return pickle.loads(data.cpu().numpy().tobytes())

    def tensors(self, header: list, flat: Optional[torch.Tensor], *, from_actor: bool) -> torch.Tensor:
        """A bucket's bytes (one flat uint8 tensor on the bridge's device) after its header object was sent."""
        nbytes = sum(numel * torch.empty(0, dtype=dtype).element_size() for _, _, dtype, numel in header)
        if not self._sends(from_actor):
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(flat, self._root(from_actor))
        return flat
