"""GRPO outcome advantages: each response is scored against the other responses to the same prompt."""

from __future__ import annotations

import torch

ADV_ESTIMATORS = ("grpo", "drgrpo")


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages from rewards laid out as consecutive groups of `group_size`.

    grpo: (R - mean_group) / (std_group + eps); drgrpo: R - mean_group (no std division).
    A group of one response, or one whose rewards are all equal, carries no signal: its advantages are 0.
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
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        # unbiased std like torch.std; undefined for a group of one, which has no signal anyway
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    # exact zeros for groups without signal (all equal rewards, or a single response)
    no_signal = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values
    return torch.where(no_signal, torch.zeros_like(centred), centred).view_as(rewards)
