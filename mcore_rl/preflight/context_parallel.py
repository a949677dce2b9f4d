"""Context parallelism's pre-flight rules: where it runs, and what it asks of a run's sequences.

With actor.parallel.cp = c > 1 the CP ranks of one DP rank hold the same samples, and every sequence is cut
into 2c chunks: CP rank r holds chunks r and 2c-1-r (the first and the last chunks together, so causal
attention's work is even across ranks). A sequence is padded to a multiple of 2c tokens for the cut, and a
micro-batch's row to a multiple of 2c x tp under sequence parallelism (`sequence_multiple`). The sizes:
world = tp x pp x cp x dp and, for MoE, ep x etp divides tp x cp x dp (`validate_layout`).

CP splits tokens, not heads, so CP adds no rule on the head counts (TP's stay). Where the attention across CP
ranks comes from (docs/context-parallel.md):
  * CPU: the local layer spec's attention gathers K / V over the CP group (mcore_rl/megatron/context_parallel.py);
  * CUDA with Transformer Engine: Megatron's TE attention does CP itself (cp_comm_type "p2p", the one TE
    communication type that takes the THD format; `Platform.context_parallel_config`); CUDA without TE is refused;
  * NPU: MindSpeed's ring attention (context_parallel_algo "megatron_cp_algo", `platform.mindspeed_cp_args`),
    which takes the packed (TND) sequences in exactly this split: per sequence, chunks r and 2c-1-r, each
    sequence a multiple of 2c tokens (its one rule on lengths, met by the split's padding). Its other rules
    (ring window 1 <= w < c, causal mask type, fused attention on) are the platform's fixed settings, so no
    config can break them; its Ulysses / hybrid algorithms, which would add head-count rules, are not used.
Before launch (`mcore-rl check` on any machine) whether TE is installed on the cluster is unknown: CUDA is
judged as the support matrix's stack, with TE; the start repeats the rule with TE known (`init_parallel`).
"""

from __future__ import annotations

import math
from typing import Optional


def sequence_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """Rows are padded to a multiple of this: 2 x cp chunks (cp > 1), each split over TP under sequence parallelism."""
    return (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def padded_length(tokens: int, cp: int) -> int:
    """A sequence of `tokens` as the CP split pads it: a multiple of 2 x cp (itself with cp 1)."""
    return tokens if cp <= 1 else math.ceil(max(tokens, 1) / (2 * cp)) * 2 * cp


def refusal(platform: Optional[str], transformer_engine: Optional[bool] = None) -> Optional[str]:
    """Why `platform` ("cpu" / "cuda" / "npu"; None or "auto": decided at start) cannot run cp > 1, or None.
    `transformer_engine`: whether the actor builds the TE layer spec (None: not known yet, as before launch)."""
    if platform == "cuda" and transformer_engine is False:
        return (
            "context parallelism on CUDA needs Transformer Engine's CP attention (cp_comm_type p2p); "
            "transformer_engine is not importable, so the actor builds the local layer spec, whose CP attention is "
            "the CPU path (install transformer-engine for TE's)"
        )
    return None


def platform_problem(cp: int, platform: Optional[str], transformer_engine: Optional[bool] = None) -> Optional[str]:
    """The pre-flight error for cp > 1 on a platform that cannot run it (naming the key and the fix), or None."""
    why = refusal(platform, transformer_engine) if cp > 1 else None
    return None if why is None else f"actor.parallel.cp = {cp} on {platform}: {why}: set actor.parallel.cp = 1"


# What attends across the CP ranks, per platform, as `mcore-rl check` names it (the values the platform sets:
# mcore_rl.platform.TE_CP_COMM_TYPE and MINDSPEED_CP_ALGO; tests/test_cp_preflight.py keeps them equal).
CP_ATTENTION = {
    "cpu": "K / V all-gathered over the CP group (the local spec's attention)",
    "cuda": "Transformer Engine's CP attention, cp_comm_type p2p (refused at start without Transformer Engine)",
    "npu": "MindSpeed's ring attention, context_parallel_algo megatron_cp_algo",
}


def cp_attention(platform: Optional[str]) -> str:
    """What attends across the CP ranks on `platform` (None / "auto": each platform's, decided at start)."""
    if platform in CP_ATTENTION:
        return CP_ATTENTION[platform]
    return "decided at start: " + "; ".join(f"{name.upper()}: {how}" for name, how in CP_ATTENTION.items())


def split_summary(
    cp: int, tp: int, sequence_parallel: bool, longest: int, budget: Optional[int], platform: Optional[str] = None
) -> Optional[str]:
    """One line for `mcore-rl check`: how sequences are cut over the CP ranks and what attends across them (None
    with cp 1)."""
    if cp <= 1:
        return None
    multiple = sequence_multiple(cp, tp, sequence_parallel)
    per_rank = padded_length(longest, cp) // cp
    row = f"micro-batches of <= {budget} tokens" if budget is not None else "padded micro-batches"
    return (
        f"context parallel: cp{cp}, each sequence in {2 * cp} load-balanced chunks (padded to a multiple of "
        f"{2 * cp} tokens), rows to a multiple of {multiple}; the longest sequence ({longest} tokens) is "
        f"{per_rank} tokens per CP rank; {row} are split the same way; attention across CP ranks: "
        f"{cp_attention(platform)}"
    )
