"""The cache release before every engine wake, in the trainer's real sync (plain python, world 1, CPU).

The trainer runs on `RecordingPlatform`: the CPU platform, recording each `empty_cache` (and passing it on); the real
embedded engine's `sleep` / `wake_up` / `rebuild_from` are recorded too. Sequence: a sync with `actor.offload`
(two-phase wake), the hand-back to training, a sync without offload (one wake of everything), then a failed
verification's rebuild (the engine's weights corrupted after a sync). Result: the recorded events in order.

Arguments: --config (a tiny preset), --model-dir, --train, --val, --run-dir, --results."""

import dataclasses

import torch

from tests.workers.harness import worker_args, write_result


def recording_platform_class():
    from mcore_rl.platform import Platform

    @dataclasses.dataclass(frozen=True)
    class Recording(Platform):
        events: list = dataclasses.field(default_factory=list, compare=False)

        def empty_cache(self) -> None:
            self.events.append("empty_cache")
            super().empty_cache()

    return Recording


def record(obj, method: str, events: list) -> None:
    """Record each call of `obj.method` (by name, with its tags for wake_up), then call it."""
    original = getattr(obj, method)

    def recorded(*args, **kwargs):
        tags = args[0] if args else kwargs.get("tags")
        events.append(f"{method}({','.join(tags) if tags else 'all'})" if method == "wake_up" else method)
        return original(*args, **kwargs)

    setattr(obj, method, recorded)


def main():
    args = worker_args(__doc__, config=str, model_dir=str, train=str, val=str, run_dir=str)
    import mcore_rl.trainer as trainer_module
    from mcore_rl.colocation import Phase
    from mcore_rl.config import load_config

    platform = recording_platform_class()("cpu")
    trainer_module.get_platform = lambda name="auto": platform  # the trainer asks for its platform by name
    cfg = load_config(
        args.config,
        [
            f"model.path={args.model_dir}",
            f"data.train_path={args.train}",
            f"data.val_path={args.val}",
            f"trainer.run_dir={args.run_dir}",
            "trainer.nproc=1",
            "actor.parallel.ep=1",
            "actor.offload=true",
            "rollout.verify_fallback=rebuild",
        ],
    )
    trainer = trainer_module.Trainer(cfg)
    events = platform.events
    for method in ("sleep", "wake_up", "rebuild_from"):
        record(trainer.engine, method, events)
    phases = {}

    def phase(name, fn):
        start = len(events)
        fn()
        phases[name] = events[start:]

    phase("sync_offload", lambda: trainer.weight_sync.sync(True, trainer.step))
    phase("to_training", lambda: trainer.placement.ensure(Phase.TRAINING))
    trainer.placement.offload = False
    phase("sync_resident", lambda: trainer.weight_sync.sync(False, trainer.step))

    # a verification that fails: the engine's weights changed behind the sync's back -> rebuild beside the awake engine
    def corrupted_sync():
        engine = trainer.engine
        fingerprints = engine.weight_fingerprints

        def corrupt_then_read(names):  # the verification's first read, after the sync wrote every weight
            engine.weight_fingerprints = fingerprints
            with torch.no_grad():
                for p in engine.model.parameters():
                    p.add_(1.0)
            return fingerprints(names)

        engine.weight_fingerprints = corrupt_then_read
        return trainer.weight_sync.sync(True, trainer.step)

    rebuild_metrics = {}
    phase("sync_rebuild", lambda: rebuild_metrics.update(corrupted_sync()))
    write_result(args.results, phases=phases, rebuilt=rebuild_metrics.get("sync/rebuilt"))


if __name__ == "__main__":
    main()
