"""The GPU smoke suite (tests/gpu/smoke.py): its dry run here (argument parsing, environment checks, plan),
the real run on a GPU (marker `gpu`: `make test-gpu`; deselected elsewhere)."""

import subprocess
import sys

import pytest
import torch

from tests.torchrun_util import REPO

SMOKE = REPO / "tests" / "gpu" / "smoke.py"


def smoke(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(SMOKE), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_dry_run_checks_the_environment_and_prints_the_plan(tmp_path):
    out = tmp_path / "summary.txt"
    proc = smoke("--dry-run", "--out", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.strip() == proc.stdout.strip() and "dry run: nothing ran on a GPU" in text
    for stage in ("env", "nccl", "parity", "train", "sync", "memory", "gspo", "vllm"):
        assert f"  {stage} " in text, stage
    assert "of a 300 s budget" in text and "transformer_engine absent" in text
    if not torch.cuda.is_available():
        assert "needs: a CUDA device" in text


def test_bad_arguments_and_missing_gpu_fail_fast(tmp_path):
    proc = smoke("--gspo-steps", "5", "--dry-run")
    assert proc.returncode == 2 and "--gspo-steps must be >= 20" in proc.stderr
    if not torch.cuda.is_available():
        proc = smoke("--out", tmp_path / "s.txt")
        assert proc.returncode == 2 and "missing a CUDA device" in proc.stderr


@pytest.mark.gpu
def test_smoke_suite_on_the_gpu(tmp_path):
    out = tmp_path / "summary.txt"
    proc = smoke("--out", out, timeout=600)
    assert proc.returncode == 0 and "result: ok" in out.read_text(), proc.stdout[-4000:] + proc.stderr[-4000:]
