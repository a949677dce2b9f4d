"""Shared-memory regions (mcore_rl/platform/shared_memory.py): a module's parameters moved into one, another real
process opening it by handle and writing named tensors that the owner then sees, the checks that refuse a wrong
process or a tensor outside the region, and nothing left in /dev/shm."""

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch

from mcore_rl.platform.shared_memory import SharedRegion, SharedTensors, TensorSpec, share_parameters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEER = """
import pickle, sys, torch
from mcore_rl.platform.shared_memory import SharedTensors
shared = SharedTensors.open(pickle.loads(bytes.fromhex(sys.argv[1])))
print(sorted(shared.table))
shared.view("1.weight").copy_(torch.arange(24, dtype=torch.float32).view(4, 6).to(torch.bfloat16))
shared.view("0.weight.row1").fill_(7.0)
"""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(4, 6))
    model[2].weight = model[0].weight  # tied: must stay one tensor
    return model.to(torch.bfloat16)


def test_parameters_move_into_one_region_and_a_peer_process_writes_them():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    shm_before = set(os.listdir("/dev/shm"))
    region = share_parameters(model)
    for name, p in model.named_parameters():
        assert region.contains(p) and torch.equal(p, before[name]), name
    assert model[2].weight is model[0].weight
    targets = {n: p.detach() for n, p in model.named_parameters()} | {"0.weight.row1": model[0].weight.detach()[1]}
    shared = SharedTensors.describe(region, targets)
    assert shared.view("0.weight.row1").data_ptr() == model[0].weight[1].data_ptr()

    env = dict(os.environ, PYTHONPATH=REPO)
    handle = pickle.dumps(shared.handle).hex()
    out = subprocess.run([sys.executable, "-c", PEER, handle], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == str(sorted(targets))
    # the peer's bytes are the model's now (no copy on this side), the rest untouched
    assert torch.equal(model[1].weight.float(), torch.arange(24, dtype=torch.float32).view(4, 6))
    assert torch.equal(model[0].weight[1].float(), torch.full((4,), 7.0))
    assert torch.equal(model[0].weight[0], before["0.weight"][0]) and torch.equal(model[0].bias, before["0.bias"])
    assert set(os.listdir("/dev/shm")) == shm_before  # the region has no name anywhere


def test_open_refuses_a_wrong_token_and_our_own_region():
    region = SharedRegion.create(1 << 12)
    assert SharedRegion.open(region.handle) is None  # the owner uses its own object
    forged = dataclasses.replace(region.handle, pid=os.getppid(), token="0" * 32)
    assert SharedTensors.open(forged) is None  # another process behind (pid, fd), or none: not ours
    region.close()
    with pytest.raises(ValueError, match="until it closes it"):
        _ = region.handle


def test_tensor_outside_the_region_is_refused():
    region = SharedRegion.create(1 << 12)
    with pytest.raises(ValueError, match="ends past"):
        region.tensor(TensorSpec(4096, (1 << 12,), (1,), "torch.float32"))
    with pytest.raises(ValueError, match="does not live in this region"):
        region.spec(torch.zeros(3))
