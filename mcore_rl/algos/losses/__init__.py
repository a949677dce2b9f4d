"""Policy-gradient losses as registered classes: one file per loss (grpo, gspo, gspo_token, sapo).

Adding a loss: a `PolicyLoss` subclass in its own file here, and one line in `mcore_rl.algo_config.LOSSES` (the
registry: config validation takes the allowed names and the loss's option checks from it); or, outside the
package, algo.loss='package.module:Class'. See docs/architecture.md, "Adding a loss".
"""

from mcore_rl.algos.losses.base import LossInputs, PolicyLoss, TokenLoss, build_loss

__all__ = ["LossInputs", "PolicyLoss", "TokenLoss", "build_loss"]
