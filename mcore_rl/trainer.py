"""The RL loop. SPMD: every rank runs `run(cfg)`; torchrun (or `mcore-rl train`) starts the ranks.

One step:
  prompts -> rollout (n samples each; each engine replica generates a contiguous share of the prompts)
  -> rewards (each sample scored once, by one rank of the replica that generated it)
  -> step metadata on every rank (lengths, truncated, reward, validity of every sample: tensors, all-reduced)
  -> group advantages and the plan of mini-batches / DP ranks / micro-batches, from that metadata, on every rank
  -> each sample's tokens (+ rollout log-probs, R3 routes) to the ranks of the DP rank that trains on it only
  -> old log-probs (a forward-only pass; skipped when the update is exactly on-policy: one mini-batch,
     one epoch, no R3, where the update's own log-probs, detached, are the old ones)
  -> mini-batch updates with the chosen loss (Megatron forward-backward, global normalisation)
  -> weight sync actor -> engine (+ verification) -> metrics, validation, checkpoint.

No rank holds the whole step: a data-parallel rank (and its model-parallel peers) receives exactly the
samples of its share, as `batch.split_for_rank` of the whole batch would cut it (mcore_rl/step_data.py;
docs/architecture.md, "Per-rank step data"). Groups need no cross-rank gather for advantages: every rank
has every sample's reward and validity from the metadata.

What depends on rollout.placement - who holds the device, how weights reach the engine, when generation for the next
step starts - is mcore_rl.placement's (separate: mcore_rl.separate, where the rollout ranks run their own loop).
Colocated, who holds the device - the engine (rollout) or the actor (training) - is mcore_rl.colocation's: the step asks for
a phase, a checkpoint, load or export for the actor's state, and the sync runs inside the hand-over (with
actor.offload: the engine's weights woken, the sync, the actor's state to the host, the KV cache woken). The
reference model is on the host except during its own pass.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mcore_rl.algos import group_advantages
from mcore_rl.batch import plan_mini_batches
from mcore_rl.compat import describe_versions
from mcore_rl.config import Config, ConfigError, save_config
from mcore_rl.data import PromptInputs
from mcore_rl.dynamic_sampling import overlong_filtered
from mcore_rl.generation import StepGenerator, build_engine, load_step_inputs, validation_examples
from mcore_rl.metrics import MetricsLogger, PhaseTimer, SampleLog
from mcore_rl.placement import ColocatedPlacement, Phase, Placement
from mcore_rl.platform import RunEnvironment, collectives, get_platform
from mcore_rl.platform.library_warnings import quiet_startup, verbose_requested
from mcore_rl.platform.split import init_split
from mcore_rl.plot import plot_run
from mcore_rl.preflight.resume_changes import CONFIG_FILE, check_resume_changes, describe
from mcore_rl.preflight.run import check_before_build, split_unit
from mcore_rl.run_dir import (
    Checkpoint,
    CheckpointManager,
    OutputWriteError,
    check_pickles,
    claim_run_dir_collective,
    read_state,
    resolve_verified_resume,
    rng_state,
    set_rng_state,
    state_file,
    write_failure,
)
from mcore_rl.run_dir.errors import disk_full_error
from mcore_rl.safety import (
    STOP_FILE,
    Interrupted,
    SkipCounter,
    StopRequested,
    StopSignals,
)
from mcore_rl.separate import RolloutWorker, SeparatePlacement, split_sizes
from mcore_rl.step_data import ExchangeStats, dp_ranks, local_mini_batches
from mcore_rl.streaming import StreamingWorker
from mcore_rl.supervise import tell_launcher
from mcore_rl.weight_sync.sync import WeightSync

log = logging.getLogger("mcore_rl.trainer")


class Trainer:
    """Holds what lives across steps: actor, engine, data sampler, reward function, loggers."""

    def __init__(self, cfg: Config, inputs: "PromptInputs | None" = None, bridge=None):
        self.cfg = cfg
        # First: a Ctrl-C while the run starts stops it at the first step boundary, like one later on.
        self.stop_signals = StopSignals(Path(cfg.trainer.run_dir) / STOP_FILE, at_once=self._stop_at_once)
        self.stop_signals.install()
        self.platform = get_platform(cfg.platform)
        self.platform.init_distributed(RunEnvironment.of(cfg))  # the collective timeout, HCCL's env (NPU)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()  # the actor's ranks (separate placement: the rollout ranks are not in it)
        self.job_world = int(os.environ.get("WORLD_SIZE", self.world))  # every rank torchrun started
        self.run_dir = Path(cfg.trainer.run_dir)
        check_before_build(cfg, self.job_world, self.platform.name)  # plain torchrun launches skip the pre-flight
        resume = self._claim_run_dir()
        # Cheap, rank-local work first so bad data or reward functions fail before Megatron starts.
        self._load_inputs(inputs)
        self._build_actors()
        self._build_step_parts(bridge)
        self.weight_sync = WeightSync(cfg, self.actor, self.placement, self.rank, self.platform.release_cache)
        self.ckpt = CheckpointManager(cfg.trainer.run_dir, cfg.checkpoint.keep_last)
        self.step = 0
        self.skips = SkipCounter(cfg.trainer.max_consecutive_skips)
        self.last_applied: list[bool] = []
        if resume is not None:
            self._load(resume.path)
        self.metrics = MetricsLogger(cfg.trainer.run_dir, cfg, rank=self.rank, start_step=self.step)
        self.placement.begin_run(self.step, self.sampler.state_dict(), self.unit)
        if resume is not None:
            self.weight_sync.sync(verify=True, step=self.step)

    def _claim_run_dir(self):
        """The checkpoint to resume from (the newest whose checksums verify; None: a fresh run), the run directory
        locked for the life of the run (another run's checkpoints refused) and the config written into it."""
        cfg = self.cfg
        resume = resolve_verified_resume(cfg, log)
        if resume is not None:  # refused changes stop here too, for launchers without the pre-flight
            applied = check_resume_changes(cfg, resume.path)
            if applied and self.rank == 0:
                log.info("resuming from %s with changed settings, applied: %s", resume.path, describe(applied))
        self.run_lock = claim_run_dir_collective(cfg, resume, log)
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        return resume

    def _load_inputs(self, inputs: "PromptInputs | None") -> None:
        loaded = load_step_inputs(self.cfg, inputs)
        self.reward_fn, self.tokenizer, self.sampler = loaded.reward_fn, loaded.tokenizer, loaded.sampler
        self.train_set, self.val_set = loaded.train_set, loaded.val_set

    def _build_actors(self) -> None:
        """The actor (its weights checked finite) and, for KL, the frozen reference (actor.offload: on the host
        except during its own pass)."""
        # Here, not at the top: the actor imports Megatron, whose warnings are raised at import time, after `run`
        # has quieted the known ones (platform.library_warnings.quiet_startup); and after adapt_megatron, which
        # imports Megatron without TorchDynamo on CPU (cpu_adapt patch 9: ~1 s of CPU per rank otherwise).
        self.platform.adapt_megatron(self.cfg.actor.parallel.cp)
        from mcore_rl.megatron.actor import Actor

        cfg = self.cfg
        self.actor = Actor(cfg, self.platform)
        # The pre-flight reads every weight of a small model folder (preflight.FINITE_CHECK_MAX_BYTES); this covers
        # every size, on the devices, before the engine samples from the weights.
        self.actor.check_weights_finite(
            f"model.path = {cfg.model.path}", fix="the input model is damaged: download it again"
        )
        if cfg.algo.routing_replay is not None:
            self.actor.enable_routing_replay()
        # The data-parallel rank of every rank: who trains on which samples (mcore_rl.step_data).
        self.dp_of_rank = dp_ranks(self.actor.layout.ranks.dp)
        # The KL reference is the initial policy: a second, frozen copy of the model in the same layout.
        self.ref_actor = Actor.frozen(cfg, self.platform) if cfg.algo.kl_coef > 0 else None
        if cfg.actor.offload and self.ref_actor is not None:
            self.ref_actor.offload()

    def _build_step_parts(self, bridge) -> None:
        """The placement, the step's generator (its rounds from the placement) and whether the old-policy pass may
        be taken from the update."""
        cfg = self.cfg
        self.placement = self._placement(bridge)
        fixed = None if cfg.actor.max_tokens_per_micro_batch else cfg.actor.parallel.micro_batch_size
        self.unit = split_unit(cfg.algo.mini_batches, self.actor.layout.dp, fixed)
        self.sample_log = SampleLog(cfg.trainer.run_dir, cfg.trainer.sample_log, self.rank)
        parts = (self.placement.rounds, self.unit, self.sample_log, self.rank)
        self.generator = StepGenerator(cfg, self.train_set, self.sampler, self.tokenizer, *parts)
        # off-policy the proximal (old-policy) pass runs unless algo.proximal=loglinear interpolates it: the update's
        # weights did not sample the batch
        self.old_from_update = cfg.algo.old_from_update and self.placement.skips_old_pass
        self.old_pass = not self.old_from_update and cfg.algo.proximal == "recompute"

    def _placement(self, bridge) -> Placement:
        """The colocated placement (the engine in this process, Colocation holding the device) or the separate one's
        actor side (the rollout ranks behind the bridge)."""
        cfg = self.cfg
        if cfg.rollout.placement == "separate":
            return SeparatePlacement(cfg, self.actor, bridge)
        rounds = (self.reward_fn, self.tokenizer, cfg.rollout, [self.tokenizer.eos_token_id])
        build = lambda: build_engine(cfg, self.platform)
        sync = lambda: self.weight_sync.sync(False, self.step)
        return ColocatedPlacement.start(self.actor, self.platform, cfg.actor.offload, build, sync, rounds_args=rounds)

    @property
    def engine(self):
        return self.placement.engine

    def old_policy_pass(self, micro_batches) -> float:
        """Fill each micro-batch's old_log_prob (and entropy); R2 records the routes the update replays.
        Returns the summed entropy over response tokens. Not run when the update is exactly on-policy
        (AlgoConfig.old_from_update): the update's own forward gives both then."""
        cfg = self.cfg
        outputs = self.actor.log_probs(micro_batches, with_entropy=True, record_routes=cfg.algo.routing_replay == "r2")
        for mb, out in zip(micro_batches, outputs):
            mb.old_log_prob, mb.entropy = out[0], out[1]
        return self.actor.masked_sum([mb.entropy for mb in micro_batches], micro_batches)

    def train_step(self) -> dict:
        """One step: the rollout (after a sync where the engine is behind the actor), the actor's passes and updates
        on this rank's samples, the sync into the engine. Returns the step's metrics."""
        timer, exchanged = PhaseTimer(), ExchangeStats()
        step_start = time.perf_counter()
        self.placement.ensure(Phase.ROLLOUT)
        with timer("rollout"):  # separate: the wait for the rollout ranks' samples
            self.placement.begin_step(self.step)
            selection = self.generator.step(self.step, exchanged)
        # the verification's probe; the initial weights' gap: the engine scores now, awake; the actor once it is back
        self.weight_sync.after_rollout(self.step, selection)
        with timer("to_training"):
            self.placement.ensure(Phase.TRAINING)  # the engine's memory to the actor's passes (offload: its state)
        calibration_metrics = self.weight_sync.calibration()
        meta, mini_batches = self._mini_batches(selection, exchanged)
        update, entropy_sum = self._actor_passes(mini_batches, timer)
        # An applied step can still overflow the weights (finite gradients, a huge learning rate): stop
        # before the engine, a checkpoint or the export sees them.
        self.actor.check_weights_finite(f"step {self.step + 1} made the weights non-finite")
        with timer("sync"):
            sync_metrics = self.weight_sync.after_update(self.step)
        placement_metrics = self.placement.step_metrics(self.step)
        self.step += 1
        self.last_applied = [bool(v) for v in update.get("update_successful", [])]
        metrics = {
            **self._step_metrics(selection, meta, update, exchanged, timer, step_start),
            **sync_metrics,
            **calibration_metrics,
            **placement_metrics,
        }
        if entropy_sum is not None:
            metrics["train/entropy_old"] = entropy_sum / max(1, sum(meta.loss_tokens))
        else:  # no old-policy pass: the update's forward ran on the old policy's weights (loglinear: the proximal's)
            metrics["train/entropy_old"] = metrics["train/entropy"]
        return metrics

    def _mini_batches(self, selection, exchanged):
        """The step's advantages and plan of mini-batches / DP ranks / micro-batches, and this rank's mini-batches
        (only the samples its data-parallel rank trains on reach it: mcore_rl.step_data). Returns (the metadata the
        update counts, after the overlong filter; the mini-batches)."""
        cfg, layout, meta = self.cfg, self.actor.layout, selection.meta
        # failed rewards (meta.valid False): out of their group and the loss
        advantages = group_advantages(meta.rewards, cfg.rollout.n, cfg.algo.adv_estimator, valid=meta.valid)
        if cfg.algo.overlong_filtering:  # after the advantages: truncated samples still count in their group
            meta = overlong_filtered(meta, self.step + 1, cfg.rollout.max_new_tokens)
        plans = plan_mini_batches(
            meta.lengths,
            meta.loss_tokens,
            cfg.algo.mini_batches,
            layout.dp,
            None if cfg.actor.max_tokens_per_micro_batch else cfg.actor.parallel.micro_batch_size,
            cfg.actor.max_tokens_per_micro_batch,
            layout.seq_len_multiple,
            max_len=cfg.rollout.max_new_tokens,
        )
        return meta, local_mini_batches(
            selection.local,
            meta,
            plans,
            advantages,
            self.dp_of_rank,
            self.tokenizer.pad_token_id,
            layout.seq_len_multiple,
            route_experts=self.actor.hf_config.num_experts if cfg.algo.routing_replay == "r3" else None,
            stats=exchanged,
            versions=(self.step, self.placement.samples_version(self.step)),  # each token's lag behind this update
        )

    def _actor_passes(self, mini_batches, timer: PhaseTimer) -> "tuple[dict[str, list[float]], float | None]":
        """The old-policy and reference passes, then the updates (algo.ppo_epochs over the mini-batches). Returns the
        update's metrics (one value per optimizer step) and the old policy's summed entropy (None: on-policy)."""
        algo = self.cfg.algo
        micro_all = [mb for mini in mini_batches for mb in mini.micro_batches]
        entropy_sum = None
        if self.old_pass:
            with timer("old_logprob"):
                entropy_sum = self.old_policy_pass(micro_all)
        if self.ref_actor is not None:
            with timer("ref_logprob"), self.ref_actor.resident():  # offload: on the device for this pass only
                for mb, lp in zip(micro_all, self.ref_actor.log_probs(micro_all)):
                    mb.ref_log_prob = lp
        update: dict[str, list[float]] = {}
        with timer("update"):
            for _ in range(algo.ppo_epochs):
                for mini in mini_batches:
                    for k, v in self.actor.train_policy(mini, algo, on_policy=self.old_from_update).items():
                        update.setdefault(k, []).append(v)
        return update, entropy_sum

    def _step_metrics(self, selection, meta, update, exchanged, timer: PhaseTimer, step_start: float) -> dict:
        """Rewards, lengths, throughput, phase times and the update's means of a finished step."""
        response_lengths = meta.response_lengths.float()
        num_tokens = int(response_lengths.sum())
        generated_tokens = sum(int(m.response_lengths.sum()) for m in selection.generated)
        elapsed = time.perf_counter() - step_start
        # the rewards of every sample generated this step (all rounds): what the policy earns on fresh prompts
        scored_rewards = torch.cat([m.rewards[m.valid] for m in selection.generated])
        return {
            "reward/mean": float(scored_rewards.mean()) if len(scored_rewards) else 0.0,
            "reward/std": float(scored_rewards.std()) if len(scored_rewards) > 1 else 0.0,
            "reward/errors": sum(m.errors for m in selection.generated),
            **selection.metrics(self.cfg.rollout.n, self.cfg.algo.dynamic_sampling),
            "response/length_mean": float(response_lengths.mean()),
            "response/length_max": float(response_lengths.max()),
            "response/clip_ratio": float(meta.truncated.float().mean()),
            # this rank's step-data traffic: its part of the metadata all-reduce + the samples it received
            "perf/step_data_bytes": exchanged.meta_bytes + exchanged.received_bytes,
            "perf/tokens_per_s": num_tokens / max(elapsed, 1e-9),
            "perf/rollout_tokens_per_s": generated_tokens / max(timer.seconds["rollout"], 1e-9),
            "perf/step_seconds": elapsed,
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            **{(k if k.startswith("routing/") else f"train/{k}"): float(np.mean(v)) for k, v in update.items()},
            "train/skipped_steps": float(np.sum(update.get("skipped_steps", [0.0]))),
        }

    def validate(self) -> dict:
        """Mean reward of one sample per validation prompt (pass@1), greedy."""
        examples = validation_examples(self.cfg, self.val_set)
        return {"val/reward_mean": self.placement.validation_reward(examples, self.cfg.trainer.seed)}

    # ---- checkpoints -------------------------------------------------------------------------
    def _stop_if_asked(self) -> None:
        """Between steps (a checkpoint in progress is finished first): stop every rank on SIGTERM/SIGINT."""
        name = self.stop_signals.agreed(also=self.placement.peer_stop_signal())
        if name:
            self.placement.stop()
            self.reward_fn.close()
            if self.rank == 0:
                (self.run_dir / STOP_FILE).unlink(missing_ok=True)  # a later resume must not stop at once
            newest = self.ckpt.latest()
            raise StopRequested.between_steps(name, self.step, newest.path if newest else None)

    def _stop_at_once(self) -> None:
        """Ctrl-C twice: say so and end this process where it is. Nothing half-written is ever published (a
        checkpoint's .tmp folder, the export's temporary shards); the run directory's lock is dropped by the
        kernel; the launcher reaps what this process started."""
        tell_launcher(128 + signal.SIGINT, f"mcore-rl: {_interrupted(self.cfg, self)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # stopped as asked, like a StopRequested: the launcher exits 128 + SIGINT

    def save(self) -> None:
        self.placement.ensure_actor_state()  # for the writer
        self.actor.check_weights_finite(f"not writing checkpoint step {self.step}")

        ahead = self.placement.state_dict(self.step)  # before the writer: it may wait for the rollout ranks

        def write(tmp_dir: Path) -> None:
            self.actor.save_checkpoint(str(tmp_dir / "actor"))
            state = {
                "step": self.step,
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),  # tensors and plain types: read back with weights_only=True
                "skips": self.skips.state_dict(),
                **({"placement": ahead} if ahead else {}),
            }
            torch.save(state, state_file(tmp_dir, self.rank))
            if self.rank == 0:  # what a resume compares its config with (mcore_rl.preflight.resume_changes)
                save_config(self.cfg, tmp_dir / CONFIG_FILE)

        ckpt = self.ckpt.save(self.step, write, meta={"step": self.step, "world_size": self.job_world})
        if self.rank == 0:
            log.info("saved checkpoint %s", ckpt.path)

    def _load(self, path: Path) -> None:
        self.placement.ensure_actor_state()  # loaded into the actor on the device; a sync hands over afterwards
        saved_world = Checkpoint(self.step, Path(path)).meta.get("world_size")
        own_state = state_file(path, self.rank)
        if saved_world is not None and saved_world != self.job_world:
            raise RuntimeError(
                f"{path} was written by {saved_world} processes, this run has {self.job_world}: resume with "
                f"trainer.nproc x trainer.nnodes = {saved_world}"
            )
        if not own_state.exists():
            raise FileNotFoundError(f"{own_state} is missing: the checkpoint {path} is incomplete; resume from another")
        try:
            check_pickles(path, self.cfg.checkpoint.trust_pickle)  # unpickling the files runs no code from them
            state = read_state(own_state, self.cfg.checkpoint.trust_pickle, log)
            self.actor.load_checkpoint(str(Path(path) / "actor"))
        except ConfigError:
            raise
        except Exception as e:  # name the checkpoint: torch's own messages ("zip archive corrupted") do not
            raise RuntimeError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from e
        self.placement.weights_replaced()
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        if "skips" in state:
            self.skips.load_state_dict(state["skips"])
        self.placement.load_state_dict(state.get("placement", {}))
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.step)

    def export_hf(self, out_dir: Path) -> None:
        """Write the actor as a Hugging Face folder (collective)."""
        self.placement.ensure_actor_state()
        self.actor.check_weights_finite(f"not writing the Hugging Face export {out_dir}")
        try:
            self.actor.save_hf(str(out_dir), source_dir=self.cfg.model.path)
        except OutputWriteError as e:
            newest = self.ckpt.latest()
            raise OutputWriteError(
                f"{e}; training finished and the newest checkpoint {newest.path if newest else '(none)'} is intact: "
                f"free space, then export it with `mcore-rl convert mcore-to-hf --hf {self.cfg.model.path} --ckpt "
                f"{newest.path / 'actor' if newest else 'CHECKPOINT/actor'} --out {out_dir}`"
            ) from None
        if self.rank == 0:
            log.info("exported the trained model to %s", out_dir)

    # ---- loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.cfg
        save_every = cfg.checkpoint.save_every
        while self.step < cfg.trainer.steps:
            self._stop_if_asked()
            metrics = self.train_step()
            if self.val_set is not None and self.step % cfg.trainer.val_every == 0:
                metrics.update(self.validate())
            self.metrics.log(self.step, metrics)
            self.skips.record(self.last_applied, self.step)  # stops after too many skipped steps in a row
            if (save_every and self.step % save_every == 0) or self.step == cfg.trainer.steps:
                self.save()
        self.metrics.close()
        self.sample_log.close()
        self.reward_fn.close()
        if cfg.checkpoint.save_hf:
            self.export_hf(self.run_dir / "hf")
        self.placement.close()
        self._plot()

    def _plot(self) -> None:
        """Every rank writes its share of the plots (plot.plot_run's part); a failure on any (a full disk) stops
        every rank with the same message."""
        if not self.cfg.trainer.plots:
            return
        failed = None
        try:
            plot_run(self.run_dir, part=(self.rank, self.world))
        except OSError as e:
            failed = write_failure(e, self.run_dir / "plots")[0]
        failed = collectives.first_given(failed)
        if failed is not None:
            export = " and the export" if self.cfg.checkpoint.save_hf else ""
            raise OutputWriteError(
                f"the plots {self.run_dir / 'plots'} were not written ({failed}); training finished and the "
                f"checkpoints, metrics.jsonl{export} are intact: free space, then write them with "
                f"`mcore-rl plot {self.run_dir}`"
            )
        if self.rank == 0:
            log.info("training done: metrics %s, plots %s", self.run_dir / "metrics.jsonl", self.run_dir / "plots")


def _setup_logging() -> None:
    """Our INFO logs on rank 0 only; libraries (Megatron prints its whole config at INFO) at WARNING."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mcore_rl").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # Every sync's throughput goes to the metrics; the log keeps only warnings after the first one.
    for quiet in ("mcore_rl.weight_sync.buckets", "mcore_rl.weight_sync.verify"):
        logging.getLogger(quiet).setLevel(logging.WARNING)


def _interrupted(cfg: Config, trainer: "Trainer | None") -> StopRequested:
    """The stop line for Ctrl-C twice (safety.Interrupted), with the step it cut short and what is kept."""
    newest = CheckpointManager(cfg.trainer.run_dir).latest()
    step = getattr(trainer, "step", None)  # a Ctrl-C can come while the trainer is being built
    return StopRequested.at_once(step, newest.path if newest else None)


def run(cfg: Config, inputs: "PromptInputs | None" = None) -> None:
    """Train `cfg` on this rank; `inputs`: the tokenizer and prompt sets, already loaded (mcore_rl.cli)."""
    _setup_logging()
    verbose = verbose_requested(cfg.trainer.verbose)
    # before Megatron is imported: most of its warnings are raised at import time
    notice = quiet_startup(get_platform(cfg.platform).name, verbose)
    log.info("%s", describe_versions(brief=not verbose))
    if notice:
        log.info("%s", notice)
    torch.manual_seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)  # else the checkpoints' saved state is the OS's entropy, run to run
    bridge = start_processes(cfg)
    if bridge is not None and not bridge.is_actor:
        worker = StreamingWorker if cfg.rollout.streaming else RolloutWorker
        worker(cfg, inputs, get_platform(cfg.platform), bridge).run()
        _end_process_group()
        return
    trainer = None
    try:
        trainer = Trainer(cfg, inputs, bridge)
        trainer.fit()
    except Interrupted:
        raise _interrupted(cfg, trainer) from None
    except OSError as e:  # a full disk outside the checkpoint's own writes (metrics.jsonl ...): named, no traceback
        full = disk_full_error(e, cfg.trainer.run_dir)
        if full is None:
            raise
        raise full from None
    finally:
        StopSignals().ignore()  # the run is over: a later Ctrl-C would only interrupt the exit
        if trainer is not None and trainer.run_lock is not None:
            trainer.run_lock.release()
    _end_process_group()


def start_processes(cfg: Config):
    """torch.distributed for this rank: one world (colocated), or the separate placement's role groups and the
    bridge (mcore_rl.platform.split). Returns the bridge on the ranks that hold it, else None."""
    platform = get_platform(cfg.platform)
    if cfg.rollout.placement != "separate":
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    actor_ranks = split_sizes(cfg.rollout, world)
    run = RunEnvironment.of(cfg)
    platform.apply_environment(run=run)
    platform.set_device()
    timeout = timedelta(minutes=run.collective_timeout_minutes)
    _, bridge = init_split(platform.name, platform.dist_backend, platform.device, actor_ranks, timeout)
    return bridge


def _end_process_group() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
