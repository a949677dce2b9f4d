"""Checkpoints: saved at TP2 (after one optimizer step, with optimizer + scheduler + extra state),
loaded at other layouts (the tiny Qwen3-MoE; and the dense Qwen3 / tied Qwen2 at TP1). After loading, logits equal the saving run's, and the next optimizer step
equals the uninterrupted run's (weights <= 1e-6), which fails if Adam moments, the Adam step count
or the LR schedule position were not restored."""

import pytest

from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "ckpt_resume.py"


@pytest.fixture(scope="module")
def saved_tp2(tiny_arch_dir, tmp_path_factory):
    """Save once per model and optimizer kind (TP2, ETP2, 2 micro-batches), reuse across loading layouts."""
    saved = {}

    def get(arch: str, dist_opt: int):
        if (arch, dist_opt) not in saved:
            saved[arch, dist_opt] = tmp_path_factory.mktemp(f"ckpt_{arch}_dist{dist_opt}")
            work = saved[arch, dist_opt]
            args = dict(work_dir=work, model_dir=tiny_arch_dir(arch), tp=2, ep=1, etp=2, n_micro=2, dist_opt=dist_opt)
            for r in run_worker(WORKER, 2, **args, mode="save").results:  # actor.offload round trip + twin, per rank
                pairs = [r["offload"]] + ([r["offload"]["bf16"]] if dist_opt else [])
                assert all(c["parameters"] > 0 and c["compared"] > 0 and c["twin_tensors"] > 0 for c in pairs), r
        return saved[arch, dist_opt]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,dist_opt,nproc,tp,ep,n_micro",
    [
        ("qwen3-moe", 0, 1, 1, 1, 1),
        ("qwen3-moe", 0, 2, 1, 2, 2),
        ("qwen3-moe", 1, 2, 1, 2, 2),
        ("qwen3", 0, 1, 1, 1, 1),
        ("qwen2", 0, 1, 1, 1, 1),
    ],
    ids=["adam-tp1", "adam-ep2-dp2", "distributed-adam-ep2-dp2", "qwen3-adam-tp1", "qwen2-adam-tp1"],
)
def test_tp2_checkpoint_resumes_at_other_layout(saved_tp2, tiny_arch_dir, arch, dist_opt, nproc, tp, ep, n_micro):
    work = saved_tp2(arch, dist_opt)
    args = dict(work_dir=work, model_dir=tiny_arch_dir(arch), tp=tp, ep=ep, etp=1, n_micro=n_micro, dist_opt=dist_opt)
    for r in run_worker(WORKER, nproc, **args, mode="load").results:  # one per rank (all must report)
        assert r["logits_diff"] <= 1e-5 and r["weights_diff"] <= 1e-6, r
        assert abs(r["lr"] - r["want_lr"]) < 1e-12 and abs(r["loss"] - r["want_loss"]) < 1e-5, r
