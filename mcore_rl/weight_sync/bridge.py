"""The separate placement's transport: the export's buckets over the bridge (mcore_rl/platform/split.py) from actor
rank 0 to every rollout replica - gloo on the CPU, the bridge's device group (NCCL / HCCL) on devices.

A bucket is one message: its header (name, shape, dtype, element count of each tensor) as an object, then all its
bytes as one flat uint8 tensor, broadcast from actor rank 0; each rollout rank cuts it back into tensors and loads them
into its engine. Actor rank 0's `RemoteEngine` (mcore_rl/separate.py) takes its weight methods from
`BridgeEngineWeights`, so the sync (buckets.py) and the verification (verify.py) run unchanged against it; the
rollout ranks' loop answers the same messages (`RolloutWorker._serve`).
"""

from __future__ import annotations

from typing import Iterable

import torch

Weights = Iterable[tuple[str, torch.Tensor]]


def bucket_header(bucket: list[tuple[str, torch.Tensor]]) -> list:
    return [(name, tuple(t.shape), t.dtype, t.numel()) for name, t in bucket]


def bucket_tensors(header: list, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, shape, dtype, numel in header:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        out.append((name, flat[offset : offset + nbytes].clone().view(dtype).reshape(shape)))
        offset += nbytes
    return out


def receive_bucket(bridge, header: list) -> list[tuple[str, torch.Tensor]]:
    """A rollout rank's side of `BridgeSender.bucket`, after its "load" command carried `header`."""
    return bucket_tensors(header, bridge.tensors(header, None, from_actor=True))


class BridgeSender:
    """Actor rank 0's end of the bridge, the weights' part: a bucket as one message, a stream as one a tensor."""

    bridge: object  # and `command(kind, *args)`, the link's (mcore_rl/separate.py)

    def bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        header = bucket_header(bucket)
        self.command("load", header)
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        self.bridge.tensors(header, torch.cat(parts).to(self.bridge.device), from_actor=True)

    def stream(self, weights: Weights, begin: str, done: str) -> None:
        self.command(begin)
        for name, tensor in weights:  # one tensor a bucket: a rebuild or diff is the rare path
            self.bucket([(name, tensor)])
        self.command(done)


class BridgeEngineWeights:
    """The weight methods of actor rank 0's stand-in for the rollout replicas: each call is a message on the bridge
    (`link`: a BridgeSender; `info`: the rollout ranks' handshake), the leader's replies; every replica loads."""

    link: BridgeSender
    info: dict

    def weight_names(self) -> set[str]:
        return set(self.info["names"])

    def load_weights(self, weights: Weights) -> None:
        self.link.bucket(list(weights))

    def weight_fingerprints(self, names: list[str]) -> dict[str, torch.Tensor]:
        self.link.command("fingerprints", names)
        return self.link.reply()

    def weight_diffs(self, weights: Weights) -> dict[str, float]:
        self.link.stream(weights, "diffs", "diffed")
        return self.link.reply()

    def rebuild_from(self, weights: Weights) -> None:
        self.link.stream(weights, "rebuild", "rebuilt")
