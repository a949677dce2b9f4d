"""mcore_rl.megatron.offload: device storages to the host and back (actor.offload), on plain tensors laid out the
way Megatron lays out an actor (parameters as views of one flat buffer, gradients as views of another, optimizer
state in its own tensors). The actor itself is checked in real processes: tests/workers/ckpt_resume.py (walk of
model + optimizer while offloaded, bit-identical training with and without) and tests/workers/actor_layouts.py
(the reference model on the host outside its pass)."""

import pytest
import torch

from mcore_rl.megatron.offload import HostOffload
from mcore_rl.platform import get_platform
from mcore_rl.preflight.host_chunks import HOST_CHUNK_BYTES, chunk_bytes, layout, pinned_bytes


def _actor_like():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(10, generator=g)
    params = [flat[:4].view(2, 2), flat[4:]]  # views of one flat parameter buffer
    grad_flat = torch.randn(10, generator=g)
    grads = [grad_flat[:4].view(2, 2), grad_flat[4:]]
    moments = [torch.randn(10, generator=g), torch.randn(10, generator=g)]
    return flat, params, grad_flat, grads, moments


def test_round_trip_releases_every_storage_and_restores_it_bit_exactly():
    flat, params, grad_flat, grads, moments = _actor_like()
    before = [t.clone() for t in [flat, *moments]]
    off = HostOffload(get_platform("cpu"))
    released = off.offload(kept=[*params, *moments], gradients=grads)
    assert released == 4 * 10 * 4  # 4 storages of 10 fp32 each
    assert all(t.untyped_storage().nbytes() == 0 for t in [flat, *params, grad_flat, *grads, *moments])
    assert off.offloaded and off.host_bytes == 3 * 40  # gradients are not copied
    assert off.offload(kept=params) == 0  # a second offload while offloaded does nothing
    assert off.reload() == 160 and not off.offloaded and off.host_bytes == 0
    for t, want in zip([flat, *moments], before):
        assert torch.equal(t, want)
    assert torch.count_nonzero(grad_flat) == 0  # gradients come back as zeros
    params[0][0, 0] = 7.0  # the views still alias the buffer (Megatron's params are views of param_data)
    assert flat[0] == 7.0
    assert off.reload() == 0


def test_a_storage_in_both_lists_is_kept():
    flat, params, grad_flat, grads, moments = _actor_like()
    shard = flat[2:6]  # e.g. an fp32 main-parameter shard: a view of the parameter buffer, also listed as "kept"
    want = flat.clone()
    off = HostOffload(get_platform("cpu"))
    off.offload(kept=[shard], gradients=[flat])
    off.reload()
    assert torch.equal(flat, want)


def test_read_only_copies_once_and_keeps_the_host_copy():
    flat, params, *_ = _actor_like()
    want = flat.clone()
    off = HostOffload(get_platform("cpu"), read_only=True)
    off.offload(kept=params)
    host = [id(v) for h in off._held for v in h.host.views]
    for _ in range(2):
        off.reload()
        assert torch.equal(flat, want) and off.host_bytes == 40  # the host copy stays while on the device
        off.offload(kept=params)
        assert [id(v) for h in off._held for v in h.host.views] == host  # no new copy
        assert flat.untyped_storage().nbytes() == 0
    off.reload()
    assert torch.equal(flat, want)


def test_chunk_sizes_are_powers_of_two_and_waste_less_than_a_chunk():
    assert HOST_CHUNK_BYTES == 1 << 26
    assert chunk_bytes(120) == 128 and chunk_bytes(1) == 1 and chunk_bytes(0) == 1
    assert chunk_bytes(5 * HOST_CHUNK_BYTES) == HOST_CHUNK_BYTES
    assert pinned_bytes(0) == 0 and pinned_bytes(120) == 128
    # a 30B-class shard: 7 GiB + 1 byte in 64 MiB chunks -> one chunk more, where one pinned block per storage
    # of e.g. 3 GiB + 1 would round up to 4 GiB
    total = 7 * 2**30 + 1
    assert pinned_bytes(total) == 7 * 2**30 + HOST_CHUNK_BYTES
    for bad in (0, 3 << 20):
        with pytest.raises(ValueError, match="power of two"):
            chunk_bytes(10, bad)


def test_layout_fills_chunks_one_storage_after_another():
    assert layout([5, 2, 9, 0], chunk=8) == [
        [(0, 0, 5)],
        [(0, 5, 2)],
        [(0, 7, 1), (1, 0, 8)],  # spans the boundary
        [],
    ]


def test_copies_span_chunks_and_round_trip_bit_exactly():
    """Storages of odd sizes through 16-byte chunks: every byte back, the chunks the only host memory."""
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g) for n in (3, 7, 1, 12)]  # 12 + 28 + 4 + 48 = 92 bytes
    tensors.append(torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g))  # + 5 = 97
    want = [t.clone() for t in tensors]
    off = HostOffload(get_platform("cpu"), largest_chunk=16)
    assert off.offload(kept=tensors) == 97
    assert off.host_bytes == 97 and off.pinned_bytes == pinned_bytes(97, 16) == 7 * 16
    assert all(c.numel() == 16 and c.dtype == torch.uint8 for c in off._chunks)
    # bytes 0-12 | 12-40 (4 + 16 + 8) | 40-44 | 44-92 (4 + 16 + 16 + 12) | 92-97 (4 + 1) over 16-byte chunks
    assert [len(h.host.views) for h in off._held] == [1, 3, 1, 4, 2]
    assert not any(h.host.is_pinned() for h in off._held)  # plain memory on cpu (pinned on an accelerator)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert off.reload() == 97 and off.pinned_bytes == 0
    for t, w in zip(tensors, want):
        assert torch.equal(t.view(torch.uint8), w.view(torch.uint8))
