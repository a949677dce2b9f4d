"""DAPO dynamic sampling: keep generating until the step has enough groups with signal.

A group (the rollout.n samples of one prompt) whose valid rewards are all equal has advantage 0 for every
sample (`mcore_rl.algos.group_advantages`): it adds nothing to the policy gradient, but it still counts in
the loss denominators and dilutes the groups that do carry signal. With `algo.dynamic_sampling` such groups
are dropped and the sampler's next `data.prompts_per_step` prompts are generated (another round), until
`data.prompts_per_step` groups with signal are collected (the first ones, in round and group order; any
beyond are left out) or `algo.dynamic_sampling_max_rounds` rounds ran. At the cap: `train` trains on the
groups there are, cut to the largest count the step's layout can split (`feasible_groups`), with a warning;
none at all trains on the first round as it came (what the run would do without dynamic sampling); `error`
stops the run.

The decision is the same on every rank: it reads only the step metadata (`mcore_rl.step_data.StepMeta`),
whose rewards every rank holds after the metadata all-reduce (each sample was scored once, by one rank of its
replica, and summed into every rank's copy). Every rank therefore drops the same groups, builds the same
plan and the same equal micro-batch counts over data-parallel ranks.

The kept groups of several rounds become one step through `MergedRollout`, which answers what the per-rank
step data asks of a `LocalRollout` (which ranks hold a sample, the sample itself with its rollout log-probs
and R3 routes): the samples stay on the ranks that generated them and move only to the ranks that train on
them. Rounds draw their prompts from the one `EpochSampler`, so the sampler's saved position after a step
with extra rounds resumes the run exactly; round r of step s generates with its own seed (`round_seed`).

DAPO's overlong filtering (`algo.overlong_filtering`, `overlong_filtered`) lives here too: truncated samples
out of the loss, after the group advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from mcore_rl.batch import RolloutSample
from mcore_rl.rollout.data_parallel import LocalRollout, ReplicaLayout
from mcore_rl.safety import TrainingHalted
from mcore_rl.step_data import StepMeta

ROUND_SEED_STRIDE = 104_729  # a prime, so round r of step s does not reuse another (step, round)'s seed
CAP_WARN_EVERY = 50  # steps between the round cap's warnings


def round_seed(step_seed: int, round_index: int) -> int:
    """The generation seed of round `round_index` of a step (round 0: the step's seed, as without rounds)."""
    return step_seed + round_index * ROUND_SEED_STRIDE


def group_signal(rewards: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """[B / n] bool: the group has at least two valid rewards that differ (the `group_advantages` rule)."""
    ok = valid.bool().view(-1, n)
    r = rewards.float().view(-1, n)
    high = torch.where(ok, r, torch.full((), -torch.inf)).max(dim=1).values
    low = torch.where(ok, r, torch.full((), torch.inf)).min(dim=1).values
    return (ok.sum(dim=1) >= 2) & (high > low)


def flat_outcomes(rewards: torch.Tensor, valid: torch.Tensor, n: int) -> tuple[int, int]:
    """(all-correct, all-wrong) groups: no signal, every valid reward >= 1 (full marks of the task / math
    rewards) or <= 0 (none). Other groups without signal (e.g. all 0.5) are neither."""
    ok = valid.bool().view(-1, n)
    r = rewards.float().view(-1, n)
    flat = ~group_signal(rewards, valid, n) & ok.any(dim=1)
    correct = flat & torch.where(ok, r >= 1.0, torch.ones((), dtype=torch.bool)).all(dim=1)
    wrong = flat & torch.where(ok, r <= 0.0, torch.ones((), dtype=torch.bool)).all(dim=1)
    return int(correct.sum()), int(wrong.sum())


def feasible_groups(count: int, n: int, unit: int) -> int:
    """The largest number of groups <= count whose samples (groups x n) split into `unit`s."""
    while count > 0 and (count * n) % unit:
        count -= 1
    return count


class MergedRollout:
    """Chosen groups of several rounds as one step (group order: picks[k] is group k of the step).

    Answers what `mcore_rl.step_data` asks of a LocalRollout: `replicas`, `held`, `sample`, `holder_ranks`."""

    def __init__(self, rounds: list[LocalRollout], picks: list[tuple[int, int]]):
        self.rounds, self.picks = rounds, picks
        self.n = rounds[0].n
        self.num_prompts = len(picks)
        self.replicas: ReplicaLayout = rounds[0].replicas
        self.held = frozenset(i for i in range(len(picks) * self.n) if self._source(i)[1] in self._held_of(i))

    def _source(self, index: int) -> tuple[int, int]:
        """(round, index in that round) of step sample `index`."""
        r, group = self.picks[index // self.n]
        return r, group * self.n + index % self.n

    def _held_of(self, index: int) -> range:
        return self.rounds[self.picks[index // self.n][0]].held

    def sample(self, index: int) -> RolloutSample:
        r, i = self._source(index)
        return self.rounds[r].sample(i)

    def holder_ranks(self, index: int) -> range:
        r, i = self._source(index)
        return self.rounds[r].holder_ranks(i)


def select_meta(metas: list[StepMeta], picks: list[tuple[int, int]], n: int) -> StepMeta:
    """The metadata of the chosen groups, in pick order."""
    rows = [(r, g * n + j) for r, g in picks for j in range(n)]

    def take(name: str) -> torch.Tensor:
        return torch.stack([getattr(metas[r], name)[i] for r, i in rows])

    shapes = {m.route_shape for m in metas}
    return StepMeta(
        prompt_lengths=take("prompt_lengths"),
        response_lengths=take("response_lengths"),
        truncated=take("truncated"),
        valid=take("valid"),
        rewards=take("rewards"),
        route_shape=shapes.pop() if len(shapes) == 1 else None,
    )


@dataclass
class Selection:
    """What a step trains on, and what was generated for it."""

    local: Union[LocalRollout, MergedRollout]
    meta: StepMeta  # of the trained samples
    generated: list[StepMeta]  # every round's metadata (the rewards the policy earned this step)
    kept: int = 0  # groups with signal trained on
    dropped: int = 0  # groups generated and not trained on (no signal, or beyond data.prompts_per_step)
    short: Optional[str] = None  # the cap's warning, when the step has fewer groups than asked
    flat: tuple[int, int] = field(default=(0, 0))  # (all-correct, all-wrong) groups generated

    @property
    def rounds(self) -> int:
        return len(self.generated)

    @property
    def first_round(self) -> LocalRollout:
        """What this rank holds of the step's first round, as generated."""
        return self.local.rounds[0] if isinstance(self.local, MergedRollout) else self.local

    def metrics(self, n: int, dynamic: bool) -> dict:
        groups = sum(m.size for m in self.generated) // n
        out = {"groups/all_correct": self.flat[0] / groups, "groups/all_wrong": self.flat[1] / groups}
        if dynamic:
            out.update({"groups/kept": self.kept, "groups/dropped": self.dropped, "groups/rounds": self.rounds})
        return out


@dataclass
class CapWarnings:
    """The round cap's warning: the first time, then at most every CAP_WARN_EVERY steps with a count (a solved task
    hits the cap every step; groups/kept in the metrics has every step)."""

    steps: int = 0  # steps that ended at the cap so far
    warned: int = 0  # the last step warned

    def line(self, short: Optional[str], step: int) -> Optional[str]:
        """The warning for `step` (Selection.short: None when the step had its groups), or None: not now."""
        if short is None:
            return None
        self.steps += 1
        if self.steps > 1 and step - self.warned < CAP_WARN_EVERY:
            return None
        self.warned = step
        return short + (f" ({self.steps} steps at the cap so far)" if self.steps > 1 else "")


def _flat_counts(metas: list[StepMeta], n: int) -> tuple[int, int]:
    counts = [flat_outcomes(m.rewards, m.valid, n) for m in metas]
    return sum(c for c, _ in counts), sum(w for _, w in counts)


def single_round(local: LocalRollout, meta: StepMeta, n: int) -> Selection:
    """Without dynamic sampling: the step trains on its one round as it came."""
    kept = int(group_signal(meta.rewards, meta.valid, n).sum())
    return Selection(local, meta, [meta], kept=kept, flat=_flat_counts([meta], n))


def collect(
    generate: Callable[[int], tuple[LocalRollout, StepMeta]],
    want: int,
    n: int,
    max_rounds: int,
    unit: int,
    at_cap: str,
    step: int,
) -> Selection:
    """Collective (through `generate(round) -> (LocalRollout, StepMeta)`): rounds until `want` groups with
    signal, or `max_rounds` rounds; then the choice described in the module docstring.

    Raises TrainingHalted at the cap with at_cap='error'."""
    locals_: list[LocalRollout] = []
    metas: list[StepMeta] = []
    picks: list[tuple[int, int]] = []
    while len(picks) < want and len(metas) < max_rounds:
        local, meta = generate(len(metas))
        signal = group_signal(meta.rewards, meta.valid, n)
        picks += [(len(metas), int(g)) for g in signal.nonzero().flatten()]
        locals_.append(local)
        metas.append(meta)
    flat = _flat_counts(metas, n)
    total = sum(m.size for m in metas) // n
    picks, short = picks[:want], None
    if len(picks) < want:
        usable = feasible_groups(len(picks), n, unit)
        short = (
            f"step {step}: {len(picks)} of data.prompts_per_step = {want} groups with reward signal after "
            f"algo.dynamic_sampling_max_rounds = {max_rounds} generation rounds"
        )
        if at_cap == "error":
            raise TrainingHalted(
                f"{short}; raise algo.dynamic_sampling_max_rounds, or set algo.dynamic_sampling_at_cap=train to "
                f"train on the groups there are"
            )
        if usable == 0:
            short += "; training on the first round as generated (its groups without signal add no gradient)"
            first = single_round(locals_[0], metas[0], n)
            return Selection(locals_[0], metas[0], metas, first.kept, total - want, short, flat)
        short += f"; training on {usable} of them" + (
            f" (the layout splits {unit} samples at a time)" if usable < len(picks) else ""
        )
        picks = picks[:usable]
    dropped = total - len(picks)
    if len(metas) == 1 and picks == [(0, g) for g in range(total)]:
        return Selection(locals_[0], metas[0], metas, len(picks), dropped, short, flat)
    merged = MergedRollout(locals_, picks)
    return Selection(merged, select_meta(metas, picks, n), metas, len(picks), dropped, short, flat)


def overlong_filtered(meta: StepMeta, step: int, max_new_tokens: int) -> StepMeta:
    """algo.overlong_filtering: the truncated samples out of the loss (`StepMeta.without_truncated`); a step
    left with no loss token stops the run (every rank decides the same from the metadata)."""
    filtered = meta.without_truncated()
    if sum(filtered.loss_tokens) == 0:
        raise TrainingHalted(
            f"step {step}: every sample was cut by rollout.max_new_tokens = {max_new_tokens} and "
            f"algo.overlong_filtering masks them all out of the loss: raise rollout.max_new_tokens or set "
            f"algo.overlong_filtering=false"
        )
    return filtered
