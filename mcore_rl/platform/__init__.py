"""Device platforms: cpu (gloo), cuda (nccl), npu (hccl).

A `Platform` knows its distributed backend, the device of the local rank, how to start
torch.distributed from torchrun's environment, and how to adapt Megatron-Core to the device
before any model is built (`adapt_megatron`, call it first thing in every process).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)

PLATFORMS = ("cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the rendezvous port of a job; "" binds every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Platform:
    name: str  # cpu | cuda | npu

    @property
    def dist_backend(self) -> str:
        return _BACKENDS[self.name]

    @property
    def packed_attention(self) -> str:
        """How attention is confined to each sequence of a packed micro-batch: "thd" (Megatron's
        PackedSeqParams with cu_seqlens, for Transformer Engine / MindSpeed flash attention) or "mask"
        (a block-diagonal causal mask that Megatron's local DotProductAttention applies; CPU)."""
        return "mask" if self.name == "cpu" else "thd"

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        """The device this process computes on (torchrun's LOCAL_RANK picks the accelerator)."""
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, self.local_rank)

    def set_device(self) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(self.local_rank)
        elif self.name == "npu":
            torch.npu.set_device(self.local_rank)

    def init_distributed(self, timeout_minutes: float = 30.0) -> DistInfo:
        """Start torch.distributed from torchrun's env vars; a plain `python` run becomes world 1."""
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if not torch.distributed.is_initialized():
            if world_size == 1:  # not under torchrun: a private single-process group
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(free_port()))
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE={world_size} but {missing} unset; start the job with torchrun")
            self.set_device()
            torch.distributed.init_process_group(
                backend=self.dist_backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=timeout_minutes),
            )
        return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), self.local_rank)

    def adapt_megatron(self) -> None:
        """Make Megatron-Core run on this device. Call before building models; idempotent."""
        if self.name == "cpu":
            from mcore_rl.platform import cpu_adapt

            cpu_adapt.apply()
        elif self.name == "npu":
            _adapt_npu()
        # cuda: Megatron's native device, nothing to adapt.


def _adapt_npu() -> None:
    """torch_npu first (registers the device and its torch.cuda shims), then MindSpeed's adaptor,
    which patches megatron.core in place; both must precede any `from megatron.core... import`
    in user code, or those names stay bound to the unpatched objects."""
    already = sorted(m for m in sys.modules if m.startswith("megatron.core."))
    if already and "mindspeed.megatron_adaptor" not in sys.modules:
        logger.warning(
            "megatron.core modules imported before MindSpeed's adaptor (%d modules); "
            "call get_platform().adapt_megatron() before importing Megatron",
            len(already),
        )
    import mindspeed.megatron_adaptor  # noqa: F401
    import torch_npu  # noqa: F401


def get_platform(name: str = "auto") -> Platform:
    """`auto` picks npu if torch_npu sees a device, else cuda if available, else cpu."""
    if name == "auto":
        if _npu_available():
            name = "npu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name not in PLATFORMS:
        raise ValueError(f"platform {name!r} unknown; choose one of auto, {', '.join(PLATFORMS)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("platform 'cuda' requested but torch.cuda.is_available() is False; use 'cpu' or 'auto'")
    if name == "npu" and not _npu_available():
        raise RuntimeError("platform 'npu' requested but torch_npu finds no NPU; install torch_npu or use 'auto'")
    return Platform(name)


__all__ = ["DistInfo", "Platform", "PLATFORMS", "free_port", "get_platform"]
