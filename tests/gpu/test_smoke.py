"""The GPU smoke suite (tests/gpu/smoke.py) without a GPU: its dry run (plan, carry size, expected time), the
choice of carried wheels and the refusal of a missing one, the summary when there is no CUDA device; the run
itself on a GPU (marker `gpu`: `make test-gpu`; deselected elsewhere). The whole suite on CPU in the GPU
machine's shape is CI's `make rehearse-gpu` stage (docs/gpu-smoke.md)."""

import subprocess
import sys

import pytest
import torch
from packaging.tags import Tag

from tests.gpu import smoke as smoke_module
from tests.torchrun_util import REPO

SMOKE = REPO / "tests" / "gpu" / "smoke.py"
# the file names `make gpu-wheels` saves (pip download of tests/gpu/carry.txt for Python 3.11 and 3.12)
WHEELS = (
    "megatron_core-0.16.1-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "mbridge-0.15.1-py3-none-any.whl",
)


def smoke(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(SMOKE), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_dry_run_prints_the_plan_the_carry_size_and_the_expected_time(tmp_path):
    out = tmp_path / "summary.txt"
    proc = smoke("--dry-run", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not out.exists(), "a dry run must not leave a summary that reads like a result"
    text = proc.stdout
    for stage in smoke_module.STAGE_NAMES:
        assert f"  {stage} " in text, stage
    assert "transformer_engine absent" in text and "never measured on a GPU" in text
    assert f"gets {smoke_module.FIRST_COMPILE_S} s more: a first torch.compile" in text
    assert f"at most {smoke_module.BUDGET_S} s" in text
    tree, wheels = smoke_module.carry_bytes()
    assert f"carry: {(tree + wheels) / 2**20:.1f} MiB" in text and "fits in 64 MiB" in text
    assert tree + wheels <= 64 << 20
    want = "nothing" if torch.cuda.is_available() else "a CUDA device"
    assert f"missing here for --platform cuda: {want}" in text


def test_carried_wheels_are_picked_per_python_and_a_missing_one_is_named(tmp_path):
    for name in WHEELS:
        (tmp_path / name).write_bytes(b"")
    reqs = smoke_module.carried_requirements()
    assert reqs == [("megatron-core", "0.16.1"), ("mbridge", "0.15.1")]
    for py in ("311", "312"):
        tags = [Tag(f"cp{py}", f"cp{py}", "manylinux_2_28_x86_64"), Tag("py3", "none", "any")]
        picked, missing = smoke_module.select_wheels(tmp_path, reqs, tags)
        assert [w.name for w in picked] == [f for f in WHEELS if f"cp{py}" in f or "py3-none" in f] and not missing
    (tmp_path / WHEELS[1]).unlink()
    tags = [Tag("cp312", "cp312", "manylinux_2_28_x86_64"), Tag("py3", "none", "any")]
    picked, missing = smoke_module.select_wheels(tmp_path, reqs, tags)
    assert [w.name for w in picked] == [WHEELS[2]] and missing == ["megatron-core==0.16.1"]


def test_install_refuses_a_missing_wheel_before_pip_runs(tmp_path):
    (tmp_path / WHEELS[2]).write_bytes(b"")  # mbridge only: megatron-core is missing for every Python
    site = tmp_path / "site"
    proc = smoke("--install", "--wheels", tmp_path, "--site", site)
    assert proc.returncode == 1 and not site.exists(), proc.stdout + proc.stderr
    assert "mcore-rl: error:" in proc.stderr and "megatron-core==0.16.1" in proc.stderr
    assert "make gpu-wheels" in proc.stderr


def test_bad_arguments_fail_fast_and_no_gpu_still_writes_the_summary(tmp_path):
    proc = smoke("--gspo-steps", "5", "--dry-run")
    assert proc.returncode == 2 and "--gspo-steps must be >= 20" in proc.stderr
    if torch.cuda.is_available():
        return
    out = tmp_path / "s.txt"
    proc = smoke("--out", out)
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stderr
    lines = [l for l in out.read_text().splitlines() if not l.startswith("#")]
    assert lines[0].startswith("FAIL  env") and len(lines) == len(smoke_module.STAGES)
    assert all(l.startswith("SKIP") for l in lines[1:]), lines


def test_a_stage_past_its_budget_or_raising_fails_and_the_next_one_runs(monkeypatch):
    import time

    calls = []
    monkeypatch.setitem(smoke_module.STAGE_FNS, "env", lambda ctx: time.sleep(5))
    monkeypatch.setitem(smoke_module.STAGE_FNS, "nccl", lambda ctx: 1 / 0)
    monkeypatch.setitem(smoke_module.STAGE_FNS, "parity", lambda ctx: calls.append(1) or "fine")
    stages = [smoke_module.Stage(n, 1, 0, "") for n in ("env", "nccl", "parity")]
    ctx = {"platform": "cuda"}
    results = [smoke_module.run_stage(s, ctx, 100) for s in stages]
    assert [r.status for r in results] == ["FAIL", "FAIL", "PASS"] and calls == [1]
    assert "ran past its 1 s budget" in results[0].detail and results[0].seconds < 3
    assert "ZeroDivisionError" in results[1].detail
    assert smoke_module.run_stage(stages[2], ctx, 0.5).status == "SKIP"  # the suite's budget spent
    text = smoke_module.summary(results, "cuda", 2.0)
    assert text.splitlines()[1].startswith("FAIL  env") and text.endswith("# result: FAIL (env, nccl)")


def test_the_first_megatron_stage_has_room_for_a_first_compile_and_says_what_it_took(monkeypatch):
    """megatron-core's jit_fuser is torch.compile: until something has compiled in the process, a stage running a
    Megatron forward gets FIRST_COMPILE_S more; each stage's line says the compile seconds it spent."""
    parity, env = smoke_module.Stage("parity", 30, 0, "", megatron=True), smoke_module.Stage("env", 60, 0, "")
    first = smoke_module.FIRST_COMPILE_S
    monkeypatch.setattr(smoke_module, "compile_seconds", lambda: 0.0)
    assert smoke_module.stage_budget(parity, "cuda") == 30 + first
    assert smoke_module.stage_budget(parity, "cpu") == (30 + first) * smoke_module.CPU_BUDGET_SCALE
    assert smoke_module.stage_budget(env, "cuda") == 60
    monkeypatch.setattr(smoke_module, "compile_seconds", lambda: 2.0)  # compiled once already: no allowance
    assert smoke_module.stage_budget(parity, "cuda") == 30
    seconds = iter([0.0, 0.0, 1.5])  # at the start, for the budget, at the end
    monkeypatch.setattr(smoke_module, "compile_seconds", lambda: next(seconds))
    monkeypatch.setitem(smoke_module.STAGE_FNS, "parity", lambda ctx: "fine")
    result = smoke_module.run_stage(parity, {"platform": "cuda"}, 100)
    assert result.status == "PASS" and result.detail == "fine; torch.compile 1.5 s of it"


@pytest.mark.gpu
def test_smoke_suite_on_the_gpu(tmp_path):
    out = tmp_path / "summary.txt"
    proc = smoke("--out", out, timeout=600)
    text = out.read_text()
    assert proc.returncode == 0 and "\nFAIL" not in text, proc.stdout[-4000:] + proc.stderr[-4000:]
