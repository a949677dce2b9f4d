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
    assert [Platform(n).dist_backend for n in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]


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
