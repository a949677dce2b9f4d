"""The environment a run starts in (issue 31, defects 3 - 6 and 8's switch): the collective timeout derived from the
response length and where it goes (the process group, HCCL_EXEC_TIMEOUT), the Ascend variables set or passed
through and what `mcore-rl check` prints, `trainer.deterministic`, the allocator setting vLLM's sleep mode refuses,
and the rebuild fallback's disk (the need in `mcore-rl plan`, the free-space check before any process starts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, collective_timeout_minutes, load_config
from mcore_rl.platform import Platform, RunEnvironment
from mcore_rl.platform.ascend_env import ASCEND_PASS_THROUGH, ascend_environment
from tests.torchrun_util import REPO

QWEN3_30B = REPO / "configs/qwen3_30b_a3b"
LONG = QWEN3_30B / "npu32_tp4_pp4_cp2_ep8_32k.yaml"  # 32,768-token responses, graph mode (enforce_eager false)
EAGER = QWEN3_30B / "npu32_tp4_pp4_ep8.yaml"  # 4,096-token responses, eager
WORLD = ["--nnodes", "4", "--nproc-per-node", "8", "--model-config", QWEN3_30B / "config.json"]


def run(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ASCEND_PASS_THROUGH}
    full.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300, env=full, cwd=REPO
    )


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mcore-rl: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ---- defect 4: the collective timeout


@pytest.mark.parametrize("tokens,minutes", [(32, 31), (4096, 37), (8192, 44), (32768, 85)])
def test_collective_timeout_is_derived_from_the_longest_response(tokens, minutes):
    """30 minutes + 0.1 s per response token (10 tokens/s per sequence), whole minutes up - by hand: 32768 tokens
    x 0.1 s = 3276.8 s = 54.6 min -> 55 -> 85."""
    assert collective_timeout_minutes(load_config(None, [f"rollout.max_new_tokens={tokens}"])) == minutes


def test_collective_timeout_key_wins_and_is_validated():
    assert collective_timeout_minutes(load_config(LONG, ["trainer.collective_timeout_minutes=240"])) == 240
    with pytest.raises(ConfigError, match=r"^trainer.collective_timeout_minutes = 0.0 must be > 0, or null"):
        load_config(None, ["trainer.collective_timeout_minutes=0"])


def test_the_derived_timeout_reaches_the_process_group_and_hccl():
    """The 32k preset's 85 minutes: the timeout of the process group the platform starts (a real gloo group, read
    back from its backend's options) and, on NPU, HCCL_EXEC_TIMEOUT in seconds in the environment set before it."""
    code = (
        "import sys, torch\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "from mcore_rl.config import load_config\n"
        "from mcore_rl.platform import Platform, RunEnvironment\n"
        "Platform('cpu').init_distributed(RunEnvironment.of(load_config(sys.argv[1])))\n"
        "print(c10d._get_default_group()._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
    )
    proc = run("-c", code, LONG)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) == 85 * 60
    env: dict[str, str] = {}
    Platform("npu").apply_environment(env, RunEnvironment.of(load_config(LONG)))
    assert env["HCCL_EXEC_TIMEOUT"] == str(85 * 60)
    assert "HCCL_EXEC_TIMEOUT" not in Platform("cpu").apply_environment({}, RunEnvironment.of(load_config(LONG)))


# ---- defect 5: the Ascend environment, and what `mcore-rl check` prints


def test_launcher_environment_follows_the_config():
    """`python -m mcore_rl.platform env npu CONFIG` (the multi-node launcher's): the fixed variables, the timeout in
    seconds and the task queue level of the engine's mode (1 with graph capture, 2 eager: verl's Ascend GSPO
    guide); the user's own value wins; without a config only the fixed ones."""
    exports = {}
    for preset, timeout, queue in ((LONG, 85, "1"), (EAGER, 37, "2")):
        proc = run("-m", "mcore_rl.platform", "env", "npu", preset, "trainer.nnodes=4")
        assert proc.returncode == 0, proc.stderr
        exports = dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines())
        assert exports["HCCL_EXEC_TIMEOUT"] == str(timeout * 60) and exports["TASK_QUEUE_ENABLE"] == queue
    assert exports["HCCL_BUFFSIZE"] == "256" and exports["CPU_AFFINITY_CONF"] == "1"
    assert not set(ASCEND_PASS_THROUGH) & set(exports)  # per-cluster: never set here
    mine = run("-m", "mcore_rl.platform", "env", "npu", EAGER, env={"HCCL_EXEC_TIMEOUT": "7200"}).stdout
    assert "export HCCL_EXEC_TIMEOUT=7200" in mine.splitlines()
    bare = run("-m", "mcore_rl.platform", "env", "npu").stdout
    assert "HCCL_CONNECT_TIMEOUT=1800" in bare and "HCCL_EXEC_TIMEOUT" not in bare and "TASK_QUEUE" not in bare


def test_check_prints_the_environment_in_force():
    proc = run("-m", "mcore_rl.cli", "check", LONG, *WORLD, env={"HCCL_IF_BASE_PORT": "48000", "HCCL_BUFFSIZE": "512"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "collective timeout: 85 min (trainer.collective_timeout_minutes)" in lines
    assert "  HCCL_EXEC_TIMEOUT=5100  (set by mcore-rl)" in lines
    assert "  TASK_QUEUE_ENABLE=1  (set by mcore-rl)" in lines
    assert "  HCCL_BUFFSIZE=512  (from the environment; mcore-rl would set 256)" in lines
    assert "  HCCL_IF_BASE_PORT=48000  (per-cluster, passed through)" in lines
    assert "  HCCL_SOCKET_IFNAME unset  (per-cluster)" in lines and "  GLOO_SOCKET_IFNAME unset  (per-cluster)" in lines


def test_check_on_cpu_prints_the_timeout_only(tiny_model_dir):
    tiny = run("-m", "mcore_rl.cli", "check", REPO / "configs/tiny/gspo_cpu.yaml", f"model.path={tiny_model_dir}")
    assert tiny.returncode == 0, tiny.stderr
    assert "collective timeout: 31 min (trainer.collective_timeout_minutes)" in tiny.stdout
    assert "environment (npu)" not in tiny.stdout


# ---- defect 8: trainer.deterministic


def test_deterministic_switch_sets_the_consistency_variables():
    """verl's Ascend consistency guide (HCCL communication): CLOSE_MATMUL_K_SHIFT=1, ATB_MATMUL_SHUFFLE_K_ENABLE=0,
    HCCL_DETERMINISTIC=true - all three with the switch, none without; nothing on cpu / cuda."""
    guide = {"CLOSE_MATMUL_K_SHIFT": "1", "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "HCCL_DETERMINISTIC": "true"}
    on = ascend_environment(RunEnvironment.of(load_config(EAGER, ["trainer.deterministic=true"])))
    off = ascend_environment(RunEnvironment.of(load_config(EAGER)))
    assert {k: on[k] for k in guide} == guide and not set(guide) & set(off)
    for name in ("cpu", "cuda"):
        assert Platform(name).apply_environment({}, RunEnvironment(deterministic=True)) == {}


# ---- defect 3: the allocator setting


@pytest.mark.parametrize("platform,name", [("npu", "PYTORCH_NPU_ALLOC_CONF"), ("cuda", "PYTORCH_CUDA_ALLOC_CONF")])
def test_expandable_segments_refused_for_a_sleeping_vllm_engine(platform, name):
    """vLLM-Ascend 0.11.0 `CaMemAllocator` / vLLM 0.11 - 0.18 `CuMemAllocator` assert that the setting holds no
    expandable_segments:True: refused before any process starts, with the setting to use instead."""
    from mcore_rl.preflight.node import check_allocator
    from mcore_rl.preflight.run import check_before_build

    cfg = load_config(EAGER)
    bad = {name: "expandable_segments:True,max_split_size_mb:512"}
    with pytest.raises(
        ConfigError, match=f"^{name}=.*remove it from {name}, e.g. export {name}='max_split_size_mb:512'$"
    ):
        check_allocator(cfg, platform, bad)
    check_allocator(cfg, platform, {name: "max_split_size_mb:512"})
    with pytest.raises(ConfigError, match=f"^{name}="):
        check_allocator(cfg, platform, bad, vllm=(0, 18))
    if platform == "cuda":  # vLLM 0.23 switches them off around its pool itself (contract fact cumem_expandable)
        check_allocator(cfg, platform, bad, vllm=(0, 23))
    else:  # every vLLM-Ascend read asserts (camem_expandable)
        with pytest.raises(ConfigError, match=f"^{name}="):
            check_allocator(cfg, platform, bad, vllm=(0, 23))
    check_allocator(cfg, "cpu", bad)  # vLLM on CPU has no sleep mode
    check_allocator(load_config(EAGER, ["rollout.engine=embedded", "rollout.tp=1"]), platform, bad)
    with pytest.raises(ConfigError, match=f"^{name}="):
        check_allocator(cfg, None, bad)  # platform auto: both settings are checked
    node = [f"platform={platform}", "rollout.verify_fallback=error", "--node"]  # no disk need here
    proc = run("-m", "mcore_rl.cli", "check", EAGER, *node, *WORLD, env=bad)
    assert f"{name}=" in one_error(proc) and "OK:" not in proc.stdout
    os.environ[name] = bad[name]
    try:  # plain torchrun launches: the trainer's check before it builds anything
        with pytest.raises(ConfigError, match=f"^{name}="):
            check_before_build(cfg, 32, platform)
    finally:
        del os.environ[name]


# ---- defect 6: the rebuild fallback's disk


def test_rebuild_disk_need_is_the_hf_folders_size(tiny_model_dir, tmp_path):
    """rebuild_bytes against a real Hugging Face folder: the tiny model's safetensors (float32), less the file's
    JSON header, are exactly its need; the 30B model's bf16 folder is the ~61 GB `mcore-rl plan` states."""
    from mcore_rl.preflight.check import model_dims
    from mcore_rl.preflight.node import rebuild_bytes

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "rollout.engine=vllm", "model.dtype=float32"])
    files = sorted(Path(tiny_model_dir).glob("*.safetensors"))
    payload = 0
    for f in files:
        with open(f, "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
        payload += f.stat().st_size - 8 - header
    assert rebuild_bytes(cfg, model_dims(cfg)) == payload
    off = load_config(None, [f"model.path={tiny_model_dir}", "rollout.engine=vllm", "rollout.verify_fallback=error"])
    assert rebuild_bytes(off, model_dims(off)) == 0
    proc = run("-m", "mcore_rl.cli", "plan", EAGER, *WORLD, "--device-memory", "64")
    assert "disk: needs 61.1 GB free per node at rollout.rebuild_dir (null: TMPDIR)" in proc.stdout, proc.stdout


def test_rebuild_disk_checked_before_any_process_starts(tmp_path):
    """A model whose folder exceeds the free space at rollout.rebuild_dir (a folder still to be made: its nearest
    existing parent's disk) is refused by `mcore-rl check --node` with the fix; a 4-layer one (~7 GB) passes."""
    config = json.loads((QWEN3_30B / "config.json").read_text())
    per_layer = 61.1e9 / config["num_hidden_layers"]  # bf16 bytes per layer, about
    layers = {"big": int(shutil.disk_usage(tmp_path).free / per_layer) + 48, "small": 4}  # big: ~61 GB too many
    folder = tmp_path / "rebuild" / "here"
    procs = {}
    for name, count in layers.items():
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(dict(config, num_hidden_layers=count)))
        procs[name] = run(
            "-m", "mcore_rl.cli", "check", EAGER, f"rollout.rebuild_dir={folder}", "actor.parallel.pp=1", "--node",
            "--world-size", "32", "--model-config", path,
        )  # fmt: skip
    msg = one_error(procs["big"])
    assert f"to {folder} on each node, which has" in msg and "OK:" not in procs["big"].stdout
    assert msg.endswith(
        "set rollout.rebuild_dir to node-local storage with room for it, free space there, or set "
        "rollout.verify_fallback=error"
    )
    assert procs["small"].returncode == 0, procs["small"].stderr
    assert not folder.exists()  # checked, not made
