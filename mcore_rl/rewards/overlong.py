"""DAPO's overlong reward shaping: a soft penalty for responses that run into the last `buffer` tokens.

With L = max_new_tokens and a buffer of B tokens, a response of length n gets
  0                          if n <= L - B
  -(n - (L - B)) / B * f     if L - B < n <= L   (linear from 0 to -f)
  -f                         if n > L
added to its task reward, where f is the penalty factor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OverlongPenalty:
    max_new_tokens: int
    buffer: int
    factor: float = 1.0

    def __post_init__(self):
        if not 0 < self.buffer <= self.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.buffer} must be in 1..rollout.max_new_tokens={self.max_new_tokens}"
                " (0 turns the penalty off)"
            )
        if self.factor < 0:
            raise ValueError(f"reward.overlong_penalty={self.factor} must be >= 0")

    def __call__(self, response_length: int) -> float:
        start = self.max_new_tokens - self.buffer
        if response_length <= start:
            return 0.0
        return -min(response_length - start, self.buffer) / self.buffer * self.factor
