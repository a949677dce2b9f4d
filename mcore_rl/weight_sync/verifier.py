"""The verification of a run's syncs as one object: the probe it scores, the tolerance, the fallback, when a sync is
verified (rollout.verify_every), and the calibration at the initial weights. `WeightSync` (sync.py) owns it; the
comparisons themselves are verify.py's."""

from __future__ import annotations

import logging
from typing import Callable

from mcore_rl.weight_sync.verify import (
    ProbeBatch,
    SyncVerificationError,
    default_tolerance,
    log_prob_gap,
    shared_probe,
    verify_due,
    verify_sync,
)

log = logging.getLogger(__name__)


class SyncVerifier:
    """Engine vs actor after a sync (log-probs of a probe, the sync's fingerprints; outside the tolerance an error or
    the rebuild), and the run's calibration: the gap at the initial weights on the first step's own sequences.

    `rollout`: the config's rollout section; `release` (Platform.release_cache) runs before a rebuild."""

    def __init__(self, rollout, dtype: str, vocab_size: int, seed: int, rank: int, release: Callable[[], None]):
        self.tolerance = default_tolerance(dtype, rollout.verify_tolerance, rollout.verify_high_tolerance)
        self.fallback = rollout.verify_fallback
        self.every = rollout.verify_every
        self.rank, self.release = rank, release
        # T = 1: the check is about weights, and engines score T = 1 cheapest (vLLM: no full-vocab fetch).
        self.probe = ProbeBatch.random(vocab_size, seed=seed)
        self._calibration_scores: "list | None" = None  # the engine's, until the actor scores the same probe

    def due(self, sync_count: int) -> bool:
        """Whether sync number `sync_count` (1-based) is verified."""
        return verify_due(sync_count, self.every)

    def after_rollout(self, step: int, groups: list, engine_scores: Callable[[ProbeBatch], list]) -> None:
        """Step `step + 1` rolled out (`groups`: its first round's): the probe of the next verified sync from its own
        sequences (not random ids); on the first step the engine's scores of it, while the engine is awake with the
        initial weights (`engine_scores`: Placement.probe_scores)."""
        if step == 0 or self.due(step + 1):
            self.probe = shared_probe(groups, self.probe)
        if step == 0:
            self._calibration_scores = engine_scores(self.probe)

    def calibration(self, actor_log_probs: Callable) -> dict:
        """The calibration's metrics once the actor can score (its state on the device); {} on other steps. Above
        the tolerance every verification would fail: a warning says so."""
        scored, self._calibration_scores = self._calibration_scores, None
        if scored is None:
            return {}
        probe, tol = self.probe, self.tolerance
        gap = log_prob_gap(scored, actor_log_probs(probe.sequences, probe.prompt_lens, probe.temperature), tol.quantile)
        if self.rank == 0 and not gap.within(tol):  # within: the metrics carry it (no line on the first screen)
            log.warning(
                "sync calibration (initial weights, %d rollout tokens): engine vs actor log-probs mean %.3g, q%g %.3g "
                "above the tolerance %g / %g before any update: raise rollout.verify_tolerance / "
                "rollout.verify_high_tolerance above this gap, or every verification fails",
                gap.count,
                gap.mean,
                tol.quantile,
                gap.high,
                tol.mean,
                tol.high,
            )
        return {
            "sync/calibration_mean_diff": gap.mean,
            "sync/calibration_high_diff": gap.high,
            "sync/calibration_max_diff": gap.worst,
        }

    def verify(
        self, engine, reference: Callable, export_fn: Callable, fingerprints: dict, step: int, where: str = ""
    ) -> dict:
        """Verify the sync just done (`reference`, `export_fn`: the actor's reads, Placement.actor_reads; `step`: the
        steps trained before it; `where`: whose engine, for the error - Placement.engine_label); its metrics. The
        report is logged on rebuilds and over the first syncs."""
        try:
            report = verify_sync(
                engine,
                reference,
                self.probe,
                self.tolerance,
                fallback=self.fallback,
                export_fn=export_fn,
                fingerprints=fingerprints,
                release=self.release,  # a rebuild maps memory beside the awake engine
            )
        except SyncVerificationError as e:
            if not where:
                raise
            raise SyncVerificationError(f"{where}, at step {step + 1}: {e}") from None
        if self.rank == 0 and (report.rebuilt or step <= self.every):
            log.info(report.summary())
        return {
            "sync/verify_max_diff": report.max_diff,
            "sync/verify_mean_diff": report.mean_diff,
            "sync/verify_high_diff": report.high_diff,
            "sync/verify_weights_differ": float(report.weights.differ if report.weights else 0),
            "sync/rebuilt": float(report.rebuilt),
        }
