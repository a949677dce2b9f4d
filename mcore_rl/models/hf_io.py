"""Hugging Face folders on disk: the dtype names of configs, and the one safetensors folder writer.

`write_hf_folder` serves the trained model's export (RUN_DIR/hf), the conversion tool (Megatron -> HF)
and the vLLM engine's exact rebuild: it streams (name, tensor) pairs into safetensors shards, holding
at most one shard in memory, and copies a source folder's config / tokenizer files next to them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a Hugging Face folder that hold weights; everything else (config, tokenizer, ...) is copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16, with an error that lists the names."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} unknown; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def _copy_side_files(source_dir: str, out_dir: str) -> None:
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out_dir)


def _remove_stale_weights(out_dir: str, keep: set[str]) -> None:
    """Weight files and index of an earlier export into the same folder (RUN_DIR/hf again after a resume):
    left there, an index-reading loader would load the old shards and another the new ones."""
    for name in os.listdir(out_dir):
        if name not in keep and (name.endswith(".safetensors") or name == "model.safetensors.index.json"):
            os.remove(os.path.join(out_dir, name))


def write_hf_folder(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    source_dir: Optional[str] = None,
    hf_config: Any = None,
    expected_names: Optional[set[str]] = None,
    max_shard_bytes: int = 4 << 30,
) -> list[str]:
    """Write (hf_name, tensor) pairs as safetensors shards (+ an index when there are several).

    source_dir: its non-weight files (config.json, tokenizer, generation config, ...) are copied first;
    hf_config: a transformers config written as config.json (after the copy, so it wins);
    expected_names: the complete set of names; an unknown or a missing one raises (nothing is published).
    Shards are written under temporary names and renamed once all are complete. Returns the file names.
    """
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    shards: list[tuple[str, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"shard-{len(shards):05d}.safetensors.tmp"
            save_file(current, os.path.join(out_dir, name), metadata={"format": "pt"})
            shards.append((name, sorted(current)))
            current, size = {}, 0

    try:
        for name, tensor in named_tensors:
            if expected_names is not None and name not in expected_names:
                raise KeyError(f"{name!r} is not a weight of the checkpoint; expected Hugging Face names")
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                flush()
            current[name] = tensor.detach().to("cpu").contiguous().clone()
            size += nbytes
        flush()
    except BaseException:  # nothing half-written stays behind (a full disk gets its space back)
        for i in range(len(shards) + 1):
            Path(out_dir, f"shard-{i:05d}.safetensors.tmp").unlink(missing_ok=True)
        raise
    written = {n for _, names in shards for n in names}
    if expected_names is not None and expected_names - written:
        missing = sorted(expected_names - written)
        raise ValueError(f"got {len(written)} of {len(expected_names)} weights; missing e.g. {missing[:3]}")
    total = len(shards)
    final = (
        ["model.safetensors"] if total == 1 else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    )
    weight_map = {}
    for (tmp, names), dst in zip(shards, final):
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, dst))
        weight_map.update({n: dst for n in names})
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if total > 1:
        with open(index, "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    _remove_stale_weights(out_dir, keep=set(final) | ({os.path.basename(index)} if total > 1 else set()))
    if source_dir:
        _copy_side_files(source_dir, out_dir)
    if hf_config is not None:
        hf_config.save_pretrained(out_dir)
    return final
