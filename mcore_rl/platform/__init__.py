"""Device platforms: cpu (gloo), cuda (nccl), npu (hccl).

A `Platform` knows its distributed backend, the device of the local rank, how to start
torch.distributed from torchrun's environment, and how to adapt Megatron-Core to the device
before any model is built (`adapt_megatron`, call it first thing in every process).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

from mcore_rl.platform.ascend_env import ASCEND_ENV, RunEnvironment, ascend_environment
from mcore_rl.ports import free_port

logger = logging.getLogger(__name__)

PLATFORMS = ("cpu", "cuda", "npu")
# Process-group backend per platform. The accelerators get a multi-device string: the device backend for
# device tensors and gloo for CPU tensors, so a CPU tensor in a collective works instead of raising "No
# backend type associated with device type cpu". Megatron creates its subgroups with backend=None, which
# torch resolves to the default group's string, so TP/PP/DP/EP groups get both too (docs/devices.md).
_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}

# MindSpeed arguments set right after its adaptor import (docs/devices.md, "MindSpeed arguments"). Without
# Megatron's training arguments MindSpeed reads its flags from sys.argv, where there are none, and copies them
# onto every TransformerConfig. A GPTModel built from a layer spec then needs:
MINDSPEED_ARGS = {
    # Its default GenerateMaskFeature wraps DotProductAttention.forward and, for attention_mask=None (causal),
    # raises "Please set micro_batch_size or set use_flash_attn=True in config." unless use_flash_attn is set;
    # with it, the fused NPU attention (FusionAttentionFeature) runs with a compressed causal mask.
    "use_flash_attn": True,
}


# MindSpeed's context-parallel algorithm for actor.parallel.cp > 1 (docs/context-parallel.md, "On NPU"): its ring
# attention ("megatron_cp_algo") takes packed (TND) sequences split per sequence into 2 x cp chunks, rank r holding
# chunks r and 2cp-1-r - the actor's split - and reads each sequence's bounds from cu_seqlens_q_padded // cp.
# Ulysses (contiguous split, heads all-to-all), the hybrid and adaptive algorithms split otherwise.
MINDSPEED_CP_ALGO = "megatron_cp_algo"


def mindspeed_cp_args(cp: int) -> dict:
    """The MindSpeed arguments for `cp` context-parallel ranks (none at cp 1). MindSpeed reads them from its argument
    namespace: `context_parallel_size` > 1 makes its CP feature replace the attention classes and wrap
    `initialize_model_parallel` (so they must be set before the process groups exist), and every TransformerConfig
    gets a copy, which its CP attention reads (algorithm, mask type, ring window, overlap)."""
    if cp <= 1:
        return {}
    return {
        "context_parallel_size": cp,
        "context_parallel_algo": MINDSPEED_CP_ALGO,
        # causal: the ring's per-sequence causal (TND "eod") path, with MindSpeed's compressed causal mask;
        # "general" would need a full [s, s] mask per micro-batch
        "attention_mask_type": "causal",
        # one ring over the CP group (no double ring); MindSpeed requires 1 <= cp_window_size < cp
        "cp_window_size": 1,
        # no second CP process group for overlapped send / receive (MindSpeed's default)
        "use_cp_send_recv_overlap": False,
    }


def mindspeed_args(cp: int = 1) -> dict:
    """Every MindSpeed argument the platform sets for a run with `cp` context-parallel ranks."""
    return {**MINDSPEED_ARGS, **mindspeed_cp_args(cp)}


def mindspeed_args_to_set(current: Any, cp: int = 1) -> dict:
    """The `mindspeed_args(cp)` entries whose value in MindSpeed's argument namespace `current` differs."""
    return {k: v for k, v in mindspeed_args(cp).items() if getattr(current, k, None) != v}


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


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def uses_te_spec(name: str, te_importable: bool) -> bool:
    """Whether platform `name` builds Megatron's Transformer Engine layer spec: NPU always (MindSpeed stands in for
    TE under TE's names), CUDA only where transformer_engine imports, CPU never."""
    return name == "npu" or (name == "cuda" and te_importable)


# Transformer Engine's CP communication for Megatron's TEDotProductAttention (TransformerConfig.cp_comm_type): "p2p"
# (K / V chunks passed round a ring) is the one type whose TE attention takes the THD format the actor's CP split
# uses; TE's "all_gather" and "a2a" assert qkv_format != "thd" (docs/context-parallel.md, "On CUDA").
TE_CP_COMM_TYPE = "p2p"


def context_parallel_config(name: str, te_spec: bool, cp: int) -> dict[str, str]:
    """TransformerConfig fields for context parallelism: cp_comm_type where TE's attention does CP (CUDA with the
    TE spec); none at cp 1, none for the local spec (its attention gathers K / V itself), and none on NPU: MindSpeed
    copies its own CP arguments (`mindspeed_cp_args`, set by `adapt_megatron(cp)`) onto every TransformerConfig."""
    return {"cp_comm_type": TE_CP_COMM_TYPE} if cp > 1 and te_spec and name == "cuda" else {}


def packed_attention_mode(te_spec: bool, name: str = "cuda") -> str:
    """How a packed micro-batch's attention stays within each sequence, given the layer spec built: "thd" (Megatron's
    PackedSeqParams, which only TE's / MindSpeed's attention accept - Megatron's local DotProductAttention asserts
    packed_seq_params is None; on NPU "thd-ends": the same params with MindSpeed's fused-attention convention,
    `npu_actual_seq_len`) or "segments" (the segment bounds, for the local spec's SegmentDotProductAttention)."""
    if not te_spec:
        return "segments"
    return "thd-ends" if name == "npu" else "thd"


def npu_actual_seq_len(bounds: torch.Tensor) -> torch.Tensor:
    """Megatron's cu_seqlens [0, e1, ..., en] as `torch_npu.npu_fusion_attention`'s actual_seq_qlen / kvlen: the
    cumulative END offsets, without the leading 0 (its documented contract: lengths 2 2 2 2 2 -> 2 4 6 8 10).
    MindSpeed's flash-attention adaptor passes `packed_seq_params.cu_seqlens_q.tolist()` to the op unchanged, while
    Megatron's RoPE reads `cu_seqlens_q_padded` when set and needs the leading 0 (docs/devices.md, "Packed
    micro-batches"), so on NPU the params carry these ends as cu_seqlens and the bounds as the padded ones."""
    if bounds.dim() != 1 or bounds.numel() < 2 or int(bounds[0]) != 0:
        raise ValueError(f"cu_seqlens must be [0, e1, ..., en] (1-D, from 0), got {bounds.tolist()}")
    return bounds[1:]


@dataclass(frozen=True)
class Platform:
    name: str  # cpu | cuda | npu

    @property
    def dist_backend(self) -> str:
        """Backend string of the default process group (and of Megatron's subgroups)."""
        return _BACKENDS[self.name]

    @property
    def uses_transformer_engine(self) -> bool:
        """Whether models use Megatron's Transformer Engine layer spec: on NPU (MindSpeed stands in for TE under
        TE's names) and on CUDA where transformer_engine is importable; otherwise the local pure-torch spec
        (CPU, and CUDA without TE - the GPU smoke suite's machine has none)."""
        return uses_te_spec(self.name, transformer_engine_importable())

    @property
    def forks_workers(self) -> bool:
        """Whether `mcore-rl train` forks its ranks from the launcher (torch, transformers and the loaded inputs
        already there: ~2 s of CPU per rank less, mcore_rl.torchrun.ForkedWorker) instead of starting interpreters:
        on CPU only (and with the embedded engine: mcore_rl.cli). A launcher that queried a GPU or imported
        torch_npu holds a device runtime not made for fork."""
        return self.name == "cpu"

    def apply_environment(self, env: Optional[dict] = None, run: Optional[RunEnvironment] = None) -> dict[str, str]:
        """Set (if unset) the environment variables this platform needs in `env` (default os.environ), with `run`
        also those the run's config decides (mcore_rl/platform/ascend_env.py); returns the values in effect. Call
        before importing torch_npu / vllm-ascend."""
        env = os.environ if env is None else env
        wanted = ascend_environment(run) if self.name == "npu" else {}
        for key, value in wanted.items():
            env.setdefault(key, value)
        return {key: env[key] for key in wanted}

    @property
    def packed_attention(self) -> str:
        """How attention is confined to each sequence of a packed micro-batch (`packed_attention_mode`): "thd" with
        the Transformer Engine spec on CUDA, "thd-ends" on NPU (MindSpeed), "segments" with the local spec (CPU,
        CUDA without TE)."""
        return packed_attention_mode(self.uses_transformer_engine, self.name)

    def context_parallel_config(self, cp: int) -> dict[str, str]:
        """TransformerConfig fields for `cp` context-parallel ranks (`context_parallel_config`)."""
        return context_parallel_config(self.name, self.uses_transformer_engine, cp)

    @property
    def weight_transport(self) -> str:
        """How a weight export moves shards between ranks (mcore_rl/weight_sync/exporter.py `transport_for`):
        "shared-memory" on cpu (gloo: the ranks of one host read each other's memory), "collective" on accelerators
        (NCCL / HCCL)."""
        return "shared-memory" if self.name == "cpu" else "collective"

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

    # ---- device memory (actor offload around rollout; mcore_rl/megatron/offload.py) ----
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 host tensor of `nbytes` for a device storage's copy: page-locked on an
        accelerator (asynchronous copies, no staging buffer), plain memory on cpu (there the host copy is a
        separate tensor, so releasing the original storage is still observable)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.name != "cpu")

    def synchronize(self) -> None:
        """Wait for this process's queued device work (the copies of an offload / reload); cpu: nothing."""
        if self.name == "cuda":
            torch.cuda.synchronize()
        elif self.name == "npu":
            torch.npu.synchronize()

    def empty_cache(self) -> None:
        """Return the caching allocator's free blocks to the device, so memory that tensors released is free
        for another allocator in the process (vLLM's sleep-mode pool); cpu: nothing."""
        if self.name == "cuda":
            torch.cuda.empty_cache()
        elif self.name == "npu":
            torch.npu.empty_cache()

    def release_cache(self) -> None:
        """Collect garbage, then `empty_cache`: tensors only unreachable (reference cycles) die first, and their blocks
        leave torch's caching allocator with the others. Called before the engine maps device memory (a wake, a
        rebuild beside an awake engine): vLLM's sleep-mode allocator maps new physical memory and cannot use
        blocks that torch's cache still holds from the training peak. cpu: no collection - torch's CPU allocator
        caches nothing and no CPU engine sleeps, while a full collection of a trainer's objects costs ~0.15 s of
        CPU at every sync (half the tiny demo's step; docs/benchmarks.md). The device is synchronised first (as verl's
        memory_utils does): work still queued on it (an offload's copies, the step's last kernels) is done with the
        memory the cache then returns, before the engine maps device memory of its own."""
        if self.name != "cpu":
            gc.collect()
        self.synchronize()
        self.empty_cache()

    def reset_peak_memory_stats(self) -> None:
        """Restart the allocator's peak statistics from what is allocated now; cpu: nothing."""
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.name == "npu":
            torch.npu.reset_peak_memory_stats()

    def init_distributed(self, run: RunEnvironment = RunEnvironment()) -> DistInfo:
        """Start torch.distributed from torchrun's env vars; a plain `python` run becomes world 1. Every collective
        may wait `run.collective_timeout_minutes` (on NPU HCCL_EXEC_TIMEOUT is set to match, before the device)."""
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if not torch.distributed.is_initialized():
            if world_size == 1:  # not under torchrun: a private single-process group
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(free_port()))
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE={world_size} but {missing} unset; start the job with torchrun")
            self.apply_environment(run=run)
            self.set_device()
            torch.distributed.init_process_group(
                backend=self.dist_backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=run.collective_timeout_minutes),
            )
        return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), self.local_rank)

    def adapt_megatron(self, cp: int = 1) -> None:
        """Make Megatron-Core run on this device. Call before building models; idempotent. `cp`: the run's
        context-parallel size, needed on NPU before Megatron's process groups are created (`mindspeed_cp_args`)."""
        if self.name == "cpu":
            from mcore_rl.platform import cpu_adapt  # imports Megatron: only where a model is built

            cpu_adapt.apply()
        elif self.name == "npu":
            self.apply_environment()
            _adapt_npu(cp)
        # cuda: Megatron's native device, nothing to adapt.


def _adapt_npu(cp: int = 1) -> None:
    """torch_npu first (registers the device and its torch.cuda shims), then MindSpeed's adaptor,
    which patches megatron.core in place; both must precede any `from megatron.core... import`
    in user code, or those names stay bound to the unpatched objects. With `cp` > 1 the repatch also
    installs MindSpeed's CP attention and its process-group wrapper (before `initialize_model_parallel`)."""
    already = sorted(m for m in sys.modules if m.startswith("megatron.core."))
    if already and "mindspeed.megatron_adaptor" not in sys.modules:
        logger.warning(
            "megatron.core modules imported before MindSpeed's adaptor (%d modules); "
            "call get_platform().adapt_megatron() before importing Megatron",
            len(already),
        )
    from mcore_rl.platform.mindspeed_compile import keep_originals

    keep_originals()  # MindSpeed replaces torch.compile; the engine's build gets the original back
    import mindspeed.megatron_adaptor as adaptor
    import torch_npu  # noqa: F401
    from mindspeed.args_utils import get_full_args

    missing = mindspeed_args_to_set(get_full_args(), cp)
    if missing:  # repatch re-applies MindSpeed's features with these arguments set (MindSpeed 2.2.0_core_r0.12.1)
        adaptor.repatch(missing)


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


__all__ = ["ASCEND_ENV", "DistInfo", "Platform", "PLATFORMS", "RunEnvironment", "free_port", "get_platform"]
