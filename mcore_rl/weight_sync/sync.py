"""A run's weight sync, actor -> engine, as one object: the export (exporter.py, its transport a plug-in the engine's
`WeightReceiver` picks), streamed in buckets into the engine (buckets.py), inside the placement's hand-over, and
verified by its `SyncVerifier` (verifier.py). The trainer calls `after_rollout`, `calibration` and `after_update`
once a step each; `sync` where the engine must catch up outside a step (a resume; Colocation's ensure(ROLLOUT))."""

from __future__ import annotations

from typing import Callable

from mcore_rl.weight_sync.buckets import sync_weights
from mcore_rl.weight_sync.verifier import SyncVerifier


class WeightSync:
    """The actor's weights into the placement's engine. `placement`: mcore_rl.placement.Placement (its `handover`,
    `receiver`, `engine`, `engine_label`, `actor_reads`, `probe_scores`); `actor`: the Megatron actor (its export
    and probe pass)."""

    def __init__(self, cfg, actor, placement, rank: int, release: Callable[[], None]):
        self.actor, self.placement = actor, placement
        self.bucket_mb = cfg.rollout.sync_bucket_mb
        vocab = actor.hf_config.vocab_size
        self.verifier = SyncVerifier(cfg.rollout, cfg.model.dtype, vocab, cfg.trainer.seed, rank, release)

    def sync(self, verify: bool, step: int) -> dict:
        """Actor weights -> engine (bucketed), verified against the actor when `verify` (`step`: the steps trained so
        far), inside the placement's hand-over (colocated: the engine's wakes around it, with offload the actor to
        the host). Returns the sync's metrics."""
        placement = self.placement
        with placement.handover():
            export = self.actor.export_hf_weights(receiver=placement.receiver)
            stats = sync_weights(export, placement.engine, self.bucket_mb, fingerprints=verify)
            if verify:  # the verification's reads of the actor, valid after its state left the device
                reference, export_fn = placement.actor_reads(self.verifier.probe)
        out = {"sync/seconds": stats.seconds, "sync/gb_per_s": stats.gb_per_s}
        if verify:
            where = placement.engine_label
            out.update(self.verifier.verify(placement.engine, reference, export_fn, stats.fingerprints, step, where))
        return out

    def after_rollout(self, step: int, selection) -> None:
        """Step `step + 1`'s samples are in (the engine still awake): the verification's probe from them."""
        self.verifier.after_rollout(step, selection.first_round.groups, self.placement.probe_scores)

    def calibration(self) -> dict:
        """After the rollout of the first step, with the actor on the device: the calibration's metrics ({} later)."""
        return self.verifier.calibration(self.actor.probe_log_probs)

    def after_update(self, step: int) -> dict:
        """The sync after the update of step `step + 1` (`step`: the steps trained before it), verified every
        rollout.verify_every syncs; its metrics."""
        return self.sync(self.verifier.due(step + 1), step)
