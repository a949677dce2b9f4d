"""The rollout engine interface: every engine (embedded transformers, vLLM, vLLM-Ascend) implements it."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from mcore_rl.batch import RolloutSample  # the engines' output is the step data's input

if TYPE_CHECKING:
    from mcore_rl.platform.shared_memory import SharedTensors

# What a colocated engine's memory holds, by vLLM's sleep-mode tags: wake the weights first (to take a sync),
# the KV cache last (after the actor's state has left the device).
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None


def check_token_ids(seqs: list[list[int]], what: str, vocab_size: int) -> None:
    """Every sequence non-empty, every id inside the vocabulary (a bad id would crash deep in the engine)."""
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"{what} {i} is empty")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{what} {i} has token ids {bad[:3]} outside the vocabulary [0, {vocab_size})")


def check_generate_request(prompts: list[list[int]], n: int, params: SamplingParams, vocab_size: int) -> None:
    """The checks every engine's generate() makes before any work."""
    if not prompts:
        raise ValueError("generate() got no prompts")
    if n < 1:
        raise ValueError(f"n={n} samples per prompt; use n >= 1")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={params.max_new_tokens}; use >= 1")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(f"temperature={params.temperature} (>= 0) / top_p={params.top_p} (in (0, 1]) out of range")
    check_token_ids(prompts, "prompt", vocab_size)


class RolloutEngine(abc.ABC):
    """Generates responses and receives new weights from the actor."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """n samples for each prompt; result[i][j] is sample j of prompt i."""

    @abc.abstractmethod
    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probs of the given response tokens (positions >= prompt_len) under the engine's current weights."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights as (Hugging Face name, full tensor) pairs; may be called with a stream of buckets."""

    def weight_names(self) -> Optional[set[str]]:
        """The Hugging Face names a complete sync must deliver, or None if the engine cannot tell."""
        return None

    def weight_buffer(self, name: str) -> Optional[torch.Tensor]:
        """The engine's own tensor holding Hugging Face weight `name` (a view where the engine fuses several),
        for an exporter that writes new weights straight into it; None where the engine's memory is not
        reachable that way (then `load_weights` copies). An engine that returns tensors here must skip, in
        `load_weights`, a given tensor that already IS its own."""
        return None

    def shared_weights(self) -> Optional["SharedTensors"]:
        """The engine's weights in a shared-memory region other processes of its host can map and write
        (mcore_rl/platform/shared_memory.py), named as `weight_buffer` names them; None where they are not
        (then only this process writes into them, through `weight_buffer` or `load_weights`)."""
        return None

    def weight_diffs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Optional[dict[str, float]]:
        """Max abs difference between the engine's copy of each given tensor and the given value, or None
        where the engine cannot read its weights back (used to name the tensors a failed sync got wrong)."""
        return None

    def weight_fingerprints(self, names: list[str]) -> Optional[dict[str, torch.Tensor]]:
        """name -> `weight_sync.fingerprint(name, weight)` of the engine's copy of each weight, in Hugging Face
        layout; None when the engine cannot read its weights back that way (then the check is skipped)."""
        return None

    def rebuild_from(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Recreate the model from complete weights by a path known to be exact (the fallback after a sync
        fails verification)."""
        raise NotImplementedError(f"{type(self).__name__} has no exact rebuild path; use rollout.verify_fallback=error")

    def close(self) -> None:
        """Release the engine before the process groups go away. Default: no-op."""

    def sleep(self) -> None:
        """Release memory while the actor trains (colocated). Default: no-op."""

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Restore memory before the next rollout: `tags` (a subset of MEMORY_TAGS) or all of it (None).
        Default: no-op."""
