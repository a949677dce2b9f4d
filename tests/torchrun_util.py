"""Run a Python script under torchrun (real processes, gloo) and fail the test with its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


from mcore_rl.platform import free_port  # noqa: E402  (re-exported for the tests)


def run_torchrun(
    script: str | os.PathLike, nproc: int, *args: str, timeout: float = 300, env: dict | None = None
) -> str:
    """Start `nproc` processes running `script args...`; return combined output, raise on failure."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *map(str, args),
    ]
    full_env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    full_env.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    out = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} (nproc={nproc}) exited {proc.returncode}:\n{out[-8000:]}")
    return out
