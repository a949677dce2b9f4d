"""A loss that raises on its first use, in the rank's process (algo.loss='tests.failing_loss:FailsOnPurpose'):
the pre-flight accepts it (a PolicyLoss), so the failure is a worker's crash, for the launchers' last line."""

from mcore_rl.algos.losses import LossInputs, PolicyLoss, TokenLoss

MESSAGE = "this loss fails on purpose"


class FailsOnPurpose(PolicyLoss):
    def token_loss(self, x: LossInputs) -> TokenLoss:
        raise ValueError(MESSAGE)
