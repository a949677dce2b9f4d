"""The worker side of the multi-process tests: named arguments, the common CPU set-up, one JSON result per rank.

A worker declares its arguments and reads them with `worker_args(model_dir=str, tp=int, mode=("ref", "check"))`
(`--model-dir DIR --tp 2 --mode check` on its command line, plus the `--results DIR` every worker takes), runs its
checks (a failed check raises), and ends with `write_result(args.results, **values)`: one `rank<N>.json` per rank.
The test starts it with `tests.torchrun_util.run_worker(script, nproc, model_dir=..., tp=2, mode="check")`, which
passes a fresh results folder, fails with the worker's output when any rank wrote no result, and returns the
per-rank dicts for the test's assertions.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

RESULT_GLOB = "rank*.json"


def worker_args(description: str | None = None, **spec: type | tuple[str, ...]) -> argparse.Namespace:
    """Parse `--name value` for every entry of `spec` (all required): a type (int, float, str) converts the value,
    a tuple of strings lists the allowed values. `--results DIR` (where write_result puts this rank's file) is
    always there. Underscores in names are dashes on the command line (`model_dir` -> `--model-dir`)."""
    parser = argparse.ArgumentParser(description=description)
    for name, kind in spec.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(kind, tuple):
            parser.add_argument(flag, dest=name, required=True, choices=kind)
        else:
            parser.add_argument(flag, dest=name, required=True, type=kind)
    parser.add_argument("--results", required=True, type=Path, help="folder for this rank's result JSON")
    return parser.parse_args()


def cpu_megatron():
    """The CPU platform with Megatron-Core adapted to it (the set-up of the actor workers)."""
    from mcore_rl.platform import get_platform

    platform = get_platform("cpu")
    platform.adapt_megatron()
    return platform


def init_gloo() -> tuple[int, int]:
    """torch.distributed over gloo from torchrun's environment; (rank, world size)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def this_rank() -> int:
    """The global rank: from torch.distributed while it is up, else from the launcher's RANK (0 when alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _plain(value):
    """JSON for the values workers report: tensors become numbers or lists, tuples and paths become lists/strings."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} into a worker result: convert it to a number or string")


def write_result(results: str | os.PathLike, **values) -> Path:
    """Write this rank's result as `<results>/rank<N>.json` (whole file or nothing: written aside, then renamed).
    Call it last, once every check of the rank has passed."""
    folder = Path(results)
    folder.mkdir(parents=True, exist_ok=True)
    rank = this_rank()
    path = folder / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, **values}, default=_plain, indent=1))
    os.replace(tmp, path)
    return path


def read_results(results: str | os.PathLike, nranks: int, output: str = "") -> list[dict]:
    """The result of each rank 0..nranks-1, in rank order. Raises AssertionError (with `output`, the worker's
    stdout and stderr) unless exactly those ranks wrote one."""
    folder = Path(results)
    found = sorted(p.name for p in folder.glob(RESULT_GLOB)) if folder.is_dir() else []
    want = [f"rank{r}.json" for r in range(nranks)]
    if sorted(found) != sorted(want):
        raise AssertionError(f"expected results {want} in {folder}, found {found}; worker output:\n{output[-8000:]}")
    return [json.loads((folder / name).read_text()) for name in want]
