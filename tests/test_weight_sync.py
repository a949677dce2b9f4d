"""Bucketed weight sync and its verification, with a Hugging Face model standing in for the actor.

The actor here is a second, independent HF model: its state is the export, and its teacher-forced log-probs
are the reference. The multi-process Megatron actor versions are in tests/test_weight_sync_megatron.py.
"""

import re
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from mcore_rl.colocation import Colocation, Phase
from mcore_rl.models.tiny import make_tiny_checkpoint
from mcore_rl.rollout.embedded import EmbeddedEngine
from mcore_rl.weight_sync.buckets import sync_weights
from mcore_rl.weight_sync.verify import (
    ProbeBatch,
    SyncVerificationError,
    Tolerance,
    default_tolerance,
    verify_due,
    verify_sync,
)


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("actor_seed1"), seed=1))


def export_from(path):
    """A fresh stream of (HF name, tensor) from a checkpoint folder, one tensor at a time."""

    def stream():
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    return stream


def reference_fn(model):
    def logprobs(sequences, prompt_lens, temperature):
        out = []
        with torch.no_grad():
            for s, p in zip(sequences, prompt_lens):
                logits = model(torch.tensor([s])).logits[0].float() / temperature
                out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[p - 1 :, 0])
        return out

    return logprobs


def checkpoint_bytes(path):
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
    return sum(sizes), max(sizes), len(sizes)


def test_sync_makes_engine_equal_actor_and_changes_outputs(tiny_model_dir, actor_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
    probe = ProbeBatch.random(engine.config.vocab_size, num_seqs=3, seed=5)
    before = engine.score(probe.sequences, probe.prompt_lens)
    stats = sync_weights(export_from(actor_dir)(), engine, bucket_mb=0.05)
    total, largest, count = checkpoint_bytes(actor_dir)
    assert (stats.total_bytes, stats.largest_tensor_bytes, stats.num_tensors) == (total, largest, count)
    assert 1 < stats.num_buckets < count and stats.gb_per_s > 0
    after = engine.score(probe.sequences, probe.prompt_lens)
    ref = reference_fn(actor)(probe.sequences, probe.prompt_lens, 1.0)
    assert max((a - r).abs().max().item() for a, r in zip(after, ref)) <= 1e-4
    assert min((a - b).abs().max().item() for a, b in zip(after, before)) > 1e-2  # outputs really changed
    report = verify_sync(engine, reference_fn(actor), probe, tol=1e-4)
    assert report.passed and report.max_diff <= 1e-4 and report.num_tokens == 3 * 24 and not report.rebuilt


def test_fingerprints_only_for_a_verified_sync(tiny_model_dir, actor_dir):
    """The trainer asks for fingerprints only when it verifies the sync; the weights arrive either way."""
    engine = EmbeddedEngine(tiny_model_dir)
    plain = sync_weights(export_from(actor_dir)(), engine, bucket_mb=1, fingerprints=False)
    assert plain.fingerprints == {} and plain.num_tensors == checkpoint_bytes(actor_dir)[2]
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
    probe = ProbeBatch.random(engine.config.vocab_size, num_seqs=2, seed=5)
    assert verify_sync(engine, reference_fn(actor), probe, tol=1e-4).passed
    printed = sync_weights(export_from(actor_dir)(), engine, bucket_mb=1)
    assert sorted(printed.fingerprints) == sorted(name for name, _ in export_from(actor_dir)())


def test_bucket_smaller_than_largest_tensor(tiny_model_dir, actor_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    total, largest, count = checkpoint_bytes(actor_dir)
    with safe_open(f"{actor_dir}/model.safetensors", "pt") as f:
        big = sum(f.get_tensor(k).numel() * 4 >= largest / 4 for k in f.keys())
    stats = sync_weights(export_from(actor_dir)(), engine, bucket_mb=largest / 4 / (1 << 20))
    assert big > 1 and stats.num_buckets >= big  # each tensor of at least a bucket travels alone
    assert stats.max_bucket_bytes == largest
    # a mid-sized bucket holds several tensors but never more than the bucket (unless one tensor alone)
    stats = sync_weights(export_from(actor_dir)(), engine, bucket_mb=2.5 * largest / (1 << 20))
    assert stats.max_bucket_bytes <= 2.5 * largest and stats.num_buckets < count
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
    assert verify_sync(engine, reference_fn(actor), ProbeBatch.random(128, seed=2), tol=1e-4).passed


def test_incomplete_sync_and_bad_bucket_are_errors(tiny_model_dir, actor_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    partial = ((n, t) for n, t in export_from(actor_dir)() if "layers.1.mlp.experts.3" not in n)
    with pytest.raises(ValueError, match=r"did not receive 3 of its weights"):
        sync_weights(partial, engine, bucket_mb=1)
    with pytest.raises(ValueError, match="sync_bucket_mb=0"):
        sync_weights(export_from(actor_dir)(), engine, bucket_mb=0)


def corrupt_experts(engine, layer, scale):
    """Perturb every expert of one layer slightly, in place (what an inexact MoE reload does)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if f"layers.{layer}.mlp.experts" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def test_verification_catches_inexact_expert_reload(tiny_model_dir, actor_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
    probe = ProbeBatch.random(engine.config.vocab_size, seed=3)
    export = export_from(actor_dir)
    sync_weights(export(), engine, bucket_mb=1)
    corrupt_experts(engine, layer=1, scale=0.01)
    with pytest.raises(SyncVerificationError) as err:
        verify_sync(engine, reference_fn(actor), probe, tol=1e-3, fallback="error", export_fn=export)
    msg = str(err.value)
    assert "model.layers.1.mlp.experts." in msg and "layers [1]" in msg
    assert not re.search(r"model\.layers\.0\.", msg)  # untouched layer not blamed
    report = verify_sync(engine, reference_fn(actor), probe, tol=1e-3, fallback="rebuild", export_fn=export)
    assert not report.passed and report.max_diff > 1e-3
    assert report.rebuilt and report.max_diff_after_rebuild <= 1e-4
    assert max(engine.weight_diffs(export()).values()) == 0.0


def test_rebuild_that_cannot_fix_it_raises(tiny_model_dir, actor_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
    wrong_export = export_from(tiny_model_dir)  # rebuilding from the wrong weights cannot match the actor
    with pytest.raises(SyncVerificationError, match="still outside tolerance after the rebuild"):
        verify_sync(
            engine, reference_fn(actor), ProbeBatch.random(128), tol=1e-3, fallback="rebuild", export_fn=wrong_export
        )
    with pytest.raises(ValueError, match="needs export_fn"):
        verify_sync(engine, reference_fn(actor), ProbeBatch.random(128), tol=1e-3, fallback="rebuild")


def _sample(prompt, response):
    from mcore_rl.batch import RolloutSample

    return RolloutSample(prompt, response, torch.zeros(len(response)), "stop")


def test_probe_is_the_steps_own_sequences():
    """One sample of each prompt before a second of any, responses only, at most PROBE_SEQUENCES; alone (world 1)
    the shared probe is this rank's, and a rollout without a response keeps the fallback."""
    from mcore_rl.weight_sync.verify import PROBE_SEQUENCES, shared_probe

    groups = [
        [_sample([1, 2], [3, 4]), _sample([1, 2], [5])],
        [_sample([7], []), _sample([7], [8, 9, 10])],  # the empty response is skipped
        [_sample([11, 12, 13], [14]), _sample([11, 12, 13], [15])],
    ]
    probe = ProbeBatch.from_samples(groups, num_seqs=4, temperature=1.0)
    assert probe.sequences == [[1, 2, 3, 4], [11, 12, 13, 14], [1, 2, 5], [7, 8, 9, 10]]
    assert probe.prompt_lens == [2, 3, 2, 1]
    many = [[_sample([1], [2])] * 2 for _ in range(10)]
    assert len(ProbeBatch.from_samples(many).sequences) == PROBE_SEQUENCES == 8
    fallback = ProbeBatch.random(128, seed=1)
    assert shared_probe(groups, fallback).sequences[:2] == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert shared_probe([[_sample([1], [])]], fallback) is fallback


def test_log_prob_gap_against_a_plain_computation():
    from mcore_rl.weight_sync.verify import log_prob_gap

    g = torch.Generator().manual_seed(0)
    actor = [torch.randn(n, generator=g) for n in (3, 5, 1)]
    engine = [a + torch.randn(a.shape, generator=g) * 0.1 for a in actor]
    gap = log_prob_gap(engine, actor, 0.5)
    flat = torch.cat([(e - a).abs() for e, a in zip(engine, actor)])
    assert gap.count == 9 and gap.worst == pytest.approx(float(flat.max()))
    assert gap.mean == pytest.approx(float(flat.mean())) and gap.high == pytest.approx(float(flat.median()))
    assert log_prob_gap([torch.tensor([float("nan")])], [torch.zeros(1)], 0.5).worst == float("inf")


def test_verify_due():
    assert [verify_due(k, 2) for k in (1, 2, 3, 4)] == [False, True, False, True]
    assert not any(verify_due(k, 0) for k in range(1, 5))
    assert all(verify_due(k, 1) for k in range(1, 5))


def test_fp32_export_into_bf16_engine(tiny_model_dir, actor_dir):
    """The engine casts on copy: a bf16 engine holds exactly the bf16 rounding of the fp32 export."""
    engine = EmbeddedEngine(tiny_model_dir, dtype="bfloat16")
    sync_weights(export_from(actor_dir)(), engine, bucket_mb=1)
    for name, tensor in export_from(actor_dir)():
        held = engine._target(name, tensor)
        assert held.dtype == torch.bfloat16 and torch.equal(held, tensor.to(torch.bfloat16)), name


# ---------------------------------------------------------------- bf16: statistical bounds + weight-level check
BF16 = default_tolerance("bfloat16")


def one_step_update(path, lr=1e-6, seed=0):
    """The bf16 export after one Adam-like step at `lr` on fp32 master weights (every element moves by lr)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, t in export_from(path)():
        master = t.float() + lr * torch.randn(t.shape, generator=gen).sign()
        out.append((name, master.to(torch.bfloat16)))
    return out


def bf16_model(weights, like_dir):
    """A bf16 Hugging Face model holding `weights` (filled through the engine's checkpoint-name mapping)."""
    holder = EmbeddedEngine(like_dir, dtype="bfloat16")
    holder.rebuild_from(iter(weights))
    return holder.model.eval()


class SkipsLoads(EmbeddedEngine):
    """An engine whose in-place load silently keeps the old weights (what vLLM 0.11's argument-less
    reload_weights() does: it re-reads the checkpoint on disk)."""

    def load_weights(self, weights):
        for _ in weights:
            pass


def test_tolerance_defaults_and_overrides():
    assert default_tolerance("float32") == Tolerance(1e-3, 1e-2)
    assert BF16.mean > 0.34 and BF16.high > 5.7 and BF16.quantile == 0.99  # above the published device gaps
    assert default_tolerance("bfloat16", mean=0.1) == Tolerance(0.1, BF16.high)
    with pytest.raises(ValueError, match="no sync verification default"):
        default_tolerance("int8")


def test_clean_bf16_sync_passes_and_stale_engine_fails_on_weights(tiny_model_dir, actor_dir):
    base = [(n, t.to(torch.bfloat16)) for n, t in export_from(actor_dir)()]
    step = one_step_update(actor_dir)
    assert sum(int((a != b).sum()) for (_, a), (_, b) in zip(base, step)) > 0  # some bf16 values moved
    actor = bf16_model(step, actor_dir)
    probe = ProbeBatch.random(128, seed=4)
    clean = EmbeddedEngine(tiny_model_dir, dtype="bfloat16")
    stats = sync_weights(iter(step), clean, bucket_mb=1)
    report = verify_sync(clean, reference_fn(actor), probe, BF16, fingerprints=stats.fingerprints)
    assert report.passed and report.weights.checked == len(step) and report.weights.differ == 0
    # one sync behind: the log-probs cannot tell at lr 1e-6, the weight-level check can
    stale = SkipsLoads(tiny_model_dir, dtype="bfloat16")
    stale.rebuild_from(iter(base))
    stats = sync_weights(iter(step), stale, bucket_mb=1)
    with pytest.raises(SyncVerificationError, match=r"weights: \d+ of \d+ tensors differ") as err:
        verify_sync(stale, reference_fn(actor), probe, BF16, fingerprints=stats.fingerprints)
    assert "mean" in str(err.value)
    report = verify_sync(stale, reference_fn(actor), probe, BF16, fingerprints=None)
    assert report.passed  # without the weight-level check a stale bf16 engine passes
    report = verify_sync(
        stale,
        reference_fn(actor),
        probe,
        BF16,
        fallback="rebuild",
        export_fn=lambda: iter(step),
        fingerprints=stats.fingerprints,
    )
    assert not report.passed and report.rebuilt and report.weights.differ > 0


def test_corrupted_expert_fails_at_the_bf16_default(tiny_model_dir, actor_dir):
    actor = bf16_model([(n, t.to(torch.bfloat16)) for n, t in export_from(actor_dir)()], actor_dir)
    engine = EmbeddedEngine(tiny_model_dir, dtype="bfloat16")
    stats = sync_weights(export_from(actor_dir)(), engine, bucket_mb=1)
    corrupt_experts(engine, layer=1, scale=0.01)
    with pytest.raises(SyncVerificationError, match="tensors differ") as err:
        verify_sync(
            engine,
            reference_fn(actor),
            ProbeBatch.random(128, seed=3),
            BF16,
            fallback="error",
            export_fn=export_from(actor_dir),
            fingerprints=stats.fingerprints,
        )
    assert "model.layers.1.mlp.experts." in str(err.value)


class _HFActor:
    """The actor's side of a sync, from a Hugging Face model on disk: its export and its probe log-probs."""

    def __init__(self, path):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.hf_config = self.model.config
        self.export = export_from(path)
        self.probe_log_probs = reference_fn(self.model)

    def export_hf_weights(self, receiver=None):
        return self.export()


class _EngineHere(Colocation):
    """The colocated placement's weight-sync surface (placement.py's Placement) without its rounds."""

    receiver = property(lambda self: self.engine.capabilities.receiver)
    engine_label = ""

    def probe_scores(self, probe):
        return self.engine.score(probe.sequences, probe.prompt_lens, probe.temperature)


def test_weight_sync_object_calibrates_syncs_and_verifies(tiny_model_dir, actor_dir, caplog):
    """WeightSync (the trainer's one object) over a real engine and actor: the calibration is the gap at the engine's
    initial weights, once; a verified sync brings the engine to the actor (log-probs recomputed here); rollout.
    verify_every decides which syncs are verified; the metrics are the trainer's names."""
    from types import SimpleNamespace

    from mcore_rl.config import Config
    from mcore_rl.platform import get_platform
    from mcore_rl.weight_sync.sync import WeightSync

    cfg = Config()
    cfg = SimpleNamespace(rollout=replace(cfg.rollout, verify_every=2), model=cfg.model, trainer=cfg.trainer)
    engine, actor = EmbeddedEngine(tiny_model_dir), _HFActor(actor_dir)
    placement = _EngineHere(actor, engine, get_platform("cpu"), offload=False, sync=lambda: None)
    sync = WeightSync(cfg, actor, placement, rank=0, release=lambda: None)
    groups = [[_sample([1, 2, 3], [4, 5, 6, 7])], [_sample([9, 8], [7, 6, 5])]]
    selection = SimpleNamespace(first_round=SimpleNamespace(groups=groups))

    assert sync.calibration() == {}  # nothing scored yet
    sync.after_rollout(0, selection)
    probe = sync.verifier.probe
    assert probe.sequences == [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]  # the step's own sequences
    engine_lp = engine.score(probe.sequences, probe.prompt_lens)
    actor_lp = actor.probe_log_probs(probe.sequences, probe.prompt_lens, 1.0)
    gaps = torch.cat([(e - a).abs() for e, a in zip(engine_lp, actor_lp)])
    with caplog.at_level("WARNING", logger="mcore_rl.weight_sync.verifier"):
        calibration = sync.calibration()
    assert calibration["sync/calibration_max_diff"] == pytest.approx(float(gaps.max()))
    assert calibration["sync/calibration_mean_diff"] == pytest.approx(float(gaps.mean()))
    assert float(gaps.mean()) > 1e-3 and "sync calibration (initial weights, 7 rollout tokens)" in caplog.text
    assert sync.calibration() == {}  # once

    unverified = sync.after_update(0)  # sync 1 of verify_every 2
    assert sorted(unverified) == ["sync/gb_per_s", "sync/seconds"] and placement.phase is Phase.ROLLOUT
    after = engine.score(probe.sequences, probe.prompt_lens)
    assert max(float((e - a).abs().max()) for e, a in zip(after, actor_lp)) <= 1e-4  # the engine is the actor now
    sync.after_rollout(1, SimpleNamespace(first_round=SimpleNamespace(groups=groups[1:])))
    assert sync.verifier.probe.sequences == [[9, 8, 7, 6, 5]]  # the next sync is verified: its probe is this step's
    verified = sync.after_update(1)
    assert verified["sync/verify_max_diff"] <= 1e-4 and verified["sync/rebuilt"] == 0.0
    assert verified["sync/verify_weights_differ"] == 0.0 and "sync/verify_high_diff" in verified
