"""launch/: the multi-node torchrun script (run for real) and the Ray launcher's rank placement (pure parts)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun_util import REPO

SCRIPT = REPO / "launch" / "torchrun_multinode.sh"
PRESETS = REPO / "configs" / "qwen3_30b_a3b"


def load_ray_launch():
    spec = importlib.util.spec_from_file_location("ray_launch", REPO / "launch" / "ray_launch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through the module registry
    spec.loader.exec_module(module)
    return module


def run_script(*args, **env):
    full_env = dict(
        os.environ,
        PYTHON=sys.executable,
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        MODEL_CONFIG=str(PRESETS / "config.json"),
        **{k: str(v) for k, v in env.items()},
    )
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=full_env, cwd=REPO, timeout=120
    )


def test_multinode_script_builds_torchrun_command():
    proc = run_script(
        PRESETS / "npu32_tp4_pp4_ep8.yaml",
        "algo.loss=sapo",
        NNODES=4,
        NODE_RANK=2,
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT=29511,
        NPROC_PER_NODE=8,
        DRY_RUN=1,
    )
    assert proc.returncode == 0, proc.stderr
    assert "OK:" in proc.stdout and "tp4 pp4 cp1 dp2 | ep8" in proc.stdout
    cmd = proc.stdout.strip().splitlines()[-1]
    for part in (
        "-m mcore_rl.multinode",  # the supervised torchrun of `mcore-rl train`, per node
        "--nnodes 4",
        "--node-rank 2",
        "--nproc-per-node 8",
        "--master-addr 10.0.0.1",
        "--master-port 29511",
        "algo.loss=sapo",
        "trainer.nnodes=4",
        "trainer.nproc=8",
    ):
        assert part in cmd, (part, cmd)
    assert "export" not in proc.stdout  # no torch_npu here and no PLATFORM: no platform environment


def test_multinode_script_exports_the_ascend_environment():
    proc = run_script(PRESETS / "npu16_tp4_ep4.yaml", NNODES=2, NPROC_PER_NODE=8, DRY_RUN=1, PLATFORM="npu")
    assert proc.returncode == 0, proc.stderr
    assert "export VLLM_ASCEND_ENABLE_NZ=0" in proc.stdout and "export HCCL_CONNECT_TIMEOUT=1800" in proc.stdout
    # and what the config decides: 4,096-token responses -> 37 min collective timeout; an eager engine
    assert "export HCCL_EXEC_TIMEOUT=2220" in proc.stdout and "export TASK_QUEUE_ENABLE=2" in proc.stdout
    proc = run_script(
        PRESETS / "npu16_tp4_ep4.yaml", NNODES=2, NPROC_PER_NODE=8, DRY_RUN=1, PLATFORM="npu", HCCL_CONNECT_TIMEOUT=900
    )
    assert "export HCCL_CONNECT_TIMEOUT=900" in proc.stdout  # the user's value wins


def test_multinode_script_rejects_layout_on_every_node_before_torchrun():
    proc = run_script(
        PRESETS / "npu32_tp4_pp4_ep8.yaml", NNODES=2, NODE_RANK=1, MASTER_ADDR="10.0.0.1", NPROC_PER_NODE=8
    )
    assert proc.returncode == 2
    assert (
        "ep*etp = 8*1 = 8 must divide tp*cp*dp = 4*1*1 = 4" in proc.stderr and "mcore_rl.multinode" not in proc.stdout
    )
    proc = run_script(PRESETS / "npu32_tp4_pp4_ep8.yaml", NNODES=4, NODE_RANK=4)
    assert proc.returncode == 2 and "NODE_RANK=4 must lie in [0, NNODES=4)" in proc.stderr


def test_multinode_script_checks_the_node_before_torchrun():
    """Not a dry run: every node's check also takes --node, so an allocator setting vLLM's sleep mode asserts on
    stops the node with one error line, before torchrun starts."""
    proc = run_script(
        PRESETS / "npu16_tp4_ep4.yaml", NNODES=2, NPROC_PER_NODE=8, PYTORCH_NPU_ALLOC_CONF="expandable_segments:True"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mcore-rl: error: PYTORCH_NPU_ALLOC_CONF='expandable_segments:True'" in proc.stderr
    assert "torch.distributed.run" not in proc.stdout


def test_assign_ranks_contiguous_per_node_ordered_by_device():
    rl = load_ray_launch()
    # bundle order interleaves nodes and devices; ranks must be contiguous per node, by device id
    infos = [("10.0.0.2", ["3"]), ("10.0.0.1", ["1"]), ("10.0.0.2", ["0"]), ("10.0.0.1", ["0"])]
    placements = rl.assign_ranks(infos)
    got = [(p.rank, p.local_rank, p.node_rank, p.local_world_size, p.visible_devices) for p in placements]
    assert got == [
        (1, 1, 0, 2, ("0", "3")),
        (3, 1, 1, 2, ("0", "1")),
        (0, 0, 0, 2, ("0", "3")),
        (2, 0, 1, 2, ("0", "1")),
    ]
    # CPU bundles: no device ids, bundle order decides
    cpu = rl.assign_ranks([("h", []), ("h", [])])
    assert [(p.rank, p.local_rank, p.visible_devices) for p in cpu] == [(0, 0, ()), (1, 1, ())]
    # the driver's node is node 0 (rank 0, the master) whichever node bundle 0 landed on
    driven = rl.assign_ranks(infos, driver_ip="10.0.0.1")
    assert [(p.rank, p.node_rank, p.node_ip) for p in driven] == [
        (3, 1, "10.0.0.2"),
        (1, 0, "10.0.0.1"),
        (2, 1, "10.0.0.2"),
        (0, 0, "10.0.0.1"),
    ]


def test_rank_env_and_bundles():
    rl = load_ray_launch()
    p = rl.RankPlacement(
        rank=5, local_rank=1, local_world_size=4, node_rank=1, node_ip="h2", visible_devices=("0", "1", "2", "3")
    )
    env = rl.rank_env(p, 8, "h1", 1234, "NPU")
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "h1" and env["MASTER_PORT"] == "1234" and env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert (
        env["VLLM_ASCEND_ENABLE_NZ"] == os.environ.get("VLLM_ASCEND_ENABLE_NZ", "0") and "HCCL_CONNECT_TIMEOUT" in env
    )
    assert "HCCL_CONNECT_TIMEOUT" not in rl.rank_env(p, 8, "h1", 1, "GPU")
    assert "CUDA_VISIBLE_DEVICES" in rl.rank_env(p, 8, "h1", 1, "GPU") and "CUDA_VISIBLE_DEVICES" not in rl.rank_env(
        p, 8, "h1", 1, "CPU"
    )
    assert rl.bundles(2, "NPU", 0.25) == [{"CPU": 0.25, "NPU": 1}] * 2 and rl.bundles(1, "CPU", 1) == [{"CPU": 1}]


def test_ray_launch_preflight_fails_without_ray():
    # Bad layout: rejected before Ray is imported or started (this venv has no Ray at all).
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch" / "ray_launch.py"),
            str(PRESETS / "npu32_tp4_pp4_ep8.yaml"),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "8",
            "--model-config",
            str(PRESETS / "config.json"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "ray_launch: error: ep*etp = 8*1 = 8 must divide" in proc.stderr


TORCH_ORDER_PROBE = """
import importlib.abc, os, sys

seen = {}


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:  # the environment torch (and its device autoload) starts in
            seen["torch"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "unset")
        return None


sys.meta_path.insert(0, Watch())
sys.path.insert(0, sys.argv[1])
import importlib.util

spec = importlib.util.spec_from_file_location("ray_launch", os.path.join(sys.argv[1], "launch", "ray_launch.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
after_import = "torch" in sys.modules
worker = module.RankWorker()
port = worker.free_port()
after_port = "torch" in sys.modules
worker.run({"ASCEND_RT_VISIBLE_DEVICES": "3,5"}, None, "torch:is_tensor")  # the entry loads torch
print(port > 0, after_import, after_port, seen.get("torch"))
"""


def test_ray_rank_worker_sets_its_environment_before_torch():
    """The launcher module and RankWorker.free_port import no torch; RankWorker.run sets the rank's environment
    before torch loads (torch >= 2.5 autoloads device backends at import)."""
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_ORDER_PROBE, str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False", "False", "3,5"], proc.stdout


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path_factory.mktemp("task"), train_size=64, val_size=8, seed=0)
    return str(train), str(val)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mcore-rl train", "torchrun_multinode.sh"])
def test_a_workers_exception_is_the_last_console_line(launcher, tiny_model_dir, task, tmp_path):
    """A rank that raises (a loss that fails on purpose, which the pre-flight cannot know): the last line on the
    console is its exception and where it was raised, not only "a worker failed" (torchrun's table: the log)."""
    from mcore_rl.platform import free_port
    from tests import failing_loss

    args = [
        f"model.path={tiny_model_dir}",
        f"data.train_path={task[0]}",
        f"data.val_path={task[1]}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.val_every=0",
        "data.prompts_per_step=4",
        "rollout.n=4",
        "actor.parallel.micro_batch_size=4",
        "algo.loss=tests.failing_loss:FailsOnPurpose",
        "algo.agg_mode=token-mean",
    ]
    preset = str(REPO / "configs/tiny/gspo_cpu.yaml")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if launcher == "mcore-rl train":
        cmd = [sys.executable, "-m", "mcore_rl.cli", "train", preset, *args]
    else:
        cmd = ["bash", str(SCRIPT), preset, *args]
        env.update(NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    raised_at = next(
        i
        for i, line in enumerate(Path(failing_loss.__file__).read_text().splitlines(), 1)
        if line.strip().startswith("raise ")
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert re.fullmatch(
        rf"mcore-rl: error: rank [01] failed: ValueError: {failing_loss.MESSAGE} \(failing_loss.py:{raised_at}\)",
        lines[-1],
    ), lines[-6:]
    assert "a worker failed; torchrun's report" in proc.stdout  # the table is in the log it names


def test_ray_launch_resolves_the_configs_paths_before_shipping(tmp_path, monkeypatch):
    """A Ray rank runs in Ray's working directory (another node's temp folder): every relative path of the config
    is made absolute against the driver's directory first (the reference: os.path.abspath there)."""
    from mcore_rl.config import load_config

    rl = load_ray_launch()
    keys = {
        "model.path": "artifacts/tiny",
        "data.train_path": "artifacts/task/train.parquet",
        "data.val_path": "../val.parquet",
        "trainer.run_dir": "runs/x",
        "rollout.rebuild_dir": "scratch",
        "checkpoint.resume": "runs/old",
    }
    cfg = load_config(REPO / "configs/tiny/gspo_cpu.yaml", [f"{k}={v}" for k, v in keys.items()])
    monkeypatch.chdir(tmp_path)
    assert sorted(rl.resolve_paths(cfg, os.getcwd())) == sorted(keys)
    for key, value in keys.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == os.path.abspath(value), key
    assert rl.resolve_paths(cfg, "/elsewhere") == []  # absolute paths stay
    kept = load_config(None, ["checkpoint.resume=auto", "data.train_path=/abs/train.parquet"])
    assert rl.resolve_paths(kept, "/base") == ["trainer.run_dir"] and kept.checkpoint.resume == "auto"


def test_a_failed_rank_waits_for_a_silent_node_and_names_it(tmp_path):
    """The Ray driver's view after a rank failed (mcore_rl.multinode.NodeWatch.settle_silent), with real heartbeat
    threads writing RUN_DIR/nodes: while every node beats it returns after 3 heartbeats, naming no node; when node 1
    stops beating as the rank fails (its failure the echo of node 1's loss), node 1 is lost within the timeout."""
    import threading
    import time

    from mcore_rl.multinode import HEARTBEAT_S, NodeWatch, lost_node_line

    timeout_s = 3.0
    beats = [NodeWatch(str(tmp_path), n, (), f"node{n}", timeout_s) for n in range(2)]
    for beat in beats:
        threading.Thread(target=beat.run, args=(None,), daemon=True).start()
    driver = NodeWatch(str(tmp_path), None, range(2), "driver", timeout_s)
    deadline = time.monotonic() + 30
    while not all(p.changed_at for p in driver.peers):  # each node seen beating
        assert time.monotonic() < deadline
        driver.read()
        time.sleep(0.1)

    start = time.monotonic()
    driver.settle_silent()
    took = time.monotonic() - start
    assert driver.lost is None and 3 * HEARTBEAT_S <= took < 3 * HEARTBEAT_S + 2, took

    beats[1].stopped.set()  # node 1 goes away
    start = time.monotonic()
    driver.settle_silent()
    took = time.monotonic() - start
    beats[0].stopped.set()
    assert driver.lost is not None and driver.lost.node == 1 and took < timeout_s + 2 * HEARTBEAT_S, took
    assert lost_node_line(driver.lost, str(tmp_path), timeout_s, "run launch/ray_launch.py again") == (
        "mcore-rl: error: node 1 (node1) went away: no heartbeat for 3 s (RUN_DIR/nodes); no checkpoint was "
        "published yet; run launch/ray_launch.py again with checkpoint.resume=auto"
    )
