"""mbridge version differences (supported: 0.13.1 - 0.15.x; see docs/versions.md).

* `AutoBridge.from_config(hf_config, **kwargs)`: keyword arguments (`dtype=`) exist from 0.15.0rc1;
  0.13.x takes the config alone (TypeError otherwise) and builds with bfloat16. There the dtype is set
  on the bridge object, which `set_extra_args` then uses when it rebuilds the Megatron config (0.13.1's
  `_build_config` reads `self.dtype`; its weight conversion casts to `self.dtype` too).
"""

from __future__ import annotations

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


def bridge_from_config(hf_config, dtype: torch.dtype, extra_config: dict):
    """An mbridge bridge for `hf_config` building parameters in `dtype`, with `extra_config` applied to its
    Megatron TransformerConfig."""
    from mbridge import AutoBridge

    if _from_config_takes_kwargs():
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    else:
        bridge = AutoBridge.from_config(hf_config)
        bridge.dtype = dtype
    bridge.set_extra_args(**extra_config)  # rebuilds bridge.config (with the dtype above)
    return bridge
