"""Cost of the per-file checkpoint checksum (mcore_rl.run_dir.file_crc32: zlib CRC-32, 16 MiB chunks).

Writes a file of --gb GiB of random bytes, then times, best of --trials, (a) reading it in the same
chunks (the baseline: a checksum cannot be cheaper than the read) and (b) file_crc32. Prints seconds
per GiB for both and their ratio. Both read from the page cache after the first pass, as a save's
checksum does right after the write.

    python benchmarks/checksum_speed.py --gb 1 --trials 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from mcore_rl.run_dir.checksums import CHUNK, file_crc32


def read_only(path: Path) -> int:
    total = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            total += len(chunk)
    return total


def best(fn, path: Path, trials: int) -> float:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the test file (default: the temp dir)")
    args = parser.parse_args()
    gib = args.gb
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "payload.bin"
        with open(path, "wb") as f:
            for _ in range(int(gib * 1024 / 16)):
                f.write(os.urandom(CHUNK))
        read_s = best(read_only, path, args.trials) / gib
        crc_s = best(file_crc32, path, args.trials) / gib
    print(f"read: {read_s:.3f} s/GiB  crc32: {crc_s:.3f} s/GiB  ratio crc32/read: {crc_s / read_s:.2f}")


if __name__ == "__main__":
    main()
