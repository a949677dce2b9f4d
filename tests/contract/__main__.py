"""`python -m tests.contract --list`: every fact with its project function and its value per release.
`python -m tests.contract --lock DIST==VERSION`: download a release's wheel into the cache and add it to
tests/contract/wheels.lock (then give it a row in facts.RELEASES)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.contract.facts import FACTS, RELEASES, expected
from tests.contract.wheels import LOCK, cache_dir, sha256


def listing() -> str:
    lines = []
    for fact in FACTS:
        lines.append(f"{fact.distribution}: {fact.key} - {fact.what}")
        lines.append(f"    depends on it: mcore_rl.{fact.project}")
        for distribution, version in sorted(k for k in RELEASES if k[0] == fact.distribution):
            lines.append(f"    {version:>8}: {expected(distribution, version, fact.key)!r}")
    return "\n".join(lines)


def lock(requirement: str) -> dict:
    distribution, version = requirement.split("==")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            tmp,
            requirement,
        ]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        target = cache / wheel.name
        shutil.move(str(wheel), target)
    entries = [e for e in json.loads(LOCK.read_text()) if (e["distribution"], e["version"]) != (distribution, version)]
    entry = dict(distribution=distribution, version=version, file=target.name, sha256=sha256(target))
    LOCK.write_text(json.dumps(entries + [entry], indent=1) + "\n")
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.contract", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print every fact, its project function and its releases")
    parser.add_argument("--lock", metavar="DIST==VERSION", help="download a release and add it to wheels.lock")
    args = parser.parse_args(argv)
    if args.lock:
        print(lock(args.lock))
    if args.list or not args.lock:
        print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
