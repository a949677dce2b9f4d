"""MoE routing replay (R2 / R3) on the real Megatron actor: see tests/workers/replay_layouts.py for the checks
(replay of same-weight routes is bit-identical in logits, loss and grads; replay of perturbed routes uses
exactly those experts and the mismatch metric equals an independent count; R3 from the embedded engine's
routes gives 0 mismatch; misuse raises; the same on packed token-budget micro-batches). Plus the packing of engine routes, in-process."""

import pytest
import torch

from mcore_rl.batch import pad_rollout_routes
from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.megatron.routing_replay import RecordedRoutes
from mcore_rl.preflight.layout import LayoutError, validate_layout
from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "replay_layouts.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,tp,pp,ep,recompute",
    [(1, 1, 1, 1, 0), (2, 2, 1, 1, 0), (2, 1, 1, 2, 1), (2, 1, 2, 1, 0)],
    ids=["world1", "tp2-sp", "ep2-dp2-recompute", "pp2"],
)
def test_routing_replay_layout(tiny_model_dir, nproc, tp, pp, ep, recompute):
    if compat_megatron.layout_problem(tp, ep, 1, tp > 1, None):  # megatron-core < 0.13: TP2 / ETP1 rejected
        with pytest.raises(LayoutError, match=r"\(< 0\.13\)"):
            validate_layout(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1), nproc, tiny_model_dir, platform="cpu")
        return
    results = run_worker(WORKER, nproc, model_dir=tiny_model_dir, tp=tp, pp=pp, ep=ep, recompute=recompute).results
    for r in results:  # one per rank (run_worker fails unless all nproc ranks reported)
        assert r["token_mismatch"] > 0 and abs(r["token_mismatch"] - r["token_mismatch_counted"]) < 1e-12, r
        assert abs(r["expert_mismatch"] - r["expert_mismatch_counted"]) < 1e-12, r
        assert abs(r["masked_token_mismatch"] - r["masked_token_mismatch_counted"]) < 1e-12, r
        assert r["masked_token_mismatch"] != r["token_mismatch"], r
        assert r["r3_token_mismatch"] == 0.0 and r["r3_logit_gap"] < 1e-5, r
        packed = r["packed"]  # 5.: packed R3 and R2
        assert packed["r3_token_mismatch"] == 0.0 and packed["r2_token_mismatch"] == 0.0, r
        assert packed["logit_gap"] < 1e-5 and packed["r3_logit_gap"] < 1e-5 and packed["r2_loss_diff"] == 0.0, r


def test_pad_rollout_routes_pads_with_distinct_experts():
    a = torch.tensor([[[5, 1]], [[2, 7]], [[0, 3]]], dtype=torch.int16)  # T=3, 1 layer, k=2
    b = torch.tensor([[[4, 6]]], dtype=torch.int16)  # T=1
    ids, valid = pad_rollout_routes([a, b], seq_len=8, num_experts=8)
    assert ids.shape == (2, 8, 1, 2) and valid.tolist() == [[True] * 3 + [False] * 5, [True] + [False] * 7]
    assert torch.equal(ids[0, :3], a) and torch.equal(ids[1, :1], b)
    pads = ids[~valid].reshape(-1, 2)
    assert bool((pads[:, 0] != pads[:, 1]).all()), "a padding token got the same expert twice"
    assert len(set(pads.flatten().tolist())) == 8, "padding should spread over all experts"


def test_pad_rollout_routes_rejects_bad_shapes():
    with pytest.raises(ValueError, match="cover 9 tokens > packed length 8"):
        pad_rollout_routes([torch.zeros(9, 1, 2, dtype=torch.int16)], seq_len=8, num_experts=8)
    with pytest.raises(ValueError, match=r"expected \[T, 1, 2\]"):
        pad_rollout_routes([torch.zeros(3, 1, 2), torch.zeros(3, 2, 2)], seq_len=8, num_experts=8)
    with pytest.raises(TypeError, match="slice"):
        RecordedRoutes()[0]
