"""Shared-memory all-gather (the exporter's same-host transport) against torch.distributed.all_gather, over
real processes: odd shapes, bf16/fp16/fp32/int/bool, strided destinations, multi-round tensors, senders that
do not receive, the mismatched-shapes error, no files left in /dev/shm, and the torch.distributed fallback
when the ranks report different hosts. Also the pure layout helpers the exporter gathers into."""

import os

import pytest
import torch
from safetensors import safe_open

from mcore_rl.models.shards import as_shard_view, shard_views, split_shards
from mcore_rl.platform.shm_gather import _pieces, _round_bytes, _rounds
from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "shm_gather_check.py"


@pytest.mark.slow
@pytest.mark.parametrize("nproc,mode", [(2, "shm"), (3, "shm"), (2, "fallback")])
def test_shm_gather_equals_all_gather(nproc, mode):
    results = run_worker(WORKER, nproc, mode=mode, timeout=120).results
    # one per rank (run_worker fails unless all nproc ranks reported)
    assert [(r["mode"], r["shared_memory"], r["cases"]) for r in results] == [(mode, mode == "shm", 11)] * nproc


@pytest.mark.parametrize(
    "name,shape,dim",
    [
        ("decoder.layers.0.mlp.experts.linear_fc1.weight3", (8, 6), 0),  # gated: [gate; up]
        ("decoder.layers.0.self_attention.linear_qkv.weight", (8, 6), 0),
        ("decoder.layers.0.self_attention.linear_proj.weight", (6, 8), 1),
    ],
)
def test_shard_views_are_where_split_takes_shards_from(name, shape, dim):
    full = torch.arange(48.0).reshape(shape)
    views = shard_views(name, full, 2, dim, gated=True)
    for view, shard in zip(views, split_shards(name, full, 2, dim, gated=True)):
        assert view.data_ptr() >= full.data_ptr()  # a view into `full`, not a copy
        assert torch.equal(view, as_shard_view(name, shard, gated=True))


def test_rounds_respect_the_chunk_limit_and_alignment():
    items = [torch.zeros(1000, 3), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(7, 7, dtype=torch.int64)]
    pieces = [p for t in items for p in _pieces(t, None, 4096)]
    assert sum(p.nbytes for p in pieces) == sum(t.numel() * t.element_size() for t in items)
    rounds = _rounds(pieces, 4096)
    assert len(rounds) > 1
    for r in rounds:
        assert _round_bytes(r) <= 4096
        assert all(p.offset % 64 == 0 for p in r)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,tp,ep,etp", [(2, 1, 2, 1), (2, 2, 1, 2), (4, 2, 2, 2)], ids=["ep2", "tp2", "tp2-ep2-etp2"]
)
def test_export_over_shared_memory_is_bit_exact(tiny_model_dir, nproc, tp, ep, etp):
    worker = REPO / "tests" / "workers" / "shm_export_check.py"
    results = run_worker(worker, nproc, tiny_dir=tiny_model_dir, tp=tp, ep=ep, etp=etp, timeout=240).results
    with safe_open(os.path.join(tiny_model_dir, "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    # one per rank (run_worker fails unless all nproc ranks reported), each compared 9 exports of every tensor
    # and gathered some tensors straight into the engine's memory (every layout here splits some tensor)
    for r in results:
        assert (r["layout"], r["tensors"], len(r["exports"])) == ([tp, ep, etp], tensors, 9), r
        assert 0 < r["in_place"] <= tensors, r
        # every gathered tensor went straight into the engine, none through a full-size buffer; at TP2 that
        # includes the fused QKV (regrouped per query group) and the embedding / output layer (row plans); with
        # ETP > 1 only the peers' expert shards are staged between the EP and the ETP gather
        assert r["buffered"] == [] and r["direct_bytes"] > 0, r
        if tp > 1:  # (at TP1 they are not split: the engine copies the actor's tensor once)
            assert r["rows_moved_not_in_place"] == [], r
        assert (r["staged_bytes"] > 0) == (ep > 1 and etp > 1), r
        # engines in shared memory: every rank wrote its shards straight into them, nothing through a buffer or
        # a gather segment, except the experts' EP-then-ETP gather (its intermediate step stays a gather)
        staged = ep > 1 and etp > 1
        assert r["shared_buffered"] == [] and r["shared_direct_bytes"] == r["direct_bytes"], r
        assert (r["shared_segment_bytes"] > 0) == staged, r
    assert (results[0]["rank0_only_shared_segment_bytes"] > 0) == staged, results[0]
    if nproc == 2:  # a rank that judged one tensor differently: every rank raised at the batch's confirmation
        assert all("disagree" in r["disagreement"] for r in results), results
    print(f"into the engine: {results[0]['in_place']} of {tensors} tensors gathered in place")
