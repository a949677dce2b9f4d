"""PPO-clip on a ratio, shared by grpo, gspo and gspo_token (options algo.clip_low, clip_high, dual_clip).

Clip-boundary convention: a token counts as clipped only when strictly outside the trust region
(r > 1 + clip_high with A > 0, r < 1 - clip_low with A < 0, r > dual_clip with A < 0); exactly on the
boundary the unclipped gradient flows. (The loss is continuous there; this picks the one-sided
derivative from inside the region.)
"""

from __future__ import annotations

import torch

from mcore_rl.algo_config import AlgoConfig
from mcore_rl.algos.losses.base import TokenLoss


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, algo: AlgoConfig) -> TokenLoss:
    """PPO-clip with separate low/high clip and optional dual clip; flags: clipfrac_upper / _lower, dual_clipfrac."""
    upper = (adv > 0) & (ratio > 1.0 + algo.clip_high)
    lower = (adv < 0) & (ratio < 1.0 - algo.clip_low)
    clipped_ratio = ratio.clamp(1.0 - algo.clip_low, 1.0 + algo.clip_high).detach()
    loss = torch.where(upper | lower, -adv * clipped_ratio, -adv * ratio)
    dual = torch.zeros_like(upper)
    if algo.dual_clip is not None:
        # for A < 0 a huge ratio would give an unbounded loss: cap it at -c A (no gradient)
        dual = (adv < 0) & (ratio > algo.dual_clip)
        loss = torch.where(dual, -adv * algo.dual_clip, loss)
    return TokenLoss(loss, {"clipfrac_upper": upper, "clipfrac_lower": lower, "dual_clipfrac": dual})
