"""Who holds the device in a colocated run: the actor (training) or the rollout engine (rollout).

One object owns the hand-over between the two, so the trainer states which phase it needs instead of moving memory
itself (docs/memory.md, "Offload around rollout"). The phases:

  ROLLOUT   the engine awake with the actor's weights; with actor.offload the actor's state on the host.
  TRAINING  the actor's state on the device; the engine behind the actor (asleep since the rollout, or awake after a
            checkpoint was loaded into the actor without offload): a sync comes before it generates again.
  HANDOVER  inside `handover()`: the engine's weights awake and being written from the actor.
  CLOSED    after `close()`: the engine is gone.

The transitions:

  ROLLOUT -> TRAINING         ensure(TRAINING): the engine sleeps; with offload the actor's state comes back, bit for bit.
  TRAINING -> ROLLOUT         ensure(ROLLOUT): the sync the trainer gave (a `handover()` around the weight transfer).
  TRAINING | ROLLOUT -> HANDOVER -> ROLLOUT
                              handover(): with offload the two-phase wake - TRAINING first, the engine's weights, the
                              transfer (the block), the actor's state to the host, then the engine's KV cache; without
                              offload one wake of everything before the transfer. From ROLLOUT it is a re-sync.
  any -> CLOSED               close().

Every wake comes after `Platform.release_cache`: the blocks torch's allocator still caches from the training peak are
not usable by the engine's allocator (vLLM's sleep mode maps new memory). Anything else - a phase asked for in the
middle of a hand-over, or after close - raises ColocationError.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import TYPE_CHECKING, Callable, Iterator

from mcore_rl.rollout.base import KV_CACHE, WEIGHTS

if TYPE_CHECKING:
    from mcore_rl.megatron.actor import Actor
    from mcore_rl.platform import Platform
    from mcore_rl.rollout.base import RolloutEngine
    from mcore_rl.weight_sync.verify import ProbeBatch

log = logging.getLogger("mcore_rl.colocation")


class Phase(enum.Enum):
    TRAINING = "training"
    ROLLOUT = "rollout"
    HANDOVER = "handover"
    CLOSED = "closed"


class ColocationError(RuntimeError):
    """A phase asked for where it cannot be reached: a bug in the caller, not in the run's input."""


class Colocation:
    """The device between the actor and the rollout engine (see the module docstring for the phases).

    `sync` brings the engine up to the actor's weights (the trainer's sync, which runs `handover()`); `offload` is
    actor.offload: whether the actor's state leaves the device while the engine generates."""

    def __init__(
        self,
        actor: Actor,
        engine: RolloutEngine,
        platform: Platform,
        offload: bool,
        sync: Callable[[], object],
        phase: Phase = Phase.ROLLOUT,
    ):
        self.actor, self.engine, self.platform = actor, engine, platform
        self.offload = offload
        self._sync = sync
        self._phase = phase
        self._offload_logged = False

    @classmethod
    def start(
        cls,
        actor: Actor,
        platform: Platform,
        offload: bool,
        build_engine: Callable[[], RolloutEngine],
        sync: Callable[[], object],
        **kwargs,
    ) -> Colocation:
        """Build the engine with the device as the rollout phase has it, and start in ROLLOUT: the engine awake with
        the same Hugging Face weights the actor started from (a resume loads into the actor, `weights_replaced`).
        vLLM sizes its KV cache once, at start-up, from what the process holds then (vLLM-Ascend: from the
        allocator's peak after its own reset, which counts every live tensor): with offload the actor is not there."""
        if offload:
            actor.offload()
            platform.reset_peak_memory_stats()
        return cls(actor, build_engine(), platform, offload, sync, **kwargs)

    @property
    def phase(self) -> Phase:
        return self._phase

    def _refuse(self, what: str, *allowed: Phase) -> None:
        if self._phase not in allowed:
            raise ColocationError(
                f"{what} in the {self._phase.value} phase: only from {' or '.join(p.value for p in allowed)}"
                + (" (a weight sync into the engine did not finish)" if self._phase is Phase.HANDOVER else "")
            )

    def ensure(self, phase: Phase) -> None:
        """Be in `phase` (TRAINING or ROLLOUT), moving the device over if the run is not there already."""
        if phase is Phase.TRAINING:
            self._to_training()
        elif phase is Phase.ROLLOUT:
            self._refuse("ensure(rollout)", Phase.TRAINING, Phase.ROLLOUT)
            if self._phase is not Phase.ROLLOUT:
                self._sync()
                if self._phase is not Phase.ROLLOUT:
                    raise ColocationError("the sync given to Colocation did not hand over (it must run handover())")
        else:
            raise ColocationError(f"ensure({phase.value}): only training or rollout can be asked for")

    def _to_training(self) -> None:
        self._refuse("ensure(training)", Phase.TRAINING, Phase.ROLLOUT)
        if self._phase is Phase.ROLLOUT:
            self.engine.sleep()  # a no-op where the engine cannot sleep
            if self.offload:
                self.actor.reload()
            self._phase = Phase.TRAINING

    def ensure_actor_state(self) -> None:
        """The actor's state on the device (a checkpoint, a load, an export): with offload that is the training
        phase; without it the state never leaves the device and the engine stays as it is."""
        self._refuse("the actor's state asked for", Phase.TRAINING, Phase.ROLLOUT)
        if self.offload:
            self._to_training()

    def weights_replaced(self) -> None:
        """The actor's weights changed outside an update (a checkpoint loaded into it): the engine is behind, and the
        next ensure(ROLLOUT) syncs. Nothing moves."""
        self._refuse("weights_replaced", Phase.TRAINING, Phase.ROLLOUT)
        self._phase = Phase.TRAINING

    @contextlib.contextmanager
    def handover(self) -> Iterator[Colocation]:
        """The engine's wake around the weight transfer in the block, ending in ROLLOUT. An error in the block leaves
        the hand-over unfinished: every later phase change refuses."""
        self._refuse("handover", Phase.TRAINING, Phase.ROLLOUT)
        if self.offload:
            self._to_training()  # the engine asleep, the actor on the device (already so after an update)
        self._wake([WEIGHTS] if self.offload else None)  # colocated engines slept during the update
        self._phase = Phase.HANDOVER
        yield self
        if self.offload:
            self._actor_to_host()
            self._wake([KV_CACHE])
        self._phase = Phase.ROLLOUT

    def _wake(self, tags) -> None:
        """Wake the engine's `tags` (None: all) after releasing torch's cached blocks (Platform.release_cache)."""
        self.platform.release_cache()
        self.engine.wake_up(tags)

    def _actor_to_host(self) -> None:
        released = self.actor.offload()
        if not self._offload_logged:
            log.info(
                "actor.offload: %.1f MiB of the actor's device state released for rollout (%.1f MiB copied to the "
                "host; gradients are not copied)",
                released / 2**20,
                self.actor.host_bytes / 2**20,
            )
            self._offload_logged = True

    def actor_reads(self, probe: ProbeBatch) -> tuple[Callable, Callable]:
        """(reference log-probs, fresh export) of the actor for the sync's verification, valid after the hand-over:
        with offload the log-probs of `probe` are taken now, while the actor's state is on the device, and the
        export (the rebuild fallback's) brings the state back for its pass. Inside `handover()` only."""
        self._refuse("actor_reads", Phase.HANDOVER)
        if not self.offload:
            return self.actor.probe_log_probs, self.actor.export_hf_weights
        probe_lp = self.actor.probe_log_probs(probe.sequences, probe.prompt_lens, probe.temperature)
        return (lambda *_: probe_lp), self._export_on_device

    def _export_on_device(self):
        with self.actor.resident():
            yield from self.actor.export_hf_weights()

    def close(self) -> None:
        """Release the engine (before the process groups go away); every later phase change refuses."""
        self._refuse("close", Phase.TRAINING, Phase.ROLLOUT)
        self.engine.close()
        self._phase = Phase.CLOSED
