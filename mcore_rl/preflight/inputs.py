"""Checks of a run's model folder and installed packages that `mcore-rl train` makes before torchrun
starts (seconds, one process), so these inputs fail with one line instead of a traceback on every rank."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Optional

from packaging.version import Version

from mcore_rl.compat import transformers as compat_transformers
from mcore_rl.config import Config, ConfigError
from mcore_rl.preflight.architectures import ARCHITECTURES
from mcore_rl.preflight.hf_tensors import expected_hf_tensors, tolerated_extra
from mcore_rl.safety import first_non_finite

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


def _safetensors_header(path: Path) -> dict[str, dict]:
    """{name: {"dtype", "shape", "data_offsets"}} of one file; the file is as long as its header says (a truncated
    download fails here). Reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise ConfigError(f"{path} is not a readable safetensors file ({e}): download it again") from None
    if 8 + header_len + end != size:
        raise ConfigError(
            f"{path} has {size} bytes but its header describes {8 + header_len + end}: it is truncated or damaged; "
            f"download it again"
        )
    return header


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files the run reads: those of the index (a stray file next to them is refused, since
    the engine reads every *.safetensors of the folder), else every *.safetensors."""
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not present:
            raise ConfigError(
                f"model.path = {folder} has no *.safetensors weights: point it at a Hugging Face checkpoint"
            )
        return present
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"{index} is unreadable ({type(e).__name__}: {e}): download it again") from None
    for name in files:
        if not (folder / name).is_file():
            raise ConfigError(f"{folder / name} is missing (listed in {index.name}): download it again")
    stray = [name for name in present if name not in files]
    if stray:
        raise ConfigError(
            f"{folder / stray[0]} is not listed in {index} (it would be loaded too): move it out of model.path "
            f"(it is not part of this checkpoint)"
        )
    return files


def _read_headers(folder: Path, files: list[str]) -> dict[str, tuple[str, dict]]:
    """{tensor name: (file, header entry)} over all files; a name in two files is refused."""
    tensors: dict[str, tuple[str, dict]] = {}
    for name in files:
        for tensor, entry in _safetensors_header(folder / name).items():
            if tensor in tensors:
                raise ConfigError(
                    f"{tensor} is in both {folder / tensors[tensor][0]} and {folder / name}: download the "
                    f"checkpoint again"
                )
            tensors[tensor] = (name, entry)
    return tensors


def _check_tensors(folder: Path, config: dict, tensors: dict[str, tuple[str, dict]]) -> None:
    """Names and shapes against what config.json's architecture needs (mcore_rl.preflight.hf_tensors)."""
    try:
        expected = expected_hf_tensors(config)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{folder / 'config.json'} lacks {e}: restore it from the model's release") from None
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"model.path = {folder}: the weights lack {missing[0]}{more}, which config.json "
            f"({config['model_type']}, {config['num_hidden_layers']} layers) needs: the download is incomplete or "
            f"config.json belongs to another checkpoint; download the checkpoint again"
        )
    extra = [n for n in tensors if n not in expected and not tolerated_extra(n, config)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(
            f"{folder / tensors[extra[0]][0]} holds {extra[0]}{more}, which config.json "
            f"({config['model_type']}, {config['num_hidden_layers']} layers) does not have: use the checkpoint's "
            f"own config.json"
        )
    for name, shape in expected.items():
        file, entry = tensors[name]
        found = tuple(entry["shape"])
        if found == shape:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight") and found[1:] == shape[1:]:
            raise ConfigError(
                f"{folder / 'config.json'}: vocab_size = {config['vocab_size']} but {name} in {folder / file} has "
                f"{found[0]} rows: set vocab_size to {found[0]} (or use the checkpoint's own config.json)"
            )
        raise ConfigError(
            f"{folder / file}: {name} has shape {list(found)} but config.json implies {list(shape)}: config.json "
            f"belongs to another checkpoint or the file is damaged; use the checkpoint's own files"
        )


# The finite check reads every weight byte: done here for folders up to this size (seconds), and after loading
# on the devices (Trainer: Actor.check_weights_finite) for every model.
FINITE_CHECK_MAX_BYTES = 4 << 30
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _check_finite(folder: Path, tensors: dict[str, tuple[str, dict]]) -> None:
    from safetensors import safe_open

    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e in tensors.values())
    if total > FINITE_CHECK_MAX_BYTES:
        return
    for file in sorted({f for f, _ in tensors.values()}):
        with safe_open(str(folder / file), framework="pt") as f:
            names = [n for n in f.keys() if tensors[n][1]["dtype"] in _FLOAT_DTYPES]
            bad = first_non_finite((n, f.get_tensor(n)) for n in names)
        if bad is not None:
            raise ConfigError(
                f"{folder / file}: {bad} holds NaN/inf: the input model is damaged; download it again (or start "
                f"from a checkpoint whose weights are finite)"
            )


def check_model_type(folder: str | os.PathLike) -> dict:
    """config.json is readable and its model_type supported; returns it."""
    folder = Path(folder)
    config = _read_config_json(folder)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:  # the one table of supported architectures (preflight/architectures.py)
        raise ConfigError(
            f"model.path = {folder}: model_type {model_type!r} is not supported; mcore-rl trains "
            f"{', '.join(ARCHITECTURES)} models"
        )
    return config


def check_model_folder(folder: str | os.PathLike) -> None:
    """config.json readable with a supported model_type, tokenizer files present, weights complete: every file
    whole, exactly the tensors config.json's architecture needs, in its shapes, finite."""
    folder = Path(folder)
    config = check_model_type(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model.path = {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the tokenizer of the "
            f"model's release next to config.json"
        )
    check_weights(folder, config)


def check_weights(folder: str | os.PathLike, config: Optional[dict] = None) -> None:
    """Every weight file whole, exactly the tensors config.json's architecture needs, in its shapes, finite."""
    folder = Path(folder)
    config = check_model_type(folder) if config is None else config
    tensors = _read_headers(folder, _weight_files(folder))
    _check_tensors(folder, config, tensors)
    _check_finite(folder, tensors)


def check_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """Every token id the tokenizer can produce is a row of the embedding (config.json vocab_size)."""
    vocab_size = _read_config_json(Path(folder)).get("vocab_size")
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ConfigError(
            f"model.path = {folder}: the tokenizer has {len(tokenizer)} tokens (ids up to {len(tokenizer) - 1}) but "
            f"config.json vocab_size = {vocab_size}: use the tokenizer of this checkpoint's release (or a model "
            f"whose embedding has a row for every token)"
        )


def check_transformers(installed: Optional[Version] = None) -> None:
    """The installed transformers (or `installed`) is one mcore-rl runs on (compat.transformers.refusal)."""
    reason = compat_transformers.refusal(compat_transformers.version() if installed is None else installed)
    if reason is not None:
        raise ConfigError(reason)


def check_packages(cfg: Config) -> None:
    """Packages the configured components need."""
    check_transformers()
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine = vllm but vLLM is not installed in this environment: install it (make setup-vllm) "
            "or set rollout.engine=embedded"
        )


def check_run_inputs(cfg: Config) -> None:
    """Everything above, for `mcore-rl train`."""
    check_model_folder(cfg.model.path)
    check_packages(cfg)
