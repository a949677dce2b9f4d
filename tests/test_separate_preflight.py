"""The separate placement before anything starts (issue 32): the pre-flight of the split
(mcore_rl/preflight/placement.py, validate_run), the roles `check` prints, the per-role memory plan
(mcore_rl/preflight/role_memory.py).
Pure Python and `mcore-rl` subprocesses; no training (the runtime of the placement is tested with it)."""

import math
import re

import pytest

from mcore_rl.config import load_config
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
