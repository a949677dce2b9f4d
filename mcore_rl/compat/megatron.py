"""megatron-core version differences (supported: 0.12.1 - 0.16.x; see docs/versions.md).

API differences (chosen by the installed version):
  * `vp_stage` in model building (`get_gpt_decoder_block_spec`, `is_pipeline_*_stage`): from 0.13.
    0.12 builds the current virtual stage only, so virtual pipeline stages need >= 0.13
    (`layout_problem` rejects them before any process starts).
  * `TransformerConfig` fields: `moe_router_fusion` exists from 0.14. A fusion flag the installed
    version does not know is a fusion it cannot switch on, so `known_config_fields` drops it.
  * optimizer `sharded_state_dict(..., metadata=...)` (`optimizer_sharded_state_dict`): 0.12 takes no
    `metadata` (its distributed optimizer's default sharding is `fully_sharded_model_space`); 0.13/0.14 know
    `fully_sharded_model_space` but not `fully_reshardable` (0.15+; "Unknown sharding_type" otherwise);
    `chained_optim_avoid_prefix` exists from 0.14. Without it the chained optimizers' state is keyed
    `chained_<i>.`; that still matches across layouts because every layout chains the same two optimizers
    (dense + expert: models/bridge.py marks experts in every layout).

The output layer (`output_hidden_states`, `output_weight`): the actor computes log-probs from the last hidden
states and the output weight (mcore_rl.megatron.logprobs.fused_output_log_probs), so the last stage's
`GPTModel.forward` must stop before the output projection. 0.12.1 and 0.16.1 both call
`self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=...)` (a ColumnParallelLinear)
with `output_weight` the shared embedding's weight for tied models (else None: the layer's own), then, without
labels, return `output.transpose(0, 1).contiguous()`. `output_hidden_states` makes that one call return the
layer's input, with the tensor-parallel region op the layer itself applies to it (sequence parallel: all-gather
of the sequence in forward, reduce-scatter of the gradient in backward; else identity forward, all-reduce
backward), so the model returns [b, s, h] instead of [b, s, V/tp]. `output_weight` is the tensor the layer
would multiply by; its gradient reaches the same parameter (and DDP's buffer, and for tied weights the
embedding all-reduce between the first and last stage) as the layer's own backward would give it.

  * where a plain `dist_checkpointing.save` writes (`sync_save_writes_here`): 0.16's
    `AsyncSaveShardedStrategy.save` runs the writer's function in the calling process (`execute_sync`); 0.12's
    schedules it on a forked caller process (`TemporalAsyncCaller`), so an in-process queue for its results
    would stay empty in the parent.

Upstream defects worked around (`apply_shims`, called once per process before Megatron is used):
  * `_write_item` (megatron-core < 0.13 with torch >= 2.8): torch 2.8 added a required `serialization_format`
    argument to `torch.distributed.checkpoint.filesystem._write_item`; megatron-core 0.12's
    `FileSystemWriterAsync` calls it without, so every dist-checkpoint save fails. The shim passes
    `SerializationFormat.TORCH_SAVE` (the value 0.13 passes) to the name bound in megatron's module only.
    MindSpeed 2.2.0_core_r0.12.1 does not patch this (it replaces `preload_tensors` only).
  * `fp8 quantize without TE` (megatron-core < 0.13 without Transformer Engine): the distributed optimizer
    calls `quantize_param_shard` on every step, and 0.12's fallback raises "Invalid Transformer Engine
    version for FP8 distributed optimizer" even when no parameter is fp8. The shim returns early when
    there are no fp8 parameters and calls the original otherwise. MindSpeed 2.2.0_core_r0.12.1 replaces
    `quantize_param_shard` itself (a warning-only function); then the bound function is not megatron's
    own and the shim is not installed, so the two never stack.
  * `np.product` (megatron-core < 0.16 with numpy >= 2): dist_checkpointing (`mapping`, `validation`,
    `exchange_utils`) calls `np.product`, removed in numpy 2; distributed-optimizer checkpoints fail.
    The shim gives those three modules a numpy namespace that also has `product` (= `numpy.prod`);
    numpy itself is not changed. Ascend images with numpy 1.26 never need it.
  * `te_general_gemm` (megatron-core >= 0.13 without Transformer Engine, on every platform): `moe_utils` binds
    `te_general_gemm` only inside `try: import transformer_engine` (0.16.1 lines 22-39), but
    `RouterGatingLinearFunction.forward` / `backward` read it unguarded (`if te_general_gemm is not None`, 0.16.1
    lines 1192 / 1225), and `TopKRouter.gating` calls it on every MoE forward: `NameError: name
    'te_general_gemm' is not defined` on CUDA without TE (the GPU smoke machine) as on CPU. Read in the 0.13.1,
    0.14.0, 0.15.0 and 0.16.1 wheels; 0.12.1 has no such name. The shim binds it to None in `moe_utils`, so the
    plain torch matmul path runs (what the guard meant); with TE installed the name exists and nothing changes.

Which library each shim is keyed on, never the device: a platform without the library gets the shim (the CPU
adaptation, mcore_rl/platform/cpu_adapt.py, holds device routing and CPU speed-ups only; its docstring says why).

Left behind by `parallel_state.destroy_model_parallel` (`destroy_model_parallel` clears them too):
  * the embedding / position-embedding groups' rank lists: `initialize_model_parallel` sets them only on ranks
    inside such a group, and 0.12.1 clears neither (0.16.1 clears the position-embedding one), so after a
    layout change a rank outside the new groups still counts as inside (a later stage of PP2 after PP1:
    `finalize_model_grads` asks for the position-embedding group, "not initialized").

Defect rejected instead (`layout_problem`, run by the layout pre-flight):
  * megatron-core < 0.13 with tp > 1, ep = 1, etp = 1 and sequence parallel: the experts' row-parallel
    linear reduce-scatters its output over the dense TP group although the experts are not split over it
    (gloo aborts on a size mismatch; on devices the result would be silently wrong). Fixed in 0.13.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import types
from typing import Optional

from packaging.version import Version

from mcore_rl.compat import Shim, at_least, installed_version

_DISTRIBUTION = "megatron-core"
_NUMPY_PRODUCT_MODULES = (
    "megatron.core.dist_checkpointing.mapping",
    "megatron.core.dist_checkpointing.validation",
    "megatron.core.dist_checkpointing.exchange_utils",
)


def version() -> Optional[Version]:
    """The installed megatron-core version (None when absent)."""
    return installed_version(_DISTRIBUTION)


def _before(v: str) -> bool:
    return installed_version(_DISTRIBUTION) is not None and not at_least(_DISTRIBUTION, v)


# ---- model building ------------------------------------------------------------------------------


def builds_with_vp_stage() -> bool:
    """Model building takes `vp_stage` (megatron-core >= 0.13)."""
    return at_least(_DISTRIBUTION, "0.13")


def sync_save_writes_here() -> bool:
    """Whether dist_checkpointing.save (the sync path) runs the file writes in the calling process."""
    from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

    return "execute_sync" in inspect.getsource(AsyncSaveShardedStrategy.save)


@functools.lru_cache(maxsize=None)
def _transformer_config_fields() -> frozenset[str]:
    from megatron.core.transformer import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def known_config_fields(flags: dict) -> dict:
    """`flags` without the entries the installed `TransformerConfig` has no field for (e.g. moe_router_fusion
    before 0.14). Only for switches whose absence means "off"."""
    fields = _transformer_config_fields()
    return {k: v for k, v in flags.items() if k in fields}


# ---- layout --------------------------------------------------------------------------------------


def layout_problem(
    tp: int, ep: int, etp: int, sequence_parallel: bool, virtual_pp: Optional[int], moe: bool = True
) -> Optional[str]:
    """Why the installed megatron-core cannot run this layout (one line naming the fix), or None.
    `moe`: the model has expert layers (the expert rule does not apply to a dense model)."""
    v = version()
    if v is None or v >= Version("0.13"):
        return None
    if moe and tp > 1 and ep == 1 and etp == 1 and sequence_parallel:
        return (
            f"tp = {tp} with ep = 1, etp = 1 and sequence parallel is wrong on megatron-core {v} (< 0.13): the experts "
            f"reduce-scatter their output over the TP group they are not split over; set actor.parallel.etp = {tp}, "
            f"or ep > 1, or upgrade megatron-core to >= 0.13"
        )
    if virtual_pp is not None:
        return (
            f"virtual_pp = {virtual_pp} needs megatron-core >= 0.13 (vp_stage-aware model building; installed {v}): "
            f"unset actor.parallel.virtual_pp or upgrade megatron-core"
        )
    return None


# ---- the output layer -----------------------------------------------------------------------------


def gpt_model(chunk):
    """The GPTModel inside DDP / Float16Module wrappers (a model chunk as the actor holds it)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder") and not hasattr(chunk, "embedding"):
        chunk = chunk.module
    return chunk


def destroy_model_parallel() -> None:
    """Megatron's process groups gone (torch.distributed stays), with the rank lists it leaves (module docstring)."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    mpu._EMBEDDING_GLOBAL_RANKS = None
    mpu._POSITION_EMBEDDING_GLOBAL_RANKS = None


def drop_received_activations(chunks) -> None:
    """Forget the activation the pipeline schedule last handed each chunk's decoder (`set_input_tensor`, kept
    after the schedule returns on every stage but the first). Same call on 0.12.1 and 0.16.1."""
    for chunk in chunks:
        gpt_model(chunk).set_input_tensor(None)


def output_weight(model):
    """The weight the last stage's output layer multiplies by: this rank's [V/tp, h] vocabulary shard (the
    shared embedding's weight for tied models). None on other pipeline stages."""
    gpt = gpt_model(model)
    if not getattr(gpt, "post_process", False):
        return None
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _hidden_instead_of_logits(layer, expected_weight):
    """A forward for the output layer `layer` that returns its input as the projection would see it (and
    checks that the weight the model passes is `expected_weight`, the one the loss will use)."""
    from megatron.core.tensor_parallel import mappings

    if getattr(layer, "gather_output", False):
        raise ValueError(
            "the output layer gathers its output over TP (parallel_output=False): build the model "
            "with parallel_output=True (the actor computes vocabulary-parallel log-probs)"
        )
    group = getattr(layer, "tp_group", None)  # 0.16 keeps its group; 0.12 uses the global TP group
    extra = {} if group is None else {"group": group}

    def forward(input_, weight=None, runtime_gather_output=None):
        if (layer.weight if weight is None else weight) is not expected_weight:
            raise RuntimeError("the output layer was called with another weight than output_weight() found")
        if layer.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, **extra
            ), None
        return mappings.copy_to_tensor_model_parallel_region(input_, **extra), None

    return forward


@contextlib.contextmanager
def output_hidden_states(model):
    """While active, `model(...)` (a GPTModel, possibly wrapped) returns on the last pipeline stage the last
    hidden states [b, s, h] (after the final norm, gathered over sequence parallel) instead of the logits;
    yields `output_weight(model)` (None on other stages, where nothing changes). See the module docstring."""
    gpt = gpt_model(model)
    weight = output_weight(gpt)
    if weight is None:
        yield None
        return
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("multi-token prediction layers call the output layer too: build the model without them")
    layer = gpt.output_layer
    layer.forward = _hidden_instead_of_logits(layer, weight)  # instance attribute: shadows the class's forward
    try:
        yield weight
    finally:
        del layer.forward


# ---- optimizer checkpoint ------------------------------------------------------------------------


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    """The optimizer's sharded state dict, keyed by parameter and reshardable across DP sizes where the
    installed version allows it (see the module docstring)."""
    if _before("0.13"):
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)
    metadata = {
        "distrib_optim_sharding_type": "fully_reshardable"
        if at_least(_DISTRIBUTION, "0.15")
        else "fully_sharded_model_space"
    }
    if at_least(_DISTRIBUTION, "0.14"):
        metadata["chained_optim_avoid_prefix"] = True
    # Gather the distributed optimizer's state over DP with gloo into DP rank 0's HOST memory; the default
    # gathers each whole gradient buffer in fp32 on the device of every rank (~29 GiB per NPU for
    # Qwen3-30B-A3B at TP4 EP4), the peak of a checkpoint save in the memory plan. Versions that do not
    # know the flag ignore it (it is read with metadata.get).
    metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)


# ---- upstream defect shims -----------------------------------------------------------------------


def _write_item_needs_format() -> bool:
    from torch.distributed.checkpoint import filesystem

    param = inspect.signature(filesystem._write_item).parameters.get("serialization_format")
    return param is not None and param.default is inspect.Parameter.empty


def _numpy_lacks_product() -> bool:
    import numpy

    return not hasattr(numpy, "product")


def _te_absent() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


_SHIMS = types.MappingProxyType(
    {
        "write_item": Shim(
            "write_item serialization_format",
            "megatron-core < 0.13 with torch >= 2.8",
            "dist-checkpoint saves call torch's _write_item without its new serialization_format argument",
        ),
        "fp8": Shim(
            "fp8 quantize without TE",
            "megatron-core < 0.13 without Transformer Engine",
            "the distributed optimizer's step raises 'Invalid Transformer Engine version' even with no fp8 parameter",
        ),
        "np_product": Shim(
            "np.product",
            "megatron-core < 0.16 with numpy >= 2",
            "dist_checkpointing calls np.product, removed in numpy 2 (distributed-optimizer checkpoints)",
        ),
        "te_general_gemm": Shim(
            "te_general_gemm without TE",
            "megatron-core >= 0.13 without Transformer Engine",
            "the MoE router's gating reads te_general_gemm, bound only when TE imports (NameError on every forward)",
        ),
    }
)


def _needed() -> dict[str, bool]:
    return {
        "write_item": _before("0.13") and _write_item_needs_format(),
        "fp8": _before("0.13") and _te_absent(),
        "np_product": _before("0.16") and _numpy_lacks_product(),
        "te_general_gemm": at_least(_DISTRIBUTION, "0.13") and _te_absent(),
    }


def shims() -> list[Shim]:
    """The upstream-defect shims `apply_shims` installs for the installed versions."""
    return [_SHIMS[key] for key, needed in _needed().items() if needed]


def _is_shim(fn) -> bool:
    return getattr(fn, "_mcore_rl_compat_shim", False)


def _mark(fn):
    fn._mcore_rl_compat_shim = True
    return fn


def _shim_write_item() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    original = filesystem_async._write_item
    if _is_shim(original):
        return

    @functools.wraps(original)
    def write_item(*args, **kwargs):
        kwargs.setdefault("serialization_format", SerializationFormat.TORCH_SAVE)
        return original(*args, **kwargs)

    filesystem_async._write_item = _mark(write_item)


def _shim_fp8_quantize() -> None:
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer.quantize_param_shard
    if (
        _is_shim(original)
        or original is not fp8_utils.quantize_param_shard
        or original.__module__ != fp8_utils.__name__
    ):
        return  # already shimmed, or replaced by someone else (MindSpeed): do not stack

    @functools.wraps(original)
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None  # no fp8 parameter: nothing to quantize (what megatron-core 0.13 does)
        return original(model_params, *args, **kwargs)

    distrib_optimizer.quantize_param_shard = _mark(quantize_param_shard)


class _NumpyWithProduct(types.ModuleType):
    """numpy, plus the `product` alias numpy 2 removed; everything else is looked up on numpy itself."""

    def __init__(self, numpy_module):
        super().__init__("numpy")
        self._numpy = numpy_module
        self.product = numpy_module.prod
        self._mcore_rl_compat_shim = True

    def __getattr__(self, name):
        return getattr(self._numpy, name)


def _shim_numpy_product() -> None:
    import numpy

    for name in _NUMPY_PRODUCT_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "np", None) is numpy:
            module.np = _NumpyWithProduct(numpy)


def _shim_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # TE imported after all, or set already: leave it
        moe_utils.te_general_gemm = None


def apply_shims() -> None:
    """Install the upstream-defect shims the installed versions need (see the module docstring).
    Idempotent; call once per process before Megatron builds models or checkpoints."""
    needed = _needed()
    if needed["write_item"]:
        _shim_write_item()
    if needed["fp8"]:
        _shim_fp8_quantize()
    if needed["np_product"]:
        _shim_numpy_product()
    if needed["te_general_gemm"]:
        _shim_te_general_gemm()
