"""Weight sync from the actor to the rollout engine, streamed in buckets, and its verification.

Multi-rank contract (every rank of the actor calls these functions, in the same order):
- ``sync_weights``: every rank iterates the exporter to the end, because the exporter gathers each full
  tensor with collectives over TP / PP / EP groups; only ranks that hold an engine replica (``engine`` is not
  None) load what they receive, the others drop each tensor as soon as it is yielded.
- ``verify_sync``: every rank calls ``reference_logprob_fn`` (the actor's forward is collective); ranks with an
  engine score the probe batch and compare; the max / mean difference is reduced over the process group so
  every rank takes the same decision (pass, rebuild, or raise) and no rank is left waiting in a collective.

Memory: a bucket holds at most ``bucket_mb`` of tensors (a single larger tensor travels alone), so the extra
memory of a sync is about one bucket plus the one tensor the exporter is gathering.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from mcore_rl.rollout.base import RolloutEngine

log = logging.getLogger(__name__)

WeightStream = Iterable[tuple[str, torch.Tensor]]
ReferenceLogprobFn = Callable[[list[list[int]], list[int], float], list[torch.Tensor]]


class SyncVerificationError(RuntimeError):
    """The engine's log-probs disagree with the actor's after a weight sync."""


@dataclass
class SyncStats:
    num_tensors: int
    num_buckets: int
    total_bytes: int
    largest_tensor_bytes: int
    max_bucket_bytes: int  # the largest bucket actually held (>= bucket size only for a single oversized tensor)
    seconds: float  # wall time of the whole sync (export + load)
    export_seconds: float  # time spent inside the exporter (gathers)
    load_seconds: float  # time spent in engine.load_weights

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / 1e9 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        return (
            f"weight sync: {self.num_tensors} tensors, {self.total_bytes / 1e9:.3f} GB in {self.num_buckets} "
            f"buckets (largest {self.max_bucket_bytes / 1e6:.1f} MB) in {self.seconds:.3f} s = "
            f"{self.gb_per_s:.2f} GB/s (export {self.export_seconds:.3f} s, load {self.load_seconds:.3f} s)"
        )


def _timed(stream: WeightStream, clock: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield from `stream`, adding the time spent producing each item to clock[0]."""
    it = iter(stream)
    while True:
        start = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            clock[0] += time.perf_counter() - start
            return
        clock[0] += time.perf_counter() - start
        yield item


def sync_weights(export_iter: WeightStream, engine: Optional[RolloutEngine], bucket_mb: float, group=None) -> SyncStats:
    """Stream (HF name, full tensor) pairs from the exporter into `engine` in buckets of `bucket_mb` MB.

    `engine` is None on ranks without an engine replica (they still drive the exporter; see module doc).
    After the stream, an engine that knows its weight names checks that every one of them arrived; the
    outcome is agreed over `group` (default: all ranks), so a missing weight raises on every rank.
    """
    if bucket_mb <= 0:
        raise ValueError(f"rollout.sync_bucket_mb={bucket_mb}; use a positive bucket size in MB (e.g. 256)")
    limit = int(bucket_mb * (1 << 20))
    export_clock = [0.0]
    load_seconds = 0.0
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_bytes = 0
    stats = dict(num_tensors=0, num_buckets=0, total_bytes=0, largest_tensor_bytes=0, max_bucket_bytes=0)
    seen: set[str] = set()

    def flush() -> None:
        nonlocal bucket, bucket_bytes, load_seconds
        if not bucket:
            return
        stats["num_buckets"] += 1
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], bucket_bytes)
        if engine is not None:
            start = time.perf_counter()
            engine.load_weights(bucket)
            load_seconds += time.perf_counter() - start
        bucket, bucket_bytes = [], 0  # drop references so the bucket's memory is freed before the next fills

    start = time.perf_counter()
    for name, tensor in _timed(export_iter, export_clock):
        size = tensor.numel() * tensor.element_size()
        stats["num_tensors"] += 1
        stats["total_bytes"] += size
        stats["largest_tensor_bytes"] = max(stats["largest_tensor_bytes"], size)
        seen.add(name)
        if bucket and bucket_bytes + size > limit:
            flush()
        bucket.append((name, tensor))
        bucket_bytes += size
        del tensor
        if bucket_bytes >= limit:  # a tensor at least as big as a bucket goes alone
            flush()
    flush()
    result = SyncStats(
        seconds=time.perf_counter() - start, export_seconds=export_clock[0], load_seconds=load_seconds, **stats
    )
    _check_complete(engine, seen, group)
    log.info(result.summary())
    return result


def _check_complete(engine: Optional[RolloutEngine], seen: set[str], group) -> None:
    """Raise on every rank (so none waits in a later collective) when an engine missed some of its weights."""
    expected = engine.weight_names() if engine is not None else None
    missing = sorted(expected - seen) if expected is not None else []
    count = torch.tensor([len(missing)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if count.item():
        example = f" (e.g. {missing[:3]})" if missing else " on another rank"
        raise ValueError(
            f"weight sync delivered {len(seen)} tensors but an engine did not receive {count.item()} of its "
            f"weights{example}; its copies of those are stale - the exporter must yield every Hugging "
            f"Face weight"
        )


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
        """Uniformly random token ids: every token of the vocabulary and, in an MoE, many experts get exercised."""
        gen = torch.Generator().manual_seed(seed)
        seqs = torch.randint(0, vocab_size, (num_seqs, prompt_len + response_len), generator=gen)
        return cls([s.tolist() for s in seqs], [prompt_len] * num_seqs, temperature)


@dataclass
class VerifyReport:
    max_diff: float  # max |engine - actor| log-prob over all probe tokens and ranks (nats)
    mean_diff: float
    num_tokens: int
    tolerance: float
    passed: bool  # the first comparison was within tolerance
    rebuilt: bool = False  # the engine was rebuilt from exported weights (fallback "rebuild")
    max_diff_after_rebuild: Optional[float] = None
    seconds: float = 0.0

    def summary(self) -> str:
        text = (
            f"sync verification: engine vs actor log-probs max {self.max_diff:.3g} mean {self.mean_diff:.3g} nats "
            f"over {self.num_tokens} tokens (tolerance {self.tolerance:g}): {'ok' if self.passed else 'FAILED'}"
        )
        if self.rebuilt:
            text += f"; rebuilt the engine from exported weights -> max {self.max_diff_after_rebuild:.3g}"
        return text


def verify_due(sync_count: int, verify_every: int) -> bool:
    """Whether sync number `sync_count` (1-based) is verified under rollout.verify_every (0: never)."""
    return verify_every > 0 and sync_count % verify_every == 0


def _compare(
    engine: Optional[RolloutEngine], reference_logprob_fn: ReferenceLogprobFn, probe: ProbeBatch, group
) -> tuple[float, float, int]:
    """(max, mean, count) of |engine - actor| over the probe tokens, reduced over the group."""
    reference = reference_logprob_fn(probe.sequences, probe.prompt_lens, probe.temperature)
    worst, total, count = 0.0, 0.0, 0
    if engine is not None:
        scored = engine.score(probe.sequences, probe.prompt_lens, probe.temperature)
        for i, (ours, ref) in enumerate(zip(scored, reference)):
            if ours.shape != ref.shape:
                raise ValueError(
                    f"probe sequence {i}: engine gave {tuple(ours.shape)} log-probs, actor "
                    f"{tuple(ref.shape)}; both must cover the tokens at positions >= prompt_len"
                )
            diff = (ours.float().cpu() - ref.float().cpu()).abs()
            # NaN/inf outputs must fail the check: max() and comparisons with NaN would silently pass them.
            diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
            worst = max(worst, diff.max().item())
            total += diff.sum().item()
            count += diff.numel()
    if dist.is_available() and dist.is_initialized():
        worst_t = torch.tensor([worst], dtype=torch.float64)
        sums = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sums, group=group)
        worst, total, count = worst_t.item(), sums[0].item(), int(sums[1].item())
    if count == 0:
        raise ValueError("sync verification compared no tokens: no rank holds an engine or the probe is empty")
    return worst, total / count, count


def _drain(stream: WeightStream) -> None:
    for _ in stream:  # ranks without an engine still take part in the exporter's collectives
        pass


def _worst_tensors(engine: Optional[RolloutEngine], export_fn: Callable[[], WeightStream], group) -> str:
    """Name the tensors whose engine copy differs most from the actor's export, over all ranks."""
    if engine is None:
        _drain(export_fn())
        diffs = None
    else:
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
    engine: Optional[RolloutEngine],
    reference_logprob_fn: ReferenceLogprobFn,
    probe_batch: ProbeBatch,
    tol: float,
    fallback: str = "error",
    export_fn: Optional[Callable[[], WeightStream]] = None,
    group=None,
) -> VerifyReport:
    """Compare the engine's log-probs of `probe_batch` with the actor's (`reference_logprob_fn`).

    Within `tol` -> a passing report. Above it:
    - fallback "rebuild": recreate the engine from a fresh export (`export_fn()`, collective on every rank) via
      `engine.rebuild_from`, an exact path; compare again; still above `tol` -> SyncVerificationError.
    - fallback "error": SyncVerificationError naming the worst tensors / layers when `export_fn` is given and
      the engine can read its weights back.
    """
    if fallback not in ("rebuild", "error"):
        raise ValueError(f"rollout.verify_fallback={fallback!r}; use 'rebuild' or 'error'")
    if fallback == "rebuild" and export_fn is None:
        raise ValueError("verify_fallback='rebuild' needs export_fn (a callable returning a fresh weight export)")
    start = time.perf_counter()
    worst, mean, count = _compare(engine, reference_logprob_fn, probe_batch, group)
    report = VerifyReport(max_diff=worst, mean_diff=mean, num_tokens=count, tolerance=tol, passed=worst <= tol)
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
        if engine is None:
            _drain(export_fn())
        else:
            engine.rebuild_from(export_fn())
        report.rebuilt = True
        report.max_diff_after_rebuild, _, _ = _compare(engine, reference_logprob_fn, probe_batch, group)
        if report.max_diff_after_rebuild > tol:
            raise SyncVerificationError(
                f"{report.summary()}: still above tolerance after the rebuild; engine and actor "
                f"compute different functions of the same weights (check dtype / model config)"
            )
    report.seconds = time.perf_counter() - start
    log.info(report.summary())
    return report
