"""Version differences of the libraries mcore-rl builds on, kept in one place.

One module per library: `compat.torch` (gloo collectives), `compat.megatron` (megatron-core), `compat.mbridge`, `compat.transformers`,
`compat.vllm` (vLLM / vLLM-Ascend: the in-place reload path and the vLLM-Ascend floor), `compat.megatron_optim`
(the optimizer step split into Megatron's own stages, to skip non-finite steps on every version). Each
detects the installed version once (a cached function; nothing is stored at import time), exposes the few
calls that differ between versions and lists every shim it can apply with the versions it covers and why
(`Shim`); `shims()` returns the ones in force for the installed versions. Code elsewhere calls these
functions instead of checking versions itself. The supported and tested versions are in docs/versions.md.

`describe_versions()` is what the trainer logs at start-up and `mcore-rl check` prints.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from packaging.version import Version


@dataclass(frozen=True)
class Shim:
    """One work-around for a version difference: what it does, for which versions, and why."""

    name: str
    covers: str  # the versions it applies to, e.g. "megatron-core < 0.13"
    why: str


@functools.lru_cache(maxsize=None)
def installed_version(distribution: str) -> Optional[Version]:
    """The installed version of a distribution (pip name), read from its metadata without importing it;
    None when it is not installed. Local tags (+cpu) are dropped."""
    try:
        return Version(Version(metadata.version(distribution)).base_version)
    except metadata.PackageNotFoundError:
        return None


def at_least(distribution: str, minimum: str) -> bool:
    """True when `distribution` is installed at `minimum` or newer (pre-releases of `minimum` count)."""
    v = installed_version(distribution)
    return v is not None and v >= Version(f"{minimum}.dev0")


_LIBRARIES = ("torch", "megatron-core", "mbridge", "transformers", "numpy")


def detected_versions() -> dict[str, str]:
    """Library -> installed version ("absent" when not installed)."""
    return {name: str(installed_version(name) or "absent") for name in _LIBRARIES}


def shims_in_force() -> list[Shim]:
    """Every shim that applies to the installed versions, over all libraries."""
    # here, not at the top: each library module imports this one (Shim), and importing them all would load torch
    from mcore_rl.compat import mbridge, megatron, torch, transformers

    return torch.shims() + megatron.shims() + mbridge.shims() + transformers.shims()


def describe_versions(brief: bool = False) -> str:
    """Detected versions and the shims in force, a few lines for logs and `mcore-rl check`; `brief`: one line
    that names the shims only (the training log's start; `mcore-rl check` says why each is needed)."""
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in detected_versions().items())]
    shims = shims_in_force()
    if brief:
        names = ", ".join(shim.name for shim in shims) or "none"
        return f"{lines[0]}; version shims: {names}" + (" (mcore-rl check says why)" if shims else "")
    if not shims:
        lines.append("version shims: none")
    for shim in shims:
        lines.append(f"version shim: {shim.name} ({shim.covers}): {shim.why}")
    return "\n".join(lines)
