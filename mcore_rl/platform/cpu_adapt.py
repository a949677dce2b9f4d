"""Megatron-Core on a CPU-only torch build: every CPU adaptation in one place.

Megatron assumes CUDA in many call sites. On a CPU build of torch those calls raise ("Torch not
compiled with CUDA"), so we route them to their CPU equivalents, the same idea as MindSpeed's
adaptor for Ascend. Both entry points are idempotent (each patch marks what it replaced) and refuse to
run when CUDA is available, so they can never change behaviour on a GPU machine:
  * `route_devices()`: the device routing alone (patches 1-6 and 8), what Megatron needs to run on CPU at all;
  * `apply()` (`Platform("cpu").adapt_megatron`): the routing plus the CPU speed-ups (patches 9 and 10).
    With MCORE_RL_CPU_ADAPT=routing it applies the routing alone: the GPU rehearsal (docs/gpu-smoke.md) then
    runs what a CUDA process runs, torch.compile'd fusions and the forking checkpoint writer included.

Every patch is one of two kinds, both CPU-only: a CUDA or NPU process never gets them.
  device routing - the call names the CUDA device, a CPU process has none (an NPU process gets the same
      routing from torch_npu's transfer_to_npu, which MindSpeed's adaptor imports);
  CPU speed-up - upstream's path works on CPU, only slower; on a device it is the path that must be measured.
A patch for a missing or broken LIBRARY is neither: it belongs to mcore_rl.compat, keyed on the library,
applied on every platform by `compat.megatron.apply_shims()` (Megatron without Transformer Engine's
`te_general_gemm`, once this module's patch 7, is such a shim: a CUDA process without TE needs it as much).
tests/test_compat.py runs a Megatron MoE forward with `route_devices()` and the compat shims alone.

Patches and why (megatron-core 0.12-0.19; docs/megatron-on-cpu.md lists the call sites each one serves):
 1. [routing] torch.cuda.current_device -> torch.device("cpu"): used as a `device=` argument by rotary
    embedding, MoE router, tensor-parallel layers/mappings, grad buffers, p2p communication, mbridge.
 2. [routing] torch.cuda.synchronize -> no-op: p2p communication waits on the device; CPU ops are synchronous.
 3. [routing] torch.cuda.Stream / current_stream / default_stream / stream / Event -> inert stand-ins: the
    alltoall token dispatcher overlaps device-to-host copies on a side stream.
 4. [routing] torch.cuda.get_rng_state / set_rng_state / manual_seed and Megatron's
    `_get_cuda_rng_state` / `_set_cuda_rng_state` -> the CPU generator: Megatron's RNG tracker
    (tensor/expert-parallel seeds, dropout forks) keeps per-region CUDA states. Megatron then logs a
    benign "CPU RNG state changed within GPU RNG context" warning: both states are one generator.
 5. [routing] Tensor factories (tensor, zeros, ones, empty, full, arange, *_like, rand*) given device="cuda"
    (or an int index) -> CPU, and pin_memory=True dropped: literal device='cuda' in the optimizer
    loss scale, grad clipping, schedules, grad buffers, dist-checkpointing exchange; pinned memory
    needs an accelerator allocator. Tensor.cuda / Module.cuda return the object unchanged.
 6. [routing] Asserts of `p.type() == 'torch.cuda.FloatTensor'` (grad clipping, fp16/bf16 optimizer,
    distributed optimizer): those three functions run with Tensor.type() reporting the CUDA type name
    of CPU tensors; nothing else sees that.
 7. (moved to compat.megatron: the `te_general_gemm` shim, megatron-core >= 0.13 without Transformer Engine.)
 8. [routing] The alltoall dispatcher converts split sizes to numpy only for CUDA tensors (`tensor.is_cuda`);
    on CPU they stay tensors and all_to_all_single rejects them: convert CPU tensors too when numpy is asked
    for. Keyed on the tensors' device, not on a library: on CUDA (and on NPU under transfer_to_npu) they
    are device tensors and upstream converts them itself.
 9. [speed-up] Megatron decorates its fusion kernels with `torch.compile` (megatron.core.jit.jit_fuser) as its
    modules are imported; each decoration imports TorchDynamo and Inductor, about 1.2 s of every process's
    start-up (3.5 s on a loaded 2-core machine). While megatron.core is first imported, torch.compile is the
    identity, and jit_fuser stays the identity for modules imported later: such a function (the MoE router's
    `_apply_expert_bias` runs on every forward from 0.16) runs eagerly with the same arithmetic.
10. [speed-up] dist-checkpointing's writer (FileSystemWriterAsync) hands each save to a multiprocessing Manager
    queue, started with the "spawn" method at a process's first save (a fresh interpreter, ~1 s of a 2-core
    machine's start-up of the tiny demo), and forks one process per write bucket on every save, to overlap
    large GPU-to-file writes. On CPU the tensors are already in host memory: the buckets are written in this
    process, one after the other, by the same function (same files, same bytes), the results in a plain queue.
    Only where that save runs the writes in the calling process (megatron-core 0.16; 0.12 forks a caller for
    every save, compat.megatron.sync_save_writes_here): elsewhere nothing is changed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from mcore_rl.compat import megatron as compat_megatron

logger = logging.getLogger(__name__)

_MARK = "_mcore_rl_cpu_patch"  # set on every replacement: makes apply() idempotent

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


def _is_patched(fn) -> bool:
    return getattr(fn, _MARK, False)


def _mark(fn):
    setattr(fn, _MARK, True)
    return fn


def _set(owner, name: str, replacement) -> None:
    """Replace owner.name once; a second apply() finds the mark and leaves it alone."""
    current = getattr(owner, name, None)
    if current is not None and _is_patched(current):
        return
    setattr(owner, name, _mark(replacement))


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA device in torch
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


class _InertStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _InertStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, _InertStream)

    def __hash__(self):
        return 0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "current_device", lambda: torch.device("cpu"))
    _set(cuda, "synchronize", lambda *args, **kwargs: None)
    _set(cuda, "Stream", type("Stream", (_InertStream,), {}))
    _set(cuda, "Event", type("Event", (_InertStream,), {}))
    _set(cuda, "current_stream", lambda *args, **kwargs: _InertStream())
    _set(cuda, "default_stream", lambda *args, **kwargs: _InertStream())
    _set(cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
    _set(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    # The CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    _set(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)) and None)
    _set(cuda.random, "get_rng_state", cuda.get_rng_state)
    _set(cuda.random, "set_rng_state", cuda.set_rng_state)


def _patch_factories() -> None:
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not _is_patched(fn):
            _set(torch, name, _cpu_factory(fn))
    _set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    _set(torch.nn.Module, "cuda", lambda self, *args, **kwargs: self)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, `t.type()` (no arguments) names CPU float tensors like CUDA ones."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _identity_compile(model=None, **unused):
    """torch.compile's two call forms (decorator with or without arguments) without compiling."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def _eager_jit_fuser():
    """torch.compile as the identity for the duration (patch 9)."""
    compile_fn = torch.compile
    torch.compile = _identity_compile
    try:
        yield
    finally:
        torch.compile = compile_fn


def _import_megatron_eager() -> None:
    import sys

    if "megatron.core" not in sys.modules:
        with _eager_jit_fuser():
            import megatron.core  # noqa: F401
    from megatron.core import jit

    jit.jit_fuser = _identity_compile


def _patch_megatron_devices() -> None:
    """Megatron's own CUDA call sites (patches 4, 6 and 8)."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mc_optimizer
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _set(mc_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _set(mc_random, "_set_cuda_rng_state", lambda new_state, *args, **kwargs: torch.set_rng_state(new_state))

    clip = clip_grads.clip_grad_by_total_norm_fp32
    if not _is_patched(clip):
        clip = _with_cuda_type_names(clip)
        _set(clip_grads, "clip_grad_by_total_norm_fp32", clip)
    if hasattr(mc_optimizer, "clip_grad_by_total_norm_fp32"):  # imported by name there
        _set(mc_optimizer, "clip_grad_by_total_norm_fp32", clip)

    f16 = mc_optimizer.Float16OptimizerWithFloat16Params
    if not _is_patched(f16.__init__):
        _set(f16, "__init__", _with_cuda_type_names(f16.__init__))
    dist = distrib_optimizer.DistributedOptimizer
    build = dist.__dict__["_build_model_and_main_param_groups"]
    if not _is_patched(build.__func__):  # a classmethod (0.16) or staticmethod (older): keep the kind
        dist._build_model_and_main_param_groups = type(build)(_mark(_with_cuda_type_names(build.__func__)))

    move = moe_utils.maybe_move_tensor_to_cpu
    if not _is_patched(move):

        def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
            if torch.is_tensor(tensor) and as_numpy:
                return tensor.detach().cpu().numpy()
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        _set(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        _set(token_dispatcher, "maybe_move_tensor_to_cpu", moe_utils.maybe_move_tensor_to_cpu)


def _write_buckets_in_process(*args) -> None:
    """FileSystemWriterAsync.write_preloaded_data_multiproc's contract without processes (patch 10): its arguments
    are (transform_list, [use_msc (megatron-core >= 0.14)], rank, write_buckets, results_queue); every bucket
    goes through write_preloaded_data, and the results queue gets {bucket index: results} or the first error."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    transform_list, *middle, _rank, write_buckets, results_queue = args
    kwargs = {"use_msc": True} if middle and middle[0] else {}
    local, done = queue.Queue(), queue.Queue()
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        done.put(i)  # write_preloaded_data takes it back (task_done) when the bucket is written
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, done, True, **kwargs)
        index, written = local.get()
        if isinstance(written, Exception):
            results = written
            break
        results[index] = written
    results_queue.put(results)


def _results_queue():
    """A fresh queue per writer (one writer per save) in place of the Manager's (patch 10)."""
    import queue

    return queue.Queue()


def _patch_checkpoint_writer() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not compat_megatron.sync_save_writes_here():
        return

    _set(filesystem_async, "_get_write_results_queue", _results_queue)
    writer = filesystem_async.FileSystemWriterAsync
    if not _is_patched(writer.__dict__["write_preloaded_data_multiproc"].__func__):
        writer.write_preloaded_data_multiproc = staticmethod(_mark(_write_buckets_in_process))


def _refuse_cuda() -> None:
    if torch.cuda.is_available():
        raise RuntimeError("cpu_adapt is for CPU-only runs but CUDA is available; use platform 'cuda'")


def route_devices() -> None:
    """The device routing alone (patches 1-6 and 8): what Megatron needs to run on CPU at all, no speed-up.
    With `compat.megatron.apply_shims()` a CPU process then runs what a CUDA process without Transformer
    Engine runs. Safe to call any number of times."""
    _refuse_cuda()
    _patch_torch_cuda()
    _patch_factories()
    _patch_megatron_devices()


# "all" (default): routing and speed-ups; "routing": the routing alone (the GPU rehearsal, docs/gpu-smoke.md)
MODE_ENV = "MCORE_RL_CPU_ADAPT"
_MODES = ("all", "routing")


def mode() -> str:
    """The adaptation `apply()` makes, from MCORE_RL_CPU_ADAPT (unset: "all")."""
    value = os.environ.get(MODE_ENV, "all") or "all"
    if value not in _MODES:
        raise ValueError(f"{MODE_ENV}={value!r} is not one of {', '.join(_MODES)}: unset it or pick one")
    return value


def apply() -> None:
    """Adapt torch.cuda and Megatron-Core to run on CPU: the routing, and unless MCORE_RL_CPU_ADAPT=routing the
    CPU speed-ups. Safe to call any number of times."""
    _refuse_cuda()
    speedups = mode() == "all"
    if speedups:
        _import_megatron_eager()  # patch 9 first: it only helps before anything imports megatron.core
    route_devices()
    if speedups:
        _patch_checkpoint_writer()
