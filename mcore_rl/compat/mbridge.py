"""mbridge version differences (supported: 0.13.1 - 0.15.x; see docs/versions.md).

* `AutoBridge.from_config(hf_config, **kwargs)`: keyword arguments (`dtype=`) exist from 0.15.0rc1;
  0.13.x takes the config alone (TypeError otherwise) and builds with bfloat16. There the dtype is set
  on the bridge object, which `set_extra_args` then uses when it rebuilds the Megatron config (0.13.1's
  `_build_config` reads `self.dtype`; its weight conversion casts to `self.dtype` too).
* `import mbridge` runs `mbridge.models`' `__init__`, which imports every model bridge it ships (0.13.1 and
  0.15.1): with them 18 transformers model modules and, through the vision-language ones, TorchDynamo and
  Inductor - ~0.75 s of every rank's start-up, on a 2-core machine more. Each bridge registers itself for its
  `model_type` when its own module (`mbridge.models.<model_type without "_">`) is imported, and those of the
  architectures we build import only their parents (qwen3moe -> qwen2moe, qwen3 -> qwen2).
  `bridge_from_config` therefore imports mbridge with `mbridge.models` as the bare package (its modules
  importable, its `__init__` not run) and then the one bridge module; the first name asked of the package
  itself (`from mbridge.models import X`, anywhere) runs its `__init__` after all.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Optional

import torch
from packaging.version import Version

from mcore_rl.compat import Shim, at_least, installed_version

_DISTRIBUTION = "mbridge"


def version() -> Optional[Version]:
    """The installed mbridge version (None when absent)."""
    return installed_version(_DISTRIBUTION)


def _from_config_takes_kwargs() -> bool:
    return at_least(_DISTRIBUTION, "0.15")


def shims() -> list[Shim]:
    if version() is None or _from_config_takes_kwargs():
        return []
    return [
        Shim("from_config dtype", "mbridge < 0.15", "from_config takes no dtype=; set on the bridge, config rebuilt")
    ]


# The model types whose bridge module imports no other architecture's than its parents' (checked for 0.13.1, 0.15.1)
_SINGLE_BRIDGE_TYPES = frozenset({"qwen3_moe", "qwen3", "qwen2"})


class _ModelsPackage(types.ModuleType):
    """`mbridge.models` with its submodules importable and its `__init__` run on the first name asked of it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        init = Path(self.__path__[0]) / "__init__.py"
        exec(compile(init.read_text(), str(init), "exec"), self.__dict__)  # imports every bridge (registers them)
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'mbridge.models' has no attribute {name!r}") from None


def _import_bridge(model_type: str) -> None:
    """Register `model_type`'s bridge without importing every other one (see the module's docstring)."""
    if "mbridge" in sys.modules or model_type not in _SINGLE_BRIDGE_TYPES:
        importlib.import_module("mbridge")  # already imported, or a bridge that may need the others
        return
    root = Path(importlib.util.find_spec("mbridge").origin).parent / "models"
    package = _ModelsPackage("mbridge.models")
    package.__path__, package.__package__, package.__file__ = [str(root)], "mbridge.models", str(root / "__init__.py")
    sys.modules["mbridge.models"] = package
    try:
        importlib.import_module("mbridge")
    except BaseException:
        sys.modules.pop("mbridge.models", None)
        raise
    importlib.import_module(f"mbridge.models.{model_type.replace('_', '')}")


def bridge_from_config(hf_config, dtype: torch.dtype, extra_config: dict):
    """An mbridge bridge for `hf_config` building parameters in `dtype`, with `extra_config` applied to its
    Megatron TransformerConfig."""
    _import_bridge(hf_config.model_type)
    from mbridge import AutoBridge

    if _from_config_takes_kwargs():
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    else:
        bridge = AutoBridge.from_config(hf_config)
        bridge.dtype = dtype
    bridge.set_extra_args(**extra_config)  # rebuilds bridge.config (with the dtype above)
    return bridge
