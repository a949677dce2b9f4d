"""Save / load the actor (model + optimizer + LR scheduler + caller's extra state) with Megatron
dist-checkpointing (torch_dist format), loadable into any other TP/PP/EP/DP layout.

`save_checkpoint(actor, directory, extra)` writes into an existing or new directory; the trainer
publishes it atomically around this call. All ranks must call both functions (collective).

Traps handled here (docs/megatron-on-cpu.md records how each was found):
  * the optimizer's sharded state dict must be built with is_loading=True for loading, or the
    optimizer state silently stays as it was;
  * the distributed optimizer is saved reshardable ("fully_reshardable" from megatron-core 0.15,
    "fully_sharded_model_space" before; compat.megatron) so that a checkpoint written at one DP size loads
    at another;
  * `extra` is stored as common (rank-0) state: it must be identical on every rank;
  * loading restores the saving run's hyper-parameters (the param groups' lr, betas, eps, max_lr, and the
    scheduler's shape): this run's are put back after the load, so a resume with a changed lr uses it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from mcore_rl.compat import megatron as compat_megatron


def _model_keys(n_chunks: int) -> list[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _model_sharded_state_dict(actor) -> dict:
    chunks = [compat_megatron.gpt_model(m) for m in actor.model]
    return {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(len(chunks)), chunks)}


def _flat_model_sd(model_sd: dict) -> dict:
    # Megatron's optimizer maps params to sharded tensors over the union of all chunks.
    if len(model_sd) == 1:
        return next(iter(model_sd.values()))
    merged = {}
    for key, sd in model_sd.items():
        merged.update({f"{key}.{k}": v for k, v in sd.items()})
    return merged


def _state(actor, is_loading: bool, with_optimizer: bool) -> dict:
    model_sd = _model_sharded_state_dict(actor)
    state = dict(model_sd)
    if with_optimizer and actor.optimizer is not None:
        state["optimizer"] = compat_megatron.optimizer_sharded_state_dict(
            actor.optimizer, _flat_model_sd(model_sd), is_loading
        )
    return state


def _inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]


def _prime_adam_state(optimizer) -> None:
    """A fresh torch Adam has no per-param state, but the distributed optimizer's state_dict()
    (without Apex/TE) reads each param's `step`: create zero state so a load target exists."""
    for opt in _inner_torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p.data))
                state.setdefault("exp_avg_sq", torch.zeros_like(p.data))
                state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _unalias_steps(optimizer) -> None:
    """Loading may hand every param the SAME `step` tensor; torch Adam increments it in place per
    param, so a shared one would advance n_params times per step. Give each param its own."""
    for opt in _inner_torch_optimizers(optimizer):
        for state in opt.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _tolerate_absent_state_keys(optimizer) -> None:
    """The distributed optimizer's fully-reshardable load copies every key of a param's current
    state from the checkpoint, but it stores torch Adam's `step` separately (not per tensor): keep
    keys the checkpoint lacks as they are instead of raising KeyError. Set on the instances only."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "_get_main_param_and_optimizer_states") or getattr(opt, "_mcore_rl_tolerant", False):
            continue
        setter, getter = opt._set_main_param_and_optimizer_states, opt._get_main_param_and_optimizer_states

        def set_states(model_param, tensors, _set=setter, _get=getter):
            current = _get(model_param)
            return _set(model_param, {**{k: v for k, v in current.items() if k not in tensors}, **tensors})

        opt._set_main_param_and_optimizer_states = set_states
        opt._mcore_rl_tolerant = True


# The schedule's shape; its position (num_steps) comes from the checkpoint.
_SCHEDULE_FIELDS = (
    "init_lr",
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


def _settings(actor) -> tuple[list[dict], dict]:
    """This run's optimizer hyper-parameters (param groups without their params) and schedule shape."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in actor.optimizer.param_groups]
    schedule = {k: getattr(actor.scheduler, k) for k in _SCHEDULE_FIELDS if hasattr(actor.scheduler, k)}
    return groups, schedule


def _apply_settings(actor, settings: tuple[list[dict], dict]) -> None:
    """After a load: this run's config wins over the checkpoint's hyper-parameters (torch's and Megatron's
    loads restore lr, betas, eps, max_lr ... of the run that saved), the state (Adam moments, step count)
    stays the checkpoint's. mcore_rl.preflight.resume_changes decides which changes may reach this point."""
    groups, schedule = settings
    current = actor.optimizer.param_groups
    if len(current) == len(groups):
        for group, fresh in zip(current, groups):
            group.update(fresh)
    for key, value in schedule.items():
        setattr(actor.scheduler, key, value)
    actor.scheduler.step(increment=0)  # this step's lr and weight decay from the new shape


def save_checkpoint(actor, directory: str, extra: Optional[dict[str, Any]] = None) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = _state(actor, is_loading=False, with_optimizer=True)
    if actor.scheduler is not None:
        state["scheduler"] = actor.scheduler.state_dict()
    state["extra"] = dict(extra or {})
    dist_checkpointing.save(state, directory)
    torch.distributed.barrier()


def load_checkpoint(actor, directory: str, load_optimizer: bool = True) -> dict[str, Any]:
    """Load into `actor` (any layout); returns the `extra` dict given at save time."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory) or not os.path.exists(os.path.join(directory, "metadata.json")):
        raise FileNotFoundError(
            f"{directory} is not a Megatron dist checkpoint (no metadata.json): check checkpoint.resume"
        )
    common = dist_checkpointing.load_common_state_dict(directory)
    with_optimizer = load_optimizer and actor.optimizer is not None
    if with_optimizer and "optimizer" not in common:
        raise ValueError(
            f"{directory} holds no optimizer state (e.g. converted from HF): load it with load_optimizer=False"
        )
    settings = _settings(actor) if with_optimizer and actor.scheduler is not None else None
    if with_optimizer:
        _prime_adam_state(actor.optimizer)
        _tolerate_absent_state_keys(actor.optimizer)
    state = _state(actor, is_loading=True, with_optimizer=with_optimizer)
    loaded = dist_checkpointing.load(state, directory)
    for key, chunk in zip(_model_keys(len(actor.model)), actor.model):
        compat_megatron.gpt_model(chunk).load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        actor.optimizer.load_state_dict(loaded["optimizer"])
        _unalias_steps(actor.optimizer)
        if actor.scheduler is not None and "scheduler" in common:
            actor.scheduler.load_state_dict(common["scheduler"])
        if settings is not None:
            _apply_settings(actor, settings)
    return dict(common.get("extra", {}))
