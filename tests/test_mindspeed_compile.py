"""torch.compile around the engine's build on NPU (issue 31, defect 2; mcore_rl/platform/mindspeed_compile.py).

MindSpeed cannot be installed here, so `StandInPatch` does what its patch manager does to `torch.compile` and
`torch.jit.script` (MindSpeed 2.2.0 / 26.1.0 `patch_utils.Patch.apply_patch` with `dummy_compile` from
`core/megatron_basic/requirements_basic.py`): bind an identity wrapper in every loaded module whose attribute of that
name is the original - torch itself and a module that did `from torch import compile`. The reference for "compiled"
is torch's own: what real torch.compile returns carries `_torchdynamo_orig_callable`; the identity wrapper does not.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_rl.platform import mindspeed_compile


def dummy_compile(*args, **kwargs):
    """MindSpeed's shape: the function back, wrapped, never compiled."""
    if args and callable(args[0]):
        fn = args[0]

        def wrapper(*fn_args, **fn_kwargs):
            return fn(*fn_args, **fn_kwargs)

        return wrapper
    return lambda fn: dummy_compile(fn)


dummy_compile.__module__ = "mindspeed.core.megatron_basic.requirements_basic"


class StandInPatch:
    """Replace `module.name` by `new` in every module of sys.modules holding the current function; undo()."""

    def __init__(self, module: str, name: str, new):
        self.module, self.name, self.new = module, name, new
        self.original = getattr(sys.modules[module], name)
        self.bound: list = []

    def apply(self):
        for mod in list(sys.modules.values()):
            if getattr(mod, "__dict__", {}).get(self.name) is self.original:
                setattr(mod, self.name, self.new)
                self.bound.append(mod)

    def undo(self):
        for mod in self.bound:
            setattr(mod, self.name, self.original)


def compiled(fn_result) -> bool:
    return hasattr(fn_result, "_torchdynamo_orig_callable")


@pytest.fixture
def mindspeed_applied(monkeypatch):
    """keep_originals (as _adapt_npu calls it before MindSpeed's import), then the stand-in patches, a module that
    imported torch.compile by name, and everything undone at the end."""
    monkeypatch.setattr(mindspeed_compile, "_ORIGINALS", {})
    holder = types.ModuleType("npu_test_holder")
    holder.compile = torch.compile
    monkeypatch.setitem(sys.modules, "npu_test_holder", holder)
    mindspeed_compile.keep_originals()
    patches = [StandInPatch("torch", "compile", dummy_compile), StandInPatch("torch.jit", "script", dummy_compile)]
    for p in patches:
        p.apply()
    try:
        yield holder
    finally:
        for p in patches:
            p.undo()


def square(x):
    return x * x


def test_engine_build_gets_the_original_compile_back(mindspeed_applied):
    holder = mindspeed_applied
    assert torch.compile is dummy_compile and holder.compile is dummy_compile and torch.jit.script is dummy_compile
    assert not compiled(torch.compile(square, backend="eager"))  # the defect: vLLM would keep this, eager
    with mindspeed_compile.original_compile():
        assert torch.compile is not dummy_compile and holder.compile is torch.compile
        fn = torch.compile(square, backend="eager")
        assert compiled(fn) and torch.equal(fn(torch.arange(4.0)), torch.arange(4.0) ** 2)
        assert torch.jit.script is mindspeed_compile._ORIGINALS[("torch.jit", "script")]
    # MindSpeed's replacements again for the actor, everywhere they were bound
    assert torch.compile is dummy_compile and holder.compile is dummy_compile and torch.jit.script is dummy_compile


def test_restore_undone_when_the_build_raises(mindspeed_applied):
    with pytest.raises(RuntimeError, match="engine failed"):
        with mindspeed_compile.original_compile():
            assert torch.compile is not dummy_compile
            raise RuntimeError("engine failed")
    assert torch.compile is dummy_compile and mindspeed_applied.compile is dummy_compile


def test_nothing_changes_without_mindspeed(monkeypatch):
    """CPU / CUDA (no originals recorded), and MindSpeed imported before the platform (its function is not taken
    for the original): the block leaves torch.compile as it is."""
    monkeypatch.setattr(mindspeed_compile, "_ORIGINALS", {})
    before = torch.compile
    with mindspeed_compile.original_compile():
        assert torch.compile is before
    monkeypatch.setattr(torch, "compile", dummy_compile)
    mindspeed_compile.keep_originals()
    assert ("torch", "compile") not in mindspeed_compile._ORIGINALS
    with mindspeed_compile.original_compile():
        assert torch.compile is dummy_compile
