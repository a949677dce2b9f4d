"""The rollout engine protocol: what every engine (embedded transformers, vLLM, vLLM-Ascend) implements, and the
capabilities it declares for what only some engines offer."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from mcore_rl.batch import RolloutSample  # the engines' output is the step data's input
from mcore_rl.weight_sync.receiver import COPY_IN, WeightReceiver  # what an engine offers a sync (weight_sync/)

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


def check_score_request(
    sequences: list[list[int]], prompt_lens: list[int], temperature: float, vocab_size: int
) -> None:
    """The checks every engine's score() makes before any work."""
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"score(): {len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    if temperature <= 0:
        raise ValueError(f"score(): temperature={temperature}; log-probs need temperature > 0")
    check_token_ids(sequences, "sequence", vocab_size)
    for i, (s, p) in enumerate(zip(sequences, prompt_lens)):
        if not 1 <= p < len(s):
            raise ValueError(f"sequence {i}: prompt_len {p} must be in [1, {len(s) - 1}] for length {len(s)}")


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine offers beyond the protocol every engine implements (`RolloutEngine`); callers read these
    flags instead of probing for methods.

    handles_data_parallel: the engine places its replicas itself (`data_parallel.DataParallelEngine`): every rank
        passes the same full prompt list, `generate_share` returns the rank's replica share.
    routes: samples carry `routed_experts` (rollout routing replay, R3).
    reads_weights: the engine reads its weights back (`WeightReader`: name the tensors a failed sync got wrong,
        compare fingerprints).
    sleeps: `sleep` releases device memory (else `sleep` / `wake_up` keep it allocated).
    receiver: where a sync may write the weights (`WeightReceiver`).
    interruptible: with `between_steps` set, `generate` calls it between two decode steps with the in-flight
        generation, which continues under new weights after its `weights_changed(version)`; every token then
        records `weights_version` (streaming, mcore_rl/streaming.py; partial rollout, docs/async.md)."""

    handles_data_parallel: bool = False
    routes: bool = False
    reads_weights: bool = False
    sleeps: bool = False
    receiver: WeightReceiver = COPY_IN
    interruptible: bool = False


class RolloutEngine(abc.ABC):
    """Generates responses and receives new weights from the actor: what every engine implements."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities:
        """What this engine offers now (the receiver may change when the engine rebuilds its model)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """n samples for each prompt; result[i][j] is sample j of prompt i."""

    @abc.abstractmethod
    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probs of the given response tokens (positions >= prompt_len) under the engine's current weights."""

    @abc.abstractmethod
    def weight_names(self) -> set[str]:
        """The Hugging Face names a complete sync must deliver."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights as (Hugging Face name, full tensor) pairs; may be called with a stream of buckets."""

    @abc.abstractmethod
    def rebuild_from(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Recreate the model from complete weights by a path known to be exact (the fallback after a sync
        fails verification)."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release memory while the actor trains (colocated); keeps it where `capabilities.sleeps` is False."""

    @abc.abstractmethod
    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Restore memory before the next rollout: `tags` (a subset of MEMORY_TAGS) or all of it (None)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine before the process groups go away."""


class WeightReader(abc.ABC):
    """An engine that reads its weights back (`EngineCapabilities.reads_weights`)."""

    @abc.abstractmethod
    def weight_diffs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Max abs difference between the engine's copy of each given tensor and the given value."""

    @abc.abstractmethod
    def weight_fingerprints(self, names: list[str]) -> dict[str, torch.Tensor]:
        """name -> `weight_sync.fingerprint(name, weight)` of the engine's copy of each weight, in Hugging Face
        layout."""
