"""GRPO: PPO-clip on each token's ratio exp(log pi_theta - log pi_old)."""

from __future__ import annotations

import torch

from mcore_rl.algos.losses.base import LossInputs, PolicyLoss, TokenLoss, token_log_ratio
from mcore_rl.algos.losses.clip import ppo_clip


class Grpo(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        return ppo_clip(torch.exp(token_log_ratio(x.log_prob, x.old_log_prob)), x.advantages, self.algo)
