"""GRPO outcome advantages: each response is scored against the other responses to the same prompt."""

from __future__ import annotations

from typing import Optional

import torch

ADV_ESTIMATORS = ("grpo", "drgrpo")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str = "grpo",
    eps: float = 1e-6,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-response advantages from rewards laid out as consecutive groups of `group_size`.

    grpo: (R - mean_group) / (std_group + eps); drgrpo: R - mean_group (no std division).
    A group of one response, or one whose rewards are all equal, carries no signal: its advantages are 0.
    `valid` (bool, like `rewards`) marks rewards that were scored; the others (reward errors) are left
    out of their group's mean and std and get advantage 0, so one bad reward cannot poison its group.
    Returns a tensor shaped like `rewards` (float32).
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {ADV_ESTIMATORS}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_responses], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; "
            f"pass all rollout.n responses of every prompt"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape:
        raise ValueError(
            f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}: give one flag per reward"
        )
    ok = valid.bool().view(-1, group_size)
    r = torch.where(ok, rewards.float().view(-1, group_size), torch.zeros(()))  # no NaN reaches the sums
    count = ok.sum(dim=1, keepdim=True)
    mean = r.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(ok, r - mean, torch.zeros(()))
    if estimator == "grpo":
        # unbiased std like torch.std; undefined for a group of one, which has no signal anyway
        var = centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    # exact zeros for groups without signal (all valid rewards equal, or fewer than two valid responses)
    high = torch.where(ok, r, torch.full((), -torch.inf)).max(dim=1, keepdim=True).values
    low = torch.where(ok, r, torch.full((), torch.inf)).min(dim=1, keepdim=True).values
    no_signal = (count < 2) | (high == low)
    return torch.where(no_signal | ~ok, torch.zeros_like(centred), centred).view_as(rewards)
