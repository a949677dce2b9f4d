"""The `algo` section of the run config: `AlgoConfig`, the loss registry and each loss's option checks.

Pure Python (no torch): `mcore-rl check` and the launcher validate the loss and its options before torch
loads. A loss's math is a `PolicyLoss` class in mcore_rl/algos/losses/ (docs/architecture.md, "Adding a loss");
`LOSSES` below names every built-in one, with the checks of the `algo.*` options it reads. `algo.loss` may also
be 'package.module:Class' (a PolicyLoss subclass outside the package, imported at start-up).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Literal, Optional

from mcore_rl.typed_yaml import ConfigError

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AdvEstimator = Literal["grpo", "drgrpo"]  # drgrpo: no division by the group's std
KlType = Literal["k1", "k2", "k3"]
RolloutCorrection = Literal["token", "sequence", "sequence_geomean", "icepop"]
ProximalLogProbs = Literal["recompute", "loglinear"]
RoutingReplayMode = Literal["r2", "r3"]
OldLogProbPass = Literal["auto", "always"]
DynamicSamplingAtCap = Literal["train", "error"]  # at the round cap: train on the groups there are, or stop

LOSS_TARGET = re.compile(r"[\w.]+:\w+")  # 'package.module:Class'


@dataclass
class AlgoConfig:
    loss: str = "gspo"  # a name in LOSSES, or 'package.module:Class' of a PolicyLoss
    agg_mode: AggMode = "seq-mean-token-mean"
    adv_estimator: AdvEstimator = "grpo"
    clip_low: float = 0.2  # grpo / gspo / gspo_token
    clip_high: float = 0.28  # grpo / gspo / gspo_token
    dual_clip: Optional[float] = None  # c > 1 enables dual clip for A < 0 (grpo / gspo / gspo_token)
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05  # sapo
    kl_coef: float = 0.0  # > 0 needs a reference model pass
    kl_type: KlType = "k3"
    entropy_coef: float = 0.0
    rollout_is: Optional[RolloutCorrection] = None  # rollout importance correction; None: off
    rollout_is_cap: float = 2.0
    rollout_is_low: float = 0.5  # icepop / sequence_geomean: the rejection's lower bound
    rollout_is_high: float = 2.0  # icepop / sequence_geomean: the rejection's upper bound
    # The proximal policy's log-probs (the old ones off-policy, docs/async-objective.md): recompute: the actor's
    # pass on the update's starting weights; loglinear: interpolated per token between the engine's log-prob and
    # the update's own by the token's weight-version lag (no pass; off-policy only).
    proximal: ProximalLogProbs = "recompute"
    temperature: float = 1.0  # must equal rollout.temperature so train log-probs match sampling
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch
    # auto: when the update is exactly on-policy (see `old_from_update`) the old log-probs are the update's
    # own, detached, and no separate forward pass runs; always: a separate old-policy pass every step.
    old_log_prob_pass: OldLogProbPass = "auto"
    routing_replay: Optional[RoutingReplayMode] = None  # None: off
    # DAPO dynamic sampling (docs/dynamic-sampling.md): groups whose rewards are all equal carry no advantage;
    # they are dropped and more prompts generated, until the step has data.prompts_per_step groups with signal
    # or dynamic_sampling_max_rounds generation rounds (the first included) ran; then `dynamic_sampling_at_cap`.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 8
    dynamic_sampling_at_cap: DynamicSamplingAtCap = "train"
    # DAPO overlong filtering: samples cut by rollout.max_new_tokens are masked out of the loss (they still
    # count in their group's advantage baseline); the linear overlong penalty is reward.overlong_buffer.
    overlong_filtering: bool = False

    @property
    def old_from_update(self) -> bool:
        """Whether the old-policy log-probs come from the training forward itself (no separate pass).

        Exact when the one update of the step sees the weights that sampled the batch: one mini-batch,
        one epoch. Then pi_old = pi_theta at the update, the ratio is exactly 1 and its gradient is the
        gradient of pi_theta, which the update's forward computes anyway. Under R3 the update routes with
        the engine's experts while the old-policy pass routes naturally, so the two differ: not taken.
        Under R2 the update records its own routes (they are the old policy's)."""
        return (
            self.old_log_prob_pass == "auto"
            and self.mini_batches == 1
            and self.ppo_epochs == 1
            and self.routing_replay != "r3"
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_clip(a: AlgoConfig) -> list[str]:
    _require(
        0 <= a.clip_low < 1, f"algo.clip_low = {a.clip_low} must lie in [0, 1) (ratio lower bound is 1 - clip_low)"
    )
    _require(a.clip_high >= 0, f"algo.clip_high = {a.clip_high} must be >= 0 (ratio upper bound is 1 + clip_high)")
    if a.dual_clip is not None:
        _require(a.dual_clip > 1, f"algo.dual_clip = {a.dual_clip} must be > 1 (commonly 3) or null to disable it")
    return []


def _check_gspo(a: AlgoConfig) -> list[str]:
    if a.clip_low <= 0.01:
        return _check_clip(a)
    return _check_clip(a) + [
        f"loss=gspo clips a length-normalised sequence ratio; clip_low={a.clip_low} is a token-level range "
        f"(the GSPO paper uses 3e-4 / 4e-4)"
    ]


def _check_sapo(a: AlgoConfig) -> list[str]:
    _require(
        a.dual_clip is None, "algo.dual_clip is set but loss=sapo has no clipping (soft gate): set algo.dual_clip=null"
    )
    for key in ("tau_pos", "tau_neg"):
        _require(getattr(a, key) > 0, f"algo.{key} = {getattr(a, key)} must be > 0")
    if a.tau_neg >= a.tau_pos:
        return []
    return [
        f"sapo with tau_neg={a.tau_neg} < tau_pos={a.tau_pos}: the paper damps negative updates harder (tau_neg > tau_pos)"
    ]


def _no_options(a: AlgoConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss: its PolicyLoss class ('module:Class', imported when the actor builds its loss) and the
    checks of the algo options it reads (raise ConfigError, return warnings)."""

    target: str
    check: Callable[[AlgoConfig], list[str]] = _no_options


# The registry: adding a loss is its file in mcore_rl/algos/losses/ and one line here.
LOSSES: MappingProxyType[str, LossSpec] = MappingProxyType(
    {
        "grpo": LossSpec("mcore_rl.algos.losses.grpo:Grpo", _check_clip),
        "gspo": LossSpec("mcore_rl.algos.losses.gspo:Gspo", _check_gspo),
        "gspo_token": LossSpec("mcore_rl.algos.losses.gspo_token:GspoToken", _check_clip),
        "sapo": LossSpec("mcore_rl.algos.losses.sapo:Sapo", _check_sapo),
    }
)


def loss_target(name: str) -> str:
    """'module:Class' of the loss `name` (a registered name, or already 'module:Class')."""
    spec = LOSSES.get(name)
    return spec.target if spec is not None else name


def check_algo(a: AlgoConfig) -> list[str]:
    """The loss name, its options and the algo-only ranges; raises ConfigError, returns warnings."""
    if a.loss not in LOSSES and LOSS_TARGET.fullmatch(a.loss) is None:
        close = difflib.get_close_matches(a.loss, list(LOSSES), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"algo.loss = {a.loss!r} is not one of: {', '.join(LOSSES)} (or 'package.module:Class' of a "
            f"mcore_rl.algos.losses.PolicyLoss).{hint}"
        )
    _require(a.rollout_is_cap > 0, f"algo.rollout_is_cap = {a.rollout_is_cap} must be > 0")
    if a.rollout_is in ("icepop", "sequence_geomean"):
        _require(
            0 <= a.rollout_is_low < 1 < a.rollout_is_high,
            f"algo.rollout_is={a.rollout_is} needs rollout_is_low < 1 < rollout_is_high, got [{a.rollout_is_low}, {a.rollout_is_high}]",
        )
    _require(
        a.proximal != "loglinear" or a.routing_replay != "r2",
        "algo.proximal=loglinear skips the proximal pass, where routing_replay=r2 records the routes the update "
        "replays: set algo.routing_replay=r3 (the engine's routes) or algo.proximal=recompute",
    )
    spec = LOSSES.get(a.loss)
    return (spec.check(a) if spec is not None else []) + _no_effect_without_dynamic_sampling(a)


def _no_effect_without_dynamic_sampling(a: AlgoConfig) -> list[str]:
    """dynamic sampling's own keys set while it is off: a warning each (like other keys without effect)."""
    if a.dynamic_sampling:
        return []
    defaults = AlgoConfig()
    return [
        f"algo.{key} = {getattr(a, key)} has no effect without algo.dynamic_sampling: remove it, or set "
        f"algo.dynamic_sampling=true"
        for key in ("dynamic_sampling_max_rounds", "dynamic_sampling_at_cap")
        if getattr(a, key) != getattr(defaults, key)
    ]


def check_proximal(a: AlgoConfig, placement: str, max_staleness: Optional[int]) -> list[str]:
    """algo.proximal=loglinear interpolates by each token's version lag: off-policy only (docs/async-objective.md)."""
    if a.proximal != "loglinear":
        return []
    _require(
        placement == "separate" and max_staleness != 0,
        f"algo.proximal=loglinear approximates the proximal log-probs from each token's weight-version lag, but with "
        f"rollout.placement={placement} rollout.max_staleness={max_staleness} every token is "
        f"on-policy (lag 0): set algo.proximal=recompute, or rollout.placement=separate with rollout.max_staleness >= 1",
    )
    if a.rollout_is is not None:
        return []
    return [
        "algo.proximal=loglinear without algo.rollout_is: the ratio is taken against the interpolated proximal "
        "policy, but nothing weights the tokens by proximal / behaviour; set algo.rollout_is (e.g. token)"
    ]
