"""Checksums: each rank hashes the files it wrote at save, and verifies a share of them at load."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Optional

from mcore_rl.run_dir.layout import CHECKSUMS, MARKER, Checkpoint

CHUNK = 16 << 20
_WRITER = (re.compile(r"__(\d+)_\d+\.distcp$"), re.compile(r"rank(\d+)"))  # dist-checkpoint shards, per-rank state


def file_owner(relpath: str, world: int) -> int:
    """The rank that wrote a payload file (Megatron's __R_k.distcp, our *_rankR.pt), else rank 0; mod world."""
    for pattern in _WRITER:
        m = pattern.search(relpath)
        if m:
            return int(m.group(1)) % world
    return 0


def file_crc32(path: Path) -> str:
    """CRC-32 (zlib) of a file, read in 16 MiB chunks; cost per GB in docs/benchmarks.md (benchmarks/checksum_speed.py)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _payload_files(directory: Path) -> list[str]:
    skip = {MARKER, CHECKSUMS}
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name not in skip)


def checksum_share(directory: Path, rank: int, world: int) -> dict[str, dict]:
    return {
        rel: {"size": (directory / rel).stat().st_size, "crc32": file_crc32(directory / rel)}
        for rel in _payload_files(directory)
        if file_owner(rel, world) == rank
    }


def _mismatch(path: Path, want: dict) -> Optional[str]:
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != want["size"]:
        return f"{path} has {path.stat().st_size} bytes, {want['size']} were written (truncated?)"
    if file_crc32(path) != want["crc32"]:
        return f"{path} fails its checksum (crc32 {file_crc32(path)}, written {want['crc32']})"
    return None


def _verify_share(directory: Path, manifest: dict[str, dict], rank: int, world: int) -> list[str]:
    found = (
        _mismatch(directory / rel, want) for rel, want in sorted(manifest.items()) if file_owner(rel, world) == rank
    )
    return [problem for problem in found if problem]


def file_problem(directory: Path, relpath: str) -> Optional[str]:
    """Why one file of a checkpoint is not the one written (missing, truncated, another checksum), or None: checked
    before the file is parsed (its config). None too where the manifest is missing or unreadable or does not list the
    file: verify_checkpoint judges the checkpoint as a whole."""
    try:
        want = json.loads((directory / CHECKSUMS).read_text())[relpath]
        return _mismatch(directory / relpath, want)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def marker_problem(path: Path) -> Optional[str]:
    """Why the COMPLETE marker of a checkpoint is unusable (it is the JSON record _publish writes), or None."""
    marker = path / MARKER
    try:
        record = json.loads(marker.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError("not a record with an integer step")
    except (OSError, ValueError) as e:
        return f"{marker} is damaged ({type(e).__name__}: {e})"
    return None


TRUST_FLAG = "checkpoint.trust_unverified=true"


def unverifiable(ckpt: "Checkpoint") -> Optional[str]:
    """Why a checkpoint cannot be verified (its CHECKSUMS.json is gone), or None. Every checkpoint this
    project writes has one: without it a flipped byte would be trained on unnoticed."""
    manifest_path = ckpt.path / CHECKSUMS
    if manifest_path.is_file():
        return None
    return f"{manifest_path} is missing, so its files cannot be verified ({TRUST_FLAG} loads it unverified)"


def verify_checkpoint(
    ckpt: "Checkpoint", rank: int = 0, world: int = 1, gather=None, trust_unverified: bool = False
) -> list[str]:
    """Collective when `gather` is given (every rank checks its share): the problems found, [] when it
    verifies. One without a manifest is a problem, unless `trust_unverified` (then taken as it is)."""
    manifest_path = ckpt.path / CHECKSUMS
    problems = []
    missing = unverifiable(ckpt)
    if missing and not trust_unverified and rank == 0:
        problems = [missing]
    elif not missing:
        try:
            manifest = json.loads(manifest_path.read_text())
            problems = _verify_share(ckpt.path, manifest, rank, world)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems = [f"{manifest_path} is unreadable ({type(e).__name__}: {e})"] if rank == 0 else []
    marker_issue = marker_problem(ckpt.path) if rank == 0 else None  # the marker is not in the manifest
    problems += [marker_issue] if marker_issue else []
    if gather is not None:
        problems = [p for share in gather(problems) for p in share]
    return problems
