"""Streaming rollout (rollout.streaming: true, on the separate placement): the rollout rank generates step after
step without waiting for the actor, takes each new weight version between two decode steps (the in-flight samples
continue under it: partial rollout, mcore_rl/rollout/decode.py) and queues finished steps until the bridge's order
lets it send them (docs/async.md).

The bridge's order is the separate placement's (mcore_rl/separate.py): samples(k) after session k - 1. What changes
is where the rollout rank stands in it: actor rank 0 rings a doorbell (a counter in the job's store,
`Bridge.ring`) before each session, and the rollout rank, between decode steps, serves a session it sees rung,
then sends every queued step the session made due. Blocking waits remain only for admission:

- **Admission (the capacity rule)**: step k starts generating once the rollout rank holds the weights after step
  k - 1 - max_staleness. The step is trained on the weights after step k - 1, so its oldest token is at most
  max_staleness versions old; the bound holds by construction and nothing generated is wasted or dropped. With
  max_staleness 0 no weights can arrive while a step generates (the actor waits for its samples): exactly the
  synchronous separate run.
- **Queue**: at most max_staleness finished steps wait for their session; `rollout/queued_steps` is how many stood
  behind a step when it was sent.

The engine stops between decode steps where it is interruptible (`EngineCapabilities.interruptible`: the embedded
engine's `decode.Generation`, the vLLM engine's `rollout/vllm_stream.py`): `between_steps` and `weights_changed`.

Groups are whole when they are sent (a step's rounds, dynamic sampling's included, finish before it is queued);
one engine replica (the pre-flight refuses more: replicas would take a session at different decode steps while
their own collectives wait for each other).
"""

from __future__ import annotations

import time
from collections import deque

from mcore_rl.generation import StepGenerator
from mcore_rl.separate import RecordingRounds, RolloutWorker, StepSamples


class StreamingWorker(RolloutWorker):
    """A rollout rank that never waits for the actor except where admission says so (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.engine.capabilities.interruptible:
            raise RuntimeError(f"rollout.streaming needs an interruptible engine; {type(self.engine).__name__} is not")
        self.queue: deque[StepSamples] = deque()
        self.interrupted = 0  # samples in flight at a weight update, over the run
        self.serving = 0.0  # seconds spent serving sessions between decode steps (not generation)

    def _steps(self, first: int, generator: StepGenerator, recorder: RecordingRounds) -> None:
        steps = self.cfg.trainer.steps
        self.engine.between_steps = self._between_steps
        try:
            for step in range(first, steps + 1):
                self._serve_until(step - 1 - self.staleness)  # admission
                self.engine.weights_version = self.synced
                self.queue.append(self._generate(generator, recorder, step))
                self._deliver()
        finally:
            self.engine.between_steps = None
        self._serve_until(steps)

    def _serve_until(self, version: int) -> None:
        """Serve sessions until the weights of `version`, sending each step a session made due at once (the actor
        waits for it before its next session)."""
        while self.synced < version:
            super()._serve_until(self.synced + 1)
            self._deliver()

    def _deliver(self) -> None:
        while self.queue and self.queue[0].step - 1 <= self.synced:
            samples = self.queue.popleft()
            samples.extra["rollout/queued_steps"] = len(self.queue)
            begin = time.perf_counter()
            self.bridge.object(samples, from_actor=False)
            self.waited += time.perf_counter() - begin

    def _between_steps(self, generation) -> None:
        """Between two decode steps: a session rung is served now, and the in-flight samples continue under its
        weights."""
        if self.bridge.rung() <= self.served:
            return
        begin = time.perf_counter()
        self.engine.between_steps = None  # a session's validation generates too
        try:
            self._serve_until(self.synced + 1)
        finally:
            self.engine.between_steps = self._between_steps
        self.engine.weights_version = self.synced
        before = generation.interrupted
        generation.weights_changed(self.synced)
        self.interrupted += generation.interrupted - before
        self.serving += time.perf_counter() - begin

    def _generate(self, generator: StepGenerator, recorder: RecordingRounds, step: int) -> StepSamples:
        interrupted, serving = self.interrupted, self.serving
        samples = super()._generate(generator, recorder, step)
        samples.generate_seconds -= self.serving - serving  # serving counts as the engine's wait (waited)
        samples.extra["rollout/interrupted_samples"] = self.interrupted - interrupted
        return samples
