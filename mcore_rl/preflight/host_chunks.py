"""How actor.offload lays host copies into pinned chunks (mcore_rl/megatron/offload.py): pure arithmetic, no torch,
so that `mcore-rl plan` (mcore_rl/preflight/memory_plan.py) counts the same bytes the offload pins.

torch's caching host allocator (and torch_npu's) rounds every pinned block up to a power of two and keeps the block
cached after release: one pinned tensor per storage costs up to 2x the storage on the host, for the life of the
process. Copies therefore go into chunks of one power-of-two size, filled one storage after another (a storage may
span chunks): each block is exactly its rounded size, and the waste is the unused tail of the last chunk.
"""

from __future__ import annotations

HOST_CHUNK_BYTES = 1 << 26  # 64 MiB a chunk: a few hundred for a 30B model's shard, waste below one chunk


def chunk_bytes(total: int, largest: int = HOST_CHUNK_BYTES) -> int:
    """The chunk size for copies of `total` bytes: HOST_CHUNK_BYTES, or the power of two that holds `total` when
    that is smaller (a small model pins no 64 MiB)."""
    if largest <= 0 or largest & (largest - 1):
        raise ValueError(f"chunk size {largest} must be a positive power of two (the host allocator's rounding)")
    return min(largest, 1 << max(0, total - 1).bit_length())


def pinned_bytes(total: int, largest: int = HOST_CHUNK_BYTES) -> int:
    """Host bytes pinned for copies of `total` bytes: whole chunks."""
    if total <= 0:
        return 0
    size = chunk_bytes(total, largest)
    return -(-total // size) * size


def layout(sizes: list[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Where each storage of `sizes` bytes goes, one after another: per storage its pieces (chunk index, offset
    in the chunk, length), in order; the pieces of a storage add up to its size."""
    out, position = [], 0
    for size in sizes:
        pieces, left = [], size
        while left > 0:
            index, offset = divmod(position, chunk)
            length = min(left, chunk - offset)
            pieces.append((index, offset, length))
            position += length
            left -= length
        out.append(pieces)
    return out
