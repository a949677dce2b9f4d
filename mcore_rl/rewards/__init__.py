"""Rewards: the embedded task, math-verify answers, DAPO's overlong penalty, selection by name."""

from mcore_rl.rewards.overlong import OverlongPenalty
from mcore_rl.rewards.registry import BUILTIN_REWARDS, RewardBatch, RewardScorer, resolve_reward_fn

__all__ = ["BUILTIN_REWARDS", "OverlongPenalty", "RewardBatch", "RewardScorer", "resolve_reward_fn"]
