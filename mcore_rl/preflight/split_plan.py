"""`mcore-rl plan --from-run RUN_DIR CONFIG`: the actor / rollout split of the separate placement for CONFIG's
cluster, from the phase times a colocated run measured (RUN_DIR/metrics.jsonl, its time/* keys).

The model (docs/placement.md, "Choosing the split"), for a colocated run on W0 ranks and a cluster of W:
  measured per step (the median of its steps; the first is left out when there are 3 or more: warm-up)
    rollout R0 = time/rollout, actor A0 = time/old_logprob + time/ref_logprob + time/update, sync S0 = time/sync,
    handover H0 = time/to_training (the device changing hands), other O0 = perf/step_seconds - the rest;
  the work of each role spreads evenly over its ranks: the colocated run's W0 ranks all generated and all
    trained, so on r rollout ranks R = R0 W0 / r and on a actor ranks A = A0 W0 / a (for whole engine replicas,
    and only where the actor's layout forms over a ranks: validate_run);
  separate, one step off: step = max(A, R) + S0 + O0 (no handover: no device changes hands);
  separate, max_staleness 0 (each waits for the other): step = A + R + S0 + O0;
  colocated on W ranks: (R0 + A0) W0 / W + S0 + H0 + O0.
The sync across the split is taken as the colocated one's: a lower bound where a network is slower than the
local copy. The recommended split is the fastest one step off (the smaller imbalance |A - R| on a tie).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mcore_rl.config import Config, ConfigError, load_config
from mcore_rl.metrics import METRICS_FILE, read_metrics
from mcore_rl.preflight.layout import LayoutError, ModelDims
from mcore_rl.preflight.memory_plan import plan_memory
from mcore_rl.preflight.placement import engine_tp
from mcore_rl.preflight.run import validate_run

ACTOR_PHASES = ("time/old_logprob", "time/ref_logprob", "time/update")
WARM_UP_STEPS = 1  # left out of the medians when at least 3 steps were measured (start-up, first compile)


@dataclass(frozen=True)
class PhaseTimes:
    """A colocated run's median seconds per step, by role."""

    rollout: float
    actor: float
    sync: float
    handover: float
    other: float
    steps: int  # steps the medians are taken over

    @property
    def step(self) -> float:
        return self.rollout + self.actor + self.sync + self.handover + self.other


@dataclass(frozen=True)
class SplitOption:
    actor_ranks: int
    rollout_ranks: int
    actor_s: float
    rollout_s: float
    overlapped_s: float  # one step off: max(actor, rollout) + sync + other
    serial_s: float  # max_staleness 0: actor + rollout + sync + other
    fits: Optional[bool] = None  # the memory plan's verdict (None: no device memory given)


def phase_times(rows: list[dict], source: str) -> PhaseTimes:
    """The medians of the rows that logged a training step (time/rollout and time/update)."""
    steps = [r for r in rows if "time/rollout" in r and "time/update" in r]
    if not steps:
        raise ConfigError(
            f"{source} has no step with time/rollout and time/update: let the run log at least one step "
            f"(metrics.jsonl is written as it trains)"
        )
    if len(steps) >= 3:
        steps = steps[WARM_UP_STEPS:]

    def median(key_sum) -> float:
        return statistics.median(key_sum(r) for r in steps)

    actor = median(lambda r: sum(float(r.get(k, 0.0)) for k in ACTOR_PHASES))
    rollout, sync = median(lambda r: float(r["time/rollout"])), median(lambda r: float(r.get("time/sync", 0.0)))
    handover = median(lambda r: float(r.get("time/to_training", 0.0)))
    timed = ("time/rollout", "time/sync", "time/to_training", *ACTOR_PHASES)
    other = median(
        lambda r: max(0.0, float(r.get("perf/step_seconds", 0.0)) - sum(float(r.get(k, 0.0)) for k in timed))
    )
    return PhaseTimes(rollout, actor, sync, handover, other, len(steps))


def read_run(run_dir: str) -> tuple[PhaseTimes, Config]:
    """A colocated run's phase times and its resolved config (RUN_DIR/config.yaml, written at its start)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"--from-run {run_dir} is not a folder: give the trainer.run_dir of a colocated run")
    if not (folder / "config.yaml").is_file():
        raise ConfigError(
            f"--from-run {run_dir} has no config.yaml (a run writes it when it starts): give a run's trainer.run_dir"
        )
    run_cfg = load_config(folder / "config.yaml")
    if run_cfg.rollout.placement != "colocated":
        raise ConfigError(
            f"--from-run {run_dir} ran with rollout.placement={run_cfg.rollout.placement}, where the roles overlap "
            f"and its phase times are not each role's whole work: give a colocated run"
        )
    return phase_times(read_metrics(folder / METRICS_FILE), f"{folder / METRICS_FILE}"), run_cfg


def colocated_step(times: PhaseTimes, measured_world: int, world: int) -> float:
    return (times.rollout + times.actor) * measured_world / world + times.sync + times.handover + times.other


def split_options(
    cfg: Config, world: int, dims: ModelDims, times: PhaseTimes, measured_world: int, device_gib: Optional[float]
) -> list[SplitOption]:
    """Every split of `world` ranks into whole engine replicas and an actor layout that forms, with its times."""
    unit = engine_tp(cfg.rollout)
    options = []
    for ranks in range(unit, world, unit):
        option = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, placement="separate", ranks=ranks))
        if option.actor.offload:  # nothing to offload for in the separate placement
            option = dataclasses.replace(option, actor=dataclasses.replace(option.actor, offload=False))
        try:
            layout = validate_run(option, world, dims)
        except LayoutError:
            continue
        actor_s = times.actor * measured_world / (world - ranks)
        rollout_s = times.rollout * measured_world / ranks
        rest = times.sync + times.other
        fits = None if device_gib is None else plan_memory(option, layout, dims, device_gib, with_levers=False).fits
        options.append(
            SplitOption(
                world - ranks,
                ranks,
                actor_s,
                rollout_s,
                max(actor_s, rollout_s) + rest,
                actor_s + rollout_s + rest,
                fits,
            )
        )
    return options


def best_option(options: list[SplitOption]) -> Optional[SplitOption]:
    usable = [o for o in options if o.fits is not False]
    return min(usable, key=lambda o: (o.overlapped_s, abs(o.actor_s - o.rollout_s)), default=None)


def split_report(run_dir: str, cfg: Config, world: int, dims: ModelDims, device_gib: Optional[float] = None) -> str:
    """What `mcore-rl plan --from-run` prints: the measured times, each split's expected step and the best one."""
    times, run_cfg = read_run(run_dir)
    measured_world = run_cfg.trainer.nnodes * run_cfg.trainer.nproc
    colocated = colocated_step(times, measured_world, world)
    options = split_options(cfg, world, dims, times, measured_world, device_gib)
    lines = [
        f"measured: {run_dir}, colocated on {measured_world} rank(s), median of {times.steps} step(s): "
        f"rollout {times.rollout:.3f} s, actor {times.actor:.3f} s, sync {times.sync:.3f} s, handover "
        f"{times.handover:.3f} s, other {times.other:.3f} s (step {times.step:.3f} s; rollout "
        f"{times.rollout / max(times.step, 1e-12):.0%})",
        f"expected s/step on {world} ranks (actor time x {measured_world}/actor ranks, rollout time x "
        f"{measured_world}/rollout ranks; docs/placement.md):",
        f"  {'actor + rollout ranks':<22} {'actor':>8} {'rollout':>8} {'one-step-off':>13} {'staleness 0':>12}"
        + ("  memory" if device_gib is not None else ""),
        f"  {'colocated (all ' + str(world) + ')':<22} {'':>8} {'':>8} {colocated:>13.3f} {colocated:>12.3f}",
    ]
    for o in options:
        memory = "" if o.fits is None else ("  fits" if o.fits else "  DOES NOT FIT")
        lines.append(
            f"  {f'{o.actor_ranks} + {o.rollout_ranks}':<22} {o.actor_s:>8.3f} {o.rollout_s:>8.3f} "
            f"{o.overlapped_s:>13.3f} {o.serial_s:>12.3f}{memory}"
        )
    best = best_option(options)
    if best is None:
        lines.append(
            f"recommended: stay colocated (no split of {world} ranks forms the actor's layout and whole replicas)"
        )
    elif best.overlapped_s < colocated:
        lines.append(
            f"recommended: rollout.placement=separate rollout.ranks={best.rollout_ranks} ({best.actor_ranks} actor "
            f"ranks): {best.overlapped_s:.3f} s/step one step off, {colocated / best.overlapped_s:.2f}x the colocated "
            f"{colocated:.3f} s"
        )
    else:
        lines.append(
            f"recommended: stay colocated ({colocated:.3f} s/step); the best split, rollout.ranks="
            f"{best.rollout_ranks}, expects {best.overlapped_s:.3f} s one step off"
        )
    return "\n".join(lines)
