"""Checks of actor.offload inside the existing torchrun workers (ckpt_resume.py, actor_layouts.py).

The evidence is taken by walking the objects - the model chunks and the optimizer, through attributes, lists,
dicts and every tensor's `.grad` / `.main_grad` - not from anything the offload code counts: while offloaded,
every storage that holds parameters, gradient buffers or optimizer state must have 0 bytes.
"""

import torch

# Where a walked tensor is reached from that makes it parameter, gradient or optimizer state (Megatron's names
# in 0.12.1 and 0.16.1: DDP's flat buffers, the main gradients, torch optimizers' state and param_groups, the
# distributed / mixed-precision optimizers' fp32 main-parameter groups) and the modules' registered buffers.
STATE_PATHS = (
    "param_data",
    "grad_data",
    "main_grad",
    ".grad",
    "state[",
    "param_groups",
    "fp32_from",
    "shard_",
    "_buffers[",
)
_WALKED_PACKAGES = ("megatron", "torch", "mcore_rl")


def walk_tensors(*roots) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from `roots` (path, tensor): module / optimizer attributes, containers, `.grad` and
    `.main_grad`. Objects of other packages (process groups, configs of other libraries) are not entered."""
    seen, out, stack = set(), [], [(f"root{i}", r) for i, r in enumerate(roots)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            out.append((path, obj))
            stack += [
                (f"{path}.{a}", getattr(obj, a)) for a in ("grad", "main_grad") if getattr(obj, a, None) is not None
            ]
        elif isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", v))
                if torch.is_tensor(k):
                    stack.append((f"{path}.key", k))
        elif isinstance(obj, (list, tuple, set)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in _WALKED_PACKAGES:
            if not isinstance(obj, torch.distributed.ProcessGroup):
                stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return out


def _is_state(path: str, t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or any(s in path for s in STATE_PATHS)


def check_released(actor) -> dict:
    """After actor.offload(): walk model + optimizer; every parameter / gradient / optimizer-state storage has 0
    bytes and what is left on the device is small. Returns counts for the caller's message."""
    found = walk_tensors(actor.model, actor.optimizer)
    state = [(p, t) for p, t in found if _is_state(p, t)]
    kinds = {k: sum(k in p for p, _ in state) for k in ("param_data", "grad_data", "main_grad", "exp_avg")}
    kinds["parameters"] = sum(isinstance(t, torch.nn.Parameter) for _, t in state)
    if actor.optimizer is not None:
        needed = [k for k in kinds if k != "param_data" or actor.cfg.actor.optim.use_distributed_optimizer]
        assert all(kinds[k] for k in needed), f"the walk found no {[k for k in needed if not kinds[k]]}: it is blind"
    held = [(p, t.untyped_storage().nbytes()) for p, t in state if t.untyped_storage().nbytes() > 0]
    assert not held, f"{len(held)} parameter / gradient / optimizer storages still on the device: {held[:5]}"
    left = {t.untyped_storage().data_ptr(): (p, t.untyped_storage().nbytes()) for p, t in found}
    released = sum(t.numel() * t.element_size() for _, t in state if isinstance(t, torch.nn.Parameter))
    left_bytes = sum(n for _, n in left.values())
    biggest = sorted(left.values(), key=lambda pn: -pn[1])[:5]
    assert left_bytes < 0.02 * released, f"{left_bytes} bytes left beside {released} of parameters: {biggest}"
    return {**kinds, "left_bytes": left_bytes}


def snapshot(actor) -> dict[int, torch.Tensor]:
    """Copies of every non-gradient tensor reachable from model + optimizer (for the bit-exact reload check)."""
    return {id(t): t.detach().clone() for p, t in walk_tensors(actor.model, actor.optimizer) if "grad" not in p}


def check_restored(actor, before: dict[int, torch.Tensor]) -> int:
    """After actor.reload(): every tensor of the snapshot has its bytes back, bit for bit; gradients are zeros."""
    found = walk_tensors(actor.model, actor.optimizer)
    compared = 0
    for path, t in found:
        if id(t) in before:
            want = before[id(t)]
            assert t.dtype == want.dtype and t.shape == want.shape, path
            assert torch.equal(_bits(t), _bits(want)), f"{path} differs after reload"
            compared += 1
        elif "grad_data" in path:
            assert torch.count_nonzero(t) == 0, f"{path}: a gradient buffer came back non-zero"
    assert compared >= len(before) * 0.99, (compared, len(before))
    return compared


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def offload_round_trip(actor) -> dict:
    """offload -> walk (released) -> reload -> walk (bit-exact)."""
    before = snapshot(actor)
    actor.offload()
    assert actor.offloaded
    counts = check_released(actor)
    try:
        actor.forward_only([], None)
    except RuntimeError as e:
        assert "offloaded" in str(e), e
    else:
        raise AssertionError("a pass ran on an offloaded actor")
    actor.reload()
    counts["compared"] = check_restored(actor, before)
    return counts


def _named_state(actor) -> dict[str, torch.Tensor]:
    """Parameters by name and the optimizer's main parameters and state by position (both actors are built alike)."""
    out = {f"chunk{i}.{n}": p for i, chunk in enumerate(actor.model) for n, p in chunk.named_parameters()}
    for j, opt in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"opt{j}.group{g}.main{k}"] = p
                for key, v in opt.optimizer.state.get(p, {}).items():
                    out[f"opt{j}.group{g}.main{k}.{key}"] = v
    return out


def same_weights(a, b) -> int:
    """Two actors' parameters, main parameters and optimizer state are bit-identical; returns how many tensors."""
    sa, sb = _named_state(a), _named_state(b)
    assert sa.keys() == sb.keys() and any(".exp_avg" in k for k in sa), sorted(sa.keys() ^ sb.keys())[:5]
    for name in sa:
        assert torch.equal(_bits(torch.as_tensor(sa[name])), _bits(torch.as_tensor(sb[name]))), (
            f"{name} differs between the offloaded actor and its twin"
        )
    return len(sa)
