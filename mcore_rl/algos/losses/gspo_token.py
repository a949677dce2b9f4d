"""GSPO-token: the sequence ratio's value with each token's own gradient, for per-token advantages."""

from __future__ import annotations

import torch

from mcore_rl.algos.losses.base import LossInputs, PolicyLoss, TokenLoss
from mcore_rl.algos.losses.clip import ppo_clip


class GspoToken(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        # value s_i, gradient through each token: lp - sg(lp) + sg(log s_i)
        log_s = x.sequence_log_ratio().detach()
        ratio = torch.exp(x.log_prob - x.log_prob.detach() + log_s)
        return ppo_clip(ratio, x.advantages, self.algo)
