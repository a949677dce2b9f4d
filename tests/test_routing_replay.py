"""MoE routing replay (R2 / R3) on the real Megatron actor: see tests/workers/replay_layouts.py for the checks
(replay of same-weight routes is bit-identical in logits, loss and grads; replay of perturbed routes uses
exactly those experts and the mismatch metric equals an independent count; R3 from the embedded engine's
routes gives 0 mismatch; misuse raises; the same on packed token-budget micro-batches). Plus the packing of engine routes, in-process."""

import pytest
import torch

from mcore_rl.batch import pack_rollout_routes
from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.megatron.layout import LayoutError, validate_layout
from mcore_rl.megatron.routing_replay import RecordedRoutes
from tests.torchrun_util import REPO, run_torchrun

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
    out = run_torchrun(WORKER, nproc, tiny_model_dir, tp, pp, ep, recompute)
    assert out.count(" OK replay ") == nproc and out.count(" PACKED_REPLAY_OK ") == nproc, out[-3000:]


def test_pack_rollout_routes_pads_with_distinct_experts():
    a = torch.tensor([[[5, 1]], [[2, 7]], [[0, 3]]], dtype=torch.int16)  # T=3, 1 layer, k=2
    b = torch.tensor([[[4, 6]]], dtype=torch.int16)  # T=1
    ids, valid = pack_rollout_routes([a, b], seq_len=8, num_experts=8)
    assert ids.shape == (2, 8, 1, 2) and valid.tolist() == [[True] * 3 + [False] * 5, [True] + [False] * 7]
    assert torch.equal(ids[0, :3], a) and torch.equal(ids[1, :1], b)
    pads = ids[~valid].reshape(-1, 2)
    assert bool((pads[:, 0] != pads[:, 1]).all()), "a padding token got the same expert twice"
    assert len(set(pads.flatten().tolist())) == 8, "padding should spread over all experts"


def test_pack_rollout_routes_rejects_bad_shapes():
    with pytest.raises(ValueError, match="cover 9 tokens > packed length 8"):
        pack_rollout_routes([torch.zeros(9, 1, 2, dtype=torch.int16)], seq_len=8, num_experts=8)
    with pytest.raises(ValueError, match=r"expected \[T, 1, 2\]"):
        pack_rollout_routes([torch.zeros(3, 1, 2), torch.zeros(3, 2, 2)], seq_len=8, num_experts=8)
    with pytest.raises(TypeError, match="slice"):
        RecordedRoutes()[0]
