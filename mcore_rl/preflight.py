"""Checks of a run's model folder and installed packages that `mcore-rl train` makes before torchrun
starts (seconds, one process), so these inputs fail with one line instead of a traceback on every rank."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

from mcore_rl.config import Config, ConfigError
from mcore_rl.megatron.layout import ARCHITECTURES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path = {folder}: {path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path = {folder}: {path} is not a JSON object")
    return data


def _check_safetensors_file(path: Path) -> None:
    """The header parses and the file is as long as the header says (a truncated download fails here)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ConfigError(f"{path} is not a readable safetensors file ({e}): download it again") from None
    if 8 + header_len + end != size:
        raise ConfigError(
            f"{path} has {size} bytes but its header describes {8 + header_len + end}: it is truncated or damaged; "
            f"download it again"
        )


def check_model_folder(folder: str | os.PathLike) -> None:
    """config.json readable with a supported model_type, tokenizer files present, weights complete."""
    folder = Path(folder)
    config = _read_config_json(folder)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:  # the one table of supported architectures (megatron/layout.py)
        raise ConfigError(
            f"model.path = {folder}: model_type {model_type!r} is not supported; mcore-rl trains "
            f"{', '.join(ARCHITECTURES)} models"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model.path = {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the tokenizer of the "
            f"model's release next to config.json"
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{index} is unreadable ({type(e).__name__}: {e}): download it again") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path = {folder} has no *.safetensors weights: point it at a Hugging Face checkpoint")
    for name in files:
        if not (folder / name).is_file():
            raise ConfigError(f"{folder / name} is missing (listed in {index.name}): download it again")
        _check_safetensors_file(folder / name)


def check_packages(cfg: Config) -> None:
    """Packages the configured components need."""
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine = vllm but vLLM is not installed in this environment: install it (make setup-vllm) "
            "or set rollout.engine=embedded"
        )


def check_run_inputs(cfg: Config) -> None:
    """Everything above, for `mcore-rl train`."""
    check_model_folder(cfg.model.path)
    check_packages(cfg)
