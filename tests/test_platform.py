"""Platform selection and the CPU adaptation of Megatron-Core (each patched call site, idempotence)."""

import os
import subprocess
import sys

import pytest
import torch

from mcore_rl.platform import Platform, get_platform
from tests.torchrun_util import REPO

SITES = ["idempotent", "factories", "seeding", "rotary", "streams", "clip_grads", "router_gemm", "split_sizes"]


def test_auto_picks_cpu_here():
    p = get_platform("auto")
    assert p == Platform("cpu") and p.dist_backend == "gloo" and p.device == torch.device("cpu")


def test_backends():
    # accelerators: the device backend for device tensors and gloo for CPU tensors (docs/devices.md)
    assert [Platform(n).dist_backend for n in ("cpu", "cuda", "npu")] == [
        "gloo",
        "cpu:gloo,cuda:nccl",
        "cpu:gloo,npu:hccl",
    ]


def test_megatron_subgroups_inherit_the_default_backend():
    """Megatron's parallel_state creates its groups with backend=None; torch resolves that to the default
    group's backend string, so a multi-device default reaches every TP/PP/DP/EP group."""
    import inspect

    from megatron.core import parallel_state

    assert "backend=None" in inspect.getsource(parallel_state.create_group)
    script = (
        "import torch.distributed as dist\n"
        "dist.init_process_group('cpu:gloo', rank=0, world_size=1)\n"
        "from megatron.core import parallel_state as mpu\n"
        "mpu.initialize_model_parallel()\n"
        "print('BACKENDS', dist.get_backend(mpu.get_data_parallel_group()), "
        "dist.get_backend(mpu.get_tensor_model_parallel_group()), dist.get_backend(mpu.get_expert_model_parallel_group()))\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "BACKENDS cpu:gloo cpu:gloo cpu:gloo" in out.stdout, out.stdout + out.stderr[-3000:]


def test_ascend_environment_is_set_once_and_user_values_win():
    env = {"HCCL_CONNECT_TIMEOUT": "600"}
    applied = Platform("npu").apply_environment(env)
    assert (
        applied == {"VLLM_ASCEND_ENABLE_NZ": "0", "HCCL_CONNECT_TIMEOUT": "600"} and env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    )
    assert Platform("cuda").apply_environment({}) == {}


def _port() -> int:
    from tests.torchrun_util import free_port

    return free_port()


def test_unknown_platform_is_rejected():
    with pytest.raises(ValueError, match="unknown"):
        get_platform("tpu")


def test_cuda_requested_without_cuda_is_rejected():
    with pytest.raises(RuntimeError, match="cuda"):
        get_platform("cuda")


@pytest.fixture(scope="module")
def site_output():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WORLD_SIZE="1", RANK="0")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "actor_platform_sites.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("site", SITES)
def test_cpu_adaptation_site(site_output, site):
    assert f"ok {site}\n" in site_output, site_output[-4000:]


def test_mindspeed_arguments_set_after_the_adaptor():
    """The decision of _adapt_npu: repatch only the MindSpeed arguments that differ (idempotent)."""
    from types import SimpleNamespace

    from mcore_rl.platform import MINDSPEED_ARGS, mindspeed_args_to_set

    assert MINDSPEED_ARGS["use_flash_attn"] is True
    assert mindspeed_args_to_set(SimpleNamespace(use_flash_attn=False)) == {"use_flash_attn": True}
    assert mindspeed_args_to_set(SimpleNamespace()) == {"use_flash_attn": True}  # absent from sys.argv
    assert mindspeed_args_to_set(SimpleNamespace(**MINDSPEED_ARGS)) == {}


def test_layer_spec_choice():
    """TE spec on NPU (MindSpeed) and on CUDA only where transformer_engine imports; local spec otherwise."""
    import importlib.util

    has_te = importlib.util.find_spec("transformer_engine") is not None
    assert Platform("npu").uses_transformer_engine and not Platform("cpu").uses_transformer_engine
    assert Platform("cuda").uses_transformer_engine == has_te
    assert not has_te  # this suite's venv has no Transformer Engine: CUDA here would use the local spec
