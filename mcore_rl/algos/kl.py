"""Per-token KL estimators between the current policy and a reference policy (Schulman's k1/k2/k3)."""

from __future__ import annotations

from typing import get_args

import torch

from mcore_rl.algo_config import KlType

KL_TYPES = get_args(KlType)
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps k3 finite for any log-prob gap


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    With x = clamp(log pi_ref - log pi_theta): k1 = -x, k2 = x^2 / 2, k3 = exp(x) - x - 1 (>= 0).
    Gradients flow through log_prob only.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; use one of {KL_TYPES}")
    x = (ref_log_prob.detach() - log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kl_type == "k1":
        return -x
    if kl_type == "k2":
        return 0.5 * x * x
    return torch.exp(x) - x - 1.0
