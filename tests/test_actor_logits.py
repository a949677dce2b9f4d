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
from mcore_rl.megatron.layout import LayoutError, validate_layout
from tests.torchrun_util import REPO, run_torchrun

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
    run_torchrun(WORKER, 1, out, model_dir, 1, 1, 1, 1, 1, "ref")
    return arch, model_dir, out


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
    arch, model_dir, ref_dir = reference
    nproc, tp, pp, ep, etp, n_micro = LAYOUTS[layout]
    if compat_megatron.layout_problem(tp, ep, etp, tp > 1, None, moe=arch == "qwen3-moe"):  # < 0.13 with TP2 / ETP1
        with pytest.raises(LayoutError, match=r"megatron-core .* \(< 0\.13\).*set actor\.parallel\.etp = 2"):
            validate_layout(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp), nproc, model_dir, platform="cpu")
        return
    out = run_torchrun(WORKER, nproc, ref_dir, model_dir, tp, pp, ep, etp, n_micro, "check")
    assert out.count(" OK logits ") == nproc, out[-3000:]
    if arch == "qwen2" and pp > 1:
        assert out.count("tied copies in step") == nproc, out[-3000:]
