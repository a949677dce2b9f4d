"""Where rollout runs relative to the actor: the one seam between the loop and the placement (rollout.placement).

The trainer's step is one loop for both placements; what differs lives behind `Placement`:

  who holds the device     colocated: `Colocation` moves it between engine and actor (phases, offload, wakes);
                           separate: each role holds its own devices (the phase calls are no-ops)
  how weights reach the    colocated: the export written into this rank's engine (weight_sync/: the device path
  engine                   and the CPU plug-ins); separate: the export streamed to every rollout replica over the
                           bridge (mcore_rl.separate.RemoteEngine, weight_sync/bridge.py; platform/split.py)
  when the next step's     colocated: when the step asks for them (`rounds`: this rank's engine);
  generation starts        separate: on the rollout ranks, while the actor trains (rollout.max_staleness 1), or
                           after the sync (0); `begin_step` takes the step's samples off the bridge

docs/architecture.md ("One step") draws both; docs/placement.md has the objective and the resume rule.
"""

from __future__ import annotations

import abc
import contextlib
from collections import Counter
from typing import TYPE_CHECKING

from mcore_rl.colocation import Colocation, Phase
from mcore_rl.generation import EngineRounds, RoundSource, validation_reward

if TYPE_CHECKING:
    from mcore_rl.weight_sync.verify import ProbeBatch

__all__ = ["ColocatedPlacement", "Phase", "Placement", "staleness_metrics", "token_staleness"]


def staleness_metrics(staleness: int) -> dict:
    """Weight versions between the trained tokens' behaviour policy (the engine's weights that sampled them) and
    the update's starting weights; every token of a step has the same (one-step overlap)."""
    return {"train/staleness_max": float(staleness), "train/staleness_mean": float(staleness)}


def token_staleness(samples, step: int, bound: int) -> dict:
    """Streaming (rollout.streaming): the lag of every token of the step's samples (`StepSamples`, every round)
    behind the update's starting weights (version `step`), from each token's own version; its histogram over
    0 .. `bound` (the same keys every step). The admission rule (mcore_rl/streaming.py) keeps every lag within
    `bound`, so nothing is ever dropped; a lag beyond it is a bug, and an error rather than a silent drop."""
    lags = Counter(
        step - version
        for r in samples.rounds
        for group in r["groups"]
        for s in group
        for version in (s.token_versions or [samples.version] * len(s.response_ids))
    )
    tokens = sum(lags.values())
    if max(lags, default=0) > bound:
        raise RuntimeError(
            f"step {step + 1} got tokens {max(lags)} weight versions old, beyond rollout.max_staleness = {bound}: "
            f"the streaming admission rule failed (a bug: report it with the run's config.yaml)"
        )
    return {
        "train/staleness_max": float(max(lags, default=0)),
        "train/staleness_mean": sum(lag * n for lag, n in lags.items()) / max(tokens, 1),
        **{f"train/staleness_hist/{lag}": lags.get(lag, 0) / max(tokens, 1) for lag in range(bound + 1)},
    }


class Placement(abc.ABC):
    """What the loop asks of a placement (see the module docstring); `engine` is the engine the syncs write and
    the verification scores (None on ranks without one)."""

    engine: object
    rounds: RoundSource
    max_staleness: int
    engine_label = ""  # whose engine a failed verification names ("": this rank's own, as the launcher's line says)

    @property
    def receiver(self):
        """What a sync may write into (WeightReceiver; the same on every rank of the actor)."""
        return self.engine.capabilities.receiver

    # the device, as Colocation has it
    @abc.abstractmethod
    def ensure(self, phase: Phase) -> None: ...

    @abc.abstractmethod
    def ensure_actor_state(self) -> None: ...

    @abc.abstractmethod
    def weights_replaced(self) -> None: ...

    @abc.abstractmethod
    def handover(self) -> contextlib.AbstractContextManager: ...

    @abc.abstractmethod
    def actor_reads(self, probe: ProbeBatch): ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # the step's samples
    def begin_run(self, step: int, sampler_state: dict, unit: int) -> None:
        """After the actor is built (and a checkpoint loaded): the run starts at step `step`."""
        return None

    def begin_step(self, step: int) -> None:
        """Before step `step + 1`'s rounds are taken from `rounds`."""
        return None

    @abc.abstractmethod
    def probe_scores(self, probe: ProbeBatch) -> list:
        """The engine's log-probs of `probe` at the weights that generated the first step (the calibration)."""

    def samples_version(self, step: int) -> int:
        """The weight version that generated step `step + 1`'s samples (of the tokens without their own versions)."""
        return step

    def step_metrics(self, step: int) -> dict:
        """Staleness and per-role times of step `step + 1` (after its update)."""
        return staleness_metrics(0)

    def validation_reward(self, examples, seed: int) -> float:
        self.ensure(Phase.ROLLOUT)
        return validation_reward(self.rounds, examples, seed)

    @property
    def skips_old_pass(self) -> bool:
        """Whether the old-policy pass may be taken from the update (AlgoConfig.old_from_update): only when the
        samples come from the update's starting weights; off-policy the proximal pass always runs."""
        return self.max_staleness == 0

    def peer_stop_signal(self) -> int:
        """A SIGTERM / SIGINT that a process of another role received (0: none; colocated: no other role)."""
        return 0

    def stop(self) -> None:
        """The run stops at this step boundary (StopSignals agreed)."""
        return None

    def state_dict(self, step: int) -> dict:
        """What the checkpoint after step `step` keeps for an exact resume besides the trainer's own state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class ColocatedPlacement(Colocation, Placement):
    """Every rank generates, then trains: `Colocation` holds the device between the two."""

    max_staleness = 0

    def __init__(self, *args, rounds_args: tuple = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = EngineRounds(self.engine, *rounds_args)

    def probe_scores(self, probe: ProbeBatch) -> list:
        return self.engine.score(probe.sequences, probe.prompt_lens, probe.temperature)
