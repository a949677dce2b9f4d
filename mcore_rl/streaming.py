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

Groups are whole when they are sent (a step's rounds, dynamic sampling's included, finish before it is queued).

**Several replicas (`rollout.ranks` > 1, the embedded engine) take every session together** (`Agreement`). A session
is a sequence of broadcasts on the bridge that every rollout rank joins, and a round ends in collectives over the
rollout ranks (the rewards' exchange, the samples' gather): a replica that read the doorbell on its own would sit in
the session's broadcast while another, its share done, sat in the gather - a deadlock. So between every two decode
steps every rollout rank joins one tick: a MAX all-reduce over the rollout ranks' own group of [the sessions the
leader read rung, whether this rank still generates]. All serve a session when the leader saw it rung (the same
tick on every rank); a replica whose share is done keeps ticking, idle (serving the sessions that come), until no
replica generates, and only then does the round's gather run. The cost: one all-reduce of two integers per decode
step (and per idle tick), and one store read per tick on the leader alone (docs/async.md). Inside a session no rank
ticks (its validation generates too, on every replica).

What the rollout leader is doing can be seen from outside the job in RUN_DIR/rollout_status.json (`RolloutStatus`):
generating which step under which weights, waiting for which session, or interrupted: samples paused mid-generation
while a session is served.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from mcore_rl.generation import StepGenerator
from mcore_rl.platform import collectives
from mcore_rl.run_dir.layout import write_atomic
from mcore_rl.separate import RecordingRounds, RolloutWorker, StepSamples

STATUS_FILE = "rollout_status.json"  # RUN_DIR/rollout_status.json: RolloutStatus, written by the rollout leader


@dataclass
class RolloutStatus:
    """What the streaming rollout rank is doing, for whoever watches the run (`cat RUN_DIR/rollout_status.json`):
    the file is replaced whole at each change of state, a few times a step and never per decode step, without
    fsync (a view of the present, not a record: after a crash it shows where the rank was)."""

    path: Optional[Path]  # None: this rank does not write it (only the rollout leader does)
    state: str = "starting"  # generating | waiting (admission or the queue) | interrupted | serving | done
    step: int = 0  # the step being generated (waiting: the next one to generate; after the last step: the last)
    version: int = 0  # the weights the engine holds (interrupted: those of the tokens generated so far)
    session: Optional[int] = None  # interrupted / serving / waiting: the version whose session is awaited or served
    in_flight: int = 0  # interrupted: the samples paused mid-generation (serving: none were in flight)
    interruptions: int = 0  # weight updates that landed mid-generation, since this process started
    interrupted_samples: int = 0  # the samples they paused (rollout/interrupted_samples summed)
    queued_steps: int = 0  # finished steps waiting for their session

    def update(self, **changes) -> None:
        for name, value in changes.items():
            setattr(self, name, value)
        if self.path is None:
            return
        fields = {k: v for k, v in asdict(self).items() if k != "path"}
        text = json.dumps({**fields, "pid": os.getpid(), "time": time.time()}) + "\n"
        write_atomic(self.path, text, durable=False)


class Agreement:
    """Where the rollout ranks take a session (the module docstring): one tick between every two decode steps of
    every replica, and idle ticks (`settle`) of a replica whose share is done until no replica generates."""

    def __init__(self, bridge, leads: bool, served: Callable[[], int], take: Callable[[Any], None]):
        self.bridge, self.leads = bridge, leads
        self.served = served  # the sessions this rank has served (the resume's and admission's included)
        self.take = take  # serves the session rung; its argument: the generation in flight here, None when idle
        self.ticks = 0

    def between_steps(self, generation) -> None:
        """The engine's hook: `generation`, this replica's, is between two decode steps."""
        self._tick(generation)

    def settle(self) -> None:
        """EngineRounds' hook: this replica's share is done; tick with the others until none generates (the
        round's collectives come next)."""
        while self._tick(None):
            pass

    def _tick(self, generation) -> bool:
        """One MAX all-reduce of [the sessions the leader read rung, whether this rank generates]: every rank takes
        the session rung at the same tick. Whether any replica still generates."""
        rung = self.bridge.rung() if self.leads else 0
        rung, generating = collectives.max_ints([rung, int(generation is not None)])
        self.ticks += 1
        if rung > self.served():
            self.take(generation)
        return generating > 0


class StreamingWorker(RolloutWorker):
    """A rollout rank that never waits for the actor except where admission says so (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.engine.capabilities.interruptible:
            raise RuntimeError(f"rollout.streaming needs an interruptible engine; {type(self.engine).__name__} is not")
        self.queue: deque[StepSamples] = deque()
        self.interrupted = 0  # samples in flight at a weight update, over the run
        self.serving = 0.0  # seconds spent serving sessions between decode steps (not generation)
        self.status = RolloutStatus(Path(self.cfg.trainer.run_dir) / STATUS_FILE if self._leads else None)
        self.agreement = Agreement(self.bridge, self._leads, lambda: self.served, self._between_steps)

    def _steps(self, first: int, generator: StepGenerator, recorder: RecordingRounds) -> None:
        steps = self.cfg.trainer.steps
        self._ticking(True)
        try:
            for step in range(first, steps + 1):
                self.status.step = step
                self._serve_until(step - 1 - self.staleness)  # admission
                self.engine.weights_version = self.synced
                self.status.update(state="generating", step=step, version=self.synced, session=None)
                self.queue.append(self._generate(generator, recorder, step))
                self._deliver()
        finally:
            self._ticking(False)
        self._serve_until(steps)
        self.status.update(state="done", version=self.synced, session=None)

    def _ticking(self, on: bool) -> None:
        """The agreement's ticks between decode steps and after this replica's share (off inside a session)."""
        self.engine.between_steps = self.agreement.between_steps if on else None
        self.source.settle = self.agreement.settle if on else None

    def _serve_until(self, version: int) -> None:
        """Serve sessions until the weights of `version`, sending each step a session made due at once (the actor
        waits for it before its next session)."""
        while self.synced < version:
            self.status.update(state="waiting", version=self.synced, session=self.synced + 1)
            super()._serve_until(self.synced + 1)
            self._deliver()

    def _deliver(self) -> None:
        while self.queue and self.queue[0].step - 1 <= self.synced:
            samples = self.queue.popleft()
            samples.extra["rollout/queued_steps"] = len(self.queue)
            begin = time.perf_counter()
            self.bridge.object(samples, from_actor=False)
            self.waited += time.perf_counter() - begin
        self.status.queued_steps = len(self.queue)

    def _between_steps(self, generation) -> None:
        """A session rung, agreed at a tick: served now, and the in-flight samples (`generation`; None where this
        replica's share is done) continue under its weights."""
        begin = time.perf_counter()
        paused = generation.in_flight if generation is not None else 0
        self.status.update(state="interrupted" if paused else "serving", session=self.synced + 1, in_flight=paused)
        self._ticking(False)  # a session's validation generates too
        try:
            super()._serve_until(self.synced + 1)
            self._deliver()
        finally:
            self._ticking(True)
        self.engine.weights_version = self.synced
        if generation is not None:
            before = generation.interrupted
            generation.weights_changed(self.synced)
            self.interrupted += generation.interrupted - before
        self.status.update(
            state="generating",
            version=self.synced,
            session=None,
            in_flight=0,
            interruptions=self.status.interruptions + bool(paused),
            interrupted_samples=self.interrupted,
        )
        self.serving += time.perf_counter() - begin

    def _generate(self, generator: StepGenerator, recorder: RecordingRounds, step: int) -> StepSamples:
        interrupted, serving = self.interrupted, self.serving
        samples = super()._generate(generator, recorder, step)
        samples.generate_seconds -= self.serving - serving  # serving counts as the engine's wait (waited)
        (samples.extra["rollout/interrupted_samples"],) = collectives.sum_ints([self.interrupted - interrupted])
        return samples
