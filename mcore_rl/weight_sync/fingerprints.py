"""The weight-level check's samples: k positions of each tensor, fixed by its name, read on the actor's side (what
a sync sent) and in the engine (`WeightReader.weight_fingerprints`, mcore_rl/rollout/base.py)."""

from __future__ import annotations

import zlib

import torch

FINGERPRINT_SIZE = 32  # elements sampled per tensor for the weight-level check


def fingerprint_positions(name: str, numel: int, k: int = FINGERPRINT_SIZE) -> torch.Tensor:
    """k positions of a flattened tensor, fixed by its name (the same on the actor and in every engine)."""
    seed = zlib.crc32(name.encode()) & 0x7FFFFFFF
    return torch.randint(0, numel, (min(k, numel),), generator=torch.Generator().manual_seed(seed))


def fingerprint(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The values of `tensor` at its fingerprint positions (same device and dtype)."""
    flat = tensor.detach().reshape(-1)
    return flat[fingerprint_positions(name, flat.numel()).to(flat.device)]
