"""Layout invariance of grpo / gspo / sapo in real multi-process Megatron runs (gloo, tiny MoE).

One fixed global batch (8 sequences, one with a single response token; old log-probs perturbed so
ratios are away from 1 and the clip / dual-clip / IS / KL / entropy paths are hit). The world-1,
one-micro-batch run (TP1 x DP1) is the reference. Each 2-process layout below combines factors to
save wall time: TP2(+SP) x 4 micro-batches, EP2 x DP2, PP2 x 2 micro-batches. Compared: the global
loss (relative difference <= 1e-5) and the one-step Adam update of ALL 69 parameters by their HF
names (embed_tokens, q/k/v/o_proj, q_norm/k_norm, input/post-attention layernorms, the router
`mlp.gate`, every expert's gate/up/down_proj, the final norm and lm_head): max |update - reference
update| <= 1e-5 x the largest reference update. Adam runs with eps = 10, which makes its first step
linear in the gradient, so a wrong gradient scale cannot hide behind Adam's normalisation.

Each job also runs the packed path (token-budget micro-batches, padding removed; one sequence at the
maximum length, one with a single response token) against the same padded world-1 reference: log-probs
(<= 1e-5 abs at response tokens), loss and every update, at world 1 (in the reference job) and in each layout.
Each layout also checks the on-policy shortcut (no old-policy pass; the update's own log-probs, detached,
as old) against the two-pass path under R2: loss, entropy metric and update within 1e-6 relative.
"""

import pytest
from torchrun_util import REPO, run_torchrun

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.megatron.layout import LayoutError, validate_layout

WORKER = REPO / "tests/workers/loss_layouts.py"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_layouts")
    log = run_torchrun(WORKER, 1, out, tiny_model_dir, 1, 1, 1, 1, "ref", timeout=240)
    assert log.count("REF ") == 3 and log.count("PACKED_OK ") == 3, log[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, pp, ep, n_micro", [(2, 1, 1, 4), (1, 1, 2, 1), (1, 2, 1, 2)], ids=["tp2-sp-4micro", "ep2-dp2", "pp2-2micro"]
)
def test_loss_and_update_match_world1(reference, tiny_model_dir, tp, pp, ep, n_micro):
    if compat_megatron.layout_problem(tp, ep, 1, tp > 1, None):  # megatron-core < 0.13: TP2 / ETP1 rejected
        with pytest.raises(LayoutError, match=r"\(< 0\.13\)"):
            validate_layout(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1), 2, tiny_model_dir, platform="cpu")
        return
    log = run_torchrun(WORKER, 2, reference, tiny_model_dir, tp, pp, ep, n_micro, "check", timeout=240)
    for loss in ("grpo", "gspo", "sapo"):
        assert log.count(f"LAYOUT_OK {loss} ") == 2, log[-3000:]
        assert log.count(f"PACKED_OK {loss} ") == 2, log[-3000:]
    # exactly on-policy: the update's own log-probs as old == a separate old-policy pass (worker's SHORTCUT_TOL)
    assert log.count("SHORTCUT_OK ") == 2, log[-3000:]
    print("\n".join(line for line in log.splitlines() if "SHORTCUT_OK" in line))
