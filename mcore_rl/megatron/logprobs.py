"""Log-probabilities of target tokens and the entropy over a vocabulary sharded by tensor parallelism.

The actor's path is `OutputHead.log_probs` -> `fused_output_log_probs` (bottom of this file): from the last
hidden states and this rank's output-weight shard, projecting one chunk of tokens at a time, so no
[tokens, V/tp] logits tensor exists. `vocab_parallel_log_probs` computes the same from logits that already
exist; nothing in the package calls it any more: it stays as the materialised-logits path that the
equivalence tests (tests/workers/actor_layouts.py: the actor against Megatron's output layer + this) and
benchmarks/logprob_memory.py compare the fused path with, and it shares its per-chunk statistics with it.

Tensor parallelism shards the output layer over the vocabulary: each rank holds logits [.., V/tp]
for its contiguous vocabulary slice (rank r owns ids [r * V/tp, (r+1) * V/tp)). We never gather the
full vocabulary; per token the ranks all-reduce one max and three partial sums
(sum exp, sum exp * z, target logit). Work runs in chunks of `chunk_tokens` tokens (default: CHUNK_ELEMENTS / (V/tp)), so the only
extra [tokens, V/tp] memory beyond the input logits and their gradient is one chunk of fp32
temporaries, in forward and in backward (the backward recomputes softmax from the saved input
logits instead of keeping it). The input is never modified in place.

Temperature is applied here, once: z = logits / temperature. `LogProbOptions` holds what both paths (from
logits, from the last hidden states) take besides their tensors, and checks it once.
Plain torch.distributed (no Megatron import): pass the tensor-parallel group, or None for world 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.preflight.memory_plan import LOGPROB_CHUNK_ELEMENTS  # the one value; the memory plan counts it

CHUNK_ELEMENTS = 1 << 25  # default chunk: ~32M fp32 values (128 MiB) per temporary


@dataclass(frozen=True)
class LogProbOptions:
    """How a log-prob pass runs, on either path: the softmax temperature, the tensor-parallel group the vocabulary
    is split over (None: unsharded), whether the entropy is returned too, and the tokens per chunk (None: the
    path's element budget over V/tp). Checked when made, before any tensor work."""

    temperature: float = 1.0
    group: dist.ProcessGroup | None = None
    with_entropy: bool = False
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use the rollout's sampling temperature")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")

    def chunk(self, budget_elements: int, local_vocab: int) -> int:
        """Tokens per chunk: chunk_tokens, or as many as keep one [chunk, V/tp] fp32 temporary in the budget."""
        return int(self.chunk_tokens) if self.chunk_tokens is not None else max(1, budget_elements // local_vocab)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _vocab_start(local_vocab: int, group) -> int:
    rank = dist.get_rank(group) if group is not None else 0
    return rank * local_vocab


def _scaled(logits_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits_chunk.float()  # a view when already fp32: no copy
    return z if temperature == 1.0 else z / temperature


def _chunk_stats(z: torch.Tensor, target: torch.Tensor, vocab_start: int, group):
    """For one chunk of scaled logits z [c, V/tp]: global max m, log sum exp(z - m), target z - m, E_p[z - m]."""
    m = z.max(dim=-1).values
    _all_reduce(m, dist.ReduceOp.MAX, group)
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    local_ids = target - vocab_start
    owned = (local_ids >= 0) & (local_ids < z.shape[-1])
    picked = shifted.gather(-1, local_ids.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    sum_exp_shifted = torch.bmm(exp.unsqueeze(1), shifted.unsqueeze(2)).view(-1)  # row dot products, no temp
    sums = torch.stack([exp.sum(-1), sum_exp_shifted, torch.where(owned, picked, torch.zeros_like(picked))])
    _all_reduce(sums, dist.ReduceOp.SUM, group)  # one collective for the three partial sums
    sum_exp, sum_exp_shifted, target_shifted = sums
    log_z = sum_exp.log()
    return m, log_z, target_shifted, sum_exp_shifted / sum_exp


def _keep_settings(ctx, target, temperature, chunk_tokens, vocab_start, with_entropy) -> None:
    """What backward needs besides the saved tensors (both chunked log-prob functions keep the same)."""
    ctx.temperature, ctx.chunk_tokens, ctx.vocab_start, ctx.with_entropy = (
        temperature,
        chunk_tokens,
        vocab_start,
        with_entropy,
    )
    ctx.mark_non_differentiable(target)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, group, chunk_tokens, with_entropy):
        n, local_vocab = logits.shape
        vocab_start = _vocab_start(local_vocab, group)
        log_prob = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        maxes = torch.empty_like(log_prob)
        log_zs = torch.empty_like(log_prob)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = _scaled(logits[s:e], temperature)
            m, log_z, tgt, mean_shifted = _chunk_stats(z, target[s:e], vocab_start, group)
            log_prob[s:e] = tgt - log_z
            entropy[s:e] = log_z - mean_shifted  # H = log Z - E_p[z - m] (Z taken after the shift)
            maxes[s:e], log_zs[s:e] = m, log_z
        ctx.save_for_backward(logits, target, maxes, log_zs, entropy)
        _keep_settings(ctx, target, temperature, chunk_tokens, vocab_start, with_entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, target, maxes, log_zs, entropy = ctx.saved_tensors
        n, local_vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        g_lp = grad_log_prob.float()
        g_h = grad_entropy.float() if ctx.with_entropy and grad_entropy is not None else torch.zeros_like(g_lp)
        # d/dz_j [g_lp log p_y + g_h H] = g_lp (onehot_j - p_j) - g_h p_j (log p_j + H)
        #                               = p_j (a + b log p_j) + g_lp onehot_j,  a = -g_lp - g_h H, b = -g_h
        a = -g_lp - g_h * entropy
        b = -g_h
        for s in range(0, n, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, n)
            # log p = z - m - log Z, recomputed per chunk instead of stored
            log_p = _scaled(logits[s:e], ctx.temperature) - (maxes[s:e] + log_zs[s:e]).unsqueeze(-1)
            g = torch.addcmul(a[s:e].unsqueeze(-1), b[s:e].unsqueeze(-1), log_p)
            g.mul_(log_p.exp_())
            local_ids = target[s:e] - ctx.vocab_start
            rows = torch.nonzero((local_ids >= 0) & (local_ids < local_vocab)).squeeze(-1)
            g[rows, local_ids[rows]] += g_lp[s:e][rows]
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)  # z = logits / T
            grad_logits[s:e] = g
        return grad_logits, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `target` under softmax(logits / temperature) over the full (sharded) vocabulary.

    logits: [..., V/tp] this rank's vocabulary shard (any float dtype; math in fp32);
    target: [...] global token ids; group: the tensor-parallel group (None: unsharded).
    Returns (log_prob [...], entropy [...] or None), fp32, differentiable w.r.t. logits.
    chunk_tokens bounds the extra fp32 [chunk, V/tp] temporaries (a few live at once).
    Every rank of `group` must call this with the same tokens (it runs collectives).
    """
    opts = LogProbOptions(temperature, group, with_entropy, chunk_tokens)
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim {tuple(logits.shape[:-1])}"
        )
    lead = target.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunk = opts.chunk(CHUNK_ELEMENTS, logits.shape[-1])
    log_prob, entropy = _VocabParallelLogProbs.apply(
        flat_logits, target.reshape(-1).long(), float(temperature), group, chunk, with_entropy
    )
    return log_prob.view(lead), (entropy.view(lead) if with_entropy else None)


# ---------------------------------------------------------------------------------------------------------
# From the last hidden states: the output projection fused into the chunks (no [tokens, V/tp] logits)
# ---------------------------------------------------------------------------------------------------------


def _project(hidden_chunk: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scaled fp32 logits of one chunk, computed as the output layer does (in the weight's dtype)."""
    return _scaled(hidden_chunk @ weight.t(), temperature)


class _FusedOutputLogProbs(torch.autograd.Function):
    """log p(target) and entropy from hidden [n, h] and this rank's output weight shard [V/tp, h].

    Forward keeps per token only the max and log Z; backward recomputes each chunk's logits from the
    saved hidden states and weight, so at no time does more than one chunk of [chunk, V/tp] exist.
    Returns d/d hidden as THIS rank's partial sum over its vocabulary shard (like the matrix product
    of a column-parallel output layer): the caller's tensor-parallel region op sums it over TP.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, group, chunk_tokens, with_entropy):
        n = hidden.shape[0]
        local_vocab = weight.shape[0]
        vocab_start = _vocab_start(local_vocab, group)
        log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, maxes, log_zs = torch.empty_like(log_prob), torch.empty_like(log_prob), torch.empty_like(log_prob)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = _project(hidden[s:e], weight, temperature)
            m, log_z, tgt, mean_shifted = _chunk_stats(z, target[s:e], vocab_start, group)
            del z
            log_prob[s:e] = tgt - log_z
            entropy[s:e] = log_z - mean_shifted
            maxes[s:e], log_zs[s:e] = m, log_z
        ctx.save_for_backward(hidden, weight, target, maxes, log_zs, entropy)
        _keep_settings(ctx, target, temperature, chunk_tokens, vocab_start, with_entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, target, maxes, log_zs, entropy = ctx.saved_tensors
        n, local_vocab = hidden.shape[0], weight.shape[0]
        g_lp = grad_log_prob.float()
        g_h = grad_entropy.float() if ctx.with_entropy and grad_entropy is not None else torch.zeros_like(g_lp)
        a, b = -g_lp - g_h * entropy, -g_h  # as in _VocabParallelLogProbs.backward
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, n, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, n)
            log_p = _project(hidden[s:e], weight, ctx.temperature)
            log_p -= (maxes[s:e] + log_zs[s:e]).unsqueeze(-1)
            g = torch.addcmul(a[s:e].unsqueeze(-1), b[s:e].unsqueeze(-1), log_p)
            g.mul_(log_p.exp_())
            del log_p
            local_ids = target[s:e] - ctx.vocab_start
            rows = torch.nonzero((local_ids >= 0) & (local_ids < local_vocab)).squeeze(-1)
            g[rows, local_ids[rows]] += g_lp[s:e][rows]
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            g = g.to(weight.dtype)  # d logits, in the dtype the output layer's backward would see
            if grad_hidden is not None:
                grad_hidden[s:e] = g @ weight
            if grad_weight is not None:
                grad_weight.addmm_(g.t().float(), hidden[s:e].float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_output_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: LogProbOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_log_probs(hidden @ weight.T, ...)` without the [tokens, V/tp] logits, in forward
    or backward: the output projection runs per chunk of tokens and is recomputed in backward.

    hidden: [..., h] the last hidden states (after the final norm), the same on every rank of `group`;
    weight: [V/tp, h] this rank's output-layer shard (rank r owns ids [r * V/tp, (r+1) * V/tp));
    target: [...] global token ids; options: temperature, group, entropy, chunk (default: LogProbOptions()).
    Returns (log_prob [...], entropy [...] or None), fp32.
    Gradients: w.r.t. weight (this shard), and w.r.t. hidden as this rank's partial sum over its
    vocabulary shard - wrap `hidden` with the tensor-parallel region op that sums it (Megatron's
    copy_to_tensor_model_parallel_region, or gather_from_sequence_parallel_region under sequence
    parallelism) as the output layer does.
    """
    opts = options or LogProbOptions()
    if hidden.shape[:-1] != target.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be target {tuple(target.shape)} x h and weight {tuple(weight.shape)} [V/tp, h]"
        )
    lead = target.shape
    log_prob, entropy = _FusedOutputLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1).long(),
        float(opts.temperature),
        opts.group,
        opts.chunk(LOGPROB_CHUNK_ELEMENTS, weight.shape[0]),
        opts.with_entropy,
    )
    return log_prob.view(lead), (entropy.view(lead) if opts.with_entropy else None)


@dataclass(frozen=True)
class OutputHead:
    """What the actor's post_fn / loss_fn receive from the last pipeline stage instead of logits: the last
    hidden states and this rank's output-layer weight shard (mcore_rl.compat.megatron.output_hidden_states).

    hidden: [b, s, h] after the final norm, the whole sequence on every TP rank (gathered under sequence
    parallelism), with the tensor-parallel region op that sums d hidden over TP already applied (any float
    dtype: the projection runs in the weight's dtype, as the output layer's does);
    weight: [V/tp, h] the parameter itself (tied models: the shared embedding), so its gradient reaches the
    parameter's DDP buffer as the output layer's would;
    cp_group: under context parallelism the group whose ranks hold the other parts of these sequences
    (per-sequence sums reduce over it: mcore_rl/megatron/context_parallel.py), else None.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    cp_group: Any = None

    def log_probs(
        self, target: torch.Tensor, temperature: float, group=None, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`fused_output_log_probs` of `target` [b, s]: no [tokens, V/tp] logits in forward or backward."""
        hidden = self.hidden.to(self.weight.dtype)  # the projection's input dtype (a no-op when equal)
        return fused_output_log_probs(hidden, self.weight, target, LogProbOptions(temperature, group, with_entropy))

    def logits(self) -> torch.Tensor:
        """This rank's logits [b, s, V/tp] in fp32, MATERIALISED: for tests and inspection only (the actor's
        passes never call it)."""
        return (self.hidden.to(self.weight.dtype) @ self.weight.t()).float()
