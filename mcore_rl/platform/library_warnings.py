"""The library warnings that say nothing about a run, and the one line shown instead of them.

Megatron-Core, mbridge and torch warn at import and start-up about what they fall back to or will change:
Transformer Engine / Apex not installed (one warning per Megatron module that looks for them, on every rank),
Megatron's own default `cuda_graph_scope="full"` being deprecated, torch's deprecation of
`all_gather_into_tensor` and `reduce_scatter_tensor`. The 2-process CPU demo printed 36 such lines of its 43 before the first step.
`hide_known_warnings` filters exactly those - by category, module and message - in this process, and has to run
before Megatron is imported (most are raised at import time); every other warning and every error still shows.
`fallback_notice` is the one line that replaces them: what is absent and what that means on this platform.
`trainer.verbose=true` or MCORE_RL_VERBOSE=1 shows all of them again (docs/devices.md, "Library warnings").
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Optional

VERBOSE_ENV = "MCORE_RL_VERBOSE"


@dataclass(frozen=True)
class KnownWarning:
    category: type[Warning]
    module: str  # regular expression, matched at the start of the module the warning is attributed to
    message: str  # regular expression, matched at the start of the warning's text
    why: str  # why hiding it loses nothing


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning,
        r"(megatron|mbridge)",  # megatron.core.* and the megatron_fsdp package Megatron bundles
        r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back",
        "what is absent is said once, by fallback_notice",
    ),
    KnownWarning(
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        r"full scope is deprecated",
        "Megatron's own default (cuda_graph_scope='full', megatron-core 0.16); no CUDA graphs are captured here",
    ),
    KnownWarning(
        FutureWarning,
        r"torch\.distributed",
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        "torch 2.13 deprecates the gather every Megatron release calls; it still works",
    ),
    KnownWarning(
        FutureWarning,
        r"torch\.distributed",
        r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
        "torch 2.13 deprecates the reduce-scatter Megatron's sequence parallelism calls; it still works",
    ),
)

# Warnings that give advice only a device can take: hidden on CPU, shown elsewhere.
CPU_ONLY_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers",
        r"When using sequence parallelism it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        "a CUDA stream setting; no CUDA stream exists on CPU",
    ),
)

_NAMES = {"te": "Transformer Engine", "apex": "Apex"}


def verbose_requested(cfg_verbose: bool, env: Optional[dict] = None) -> bool:
    """trainer.verbose, or MCORE_RL_VERBOSE set to anything but empty / 0 / false / no."""
    env = os.environ if env is None else env
    return cfg_verbose or env.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def hide_known_warnings(platform: Optional[str] = None) -> None:
    """Install the KNOWN_WARNINGS filters (and CPU_ONLY_WARNINGS on platform "cpu") in this process
    (idempotent: warnings replaces an equal filter)."""
    for known in KNOWN_WARNINGS + (CPU_ONLY_WARNINGS if platform == "cpu" else ()):
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)


def installed_fallbacks() -> tuple[bool, bool]:
    """(Transformer Engine importable, Apex importable), without importing either."""
    return (importlib.util.find_spec("transformer_engine") is not None, importlib.util.find_spec("apex") is not None)


def fallback_notice(platform: str, have_te: bool, have_apex: bool) -> Optional[str]:
    """One line: which of Transformer Engine / Apex is absent and what runs instead on `platform`; None when
    both are installed (then Megatron does not warn about them)."""
    absent = [name for name, have in (("te", have_te), ("apex", have_apex)) if not have]
    if not absent:
        return None
    what = " and ".join(_NAMES[a] for a in absent) + (" are" if len(absent) > 1 else " is") + " not installed"
    if platform == "cpu":
        meaning = "not used on CPU (Megatron's PyTorch layers, norms and optimizer run)"
    elif "te" not in absent:  # cuda or npu with Transformer Engine: it has the fused norms and optimizer
        meaning = "not needed, Transformer Engine provides the fused kernels"
    elif platform == "npu":
        meaning = "on NPU MindSpeed provides the fused layers under Transformer Engine's names"
    else:
        meaning = (
            f"Megatron runs its local PyTorch layers on {platform} (no fused kernels, no FP8: slower; "
            "pip install transformer-engine for speed)"
        )
    return f"{what}: {meaning}; the warnings about it are hidden (trainer.verbose=true or {VERBOSE_ENV}=1: all)"


def quiet_startup(platform: str, verbose: bool) -> Optional[str]:
    """Hide the known warnings unless `verbose`; the line to show instead (None: nothing to say)."""
    if verbose:
        return None
    hide_known_warnings(platform)
    return fallback_notice(platform, *installed_fallbacks())
