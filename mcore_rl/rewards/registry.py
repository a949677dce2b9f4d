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
from mcore_rl.safety import Interrupted

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Any, Optional[str], Optional[dict]], float]

BUILTIN_REWARDS = {
    "task": "mcore_rl.rewards.task:score",
    "math": "mcore_rl.rewards.math:score",
}
# Built-ins that cannot hang or take the process down: our own string comparisons over one response (at most
# rollout.max_new_tokens tokens), microseconds a sample. They run in the trainer whatever reward.timeout_s says: a
# worker would add nothing but a process start at the first step and a pipe round trip every batch.
BOUNDED_REWARDS = frozenset({"task"})


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


def score_items(fn: RewardFn, items: list[tuple]) -> tuple[list[float], list[bool], int, Optional[str]]:
    """fn over (response, ground_truth, data_source, extra) items: (rewards, valid, errors, first error)."""
    task, valid, errors, first_error = [], [], 0, None
    for text, truth, source, extra in items:
        try:
            task.append(check_reward_value(fn(text, truth, source, extra)))
            valid.append(True)
        except Interrupted:  # Ctrl-C twice (mcore_rl.safety.StopSignals): stop the run, not this call
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # counted; the sample is left out of its group
            # and of the loss (a KeyboardInterrupt that the function raises itself is its failure, not a stop
            # request; a sys.exit() in it would end the trainer with status 0 and no checkpoint, timeout_s = 0)
            errors += 1
            if first_error is None:
                what = (
                    f"SystemExit: it called sys.exit({e.code!r})"
                    if isinstance(e, SystemExit)
                    else f"{type(e).__name__}: {e}"
                )
                first_error = f"{what} (on response {text[:80]!r})"
            task.append(0.0)
            valid.append(False)
    return task, valid, errors, first_error


def _worker_main(conn, fn_spec) -> None:
    """The reward worker: resolve the function once, then score batches until the pipe closes."""
    import signal

    # A Ctrl-C reaches the trainer (which stops the run); this daemon ends with the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fn = resolve_reward_fn(fn_spec) if isinstance(fn_spec, str) else fn_spec
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        conn.send(score_items(fn, items))


class RewardWorker:
    """One child process that runs the reward function, so a call that never returns can be given up
    on: after `timeout_s` the child is killed (math-verify's own timeout uses SIGALRM, which only works
    in a main thread, so a thread would not do) and a fresh one serves the next batch. A daemon with
    a pipe: it ends with the trainer, also when the trainer is killed (the pipe closes)."""

    def __init__(self, fn_spec: str | RewardFn, timeout_s: float):
        self.fn_spec, self.timeout_s = fn_spec, timeout_s
        self._proc = self._conn = None

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # the trainer holds threads and process groups: never fork it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child, self.fn_spec), daemon=True, name="mcore-rl-reward")
        self._proc.start()
        child.close()

    def start(self) -> None:
        """The worker process started (again, when it died), if it is not running."""
        if self._proc is None or not self._proc.is_alive():
            self._start()

    def score(self, items: list[tuple]):
        """score_items in the worker; TimeoutError when it does not answer within timeout_s."""
        self.start()
        self._conn.send(items)
        if not self._conn.poll(self.timeout_s):
            self.close()
            raise TimeoutError(f"the reward function did not return within reward.timeout_s = {self.timeout_s:g} s")
        try:
            return self._conn.recv()
        except EOFError:
            code = self._proc.exitcode if self._proc is not None else None
            self.close()
            raise RuntimeError(f"the reward worker process died (exit code {code})") from None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None


class RewardScorer:
    """Scores responses with one reward function plus the optional overlong penalty.

    With timeout_s > 0 the function runs in a RewardWorker process and a batch that takes longer counts
    every sample as a reward error (the message says so); timeout_s = 0 runs it in this process, and so do the
    built-ins of BOUNDED_REWARDS always (nothing to time out). Errors are counted the same way in both places."""

    def __init__(
        self,
        fn: str | RewardFn,
        max_new_tokens: int,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        timeout_s: float = 0.0,
    ):
        self.fn = resolve_reward_fn(fn) if isinstance(fn, str) else fn
        in_process = timeout_s <= 0 or (isinstance(fn, str) and fn in BOUNDED_REWARDS)
        self.worker = None if in_process else RewardWorker(fn, timeout_s)
        self.overlong = (
            OverlongPenalty(max_new_tokens, overlong_buffer, overlong_penalty) if overlong_buffer > 0 else None
        )

    @classmethod
    def from_config(cls, reward_cfg, max_new_tokens: int) -> "RewardScorer":
        """From a `config.RewardConfig` and `rollout.max_new_tokens`."""
        return cls(
            reward_cfg.fn, max_new_tokens, reward_cfg.overlong_buffer, reward_cfg.overlong_penalty, reward_cfg.timeout_s
        )

    def start(self) -> None:
        """Start the worker process now (timeout_s > 0): the trainer calls this before it builds the model, so the
        worker's interpreter starts meanwhile instead of inside the first step's scoring."""
        if self.worker is not None:
            self.worker.start()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _score(self, items: list[tuple]):
        if self.worker is None:
            return score_items(self.fn, items)
        try:
            return self.worker.score(items)
        except (TimeoutError, RuntimeError) as e:
            n = len(items)
            return [0.0] * n, [False] * n, n, f"{type(e).__name__}: {e} (batch of {n})"

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
        task, valid, errors, first_error = self._score(list(zip(responses, ground_truths, data_sources, extras)))
        if first_error is not None:
            log.warning(
                "reward function failed on %d of %d samples; first: %s (those samples are left out)",
                errors,
                n,
                first_error,
            )
        penalties = [self.overlong(l) for l in response_lengths] if self.overlong is not None else [0.0] * n
        rewards = [r + p if ok else 0.0 for r, p, ok in zip(task, penalties, valid)]
        return RewardBatch(rewards, task, errors, first_error, penalties, valid)
