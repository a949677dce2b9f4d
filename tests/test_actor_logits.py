"""The Megatron actor against independent references, in real multi-process gloo runs, for the tiny
Qwen3-MoE, dense Qwen3 (QK-norm, untied) and dense Qwen2 (q/k/v biases, tied embeddings).

Per layout (one torchrun job each): logits == HF logits and next-token log-probs == HF log_softmax
(<= 1e-4, fp32); export gives every HF tensor bit-identical to the checkpoint; one train_step with a
global-token-mean NLL over 4 sequences gives the same loss, grad norm and updated weights as a
world-1 run with one micro-batch (Adam with a huge eps, so the update is linear in the gradient).
A layout the installed megatron-core cannot run (TP2 / ETP1 on 0.12) must instead be rejected by the
pre-flight, before any process starts.
"""

import pytest
import torch

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.preflight.layout import LayoutError, validate_layout
from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "actor_layouts.py"


@pytest.fixture(scope="module")
def reference(request, tiny_arch_dir, tmp_path_factory):
    """HF logits computed here (plain transformers, one process), then the world-1 actor reference."""
    from transformers import AutoModelForCausalLM

    from tests.workers.actor_common import global_batch

    arch, model_dir = request.param, tiny_arch_dir(request.param)
    out = tmp_path_factory.mktemp(f"actor_ref_{arch}")
    tokens, loss_mask = global_batch()  # right padded: the loss ignores positions past each length
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    torch.save({"tokens": tokens, "logits": logits, "loss_mask": loss_mask}, out / "hf_ref.pt")
    # TP1 x DP1, one micro-batch: also checks TP1 logits/export against HF.
    (ref,) = run_worker(
        WORKER, 1, ref_dir=out, model_dir=model_dir, tp=1, pp=1, ep=1, etp=1, n_micro=1, mode="ref"
    ).results
    assert ref["logits_diff"] <= 1e-4 and ref["logprobs_diff"] <= 1e-4, ref
    assert_fused_equals_logits_path(ref)  # TP1
    return arch, model_dir, out, ref


def assert_fused_equals_logits_path(result: dict) -> None:
    """The actor's fused log-prob path against Megatron's output layer + vocab_parallel_log_probs on the same
    weights (tests/workers/actor_layouts.py, pipeline-parallel 1 layouts): log-probs, entropy, every gradient."""
    assert result["fused_logprobs_diff"] <= 1e-5 and result["fused_entropy_diff"] <= 1e-5, result
    assert result["fused_grad_rel_diff"] <= 1e-5, result


LAYOUTS = {  # id: (nproc, tp, pp, ep, etp, n_micro)
    "tp2-sp": (2, 2, 1, 1, 2, 4),  # TP2 + sequence parallel (MoE: experts split over TP)
    "tp2-etp1": (2, 2, 1, 1, 1, 4),  # TP2, experts replicated over TP (expert-DP over the TP ranks)
    "ep2-dp2": (2, 1, 1, 2, 1, 2),  # EP2 x DP2
    "pp2": (2, 1, 2, 1, 1, 4),  # PP2 (1F1B over 4 micro-batches); qwen2's tied embedding on both stages
    "tp2-ep2-dp2": (4, 2, 1, 2, 1, 2),  # TP2 + EP2 x DP2, 4 processes
}
# Dense models: the layouts that differ for them (the others differ only in how experts are split).
CASES = [("qwen3-moe", layout) for layout in LAYOUTS] + [
    (arch, layout) for arch in ("qwen3", "qwen2") for layout in ("tp2-sp", "pp2")
]


@pytest.mark.slow
@pytest.mark.parametrize("reference,layout", CASES, ids=[f"{a}-{lay}" for a, lay in CASES], indirect=["reference"])
def test_actor_layout_matches_reference(reference, layout):
    arch, model_dir, ref_dir, want = reference
    nproc, tp, pp, ep, etp, n_micro = LAYOUTS[layout]
    if compat_megatron.layout_problem(tp, ep, etp, tp > 1, None, moe=arch == "qwen3-moe"):  # < 0.13 with TP2 / ETP1
        with pytest.raises(LayoutError, match=r"megatron-core .* \(< 0\.13\).*set actor\.parallel\.etp = 2"):
            validate_layout(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp), nproc, model_dir, platform="cpu")
        return
    args = dict(ref_dir=ref_dir, model_dir=model_dir, tp=tp, pp=pp, ep=ep, etp=etp, n_micro=n_micro, mode="check")
    for r in run_worker(WORKER, nproc, **args).results:  # one per rank (run_worker fails unless all reported)
        assert r["logits_diff"] <= 1e-4 and r["logprobs_diff"] <= 1e-4, r
        assert r["tokens"] == want["tokens"] and abs(r["loss"] - want["loss"]) < 1e-5, (r, want)
        assert abs(r["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1.0, want["grad_norm"]), (r, want)
        assert r["step_size"] > 1e-3 and r["weights_diff"] < 1e-5, r
        assert r["tied_copies_checked"] == (arch == "qwen2" and pp > 1), r
        if pp == 1:
            assert_fused_equals_logits_path(r)
