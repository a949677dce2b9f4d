"""Layout invariance of grpo / gspo / sapo in real multi-process Megatron runs (gloo, tiny MoE).

One fixed global batch (8 sequences of 3-6 prompt and 1-10 response tokens: one response of a single token, two
cut at the budget, one of them filling its row; old log-probs perturbed so ratios are away from 1 and the clip /
dual-clip / IS / KL / entropy paths are hit; sapo with the geometric-mean sequence weight, some sequences rejected,
gspo_token with the loglinear proximal log-probs from each token's version lag: docs/async-objective.md). The world-1,
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
as old) against the two-pass path under R2: loss, entropy metric and update within 1e-6 relative, and
per-rank step data (each rank receives only its DP rank's samples through the real collectives) against the
all-gathered path: identical micro-batches, loss and update within the tolerances above.

Context parallelism against the same reference: CP2 x EP2 (world 2, with the GSPO reduction's counter-check),
and CP2 x TP2 (+SP) x EP2 and CP2 x PP2 x EP2 in ONE world-4 job (the worker runs the layouts in turn). In every CP
layout CP rank 1's part of a micro-batch ends inside a response (the padded rows' last one, and a packed row at CP2's
multiple: tests/test_context_parallel.py checks the batch has it), the case the multi-token preset crashed on.
"""

import time

import pytest

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.preflight.layout import LayoutError, validate_layout
from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests/workers/loss_layouts.py"
LOSSES = ("grpo", "gspo", "sapo")
CP_LOSSES = (*LOSSES, "gspo_token")  # the reference job computes all; the context-parallel job checks all
SHORTCUT_TOL = 1e-6  # the worker's SHORTCUT_TOL
CHECKS = ("unreduced", "r3", "shortcut", "step_data")  # the worker's extra checks


def layout_results(results: list[dict]) -> list[list[dict]]:
    """The worker's per-rank results -> per layout (in the job's order), the ranks' reports of that layout."""
    per_rank = [[dict(report, rank=r["rank"]) for report in r["layouts"]] for r in results]
    return [list(reports) for reports in zip(*per_rank)]


def close_loss(got: float, ref: float) -> bool:
    """Within 1e-5 relative or 1e-6 absolute (the worker's LOSS_ABS_TOL: where the loss's terms are summed in another
    order, packed rows or context parallel, gspo's small loss moves by ~1e-7 from rounding alone)."""
    gap = abs(got - ref)
    return gap <= 1e-5 * abs(ref) or gap <= 1e-6


def check_packed(loss: str, packed: dict, ref: dict) -> None:
    """The packed path against the padded world-1 reference: log-probs <= 1e-5, loss within 1e-5 relative or
    1e-6 absolute (see the worker), every update within 1e-5 x the largest."""
    assert packed["log_prob_diff"] <= 1e-5, (loss, packed)
    assert close_loss(packed["loss"], ref["loss"]), (loss, packed, ref["loss"])
    assert packed["params"] == ref["params"], (loss, packed, ref["params"])
    assert packed["update_diff"] <= 1e-5 * packed["largest_update"], (loss, packed)


def check_shortcut(got: dict) -> None:
    """Exactly on-policy: the update's own log-probs as old == a separate old-policy pass (loss, entropy metric,
    grad norm relative, every update against the largest)."""
    for key in ("loss", "entropy", "grad_norm"):
        assert abs(got[key] - got[f"two_pass_{key}"]) <= SHORTCUT_TOL * abs(got[f"two_pass_{key}"]), (key, got)
    assert got["largest_update"] > 0 and got["update_diff"] <= SHORTCUT_TOL * got["largest_update"], got


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_layouts")
    args = dict(out_dir=out, model_dir=tiny_model_dir, tp=1, pp=1, ep=1, cp=1, n_micro=1, mode="ref", checks="")
    args["losses"] = ",".join(CP_LOSSES)
    ((ref,),) = layout_results(run_worker(WORKER, 1, **args, timeout=240).results)
    for loss in CP_LOSSES:  # the packed path at world 1 against the padded one
        check_packed(loss, ref[loss]["packed"], ref[loss])
    return out, ref


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, pp, ep, n_micro", [(2, 1, 1, 4), (1, 1, 2, 1), (1, 2, 1, 2)], ids=["tp2-sp-4micro", "ep2-dp2", "pp2-2micro"]
)
def test_loss_and_update_match_world1(reference, tiny_model_dir, tp, pp, ep, n_micro):
    if compat_megatron.layout_problem(tp, ep, 1, tp > 1, None):  # megatron-core < 0.13: TP2 / ETP1 rejected
        with pytest.raises(LayoutError, match=r"\(< 0\.13\)"):
            validate_layout(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1), 2, tiny_model_dir, platform="cpu")
        return
    ref_dir, want = reference
    args = dict(out_dir=ref_dir, model_dir=tiny_model_dir, tp=tp, pp=pp, ep=ep, cp=1, n_micro=n_micro, mode="check")
    args.update(losses=",".join(LOSSES), checks="shortcut,step_data")
    (results,) = layout_results(run_worker(WORKER, 2, **args, timeout=240).results)
    for r in results:  # one per rank: both must report
        for loss in LOSSES:
            got, ref = r[loss], want[loss]
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (loss, got, ref)
            assert got["params"] == ref["params"], (loss, got["params"], ref["params"])
            assert got["update_diff"] <= 1e-5 * got["largest_update"], (loss, got)
            check_packed(loss, got["packed"], ref)
        check_shortcut(r["shortcut"])
        print(f"rank {r['rank']} shortcut: {r['shortcut']}")
    check_step_data([r["step_data"] for r in results], dp=2 // (tp * pp), batch=8)


def check_step_data(got: list[dict], dp: int, batch: int) -> None:
    """Per-rank step data against the all-gathered path (the worker asserted identical micro-batches): the same
    loss and update within the layout tolerances; every DP rank trained on its own share (shares of different DP
    ranks disjoint and together the whole batch; ranks of one DP rank the same share); each rank received exactly
    the samples of its share it did not generate."""
    shares: dict[int, list[int]] = {}
    for r in got:
        assert r["rel_loss"] <= 1e-5 and r["update_diff"] <= 1e-5 * r["largest_update"], r
        assert shares.setdefault(r["dp_rank"], r["trained"]) == r["trained"], got
        assert r["received"] == [i for i in r["trained"] if i not in r["held"]], r
        assert 0 < r["received_bytes"] < r["step_bytes"], r
    assert len(shares) == dp and sorted(i for s in shares.values() for i in s) == list(range(batch)), shares
    print("step data:", [{k: r[k] for k in ("dp_rank", "trained", "received_bytes", "seconds")} for r in got])


def check_context_parallel(r: dict, want: dict) -> None:
    """One rank's report of a CP layout: every loss's loss and update (padded and packed, log-probs asserted in the
    worker) equal the world-1 reference; R3 with the natural routes split like the tokens: mismatch 0, the reference
    loss and update."""
    for loss in CP_LOSSES:
        got, ref = r[loss], want[loss]
        assert close_loss(got["loss"], ref["loss"]), (loss, got, ref)
        assert got["params"] == ref["params"], (loss, got["params"], ref["params"])
        assert got["update_diff"] <= 1e-5 * got["largest_update"], (loss, got)
        check_packed(loss, got["packed"], ref)
    r3 = r["r3"]
    assert r3["token_mismatch"] == 0.0 and close_loss(r3["loss"], want["gspo"]["loss"]), r3
    assert r3["update_diff"] <= 1e-5 * r3["largest_update"], r3


@pytest.fixture(scope="module")
def context_parallel(reference, tiny_model_dir):
    """CP2 x EP2 (world 2: dp 1, the experts folded over the CP ranks), 2 micro-batches, every loss."""
    ref_dir, want = reference
    args = dict(out_dir=ref_dir, model_dir=tiny_model_dir, tp=1, pp=1, ep=2, cp=2, n_micro=2, mode="check")
    args.update(losses=",".join(CP_LOSSES), checks=",".join(CHECKS))
    (results,) = layout_results(run_worker(WORKER, 2, **args, timeout=300).results)
    return results, want


@pytest.mark.slow
def test_context_parallel_matches_world1(context_parallel):
    """Each CP rank computes its load-balanced half of every sequence; log-probs (asserted in the worker), the
    loss and every update equal the world-1 reference, padded and packed, for grpo / gspo / sapo / gspo_token;
    per-rank step data brings both CP ranks (one DP rank) the same samples; R3 with the batch's natural routes
    split like the tokens gives mismatch 0 and the reference step; R2's on-policy shortcut equals the two-pass
    path under CP."""
    results, want = context_parallel
    for r in results:
        check_context_parallel(r, want)
        check_shortcut(r["shortcut"])
    check_step_data([r["step_data"] for r in results], dp=1, batch=8)


@pytest.mark.slow
def test_gspo_without_the_context_parallel_reduction_differs(context_parallel):
    """The same CP2 GSPO step with the sequence ratio's CP reduction patched out (each rank's ratio from its
    own half of the sequence): the exactness check above fails on the update."""
    results, _ = context_parallel
    for r in results:
        got = r["unreduced"]
        assert got["update_diff"] > 1e-5 * got["largest_update"], got
        print(f"rank {r['rank']} without the reduction: {got}")


# CP with TP (sequence parallel, as TP runs here) and with PP, world 4 (dp 1): ONE job runs both layouts in turn (the
# worker drops Megatron's groups between them), the four losses, padded and packed, R3. EP2 (ETP1) in both: it runs on
# megatron-core 0.12.1 too, where TP2 with EP1 / ETP1 is rejected.
CP_WORLD4 = {
    "cp2-tp2-sp-ep2": dict(tp=2, pp=1, ep=2, cp=2, n_micro=2),
    "cp2-pp2-ep2": dict(tp=1, pp=2, ep=2, cp=2, n_micro=2),
}


@pytest.fixture(scope="module")
def context_parallel_world4(reference, tiny_model_dir):
    ref_dir, want = reference
    args = {key: ",".join(str(case[key]) for case in CP_WORLD4.values()) for key in ("tp", "pp", "ep", "cp", "n_micro")}
    args.update(out_dir=ref_dir, model_dir=tiny_model_dir, mode="check", losses=",".join(CP_LOSSES))
    args["checks"] = "r3,unreduced,shortcut"  # per-rank step data at dp 1: as in the CP2 x EP2 job
    start = time.perf_counter()
    results = layout_results(run_worker(WORKER, 4, **args, timeout=900).results)
    print(f"world-4 CP job: {time.perf_counter() - start:.1f} s")
    for name, reports in zip(CP_WORLD4, results):
        print(name, "seconds per rank:", [round(r["layout"]["seconds"], 1) for r in reports])
    return dict(zip(CP_WORLD4, results)), want


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CP_WORLD4))
def test_context_parallel_with_tp_or_pp_matches_world1(context_parallel_world4, name):
    """CP2 x TP2 (+SP) x EP2 and CP2 x PP2 x EP2 (world 4, 2 micro-batches): log-probs (asserted in the worker), the
    loss and every update equal the world-1 reference, padded and packed, grpo / gspo / sapo / gspo_token; R3 split
    like the tokens; R2's on-policy shortcut equals the two-pass path; without the GSPO CP reduction the update
    differs. PP: the stages exchange this CP rank's part of the rows (Megatron's p2p shape divides the sequence
    length it is given by cp); the loss's CP reductions run on the last stage's CP group."""
    results, want = context_parallel_world4
    assert {k: results[name][0]["layout"][k] for k in CP_WORLD4[name]} == CP_WORLD4[name], results[name][0]
    for r in results[name]:
        check_context_parallel(r, want)
        check_shortcut(r["shortcut"])
        unreduced = r["unreduced"]
        assert unreduced["update_diff"] > 1e-5 * unreduced["largest_update"], unreduced
    print(f"{name} rank 0: without the reduction {results[name][0]['unreduced']}")
