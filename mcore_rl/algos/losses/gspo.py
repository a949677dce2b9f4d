"""GSPO: PPO-clip on one length-normalised ratio and one (masked-mean) advantage per sequence."""

from __future__ import annotations

import torch

from mcore_rl.algos.losses.base import LossInputs, PolicyLoss, TokenLoss
from mcore_rl.algos.losses.clip import ppo_clip


class Gspo(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        seq_ratio = torch.exp(x.sequence_log_ratio())
        per_seq = ppo_clip(seq_ratio, x.masked_seq_mean(x.advantages), self.algo)
        shape = x.log_prob.shape  # [batch, 1] -> every token of its sequence
        return TokenLoss(per_seq.loss.expand(shape), {k: v.expand(shape) for k, v in per_seq.flags.items()})
