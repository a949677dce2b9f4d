"""Guards that keep a bad step from reaching the weights, the checkpoints or the export.

* SkipCounter: counts optimizer steps skipped for a non-finite loss / gradient norm (the skip itself
  is decided in mcore_rl.compat.megatron_optim.guarded_step, the same on every rank) and stops the
  run after `max_consecutive` skips in a row.
* first_non_finite / check_weights_finite: a checkpoint or a Hugging Face export is never written
  from weights that hold NaN or inf.
* check_reward_errors: a reward function that fails on more than a set fraction of a batch stops the
  run, with its first exception shown.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    from pathlib import Path

    import torch

log = logging.getLogger(__name__)


class TrainingHalted(RuntimeError):
    """The run cannot continue safely; the message says why and what was kept."""


class StopRequested(TrainingHalted):
    """SIGTERM / SIGINT asked the run to stop; it did, at a step boundary (not an error of the run).
    `signum`: the signal (0 for the stop file), for the launcher's exit status 128 + signum."""

    def __init__(self, message: str, signum: int = 0):
        super().__init__(message)
        self.signum = signum

    @classmethod
    def between_steps(cls, by: str, step: int, newest: Optional[Path]) -> StopRequested:
        """The stop StopSignals.agreed() asked for (`by`: the signal's name or the stop file), after `step`;
        `newest`: the newest checkpoint's path, if any."""
        import signal

        return cls(
            f"stopped by {by} after step {step}; newest checkpoint: {newest or 'none'}; continue with "
            "checkpoint.resume=auto",
            signum=signal.Signals[by].value if by in signal.Signals.__members__ else 0,
        )

    @classmethod
    def at_once(cls, step: Optional[int], newest: Optional[Path]) -> StopRequested:
        """The stop line for Ctrl-C twice (Interrupted), with the step it cut short (None: while the run started)."""
        import signal

        where = f"after step {step}" if step is not None else "while the run started"
        return cls(
            f"stopped at once by a second SIGINT {where} (a checkpoint being written is not published); newest "
            f"checkpoint: {newest or 'none'}; continue with checkpoint.resume=auto",
            signum=signal.SIGINT,
        )


@dataclass
class SkipCounter:
    """Skipped optimizer steps: in total and in a row. `record` raises after `max_consecutive` in a row."""

    max_consecutive: int
    total: int = 0
    in_a_row: int = 0

    def record(self, applied: list[bool], step: int) -> None:
        """`applied`: the optimizer steps of training step `step` in order (one per mini-batch and epoch)."""
        for ok in applied:
            self.in_a_row = 0 if ok else self.in_a_row + 1
        skipped = applied.count(False)
        self.total += skipped
        if skipped:
            log.warning(
                "step %d: %d optimizer step(s) skipped (loss or gradient norm NaN/inf); %d in a row, %d in total",
                step,
                skipped,
                self.in_a_row,
                self.total,
            )
        if self.in_a_row >= self.max_consecutive:
            raise TrainingHalted(
                f"{self.in_a_row} optimizer steps in a row were skipped because the loss or the gradient norm "
                f"was NaN/inf (trainer.max_consecutive_skips = {self.max_consecutive}); the weights were not "
                f"changed by them and the last checkpoint is intact: look for the cause (rewards, learning rate, "
                f"data) and resume, or raise trainer.max_consecutive_skips"
            )

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """Name of the first tensor holding NaN or inf, or None."""
    import torch  # here: the reward worker imports this module for Interrupted, and must start fast

    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def check_weights_finite(
    named: Iterable[tuple[str, torch.Tensor]], what: str, group=None, fix: Optional[str] = None
) -> None:
    """Collective over `group` (default: the whole job): raises TrainingHalted on every rank when any
    rank's tensors hold NaN/inf, naming the first bad one, so nothing non-finite is used or written.
    `fix` replaces the message's advice (which is about a run whose updates diverged)."""
    import torch.distributed as dist  # torch only here: importing safety loads none (the CLI, the pre-flight)

    from mcore_rl.platform import collectives

    bad = first_non_finite(named)
    found = [bad] if bad is not None else []
    if dist.is_available() and dist.is_initialized():
        if collectives.any_true(bad is not None, group=group):  # rare: collect the names for the message
            names = [None] * dist.get_world_size(group)
            dist.all_gather_object(names, bad, group=group)
            found = [n for n in names if n is not None]
    if found:
        fix = fix or (
            "nothing is written from them and the previous checkpoint is kept: resume from it with a lower "
            "actor.optim.lr (or fix what made the weights diverge)"
        )
        raise TrainingHalted(f"{what}: the weights hold NaN/inf (first: {found[0]}); {fix}")


def reward_errors_stop(errors: int, total: int, max_rate: float) -> bool:
    """Whether `errors` failed rewards of `total` stop the run: more than `max_rate` of them, or all of them
    (whatever reward.max_error_rate allows, a step needs one scored sample)."""
    return errors / max(1, total) > max_rate or (total > 0 and errors == total)


def check_reward_errors(errors: int, total: int, first_error: Optional[str], max_rate: float, step: int) -> None:
    """Stop when more than `max_rate` of a batch's rewards failed (the same counts on every rank)."""
    rate = errors / max(1, total)
    if rate > max_rate:
        raise TrainingHalted(
            f"step {step}: the reward function failed on {errors} of {total} samples ({rate:.0%} > "
            f"reward.max_error_rate = {max_rate:.0%}); first error: {first_error}; fix the reward function "
            f"(or raise reward.max_error_rate)"
        )
    if total and errors == total:
        raise TrainingHalted(
            f"step {step}: the reward function failed on all {total} samples, so there is nothing to train on "
            f"(reward.max_error_rate = {max_rate:.0%}); first error: {first_error}; fix the reward function"
        )


STOP_FILE = "STOP"  # RUN_DIR/STOP: asks a run to stop like SIGTERM (what the Ray launcher writes)
_STOP_FILE_CODE = 1000  # above every signal number


class Interrupted(KeyboardInterrupt):
    """A second SIGINT (Ctrl-C twice): stop at once. A checkpoint being written is not published (the newest
    complete one stays the newest); raised by StopSignals' handler, so it is told apart from a
    KeyboardInterrupt that a reward function raises."""


class StopSignals:
    """SIGTERM / SIGINT, or a file RUN_DIR/STOP, ask the run to stop at the next safe point instead of
    killing it where it is.

    The handler only records the signal; the trainer asks `agreed()` (collective) between steps, so
    a checkpoint being written is finished and published first, and every rank stops at the same step.
    A second SIGINT (Ctrl-C twice) stops at once: `at_once()` when given (the trainer's: it says so and ends the
    process - an exception raised from a signal handler can surface inside an interpreter hook, a fork handler
    or a weakref callback, which prints a traceback and swallows it), else it raises Interrupted. A process
    forked from this one (a checkpoint writer) just exits. In a thread other than the main one (some launchers
    run the trainer there) signal handlers cannot be set: only the file works."""

    def __init__(self, stop_file=None, at_once: Optional[Callable[[], None]] = None):
        self.received: int = 0
        self.stop_file = stop_file
        self.at_once = at_once
        self.pid = os.getpid()

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        self.pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        if self.received and signum == signal.SIGINT:
            if os.getpid() != self.pid:  # a forked helper: its parent decides what is kept
                os._exit(128 + signum)
            if self.at_once is not None:
                self.at_once()
            raise Interrupted
        self.received = self.received or signum
        log.warning("received %s: stopping after the current step", signal.Signals(signum).name)

    def ignore(self) -> None:
        """The run is over (finished or stopping): later signals have nothing left to stop, and a KeyboardInterrupt
        in the interpreter's exit handlers would only print tracebacks."""
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)

    def agreed(self, also: int = 0) -> Optional[str]:
        """Collective: the signal's name when any rank received one (then every rank stops), else None. `also`: a
        signal that a process outside this group received (the separate placement's rollout ranks)."""
        import signal

        import torch.distributed as dist  # as in check_weights_finite: safety is imported without torch

        from mcore_rl.platform import collectives

        received = self.received or also
        if not received and self.stop_file is not None and os.path.exists(self.stop_file):
            received = _STOP_FILE_CODE
        if dist.is_available() and dist.is_initialized():
            (received,) = collectives.max_ints([int(received)])
        if received == _STOP_FILE_CODE:
            return str(self.stop_file)
        return signal.Signals(received).name if received else None
