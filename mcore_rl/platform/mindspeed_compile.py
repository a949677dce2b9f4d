"""torch.compile / torch.jit.script around the rollout engine's build on NPU.

MindSpeed (2.2.0 - 26.1.0, `features_manager/megatron_basic/requirements_basic.py`) registers its `dummy_compile` for
`torch.compile` and `torch.jit.script`; its patch manager (`patch_utils.Patch.apply_patch`) binds the replacement
in every loaded module whose attribute of that name is the original. `dummy_compile` returns the function unchanged,
so vLLM's compilation wrapper (vLLM 0.11 `compilation/wrapper.py`: it keeps what `torch.compile` returns) and
vLLM-Ascend's graph capture, both run when the engine is built after `adapt_megatron`, silently run eager.

`keep_originals` records both functions before MindSpeed is first imported (`platform._adapt_npu`);
`original_compile` binds them back wherever MindSpeed's replacement is bound while the engine is built (and
captures its graphs, inside the same `LLM(...)`), and MindSpeed's again afterwards, so the actor keeps MindSpeed's
behaviour. Without recorded originals (CPU, CUDA, or MindSpeed imported before the platform) it changes nothing.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

# (module, attribute) -> the function before MindSpeed replaced it
_ORIGINALS: dict[tuple[str, str], Callable] = {}
_PATCHED = (("torch", "compile"), ("torch.jit", "script"))


def keep_originals() -> None:
    """Record torch.compile and torch.jit.script as they are now; call before MindSpeed's adaptor is imported. A
    function already replaced (MindSpeed imported earlier by someone else) is not recorded, and said so."""
    for module, name in _PATCHED:
        if (module, name) in _ORIGINALS:
            continue
        fn = getattr(sys.modules[module], name)
        if getattr(fn, "__module__", "").startswith("mindspeed"):
            logger.warning("%s.%s is MindSpeed's already: the engine's graph mode stays off", module, name)
            continue
        _ORIGINALS[(module, name)] = fn


def _bound_replacements() -> list[tuple[Any, str, Callable, Callable]]:
    """(module object, attribute, replacement, original) for every loaded module holding a replacement."""
    found = []
    for (module, name), original in _ORIGINALS.items():
        replacement = getattr(sys.modules[module], name)
        if replacement is original:
            continue
        for mod in list(sys.modules.values()):
            try:
                held = mod.__dict__.get(name) if hasattr(mod, "__dict__") else None
            except Exception:  # a lazy module that refuses to be read
                continue
            if held is replacement:
                found.append((mod, name, replacement, original))
    return found


@contextmanager
def original_compile() -> Iterator[None]:
    """The original torch.compile / torch.jit.script inside the block, MindSpeed's replacements again after."""
    swaps = _bound_replacements()
    for mod, name, _, original in swaps:
        setattr(mod, name, original)
    try:
        yield
    finally:
        for mod, name, replacement, _ in swaps:
            setattr(mod, name, replacement)
