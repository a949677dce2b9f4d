"""The support matrix: which releases can run together in one trainer process, decided from their pins.

The actor (Megatron, on NPU patched by MindSpeed) and the colocated rollout engine (vLLM, on NPU with the
vLLM-Ascend plugin) share one Python process and so one torch. A vLLM-Ascend wheel pins one torch and one
torch_npu (``Requires-Dist: torch==...``), and its compiled operators are built against them; every MindSpeed
release lists the PyTorch versions it supports. A stack is supported where these meet, and refused before
launch where they cannot: a second torch in the same process does not exist. The facts below are read from
the wheels' metadata and sources (checked by the contract tests, ``tests/contract``) and from MindSpeed's
release notes (docs/devices.md, "Facts outside the package index"); docs/versions.md shows the matrix.

Pure Python on purpose: ``mcore-rl check`` reads installed versions through ``importlib.metadata``, without
importing torch or any library it judges.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# distribution name -> installed version (None: not installed). Tests pass their own (the combination under test).
VersionOf = Callable[[str], Optional[str]]


def installed(distribution: str) -> Optional[str]:
    """The installed version of `distribution` (pip name), read from its metadata; None when absent."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class AscendRelease:
    """A vLLM-Ascend release on the package index, with what its wheel requires and offers."""

    version: str  # vllm-ascend, e.g. "0.11.0"; it goes with the vLLM of the same minor
    torch: str  # its wheel's Requires-Dist torch==...
    torch_npu: str  # its wheel's Requires-Dist torch-npu==...
    transformers: str  # its wheel's transformers requirement (a specifier set)
    routed_experts: bool  # its fused MoE feeds vLLM's RoutedExpertsCapturer (algo.routing_replay=r3)
    logprobs_mode: bool  # its sampler honours logprobs_mode (algo.rollout_is at temperature != 1)

    @property
    def vllm(self) -> str:
        """The vLLM line it plugs into (the same major.minor)."""
        return _line(self.version)


@dataclass(frozen=True)
class MindSpeedRelease:
    """A MindSpeed release (from its source branch; not on the package index), per its release notes."""

    name: str  # the branch / tag, e.g. "2.2.0_core_r0.12.1"
    megatron_core: str  # the megatron-core it patches; also the version its setup.py installs as `mindspeed`
    torch: tuple[str, ...]  # the PyTorch versions its release notes list
    cann: str
    torch_npu: str  # "Ascend Extension for PyTorch" version of its release notes


# Read from the wheels on the package index (tests/contract checks every field against the wheel).
ASCEND_RELEASES = (
    AscendRelease("0.11.0", "2.7.1", "2.7.1", "<=4.57.1", routed_experts=False, logprobs_mode=False),
    AscendRelease("0.13.0", "2.8.0", "2.8.0.post2", ">=4.57.4,<5", routed_experts=False, logprobs_mode=False),
    AscendRelease("0.18.0", "2.9.0", "2.9.0", ">=4.57.4", routed_experts=True, logprobs_mode=False),
    AscendRelease("0.23.0", "2.10.0", "2.10.0.post4", "==5.5.4", routed_experts=True, logprobs_mode=True),
)

# Read from MindSpeed's release branches (docs/devices.md, "Facts outside the package index"). Its branches
# core_r0.14.0 ... core_r0.18.0 have no release and list PyTorch 2.7.1 as well.
MINDSPEED_RELEASES = (
    MindSpeedRelease("2.2.0_core_r0.12.1", "0.12.1", ("2.1.0", "2.6.0", "2.7.1"), "8.3.RC1", "7.2.0"),
    MindSpeedRelease("2.3.0_core_r0.12.1", "0.12.1", ("2.5.1", "2.6.0", "2.7.1"), "8.5.0", "7.3.0"),
    MindSpeedRelease("26.0.0_core_r0.12.1", "0.12.1", ("2.7.1",), "9.0.0", "26.0.0"),
    MindSpeedRelease("26.1.0_core_r0.12.1", "0.12.1", ("2.7.1",), "9.1.0", "26.1.0"),
)

# CUDA: vLLM from the project's floor to the newest release read, with megatron-core 0.16 and Transformer Engine.
CUDA_VLLM = SpecifierSet(">=0.10,<0.34")
CUDA_MEGATRON = SpecifierSet(">=0.16,<0.17")
# The project's own ranges (pyproject.toml); outside them nothing is claimed on any platform.
MEGATRON_RANGE = SpecifierSet(">=0.12.1,<0.17")
MBRIDGE_RANGE = SpecifierSet(">=0.13.1,<0.16")


def _v(version: str) -> Version:
    return Version(Version(version).base_version)  # local tags (+cpu) and post-releases do not change the line


def _line(version: str) -> str:
    v = Version(version)
    return f"{v.major}.{v.minor}"


def _same_release(a: str, b: str) -> bool:
    """`a` and `b` are the same release up to post-releases and local tags (2.7.1.post4 == 2.7.1+cpu)."""
    return _v(a) == _v(b)


def _min_vllm_ascend() -> str:
    # the floor the engine enforces (one value); here, not at the top: compat.vllm imports torch, the pre-flight none
    from mcore_rl.compat.vllm import MIN_VLLM_ASCEND

    return MIN_VLLM_ASCEND


def ascend_release(version: str) -> Optional[AscendRelease]:
    """The release of the matrix of vllm-ascend `version`'s line (0.11.0rc1 -> 0.11.0), or None."""
    return next((r for r in ASCEND_RELEASES if _line(r.version) == _line(version)), None)


def mindspeed_for_torch(torch: str) -> tuple[MindSpeedRelease, ...]:
    """The MindSpeed releases whose release notes list `torch`."""
    return tuple(m for m in MINDSPEED_RELEASES if any(_same_release(torch, t) for t in m.torch))


def _mindspeed_newest_torch() -> str:
    return max((t for m in MINDSPEED_RELEASES for t in m.torch), key=Version)


def colocatable(release: AscendRelease) -> bool:
    """Whether `release` can share one process with a released MindSpeed (and is above the engine's floor)."""
    return bool(mindspeed_for_torch(release.torch)) and Version(release.version) >= Version(_min_vllm_ascend())


def supported_ascend_releases() -> tuple[AscendRelease, ...]:
    return tuple(r for r in ASCEND_RELEASES if colocatable(r))


def describe_npu_stack(release: AscendRelease) -> str:
    """One supported NPU stack, as an install line names it."""
    ms = mindspeed_for_torch(release.torch)
    return (
        f"vllm-ascend {release.version} + vllm {release.vllm}.x + torch {release.torch} + torch_npu {release.torch_npu} + "
        f"MindSpeed {' / '.join(m.name for m in ms)} + megatron-core {ms[-1].megatron_core} + transformers "
        f"{release.transformers} (docs/versions.md)"
    )


def nearest_npu_stack(version: Optional[str] = None) -> str:
    """The supported NPU stack closest to vllm-ascend `version` (None: the newest supported)."""
    stacks = supported_ascend_releases()
    if not stacks:
        raise RuntimeError("no vLLM-Ascend release of the matrix can share a process with a MindSpeed release")
    if version is None:
        return describe_npu_stack(stacks[-1])
    return describe_npu_stack(min(stacks, key=lambda r: abs(_v(r.version).minor - _v(version).minor)))


def first_release_with(feature: str) -> str:
    """Why an engine feature ("routed_experts" | "logprobs_mode") is refused on NPU: the first vLLM-Ascend
    release that has it and why it cannot share a process with MindSpeed today (one clause for an error)."""
    release = next((r for r in ASCEND_RELEASES if getattr(r, feature)), None)
    if release is None:
        return f"no vLLM-Ascend release of the matrix ({', '.join(r.version for r in ASCEND_RELEASES)}) has it"
    if colocatable(release):
        return f"vLLM-Ascend {release.version} has it and is supported: install {describe_npu_stack(release)}"
    return (
        f"the first vLLM-Ascend release with it is {release.version}, which needs torch {release.torch}, while every "
        f"MindSpeed release (up to {MINDSPEED_RELEASES[-1].name}) runs on PyTorch {_mindspeed_newest_torch()} or older, so the actor and "
        f"that engine cannot share one process yet"
    )


# ---------------------------------------------------------------------------------------- installed stacks


@dataclass(frozen=True)
class StackReport:
    """What the installed versions mean for a run: refusals (cannot work; `mcore-rl check` / `train` stop),
    notes outside the matrix (may work, not claimed) and the stack recognised."""

    refusals: tuple[str, ...]
    outside: tuple[str, ...]
    stack: str

    def lines(self) -> list[str]:
        """What `mcore-rl check` prints (after the versions)."""
        out = [f"stack: {self.stack}"]
        out += [f"stack: outside the support matrix: {o}" for o in self.outside]
        return out


def _parse(version_of: VersionOf, distribution: str) -> Optional[str]:
    raw = version_of(distribution)
    if raw is None:
        return None
    try:
        Version(raw)
    except InvalidVersion:
        return None
    return raw


def _npu_report(version_of: VersionOf, vllm_engine: bool) -> StackReport:
    got = {
        d: _parse(version_of, d) for d in ("torch", "torch-npu", "vllm", "vllm-ascend", "mindspeed", "megatron-core")
    }
    got["transformers"] = _parse(version_of, "transformers")
    if not any(got[d] for d in ("torch-npu", "vllm-ascend", "mindspeed")):
        return StackReport((), (), "no Ascend package installed here (torch-npu, vllm-ascend, mindspeed): not checked")
    refusals: list[str] = []
    outside: list[str] = []
    torch, ascend = got["torch"], got["vllm-ascend"]
    release = ascend_release(ascend) if ascend and vllm_engine else None
    nearest = nearest_npu_stack(ascend if vllm_engine else None)
    if ascend and vllm_engine:
        if release is None:
            refusals.append(
                f"vllm-ascend {ascend} is not a release line of the matrix "
                f"({', '.join(r.version for r in ASCEND_RELEASES)}): install {nearest}"
            )
        elif Version(ascend) < Version(_min_vllm_ascend()):
            refusals.append(
                f"vllm-ascend {ascend} is older than {_min_vllm_ascend()}, the first whose fused-MoE loaders take "
                f"training-layout weights: install {nearest}"
            )
        elif torch and not _same_release(torch, release.torch):
            refusals.append(
                f"vllm-ascend {ascend} is built for torch {release.torch}, torch {torch} is installed: install {nearest}"
            )
        elif not mindspeed_for_torch(release.torch):
            refusals.append(
                f"vllm-ascend {ascend} needs torch {release.torch}, but no MindSpeed release supports it (all list PyTorch "
                f"<= {_mindspeed_newest_torch()}) and the actor shares the engine's process: install {nearest}"
            )
        if release is not None and got["vllm"] and _line(got["vllm"]) != release.vllm:
            refusals.append(
                f"vllm {got['vllm']} with vllm-ascend {ascend}: the plugin needs vllm {release.vllm}.x (same minor): install {nearest}"
            )
        if (
            release is not None
            and got["transformers"]
            and got["transformers"] not in SpecifierSet(release.transformers)
        ):
            outside.append(
                f"transformers {got['transformers']} with vllm-ascend {ascend}, whose wheel requires {release.transformers}"
            )
    if torch and got["torch-npu"] and not _same_release(torch, got["torch-npu"]):
        refusals.append(
            f"torch_npu {got['torch-npu']} is built for torch {_v(got['torch-npu'])}, torch {torch} is installed: install {nearest}"
        )
    ms, mcore = got["mindspeed"], got["megatron-core"]
    if ms and mcore and not _same_release(ms, mcore):
        refusals.append(
            f"MindSpeed for megatron-core {ms} (its installed version names the core it patches) with megatron-core {mcore}: "
            f"the MindSpeed branch must match the megatron-core it patches: install {nearest}"
        )
    if torch and ms and not mindspeed_for_torch(torch):
        refusals.append(
            f"torch {torch}: no MindSpeed release supports it (all list PyTorch <= {_mindspeed_newest_torch()}): install {nearest}"
        )
    if refusals:
        return StackReport(tuple(refusals), tuple(outside), "outside the support matrix (refused)")
    stack = describe_npu_stack(release) if release else "NPU (MindSpeed and torch agree; no vLLM-Ascend engine checked)"
    return StackReport((), tuple(outside), f"supported: {stack}")


def _cuda_report(version_of: VersionOf, vllm_engine: bool) -> StackReport:
    vllm, mcore = _parse(version_of, "vllm"), _parse(version_of, "megatron-core")
    refusals: list[str] = []
    outside: list[str] = []
    nearest = f"vllm {CUDA_VLLM} with megatron-core {CUDA_MEGATRON} and transformer-engine"
    if vllm_engine and vllm and _v(vllm) not in CUDA_VLLM:
        (refusals if _v(vllm) < Version("0.10") else outside).append(f"vllm {vllm} (the matrix: {nearest})")
    if mcore and _v(mcore) not in CUDA_MEGATRON:
        outside.append(f"megatron-core {mcore} on CUDA (the matrix: {nearest}; CI runs 0.12.1 and 0.16.1 on CPU)")
    if version_of("transformer-engine") is None and version_of("transformer_engine") is None:
        outside.append("no transformer-engine on CUDA: the actor falls back to the local layer spec (not the matrix)")
    if refusals:
        return StackReport(tuple(refusals), tuple(outside), "outside the support matrix (refused)")
    return StackReport((), tuple(outside), "CUDA" + (f": vllm {vllm}, megatron-core {mcore}" if vllm or mcore else ""))


def check_installed(platform: Optional[str], vllm_engine: bool, version_of: VersionOf = installed) -> StackReport:
    """Judge the installed combination for `platform` ("npu" | "cuda" | "cpu" | None: npu where an Ascend
    package is installed, else cpu). `vllm_engine`: the run uses the vLLM engine (rollout.engine = vllm)."""
    if platform in (None, "auto"):
        platform = "npu" if any(version_of(d) for d in ("torch-npu", "vllm-ascend", "mindspeed")) else "cpu"
    if platform == "npu":
        return _npu_report(version_of, vllm_engine)
    if platform == "cuda":
        return _cuda_report(version_of, vllm_engine)
    mcore, mbridge = _parse(version_of, "megatron-core"), _parse(version_of, "mbridge")
    outside = (
        [f"megatron-core {mcore} (claimed: {MEGATRON_RANGE})"] if mcore and _v(mcore) not in MEGATRON_RANGE else []
    )
    outside += [f"mbridge {mbridge} (claimed: {MBRIDGE_RANGE})"] if mbridge and _v(mbridge) not in MBRIDGE_RANGE else []
    return StackReport((), tuple(outside), "CPU (the CI-tested stacks: docs/versions.md)")
