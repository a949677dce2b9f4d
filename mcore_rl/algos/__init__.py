"""RL algorithms in plain torch (no Megatron): advantages, policy losses, aggregation, KL."""

from mcore_rl.algos.advantages import group_advantages
from mcore_rl.algos.aggregation import GlobalCounts, aggregate
from mcore_rl.algos.kl import kl_estimate
from mcore_rl.algos.losses import LossInputs, PolicyLoss, build_loss
from mcore_rl.algos.objective import loglinear_proximal, policy_loss

__all__ = [
    "group_advantages",
    "GlobalCounts",
    "aggregate",
    "kl_estimate",
    "LossInputs",
    "PolicyLoss",
    "build_loss",
    "policy_loss",
    "loglinear_proximal",
]
