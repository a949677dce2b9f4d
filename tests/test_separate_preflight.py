"""The separate placement before anything starts (issue 32): the pre-flight of the split
(mcore_rl/preflight/placement.py, validate_run), the roles `check` prints, the per-role memory plan
(mcore_rl/preflight/role_memory.py) and `mcore-rl plan --from-run` (mcore_rl/preflight/split_plan.py).
Pure Python and `mcore-rl` subprocesses; no training (the runtime of the placement is tested with it)."""

import json
import math
import re

import pytest

from mcore_rl.config import load_config, save_config
from mcore_rl.preflight.layout import LayoutError, ModelDims
from mcore_rl.preflight.memory_plan import GIB, plan_memory, total_params
from mcore_rl.preflight.placement import RoleSplit, describe_roles
from mcore_rl.preflight.run import validate_run
from tests.test_cli import QWEN_JSON, cli, one_line_error

GPU8 = QWEN_JSON.parent / "gpu8_separate_tp2_ep4.yaml"
NPU32 = QWEN_JSON.parent / "npu32_separate_tp4_ep4.yaml"
DIMS = ModelDims.from_hf(QWEN_JSON)


def _run(preset, *overrides, world=None):
    cfg = load_config(preset, list(overrides))
    return cfg, validate_run(cfg, world or cfg.trainer.nnodes * cfg.trainer.nproc, DIMS)


def test_the_actor_layout_spans_the_world_less_the_rollout_ranks():
    _, lay = _run(GPU8)
    assert (lay.world_size, lay.rollout_ranks, lay.dp, lay.edp) == (4, 4, 2, 1)  # TP2 x DP2, EP4 folds into it
    _, lay = _run(GPU8, "rollout.ranks=null")  # default: half the world
    assert (lay.world_size, lay.rollout_ranks) == (4, 4)
    _, lay = _run(GPU8, "rollout.ranks=null", "rollout.tp=1", "actor.parallel.ep=2", world=7)  # the actor: the rest
    assert (lay.world_size, lay.rollout_ranks) == (4, 3)
    _, lay = _run(GPU8, "rollout.ranks=2", "actor.parallel.ep=2")
    assert (lay.world_size, lay.rollout_ranks, lay.dp) == (6, 2, 3)
    # streaming over 4 embedded replicas: they agree where each session is taken (mcore_rl/streaming.py)
    _, lay = _run(GPU8, "rollout.engine=embedded", "rollout.tp=1", "rollout.streaming=true")
    assert (lay.world_size, lay.rollout_ranks) == (4, 4)
    # colocated: every rank trains (and generates)
    _, lay = _run(GPU8, "rollout.placement=colocated", "rollout.ranks=null", "rollout.max_staleness=null")
    assert (lay.world_size, lay.rollout_ranks) == (8, 0)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ((), 1, "rollout.placement=separate needs at least 2 ranks (one actor, one rollout), the world is 1"),
        (("rollout.ranks=8",), 8, "rollout.ranks = 8 must lie in 1 .. 7 in a world of 8"),
        (("rollout.ranks=0",), 8, "rollout.ranks = 0 must lie in 1 .. 7"),
        (("actor.offload=true",), 8, "actor.offload with rollout.placement=separate: the actor's ranks hold no engine"),
        (
            ("rollout.streaming=true",),
            8,
            "rollout.streaming=true with rollout.engine=vllm takes new weights between decode steps on one engine "
            "replica (several replicas agree on it with the embedded engine only); rollout.ranks = 4 make 2: set "
            "rollout.ranks=2, rollout.engine=embedded or rollout.streaming=false",
        ),
        (
            ("rollout.streaming=true", "rollout.ranks=2", "algo.routing_replay=r3"),
            8,
            "rollout.streaming=true with rollout.engine=vllm and algo.routing_replay=r3: an interrupted vLLM request "
            "continues as a new one",
        ),
        (
            ("rollout.streaming=true", "rollout.ranks=2"),
            8,
            "rollout.streaming=true with rollout.engine=vllm and rollout.tp = 2: the ranks of a tensor-parallel replica",
        ),
        # the engine's TP against the rollout ranks, then against the heads
        (("rollout.ranks=3",), 8, "rollout.tp = 2 must be >= 1 and divide rollout.ranks 3: use rollout.tp in [1, 3]"),
        (("rollout.ranks=6", "rollout.tp=6"), 8, "rollout.tp = 6 must divide the model's 32 attention heads"),
        # the actor's layout over its ranks, naming the split
        (
            ("rollout.ranks=2",),
            8,
            "the actor's 6 ranks (world 8 - rollout.ranks 2): ep*etp = 4*1 = 4 must divide tp*cp*dp = 2*1*3 = 6",
        ),
    ],
)
def test_a_split_that_cannot_run_is_one_error_naming_the_fix(overrides, world, message):
    cfg = load_config(GPU8, list(overrides))
    with pytest.raises(LayoutError, match="^" + re.escape(message)):
        validate_run(cfg, world, DIMS)
    text = one_line_error(cli("check", GPU8, *overrides, "--world-size", world, "--model-config", QWEN_JSON))
    assert text.startswith(f"mcore-rl: error: {message}") and ("set " in text or "use " in text), text


def test_the_trainer_checks_the_split_before_it_builds_the_actor():
    """Plain torchrun launches skip the pre-flight; `check_before_build` (the trainer, before the actor) checks the
    split and the actor's layout over the actor ranks, not over the whole world."""
    from mcore_rl.config import ConfigError
    from mcore_rl.preflight.run import check_before_build

    path = [f"model.path={QWEN_JSON.parent}"]
    check_before_build(load_config(GPU8, path), 8, "cuda")  # TP2 x DP2 over 4 actor ranks
    # 6 actor ranks: EP4 cannot fold into TP2 x DP3 (over all 8 ranks, TP2 x DP4, it could)
    with pytest.raises(ConfigError, match=r"^the actor's 6 ranks \(world 8 - rollout.ranks 2\): ep\*etp = 4\*1"):
        check_before_build(load_config(GPU8, [*path, "rollout.ranks=2"]), 8, "cuda")
    with pytest.raises(ConfigError, match=r"^rollout.placement=separate needs at least 2 ranks"):
        check_before_build(load_config(GPU8, path), 1, "cuda")


def test_rollout_tp_above_the_kv_heads_warns_and_rollout_ranks_without_separate_warns():
    _, lay = _run(NPU32, "rollout.tp=8")  # Qwen3-30B-A3B has 4 KV heads: each replicated 2x
    assert any("rollout.tp = 8 > 4 KV heads" in w for w in lay.warnings)
    _, lay = _run(NPU32, "rollout.placement=colocated", "rollout.max_staleness=null")
    assert lay.rollout_ranks == 0 and lay.world_size == 32
    assert any(w.startswith("rollout.ranks = 16 has no effect with rollout.placement=colocated") for w in lay.warnings)


def test_check_prints_each_role_its_ranks_nodes_and_replicas():
    proc = cli("check", NPU32, "--model-config", QWEN_JSON)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world 32 (4 node(s) x 8 processes)" in out
    assert "roles (separate placement): actor ranks 0-15 (nodes 0-1), rollout ranks 16-31 (nodes 2-3)" in out
    assert (
        "rollout replicas: 4 x vllm tp4: ranks 16-19 (node 2), ranks 20-23 (node 2), ranks 24-27 (node 3), "
        "ranks 28-31 (node 3)"
    ) in out
    assert "actor: tp4 pp1 cp1 dp4 | ep4 etp1 edp4" in out and "| on its 16 ranks" in out
    assert "rollout: vllm tp4 x 4 replicas" in out and "warning:" not in out
    # one step off, the old policy is the proximal pass even where one mini-batch would be on-policy colocated
    for staleness, says in (
        ("null", "from the proximal pass (the samples are up to one update"),
        ("0", "from the update"),
    ):
        one = ["algo.mini_batches=1", "algo.routing_replay=null", f"rollout.max_staleness={staleness}"]
        proc = cli("check", NPU32, *one, "--model-config", QWEN_JSON)
        assert f", old log-probs {says}" in proc.stdout, proc.stdout + proc.stderr
    # 8 nodes of 4: the same ranks, other nodes
    proc = cli("check", NPU32, "--nnodes", 8, "--nproc-per-node", 4, "--model-config", QWEN_JSON)
    assert "actor ranks 0-15 (nodes 0-3), rollout ranks 16-31 (nodes 4-7)" in proc.stdout, proc.stderr


def test_roles_warn_where_a_node_holds_both_or_a_replica_spans_two():
    # 2 nodes x 3 processes, 2 rollout replicas of tp2 after 2 actor ranks: ranks 2-3 cross nodes 0 / 1
    lines = describe_roles(RoleSplit(world=6, rollout_ranks=4, engine_tp=2), "vllm", nproc=3)
    assert lines[0] == "roles (separate placement): actor ranks 0-1 (node 0), rollout ranks 2-5 (nodes 0-1)"
    assert lines[1] == "rollout replicas: 2 x vllm tp2: ranks 2-3 (nodes 0-1), ranks 4-5 (node 1)"
    assert lines[2].startswith("warning: node 0 holds both roles (2 actor ranks are not a multiple of 3")
    assert lines[3].startswith("warning: 1 engine replica(s) span two nodes (replica 0: ranks 2-3)")
    # one machine: sharing it is the point, no warning; many replicas are listed first, second ... last
    lines = describe_roles(RoleSplit(world=16, rollout_ranks=12, engine_tp=1), "embedded", nproc=16)
    assert lines == [
        "roles (separate placement): actor ranks 0-3 (node 0), rollout ranks 4-15 (node 0)",
        "rollout replicas: 12 x embedded tp1: ranks 4 (node 0), ranks 5 (node 0), ranks 15 (node 0) ...",
    ]


def test_each_role_plans_only_what_it_holds():
    """An actor rank's phases are a colocated rank's of the same actor layout without the rollout phase (no
    engine), plus the weight send; a rollout rank holds the engine: 1/tp of every parameter and its KV cache."""
    cfg, lay = _run(GPU8, "rollout.gpu_memory_utilization=0.5", "rollout.kv_cache_gb=20")
    plans = plan_memory(cfg, lay, DIMS, device_gib=80)
    colocated_cfg = load_config(
        GPU8,
        ["rollout.placement=colocated", "rollout.ranks=null", "rollout.max_staleness=null", "rollout.kv_cache_gb=20"],
    )
    colocated = plan_memory(colocated_cfg, validate_run(colocated_cfg, 4, DIMS), DIMS, device_gib=80)
    actor = {p.name: p.total for p in plans.actor.phases}
    assert list(actor) == ["log-probs", "update", "save", "weight send"]
    for name in ("log-probs", "update", "save"):
        assert actor[name] == colocated.phase(name).total, name
    bucket = max(256 << 20, DIMS.vocab_size * DIMS.hidden * 2)  # the embedding, bf16: larger than 256 MiB
    assert actor["weight send"] == colocated.phase("save").total + bucket
    assert not any(i.name.startswith("engine") for p in plans.actor.phases for i in p.items)
    rollout = {i.name: i.bytes for i in plans.rollout.phase("rollout").items}
    assert rollout == {
        "engine weights": total_params(DIMS) * 2 // 2,  # bf16 at rollout.tp 2
        "engine KV cache": 20 * GIB,
        "engine runtime": 2 * GIB,
    }
    assert plans.rollout.phase("weight sync").total == sum(rollout.values()) + bucket
    # the KV note: 2 replicas of tp2 share the 512 samples of 5,120 tokens; a token's K and V over 48 layers and
    # 4 KV heads of 128 split over tp 2
    per_token = 2 * 48 * 4 * 128 * 2 // 2
    assert plans.rollout.notes == (
        f"vLLM KV cache holds ~{20 * GIB // per_token:,} tokens per replica; all its samples at once need "
        f"{math.ceil(512 / 2) * 5120:,}",
    )
    assert plans.fits and plans.peak is max(plans.actor.peak, plans.rollout.peak, key=lambda p: p.total)
    table = plans.table()
    assert "actor ranks (4): the actor only, no engine resident" in table
    assert "rollout ranks (4): the engine only, no actor state" in table
    assert table.count("verdict: fits on a 80.0 GiB device") == 2


def test_the_tiny_demo_split_plans_a_sync_bucket_of_at_most_the_model(tiny_model_dir):
    """1 actor + 1 rollout rank on CPU; the sync bucket (256 MiB) cannot be larger than the whole model, whose
    parameter count is the HF model's (tests/test_memory_plan.py)."""
    from transformers import AutoModelForCausalLM

    preset = QWEN_JSON.parents[1] / "tiny" / "gspo_separate_cpu.yaml"
    cfg = load_config(preset, [f"model.path={tiny_model_dir}"])
    dims = ModelDims.from_hf(tiny_model_dir)
    lay = validate_run(cfg, cfg.trainer.nproc, dims)
    assert (lay.world_size, lay.rollout_ranks, lay.ep) == (1, 1, 1)
    plans = plan_memory(cfg, lay, dims)
    hf_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert hf_bytes < 256 << 20
    for plan, phase in ((plans.actor, "weight send"), (plans.rollout, "weight sync")):
        assert {i.name: i.bytes for i in plan.phase(phase).items}["weight sync bucket"] == hf_bytes
    # the embedded engine on the rollout rank: a whole float32 copy of the model
    assert {i.name: i.bytes for i in plans.rollout.phase("rollout").items}["engine weights"] == hf_bytes


def test_a_role_that_does_not_fit_gets_its_own_levers():
    cfg, lay = _run(GPU8, "actor.optim.optimizer_offload_fraction=0", "rollout.gpu_memory_utilization=0.95")
    plans = plan_memory(cfg, lay, DIMS, device_gib=80)
    assert plans.fits is False and plans.actor.fits is False and plans.rollout.fits is False
    assert any(lever.startswith("actor.optim.optimizer_offload_fraction=1.0 -> peak") for lever in plans.actor.levers)
    assert not any(lever.startswith("actor.offload") for lever in plans.actor.levers)  # refused in separate
    (lever,) = plans.rollout.levers
    assert lever.startswith("rollout.gpu_memory_utilization=0.85 -> peak")
    proc = cli(
        "plan", GPU8, "actor.optim.optimizer_offload_fraction=0", "--model-config", QWEN_JSON, "--device-memory", 80
    )
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout and "rollout ranks (4)" in proc.stdout


# ------------------------------------------------------------------------------------------- plan --from-run

ROWS = [  # a colocated run on 2 ranks: step 1 (warm-up) is left out, the rest give medians by hand
    {"step": 1, "time/rollout": 60.0, "time/old_logprob": 9.0, "time/update": 9.0, "time/sync": 5.0,
     "time/to_training": 2.0, "perf/step_seconds": 90.0},
    {"step": 2, "time/rollout": 5.0, "time/old_logprob": 1.0, "time/update": 2.0, "time/sync": 0.5,
     "time/to_training": 2.0, "perf/step_seconds": 10.75},
    {"step": 3, "time/rollout": 6.0, "time/old_logprob": 1.0, "time/update": 2.0, "time/sync": 0.5,
     "time/to_training": 2.0, "perf/step_seconds": 11.75},
    {"step": 3, "val/reward_mean": 0.5},  # a validation row: no phase times
    {"step": 4, "time/rollout": 7.0, "time/old_logprob": 1.0, "time/update": 2.0, "time/sync": 0.5,
     "time/to_training": 2.0, "perf/step_seconds": 12.75},
]  # fmt: skip


def _colocated_run(tmp_path, rows=ROWS, placement="colocated"):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    save_config(load_config(None, ["trainer.nproc=2", f"rollout.placement={placement}"]), run / "config.yaml")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + '{"step": 5, "time/rollout": 1')  # a running run's torn last line
    return run


def test_from_run_prints_every_split_and_the_balanced_one(tmp_path):
    """Measured on 2 ranks (medians of steps 2-4): rollout 6, actor 1 + 2 = 3, sync 0.5, handover 2, other 0.25.
    On the preset's 8 ranks (actor TP2, here EP2, so 2, 4 or 6 actor ranks form; engine replicas of 2):
      colocated: (6 + 3) x 2/8 + 0.5 + 2 + 0.25 = 5.0
      6 + 2: actor 3 x 2/6 = 1, rollout 6 x 2/2 = 6: one step off 6 + 0.75 = 6.75, staleness 0 7.75
      4 + 4: 1.5, 3: 3.75, 5.25;   2 + 6: 3, 2: 3.75, 5.75 (the same step as 4 + 4, better balanced)"""
    run = _colocated_run(tmp_path)
    proc = cli("plan", "--from-run", run, GPU8, "actor.parallel.ep=2", "--model-config", QWEN_JSON)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"plan --from-run: {GPU8} on 1 node(s) x 8 processes"
    assert out[1].startswith(f"measured: {run}, colocated on 2 rank(s), median of 3 step(s): rollout 6.000 s, ")
    assert "actor 3.000 s, sync 0.500 s, handover 2.000 s, other 0.250 s (step 11.750 s; rollout 51%)" in out[1]
    rows = [line.split() for line in out[4:8]]
    assert rows[0] == ["colocated", "(all", "8)", "5.000", "5.000"]
    assert rows[1:] == [
        ["6", "+", "2", "1.000", "6.000", "6.750", "7.750"],
        ["4", "+", "4", "1.500", "3.000", "3.750", "5.250"],
        ["2", "+", "6", "3.000", "2.000", "3.750", "5.750"],
    ]
    assert out[8] == (
        "recommended: rollout.placement=separate rollout.ranks=6 (2 actor ranks): 3.750 s/step one step off, "
        "1.33x the colocated 5.000 s"
    )
    # the preset's own EP4 forms on 4 actor ranks only; with a small handover colocated wins
    fast = [
        dict(r, **{"time/to_training": 0.0, "perf/step_seconds": r["perf/step_seconds"] - 2.0})
        for r in ROWS
        if "time/rollout" in r
    ]
    proc = cli("plan", "--from-run", _colocated_run(tmp_path / "b", fast), GPU8, "--model-config", QWEN_JSON)
    assert [line.split()[:3] for line in proc.stdout.splitlines()[5:-1]] == [["4", "+", "4"]], proc.stdout
    assert proc.stdout.splitlines()[-1] == (
        "recommended: stay colocated (3.000 s/step); the best split, rollout.ranks=4, expects 3.750 s one step off"
    )


def test_from_run_on_a_colocated_preset_whose_layout_no_split_forms(tmp_path):
    """gpu8_tp2_ep8 (colocated): EP8 must fold into TP2 x DP, so the actor needs all 8 ranks (DP4): no split."""
    run = _colocated_run(tmp_path)
    proc = cli("plan", "--from-run", run, QWEN_JSON.parent / "gpu8_tp2_ep8.yaml", "--model-config", QWEN_JSON)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[4].split() == ["colocated", "(all", "8)", "5.000", "5.000"] and len(lines) == 6
    assert lines[5] == ("recommended: stay colocated (no split of 8 ranks forms the actor's layout and whole replicas)")


def test_from_run_marks_the_splits_that_do_not_fit(tmp_path):
    run = _colocated_run(tmp_path)
    proc = cli(
        "plan",
        "--from-run",
        run,
        GPU8,
        "actor.parallel.ep=2",
        "actor.optim.optimizer_offload_fraction=0",
        "--model-config",
        QWEN_JSON,
        "--device-memory",
        200,
    )
    assert proc.returncode == 0, proc.stderr
    marks = {tuple(line.split()[:3]): line.split()[-1] for line in proc.stdout.splitlines()[5:8]}
    # Adam's state on the device: each actor rank holds 1/dp of it (distributed optimizer), so the fewer actor
    # ranks, the more: 6 (dp3) and 4 (dp2) fit a 200 GiB device, 2 (dp1: all of its half of the model) do not
    assert marks == {("6", "+", "2"): "fits", ("4", "+", "4"): "fits", ("2", "+", "6"): "FIT"}
    assert "rollout.ranks=4 (4 actor ranks)" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "--from-run {run} is not a folder: give the trainer.run_dir of a colocated run"),
        ("no-config", "--from-run {run} has no config.yaml (a run writes it when it starts)"),
        ("no-steps", "{run}/metrics.jsonl has no step with time/rollout and time/update: let the run log"),
        ("separate", "--from-run {run} ran with rollout.placement=separate"),
    ],
)
def test_from_run_refuses_what_it_cannot_read(tmp_path, case, message):
    run = tmp_path / "run"
    if case == "no-config":
        run.mkdir()
    elif case != "missing":
        _colocated_run(
            tmp_path, [{"step": 1, "val/reward_mean": 0.1}], "separate" if case == "separate" else "colocated"
        )
    msg = one_line_error(cli("plan", "--from-run", run, GPU8, "--model-config", QWEN_JSON))
    assert msg.startswith("mcore-rl: error: " + message.format(run=run)), msg
