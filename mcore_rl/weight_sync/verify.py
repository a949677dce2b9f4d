"""The sync's verification: the engine's log-probs of a probe against the actor's, the weight-level check of the
sync's fingerprints, the worst tensors named on a failure, the rebuild fallback, the tolerances.

Multi-rank contract: every rank calls ``reference_logprob_fn`` (the actor's forward is collective); ranks with an
engine score the probe batch and compare; the max / mean difference is reduced over the process group so every rank
takes the same decision (pass, rebuild, or raise) and no rank is left waiting in a collective. `SyncVerifier`
(verifier.py) holds the run's probe and tolerance and calls these.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mcore_rl.batch import RolloutSample
from mcore_rl.platform import collectives
from mcore_rl.safety import TrainingHalted
from mcore_rl.weight_sync.buckets import Engine, WeightStream

log = logging.getLogger(__name__)

ReferenceLogprobFn = Callable[[list[list[int]], list[int], float], list[torch.Tensor]]


class SyncVerificationError(TrainingHalted):
    """The engine's log-probs disagree with the actor's after a weight sync: the run stops with one line (the
    message names the worst tensors and the fix), not a crash's traceback."""


@dataclass(frozen=True)
class Tolerance:
    """Pass bounds of a sync verification over the probe tokens' |engine - actor| log-prob (nats, fp32)."""

    mean: float  # bound on the mean |delta|
    high: float  # bound on the `quantile` of |delta| (quantile 1.0: the maximum)
    quantile: float = 0.99

    def __post_init__(self):
        if not (self.mean > 0 and self.high > 0 and 0 < self.quantile <= 1):
            raise ValueError(f"sync verification tolerance {self}: mean, high > 0 and 0 < quantile <= 1")


# Defaults per actor dtype (docs/devices.md, "Sync verification"). float32: CPU / fp32 runs, where the exact
# weights give agreement to ~1e-5. bfloat16 / float16: above the published gaps between a bf16 training stack
# and a bf16 vLLM engine on the same checkpoint (Qwen3-30B-A3B, Megatron vs vLLM: mean |delta| 0.34, worst
# token 5.7 nats; dense Qwen3-32B: mean 0.006, worst 0.08); a tiny model on CPU cannot show device gaps. In
# half precision the log-prob check catches gross errors (wrong config, dtype, garbage weights); stale or
# partly wrong tensors are caught by the weight-level check (`check_weights`).
DEFAULT_TOLERANCES = {
    "float32": Tolerance(mean=1e-3, high=1e-2),
    "bfloat16": Tolerance(mean=0.5, high=8.0),
    "float16": Tolerance(mean=0.5, high=8.0),
}


def default_tolerance(dtype: str, mean: Optional[float] = None, high: Optional[float] = None) -> Tolerance:
    """The dtype's default, with `mean` / `high` (rollout.verify_tolerance / verify_high_tolerance) if set."""
    if dtype not in DEFAULT_TOLERANCES:
        raise ValueError(f"no sync verification default for dtype {dtype!r}; use one of {list(DEFAULT_TOLERANCES)}")
    base = DEFAULT_TOLERANCES[dtype]
    return Tolerance(mean=mean if mean is not None else base.mean, high=high if high is not None else base.high)


def as_tolerance(tol: "float | Tolerance") -> Tolerance:
    """A plain number bounds both the mean and the maximum (quantile 1.0)."""
    return tol if isinstance(tol, Tolerance) else Tolerance(mean=float(tol), high=float(tol), quantile=1.0)


PROBE_SEQUENCES = 8  # rollout sequences a verification scores (every rank the same ones)


@dataclass
class ProbeBatch:
    """Fixed sequences scored by engine and actor after a sync (log-probs of positions >= prompt_len)."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    temperature: float = 1.0

    @classmethod
    def random(
        cls,
        vocab_size: int,
        num_seqs: int = 4,
        prompt_len: int = 8,
        response_len: int = 24,
        seed: int = 0,
        temperature: float = 1.0,
    ) -> "ProbeBatch":
        """Uniformly random token ids: the probe before any rollout exists (a resumed run's first sync). The
        tolerances come from gaps on natural text, so once a step has rolled out its own sequences are the probe
        (`from_samples`, `shared_probe`)."""
        gen = torch.Generator().manual_seed(seed)
        seqs = torch.randint(0, vocab_size, (num_seqs, prompt_len + response_len), generator=gen)
        return cls([s.tolist() for s in seqs], [prompt_len] * num_seqs, temperature)

    @classmethod
    def from_samples(
        cls, groups: list[list[RolloutSample]], num_seqs: int = PROBE_SEQUENCES, temperature: float = 1.0
    ) -> Optional["ProbeBatch"]:
        """Up to `num_seqs` of the step's own sequences (prompt + response), one sample of each prompt before a
        second of any, those with a response only; None when there is none."""
        width = max((len(g) for g in groups), default=0)
        picked = [g[j] for j in range(width) for g in groups if j < len(g) and g[j].response_ids][:num_seqs]
        if not picked:
            return None
        return cls([s.prompt_ids + s.response_ids for s in picked], [len(s.prompt_ids) for s in picked], temperature)


def shared_probe(groups: list[list[RolloutSample]], fallback: ProbeBatch, group=None) -> ProbeBatch:
    """The probe every rank scores after the next sync: rank 0's `ProbeBatch.from_samples` of its share of the
    step's rollout (the actor's forward is collective: every rank must pass the same sequences), else `fallback`."""
    mine = ProbeBatch.from_samples(groups, temperature=fallback.temperature)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return mine or fallback
    box = [mine]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0] or fallback


@dataclass
class WeightCheck:
    """Weight-level check: the engine's values at each tensor's fingerprint positions vs what the sync sent."""

    checked: int  # tensors compared, over all ranks
    differ: int  # tensors whose engine values differ
    unsupported: int  # ranks whose engine cannot read its weights back in Hugging Face layout
    examples: tuple[str, ...] = ()  # names of differing tensors (this rank)

    @property
    def passed(self) -> bool:
        return self.differ == 0


@dataclass
class VerifyReport:
    max_diff: float  # max |engine - actor| log-prob over all probe tokens and ranks (nats)
    mean_diff: float
    num_tokens: int
    tolerance: Tolerance
    passed: bool  # the first comparison (log-probs and weights) was within tolerance
    high_diff: float = 0.0  # the tolerance's quantile of |delta| (max over ranks)
    weights: Optional[WeightCheck] = None
    rebuilt: bool = False  # the engine was rebuilt from exported weights (fallback "rebuild")
    max_diff_after_rebuild: Optional[float] = None
    seconds: float = 0.0

    def summary(self) -> str:
        tol = self.tolerance
        text = (
            f"sync verification: engine vs actor log-probs mean {self.mean_diff:.3g} (tolerance {tol.mean:g}), "
            f"q{tol.quantile:g} {self.high_diff:.3g} (tolerance {tol.high:g}), max {self.max_diff:.3g} nats over "
            f"{self.num_tokens} tokens"
        )
        if self.weights is not None:
            w = self.weights
            text += f"; weights: {w.differ} of {w.checked} tensors differ"
            if w.examples:
                text += f" (e.g. {', '.join(w.examples[:3])})"
            if w.unsupported:
                text += f"; {w.unsupported} rank(s) cannot read weights back"
        text += f": {'ok' if self.passed else 'FAILED'}"
        if self.rebuilt:
            text += f"; rebuilt the engine from exported weights -> max {self.max_diff_after_rebuild:.3g}"
        return text


def verify_due(sync_count: int, verify_every: int) -> bool:
    """Whether sync number `sync_count` (1-based) is verified under rollout.verify_every (0: never)."""
    return verify_every > 0 and sync_count % verify_every == 0


@dataclass(frozen=True)
class _Diffs:
    worst: float
    mean: float
    high: float
    count: int

    def within(self, tol: Tolerance) -> bool:
        return self.mean <= tol.mean and self.high <= tol.high


def _compare(
    engine: Optional[Engine], reference_logprob_fn: ReferenceLogprobFn, probe: ProbeBatch, tol: Tolerance, group
) -> _Diffs:
    """Mean, tol.quantile and max of |engine - actor| (fp32) over the probe tokens, agreed over the group (the
    quantile is the largest of the ranks' own: replicas are checked separately)."""
    reference = reference_logprob_fn(probe.sequences, probe.prompt_lens, probe.temperature)
    scored = engine.score(probe.sequences, probe.prompt_lens, probe.temperature) if engine is not None else None
    return log_prob_gap(scored, reference, tol.quantile, group)


def log_prob_gap(
    scored: Optional[list[torch.Tensor]], reference: list[torch.Tensor], quantile: float, group=None
) -> "_Diffs":
    """Mean, `quantile` and max of |engine - actor| (fp32) over the tokens of `scored` (the engine's log-probs of
    the probe, None on a rank without an engine) against `reference` (the actor's), agreed over the group."""
    diffs = []
    if scored is not None:
        for i, (ours, ref) in enumerate(zip(scored, reference)):
            if ours.shape != ref.shape:
                raise ValueError(
                    f"probe sequence {i}: engine gave {tuple(ours.shape)} log-probs, actor "
                    f"{tuple(ref.shape)}; both must cover the tokens at positions >= prompt_len"
                )
            diff = (ours.float().cpu() - ref.float().cpu()).abs()
            # NaN/inf outputs must fail the check: max() and comparisons with NaN would silently pass them.
            diffs.append(torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf"))))
    local = torch.cat(diffs) if diffs else torch.zeros(0)
    worst = float(local.max()) if local.numel() else 0.0
    high = float(torch.quantile(local, quantile)) if local.numel() else 0.0
    total = math.fsum(local.tolist())
    worst, high = collectives.max_floats([worst, high], group)
    total = collectives.sum_floats([total], group)[0]
    count = collectives.sum_ints([local.numel()], group)[0]
    if count == 0:
        raise ValueError("sync verification compared no tokens: no rank holds an engine or the probe is empty")
    return _Diffs(worst, total / count, high, count)


def check_weights(engine: Optional[Engine], fingerprints: dict[str, torch.Tensor], group) -> WeightCheck:
    """Compare the engine's values at the fingerprint positions with what the sync sent; collective."""
    checked = differ = unsupported = 0
    examples: list[str] = []
    if engine is not None and fingerprints:
        if not engine.capabilities.reads_weights:
            unsupported = 1
        else:
            got = engine.weight_fingerprints(list(fingerprints))
            for name, sent in fingerprints.items():
                checked += 1
                mine = got[name].cpu()  # the engine's dtype: compare with what its copy_ of `sent` would hold
                if not torch.equal(mine.float(), sent.to(mine.dtype).float()):
                    differ += 1
                    examples.append(name)
    checked, differ, unsupported = collectives.sum_ints([checked, differ, unsupported], group)
    return WeightCheck(checked, differ, unsupported, tuple(examples[:5]))


def _drain(stream: WeightStream) -> None:
    for _ in stream:  # ranks without an engine still take part in the exporter's collectives
        pass


def _worst_tensors(engine: Optional[Engine], export_fn: Callable[[], WeightStream], group) -> str:
    """Name the tensors whose engine copy differs most from the actor's export, over all ranks."""
    diffs = None
    if engine is None:
        _drain(export_fn())
    elif engine.capabilities.reads_weights:
        diffs = engine.weight_diffs(export_fn())
    top = sorted(diffs.items(), key=lambda kv: -kv[1])[:5] if diffs is not None else None
    gathered = [top]
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, top, group=group)
    tops = [t for t in gathered if t is not None]
    if not tops:
        return "the engine cannot read its weights back to name the tensors; rollout.verify_fallback=rebuild recovers"
    worst = sorted({name: d for t in tops for name, d in t}.items(), key=lambda kv: -kv[1])[:5]
    if not worst or worst[0][1] == 0:
        return "every engine weight equals the export, so the difference lies in the engine's compute, not its weights"
    layers = sorted({int(m.group(1)) for name, d in worst if d > 0 and (m := re.search(r"layers\.(\d+)\.", name))})
    named = ", ".join(f"{name} (max |dw| {d:.3g})" for name, d in worst if d > 0)
    return f"worst tensors: {named}" + (f"; layers {layers}" if layers else "")


def verify_sync(
    engine: Optional[Engine],
    reference_logprob_fn: ReferenceLogprobFn,
    probe_batch: ProbeBatch,
    tol: "float | Tolerance",
    fallback: str = "error",
    export_fn: Optional[Callable[[], WeightStream]] = None,
    group=None,
    fingerprints: Optional[dict[str, torch.Tensor]] = None,
    release: Optional[Callable[[], None]] = None,
) -> VerifyReport:
    """Compare the engine with the actor after a sync: log-probs of `probe_batch` (mean and a high quantile
    of |delta| within `tol`; a plain number bounds the mean and the maximum) and, given the sync's
    `fingerprints` (SyncStats.fingerprints; pass them on every rank or on none), the engine's weights.

    Within bounds -> a passing report. Otherwise:
    - fallback "rebuild": recreate the engine from a fresh export (`export_fn()`, collective on every rank) via
      `engine.rebuild_from`, an exact path; compare again; still outside -> SyncVerificationError.
    - fallback "error": SyncVerificationError naming the worst tensors / layers when `export_fn` is given and
      the engine can read its weights back.
    `release` (Platform.release_cache) runs before a rebuild: it maps memory beside the awake engine.
    """
    if fallback not in ("rebuild", "error"):
        raise ValueError(f"rollout.verify_fallback={fallback!r}; use 'rebuild' or 'error'")
    if fallback == "rebuild" and export_fn is None:
        raise ValueError("verify_fallback='rebuild' needs export_fn (a callable returning a fresh weight export)")
    tol = as_tolerance(tol)
    start = time.perf_counter()
    weights = check_weights(engine, fingerprints, group) if fingerprints is not None else None
    diffs = _compare(engine, reference_logprob_fn, probe_batch, tol, group)
    report = VerifyReport(
        max_diff=diffs.worst,
        mean_diff=diffs.mean,
        high_diff=diffs.high,
        num_tokens=diffs.count,
        tolerance=tol,
        weights=weights,
        passed=diffs.within(tol) and (weights is None or weights.passed),
    )
    if not report.passed:
        if fallback == "error":
            where = (
                _worst_tensors(engine, export_fn, group) if export_fn is not None else "pass export_fn to name tensors"
            )
            raise SyncVerificationError(
                f"{report.summary()}; {where}. The engine would sample from a different "
                f"policy than the one trained; use rollout.verify_fallback=rebuild to recover"
            )
        log.warning("%s; rebuilding the engine from exported weights", report.summary())
        if release is not None:
            release()
        if engine is None:
            _drain(export_fn())
        else:
            engine.rebuild_from(export_fn())
        report.rebuilt = True
        after = _compare(engine, reference_logprob_fn, probe_batch, tol, group)
        report.max_diff_after_rebuild = after.worst
        weights_after = check_weights(engine, fingerprints, group) if fingerprints is not None else None
        if not after.within(tol) or (weights_after is not None and not weights_after.passed):
            raise SyncVerificationError(
                f"{report.summary()}: still outside tolerance after the rebuild (mean {after.mean:.3g}, "
                f"q{tol.quantile:g} {after.high:.3g}); engine and actor compute different functions of the same "
                f"weights (check dtype / model config)"
            )
    report.seconds = time.perf_counter() - start
    log.info(report.summary())
    return report
