"""mcore_rl.megatron.offload: device storages to the host and back (actor.offload), on plain tensors laid out the
way Megatron lays out an actor (parameters as views of one flat buffer, gradients as views of another, optimizer
state in its own tensors). The actor itself is checked in real processes: tests/workers/ckpt_resume.py (walk of
model + optimizer while offloaded, bit-identical training with and without) and tests/workers/actor_layouts.py
(the reference model on the host outside its pass)."""

import torch

from mcore_rl.megatron.offload import HostOffload
from mcore_rl.platform import get_platform


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
    host = [h.host for h in off._held]
    for _ in range(2):
        off.reload()
        assert torch.equal(flat, want) and off.host_bytes == 40  # the host copy stays while on the device
        off.offload(kept=params)
        assert [h.host for h in off._held] == host  # no new copy
        assert flat.untyped_storage().nbytes() == 0
    off.reload()
    assert torch.equal(flat, want)
