"""A loss defined outside the package, for the tests that register one (algo.loss='tests.reinforce_loss:Reinforce').

Plain REINFORCE: l = -A * log pi_theta per token (no ratio, no clip). Its flag `reinforce_tokens` (1 on every
valid token) is logged as train/reinforce_tokens, so a run shows it trained with this loss."""

import torch

from mcore_rl.algos.losses import LossInputs, PolicyLoss, TokenLoss


class Reinforce(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        return TokenLoss(-x.advantages * x.log_prob, {"reinforce_tokens": torch.ones_like(x.mask)})


class NotALoss:
    """Named as algo.loss in a test: refused, it is no PolicyLoss."""
