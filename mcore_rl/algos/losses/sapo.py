"""SAPO: a soft gate instead of a hard clip (options algo.tau_pos, algo.tau_neg); nothing is clipped."""

from __future__ import annotations

import torch

from mcore_rl.algos.losses.base import LossInputs, PolicyLoss, TokenLoss, token_log_ratio


class Sapo(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        ratio = torch.exp(token_log_ratio(x.log_prob, x.old_log_prob))
        tau_pos, tau_neg = (torch.tensor(t, dtype=ratio.dtype) for t in (self.algo.tau_pos, self.algo.tau_neg))
        tau = torch.where(x.advantages > 0, tau_pos, tau_neg)  # built in ratio's dtype: no float32 rounding
        # gradient weight sech^2(tau (r - 1) / 2)
        gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
        return TokenLoss(-gate * x.advantages)
