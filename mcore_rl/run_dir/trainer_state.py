"""What a checkpoint unpickles, read so that a checkpoint from someone else runs no code (checksums prove a file is
the one written, not who wrote it).

Each rank's trainer state, `trainer_state_rank{R}.pt` (step, data-sampler position, skip counter, random states),
is tensors and plain types only, read with `torch.load(weights_only=True)`. Checkpoints written before this form
pickled numpy's random state as an ndarray, which only a full unpickling reads: that runs whatever the file holds,
so it is done only with `checkpoint.trust_pickle=true`, with a warning.

The actor's dist checkpoint is read by Megatron and torch: torch.distributed.checkpoint unpickles `actor/.metadata`
with a plain `pickle.load` (FileSystemReader.read_metadata, torch 2.13), and megatron-core 0.12.1 reads
`actor/common.pt` with `torch.load(weights_only=False)` (0.16.1: weights_only=True with its own allowed classes).
`check_pickles` reads both first, the metadata with an unpickler that builds only torch.distributed.checkpoint's
and Megatron's plain metadata classes, dtypes and sizes, and common.pt with weights_only=True: a file that needs anything else is refused before
Megatron opens it. torch and numpy are imported in the functions: the pre-flight imports this package without them.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcore_rl.config import ConfigError

TRUST_PICKLE = "checkpoint.trust_pickle=true"


def state_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / f"trainer_state_rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """This process's torch (CPU), Python and numpy random states, as tensors and plain types."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()  # ('MT19937', uint32[624], int, int, float)
    numpy = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)}
    numpy.update(has_gauss=int(has_gauss), cached_gaussian=float(cached))
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore rng_state(); the numpy state of an older checkpoint (the tuple numpy returns) too."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        keys = saved["keys"].numpy().astype(np.uint32)
        saved = (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    np.random.set_state(saved)


_OLD_STATE = "a checkpoint written before trainer states became plain tensors does"
_NOT_WRITTEN_HERE = "neither Megatron, torch nor this project writes such a file: it was altered"


def _unsupported(error: Exception) -> str:
    """The line of torch's weights_only error that names the global (the rest is advice for torch.load's caller)."""
    lines = [line.strip() for line in str(error).splitlines()]
    found = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return found.removeprefix("WeightsUnpickler error: ").split(" was not an allowed global")[0]


def _refused(path: Path, why: str, whose: str = _OLD_STATE) -> ConfigError:
    return ConfigError(
        f"{path} holds Python objects that only a full unpickling reads ({why}), and unpickling runs any code the "
        f"file holds; {whose}. If you trust where this checkpoint came from, set {TRUST_PICKLE} (trainer states are "
        f"re-saved in the safe form at the next checkpoint); else resume from another checkpoint"
    )


class _StandIn:
    """What the check builds for a class it knows by name without importing its module (Megatron's)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


def _plain_class(found) -> bool:
    """A class whose construction from a pickle runs none of its own code but field assignments: a dataclass, an
    enum, or one with object's __init__."""
    import dataclasses
    import enum

    if not isinstance(found, type):
        return False
    return dataclasses.is_dataclass(found) or issubclass(found, enum.Enum) or found.__init__ is object.__init__


def _metadata_unpickler(file):
    """An unpickler that builds only what torch.distributed.checkpoint's metadata holds: the plain classes of its
    metadata, planner and filesystem modules, Megatron's save plan (megatron-core 0.12.1 writes MCoreSavePlan, a
    dataclass; 0.16.1 keeps a stand-in of it), torch.Size, dtypes, layouts and memory formats."""
    import pickle

    import torch

    dcp = {f"torch.distributed.checkpoint.{m}" for m in ("metadata", "planner", "filesystem")}
    plain = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    plain |= {("pathlib", "PosixPath")}
    megatron = {("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")}

    class MetadataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) in megatron:
                return _StandIn  # not imported here: the pre-flight runs without Megatron
            if (module, name) in plain:
                return super().find_class(module, name)
            found = super().find_class(module, name) if module in dcp else getattr(torch, name, None)
            if module in dcp and _plain_class(found):
                return found
            if module == "torch" and isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")

    return MetadataOnly(file)


@contextmanager
def _torch_defaults_only():
    """weights_only loads with torch's own allowed globals: megatron-core 0.16.1 adds numpy's and its own to the
    process's list when imported, so the ranks would read what the pre-flight (no Megatron) refuses."""
    import torch.serialization

    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(added)


def read_state(path: Path, trust_pickle: bool, log=None) -> dict[str, Any]:
    """The trainer state at `path`, read with weights_only=True; a file that needs a full unpickling (an older
    checkpoint's) only with trust_pickle (a warning on `log`), else a ConfigError naming the key."""
    import pickle

    import torch

    try:
        with _torch_defaults_only():
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust_pickle:
            raise _refused(path, _unsupported(e)) from None
    if log is not None:
        log.warning("%s read by a full unpickling, which can run code from the file (%s)", path, TRUST_PICKLE)
    return torch.load(path, weights_only=False)


def check_pickles(checkpoint: Path, trust_pickle: bool) -> None:
    """Before anything of `checkpoint` is loaded: every file that is unpickled (the ranks' trainer states, the actor's
    common.pt and .metadata) needs nothing but tensors, plain types and torch.distributed.checkpoint's own classes;
    a ConfigError naming checkpoint.trust_pickle otherwise. The files are small. A file that is missing or damaged
    is left to the checksums, which name it."""
    import pickle

    import torch

    if trust_pickle:
        return
    checkpoint = Path(checkpoint)
    weights_only = [(p, _OLD_STATE) for p in sorted(checkpoint.glob("trainer_state_rank*.pt"))]
    for path, whose in [*weights_only, (checkpoint / "actor" / "common.pt", _NOT_WRITTEN_HERE)]:
        try:
            with _torch_defaults_only():
                torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(path, _unsupported(e), whose) from None
        except Exception:
            continue
    metadata = checkpoint / "actor" / ".metadata"
    try:
        with open(metadata, "rb") as f:
            _metadata_unpickler(f).load()
    except pickle.UnpicklingError as e:
        raise _refused(metadata, str(e), _NOT_WRITTEN_HERE) from None
    except Exception:
        pass
