"""Requests to vLLM and its answers in the engine-neutral types (mcore_rl.rollout.base): sampling parameters,
samples with their log-probs and routed experts, and the prompt log-probs that score a sequence.

Semantics (the module docstring of mcore_rl.rollout.vllm_engine): the sampled token's log-prob only
(``logprobs=0``, ``logprobs_mode="processed_logprobs"`` set at start-up); no detokenizing (the trainer decodes).
"""

from __future__ import annotations

from typing import Optional

import torch

from mcore_rl.rollout.base import RolloutSample, SamplingParams


def generate_params(params: SamplingParams, n: int, seed: Optional[int], allowed: Optional[list[int]] = None):
    """vLLM's SamplingParams for n samples of one prompt seeded `seed` (sample j gets `seed + j` from vLLM);
    `allowed`: the only ids it may sample (the tokenizer's, where the model's vocabulary is padded beyond it)."""
    import vllm

    return vllm.SamplingParams(
        allowed_token_ids=allowed,
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )


def prefill_params(temperature: float):
    """vLLM's SamplingParams for scoring: a prefill with prompt log-probs (the whole vocabulary at T != 1)."""
    import vllm

    return vllm.SamplingParams(max_tokens=1, prompt_logprobs=-1 if temperature != 1.0 else 0, detokenize=False)


def samples_of(prompt: list[int], out) -> list[RolloutSample]:
    """The samples of one vLLM RequestOutput, in sample order."""
    samples = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} tokens"
            )
        logprobs = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, ids)], dtype=torch.float32)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with reason {c.finish_reason!r} (expected stop/length)")
        samples.append(
            RolloutSample(
                prompt_ids=list(prompt),
                response_ids=ids,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                routed_experts=routes_of(c, len(prompt) + len(ids)),
            )
        )
    return samples


def routes_of(completion, length: int) -> Optional[torch.Tensor]:
    """A completion's routed experts as int16 [length, layers, k], or None where vLLM returned none."""
    routes = getattr(completion, "routed_experts", None)
    if routes is None:
        return None
    routes = torch.as_tensor(routes).to(torch.int16)
    if routes.shape[0] == length - 1:  # the last sampled token never went through the model
        routes = torch.cat([routes, routes[-1:]], 0)
    if routes.shape[0] != length:
        raise RuntimeError(f"vLLM returned routes for {routes.shape[0]} tokens of a {length}-token sequence")
    return routes


def prompt_logprobs(steps, seq: list[int], prompt_len: int, temperature: float, vocab_size: int) -> torch.Tensor:
    """Log-probs of `seq`'s tokens from `prompt_len` on, from vLLM's prompt log-probs `steps`.

    vLLM's prompt log-probs ignore temperature; at T != 1 they hold the whole vocabulary per position, re-normalised
    here as log_softmax(lp / T), which equals log_softmax(logits / T)."""
    # steps[k] holds the log-probs of position k given tokens < k (steps[0] is None)
    values = []
    for k in range(prompt_len, len(seq)):
        step = steps[k]
        if temperature == 1.0:
            values.append(step[seq[k]].logprob)
            continue
        full = torch.full((vocab_size,), float("-inf"), dtype=torch.float64)
        for tok, lp in step.items():
            if tok < vocab_size:
                full[tok] = lp.logprob
        values.append(torch.log_softmax(full / temperature, -1)[seq[k]].item())
    return torch.tensor(values, dtype=torch.float32)
