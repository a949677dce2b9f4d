"""One optimizer step that is skipped on every rank when the gradients are not finite.

Megatron's `optimizer.step()` skips a step only when its grad scaler found inf/NaN. In fp32 and bf16
runs there is no grad scaler (found-inf is never checked, `update_successful` is always True), and a
NaN or infinite gradient norm makes the clip coefficient NaN, so the update is applied. `guarded_step`
runs the same stages as `step()` on megatron-core 0.12 and 0.16 (the three stage methods have the same
meaning in both):

    prepare_grads()           copy grads to the main grads; fp16: unscale and Megatron's found-inf check
    get_grad_norm()           the global gradient norm (reduced over the gradient-statistics group:
                              model-parallel ranks, plus data-parallel ranks for the distributed
                              optimizer), so every rank sees the same value and takes the same decision
    clip + step_with_ready_grads()   only when the norm is finite

The norm is computed once, as `step()` would, and is used for both the decision and the clipping.
The one difference between the versions is the name of the config flag that says whether the
gradients live in `decoupled_grad` (precision-aware optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepOutcome:
    applied: bool  # False: the optimizer step was skipped (non-finite gradients or found-inf)
    grad_norm: float  # global norm before clipping; NaN when Megatron's found-inf check tripped first


def uses_decoupled_grad(config) -> bool:
    """megatron-core >= 0.13 names the flag use_precision_aware_optimizer_no_fp8_or_ds_fp8; 0.12 has only
    use_precision_aware_optimizer (same meaning there)."""
    flag = getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", None)
    if flag is None:
        flag = getattr(config, "use_precision_aware_optimizer", False)
    return bool(flag)


def _clip(optimizer, grad_norm: float) -> None:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm, uses_decoupled_grad(opt.config))


def guarded_step(optimizer) -> StepOutcome:
    """Collective like optimizer.step(): every rank calls it; the decision is the same on every rank."""
    import torch

    with torch.no_grad():
        if optimizer.prepare_grads():  # Megatron's own found-inf check (fp16 grad scaler)
            return StepOutcome(False, float("nan"))
        grad_norm = float(optimizer.get_grad_norm() or 0.0)
        if not math.isfinite(grad_norm):
            return StepOutcome(False, grad_norm)
        _clip(optimizer, grad_norm)
        return StepOutcome(bool(optimizer.step_with_ready_grads()), grad_norm)
