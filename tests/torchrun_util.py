"""Start test workers in real processes (torchrun over gloo, or plain python) and fail the test with their output.

`run_worker` is the way tests start the workers in tests/workers/: named arguments in, one result dict per rank
out (see tests/workers/harness.py for the worker side). `run_torchrun` runs any script or tool with raw arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.platform import free_port
from tests.workers.harness import read_results

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WorkerRun:
    """What a worker run gave: one result dict per rank (index = rank) and the combined stdout + stderr."""

    results: list[dict]
    output: str


def _env(extra: dict | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def _run(cmd: list[str], what: str, timeout: float, env: dict) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    out = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{what} exited {proc.returncode}:\n{out[-8000:]}")
    return out


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
    return _run(cmd, f"torchrun {script} (nproc={nproc})", timeout, _env(env))


def named_args(args: dict) -> list[str]:
    """{"model_dir": d, "tp": 2} -> ["--model-dir", d, "--tp", "2"] (what harness.worker_args parses)."""
    return [x for name, value in args.items() for x in ("--" + name.replace("_", "-"), str(value))]


def run_worker(
    script: str | os.PathLike,
    nproc: int,
    *,
    timeout: float = 300,
    env: dict | None = None,
    torchrun: bool = True,
    **args,
) -> WorkerRun:
    """Run a tests/workers script with `--name value` for each keyword in `args` (under torchrun with `nproc`
    processes, or as one plain python process with torchrun=False) and return every rank's result. Fails with
    the worker's output when it exits non-zero or when not exactly ranks 0..nproc-1 wrote a result."""
    if not torchrun and nproc != 1:
        raise ValueError(f"a plain python worker is one process, not {nproc}")
    with tempfile.TemporaryDirectory(prefix="worker-results-") as results:
        argv = [*named_args(args), "--results", results]
        if torchrun:
            out = run_torchrun(script, nproc, *argv, timeout=timeout, env=env)
        else:
            # alone, without torchrun: rank 0 of a world of 1, and no inherited rendezvous port
            plain_env = {k: v for k, v in _env(env).items() if k != "MASTER_PORT"}
            plain_env.update(WORLD_SIZE="1", RANK="0")
            out = _run([sys.executable, str(script), *argv], f"python {script}", timeout, plain_env)
        return WorkerRun(read_results(results, nproc, out), out)
