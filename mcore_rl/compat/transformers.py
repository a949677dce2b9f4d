"""transformers version differences (supported: 4.57 - 5.x; see docs/versions.md).

* RoPE settings: transformers 5 keeps `rope_theta` inside `rope_parameters` (`config.rope_theta` may be
  absent); 4.x reads a top-level `rope_theta` and its `Qwen3MoeConfig` defaults it to 10000 even when the
  config.json (written by transformers 5) carries only `rope_parameters` - a silently wrong theta.
  `load_config` sets `rope_theta` from `rope_parameters` in both cases (mbridge and the HF model read
  `config.rope_theta`); `rope_config_kwargs` writes configs the installed version reads back.
* `dtype=` in `from_pretrained` / `from_config`: from 4.56 (older versions only know `torch_dtype=`).
  4.57 is the oldest version tested, and the floor, so the code passes `dtype=` without a shim.
* Older versions are refused before launch (`refusal`, called by the pre-flight): 4.53.3, the reference runs'
  version, fails on `dtype=` (`TypeError: Qwen3MoeForCausalLM.__init__() got an unexpected keyword argument
  'dtype'` in every Megatron-facing test that builds an HF model, with megatron-core 0.12.1, mbridge 0.13.1,
  torch 2.7.1), and vLLM 0.11.0 - the vLLM-Ascend 0.11 line's, the one that shares a process with a released
  MindSpeed - itself requires transformers >= 4.55.2, so no supported Ascend stack has 4.53.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from packaging.version import Version

from mcore_rl.compat import Shim, at_least, installed_version

_DISTRIBUTION = "transformers"


def version() -> Optional[Version]:
    """The installed transformers version (None when absent)."""
    return installed_version(_DISTRIBUTION)


OLDEST = Version("4.57")  # the oldest version CI runs; the floor in pyproject.toml


def refusal(installed: Optional[Version]) -> Optional[str]:
    """Why mcore-rl cannot run on this transformers version (None when it can, or when it is absent)."""
    if installed is None or installed >= OLDEST:
        return None
    why = (
        "it has no dtype= keyword in from_pretrained / from_config (from 4.56)"
        if installed < Version("4.56")
        else "it is not tested"
    )
    return (
        f"transformers {installed} is installed; mcore-rl needs >= {OLDEST} (the oldest tested): {why}, and "
        f"vLLM 0.11 (the vLLM-Ascend 0.11 line) requires >= 4.55.2; install transformers==4.57.6 "
        f"(verl's Ascend image) or newer"
    )


def keeps_rope_parameters() -> bool:
    """Configs keep RoPE settings in `rope_parameters` (transformers >= 5)."""
    return at_least(_DISTRIBUTION, "5")


def shims() -> list[Shim]:
    if keeps_rope_parameters():
        return []
    return [
        Shim(
            "rope_theta from rope_parameters", "transformers < 5", "4.x ignores rope_parameters and defaults rope_theta"
        )
    ]


def rope_config_kwargs(theta: float) -> dict:
    """Constructor keyword arguments giving a config this RoPE theta (default rope type)."""
    if keeps_rope_parameters():
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def _rope_theta_in_file(path: str) -> Optional[float]:
    """rope_theta as config.json states it: top level, or inside rope_parameters; None when neither."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        raw = json.load(f)
    if raw.get("rope_theta") is not None:
        return float(raw["rope_theta"])
    rope = raw.get("rope_parameters") or {}
    return float(rope["rope_theta"]) if rope.get("rope_theta") is not None else None


def load_config(path: str):
    """AutoConfig for a checkpoint folder with `rope_theta` as its config.json states it (see above)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    theta = _rope_theta_in_file(path)
    if theta is None:
        raise ValueError(f"{path}/config.json has neither rope_theta nor rope_parameters.rope_theta: add one")
    cfg.rope_theta = theta
    return cfg
