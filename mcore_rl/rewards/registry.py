"""Choosing a reward function by name or `module:function`, and scoring a batch without crashing.

A reward function has the signature `score(response_text, ground_truth, data_source, extra) -> float`.
Built-in names: "task" (the embedded task) and "math" (math-verify). Anything else must be
"package.module:function", imported at start-up so a typo fails before any expensive work.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mcore_rl.rewards.overlong import OverlongPenalty

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Any, Optional[str], Optional[dict]], float]

BUILTIN_REWARDS = {
    "task": "mcore_rl.rewards.task:score",
    "math": "mcore_rl.rewards.math:score",
}


def resolve_reward_fn(name: str) -> RewardFn:
    """A built-in name or "module:function" -> the callable; a clear error when it does not import."""
    target = BUILTIN_REWARDS.get(name, name)
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(
            f"reward.fn={name!r} is neither a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))}) "
            "nor 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module raising at import time
        raise ValueError(
            f"reward.fn={name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "check the module is on PYTHONPATH"
        ) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward.fn={name!r}: module {module_name!r} has no callable {fn_name!r}")
    return fn


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite number."""


def check_reward_value(value: Any) -> float:
    """The reward as a float; a RewardValueError for a non-number (a string "1.0" too) or NaN/inf.

    bool, int, float and numpy / 0-d torch scalars are numbers; nothing is parsed from text."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # numpy or torch scalar
    if not isinstance(value, numbers.Real):
        raise RewardValueError(
            f"returned {value!r} ({type(value).__name__}), not a number: return a float (no string parsing)"
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardValueError(f"returned {value}, not a finite number")
    return value


@dataclass
class RewardBatch:
    rewards: list[float]  # final rewards (task reward + overlong penalty); 0.0 where not valid
    task_rewards: list[float]  # before the overlong penalty
    errors: int = 0  # reward calls that raised or returned a non-finite / non-numeric value
    first_error: Optional[str] = None
    penalties: list[float] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)  # False: the reward failed; leave the sample out

    @property
    def error_rate(self) -> float:
        return self.errors / max(1, len(self.rewards))


class RewardScorer:
    """Scores responses with one reward function plus the optional overlong penalty."""

    def __init__(
        self, fn: str | RewardFn, max_new_tokens: int, overlong_buffer: int = 0, overlong_penalty: float = 1.0
    ):
        self.fn = resolve_reward_fn(fn) if isinstance(fn, str) else fn
        self.overlong = (
            OverlongPenalty(max_new_tokens, overlong_buffer, overlong_penalty) if overlong_buffer > 0 else None
        )

    @classmethod
    def from_config(cls, reward_cfg, max_new_tokens: int) -> "RewardScorer":
        """From a `config.RewardConfig` and `rollout.max_new_tokens`."""
        return cls(reward_cfg.fn, max_new_tokens, reward_cfg.overlong_buffer, reward_cfg.overlong_penalty)

    def __call__(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[Optional[str]],
        extras: Optional[Sequence[Optional[dict]]] = None,
        response_lengths: Optional[Sequence[int]] = None,
    ) -> RewardBatch:
        n = len(responses)
        extras = extras if extras is not None else [None] * n
        if not len(ground_truths) == len(data_sources) == len(extras) == n:
            raise ValueError(
                f"reward batch sizes differ: {n} responses, {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources, {len(extras)} extras"
            )
        if self.overlong is not None and (response_lengths is None or len(response_lengths) != n):
            raise ValueError("the overlong penalty needs response_lengths (in tokens), one per response")
        task, valid, errors, first_error = [], [], 0, None
        for text, truth, source, extra in zip(responses, ground_truths, data_sources, extras):
            try:
                task.append(check_reward_value(self.fn(text, truth, source, extra)))
                valid.append(True)
            except Exception as e:  # counted; the sample is left out of its group and of the loss
                errors += 1
                if first_error is None:
                    first_error = f"{type(e).__name__}: {e}"
                    log.warning(
                        "reward function failed on response %r: %s (sample left out; further errors only counted)",
                        text[:80],
                        first_error,
                    )
                task.append(0.0)
                valid.append(False)
        penalties = [self.overlong(l) for l in response_lengths] if self.overlong is not None else [0.0] * n
        rewards = [r + p if ok else 0.0 for r, p, ok in zip(task, penalties, valid)]
        return RewardBatch(rewards, task, errors, first_error, penalties, valid)
