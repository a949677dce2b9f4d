"""Where megatron-core keeps an actor's device state, for moving it to the host and back (actor.offload).

Read in megatron-core 0.12.1 and 0.16.1 (docs/memory.md, "Offload around rollout"):

* `DistributedDataParallel.buffers` and `.expert_parallel_buffers` (both versions): lists of
  `_ParamAndGradBuffer`, each with `grad_data` (the flat gradient buffer; every parameter's `main_grad` is a
  view into it) and `param_data` (the flat parameter buffer, allocated only with the distributed optimizer:
  then every parameter's `.data` is a view into it; None otherwise, and the parameters own their storages).
  0.16.1 adds `shared_buffer` (one buffer serving both, for MXFP8 parameters only; never built here) and its
  own `offload_to_cpu` / `reload_from_cpu`, which 0.12.1 lacks, so neither is used: the storages are moved
  by `mcore_rl.megatron.offload` the same way on both versions.
* The DDP wrapper shadows `nn.Module.buffers()` with that list attribute, so module buffers are read with
  `nn.Module.buffers(chunk)`.
* Optimizers: `ChainedOptimizer.chained_optimizers` (dense + expert) in both versions; each Megatron
  optimizer wraps a torch optimizer in `.optimizer` whose `param_groups` hold the parameters the update works
  on - the fp32 main parameters (`DistributedOptimizer.shard_fp32_from_float16_groups`,
  `Float16OptimizerWithFloat16Params.fp32_from_float16_groups`), or for fp32 models the model parameters /
  their shards (views of the model's storages) - and whose `state` holds Adam's `exp_avg` / `exp_avg_sq`
  (and `step`). The main parameters' `.grad` (fp32 copies of the gradient shard, or views of the gradient
  buffer) are gradients. Megatron's HybridDeviceOptimizer (`optimizer_offload_fraction`) keeps `state` and
  `param_groups` in the same places, with its host part already on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DeviceState:
    """Tensors of an actor by what their content means between two training steps."""

    kept: list[torch.Tensor] = field(default_factory=list)  # parameters, optimizer state: must come back as is
    gradients: list[torch.Tensor] = field(default_factory=list)  # zeroed before they are read again


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def ddp_buffers(chunk) -> list:
    """DDP's `_ParamAndGradBuffer`s of a model chunk (dense + expert); none for a chunk without DDP (whose
    `buffers` is nn.Module's method)."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            found.extend(value)
    return found


def model_state(chunks, into: DeviceState) -> DeviceState:
    """Parameters, module buffers and DDP's flat parameter / gradient buffers of `chunks` (DDP-wrapped or not)."""
    for chunk in chunks:
        for buffer in ddp_buffers(chunk):
            if getattr(buffer, "param_data", None) is not None:
                into.kept.append(buffer.param_data)
            if getattr(buffer, "grad_data", None) is not None:
                into.gradients.append(buffer.grad_data)
        for param in chunk.parameters():
            into.kept.append(param.data)
            for grad in (getattr(param, "main_grad", None), param.grad):
                if grad is not None:
                    into.gradients.append(grad)
        into.kept.extend(torch.nn.Module.buffers(chunk))
    return into


def optimizer_state(optimizer, into: DeviceState) -> DeviceState:
    """Main parameters, their gradients and the state tensors of a Megatron optimizer (chained or not)."""
    if optimizer is None:
        return into
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:  # a stub optimizer (a rank without parameters of that kind)
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                into.kept.append(param.data)
                if param.grad is not None:
                    into.gradients.append(param.grad)
        for state in inner.state.values():
            into.kept.extend(v for v in state.values() if torch.is_tensor(v))
    return into


def actor_state(chunks, optimizer) -> DeviceState:
    """Everything an actor keeps between steps: the model's and the optimizer's tensors."""
    return optimizer_state(optimizer, model_state(chunks, DeviceState()))
