"""The whole pre-flight of a run (`validate_run`): the model's architecture, the engine's capabilities and
tensor-parallel size, the actor's layout, and how a step's samples split over mini-batches, data-parallel ranks
and micro-batches (`check_step_split`, the one statement of that rule), and whether the longest sequence, padded
as the layout pads it, fits the token budget (`check_token_budget`) and the model's positions (`check_positions`), and whether the experts can train in the
layout on this platform (`check_expert_dispatch`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from mcore_rl.config import Config, ConfigError
from mcore_rl.preflight.architectures import check_architecture
from mcore_rl.preflight.engines import check_engine_capabilities, validate_rollout_tp
from mcore_rl.preflight.layout import Layout, LayoutError, ModelDims, divisors, validate_layout
from mcore_rl.preflight.node import check_allocator, installed_vllm
from mcore_rl.preflight.placement import check_split


def validate_run(cfg: Config, world_size: int, dims: Any, platform: Optional[str] = None) -> Layout:
    """The whole pre-flight for a run: the placement's split (preflight.placement), actor layout (over the actor
    ranks when separate: the returned Layout's world_size, with its rollout_ranks), rollout TP (vLLM) and how a
    step's samples split.

    A step has prompts_per_step * n samples; they split evenly over the DP ranks and `algo.mini_batches`
    optimizer steps, and each rank's share of a mini-batch splits into micro-batches of micro_batch_size
    (unless micro-batches are cut by actor.max_tokens_per_micro_batch).
    """
    if platform is None and cfg.platform != "auto":
        platform = cfg.platform
    dims = ModelDims.from_hf(dims)
    check_architecture(cfg, dims)
    check_engine_capabilities(cfg, platform)
    split, split_warnings = check_split(cfg, world_size, dims)
    layout = _actor_layout(cfg, world_size if split is None else split.actor_ranks, dims, platform, split)
    check_expert_dispatch(layout, platform)
    warnings = list(layout.warnings) + split_warnings
    if cfg.rollout.engine == "vllm" and split is None:
        warnings += validate_rollout_tp(cfg.rollout.tp, world_size, dims).warnings
    check_token_budget(cfg, layout)
    check_positions(cfg, dims)
    packed = cfg.actor.max_tokens_per_micro_batch is not None  # DP shares are then balanced by tokens, not counts
    check_step_split(
        cfg.data.prompts_per_step * cfg.rollout.n,
        cfg.algo.mini_batches,
        layout.dp,
        None if packed else layout.micro_batch_size,
        f"data.prompts_per_step {cfg.data.prompts_per_step} x rollout.n {cfg.rollout.n}",
    )
    return dataclasses.replace(layout, warnings=tuple(warnings))


def _actor_layout(cfg: Config, ranks: int, dims: ModelDims, platform: Optional[str], split) -> Layout:
    """The actor's layout over its `ranks`: the world, or the separate placement's actor ranks (`split`), whose
    errors also name the split and rollout.ranks, the other way to fix them."""
    if split is None:
        return validate_layout(cfg.actor.parallel, ranks, dims, platform=platform)
    try:
        layout = validate_layout(cfg.actor.parallel, ranks, dims, platform=platform)
    except LayoutError as e:
        raise LayoutError(
            f"the actor's {ranks} ranks (world {split.world} - rollout.ranks {split.rollout_ranks}): {e}; "
            f"or move ranks between the roles with rollout.ranks"
        ) from None
    return dataclasses.replace(layout, rollout_ranks=split.rollout_ranks)


def check_token_budget(cfg: Config, layout: Layout) -> None:
    """The longest sequence (data.max_prompt_len + rollout.max_new_tokens), padded to the layout's
    `seq_len_multiple` as `batch.partition_by_tokens` pads it, must fit actor.max_tokens_per_micro_batch.
    `validate_run` checks it for `mcore-rl train` / `check`; `check_before_build` in the trainer again, for
    launches without the pre-flight (plain torchrun)."""
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget is None:
        return
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    padded = layout.pad_length(longest)
    if budget >= padded:
        return
    why = ""
    if padded > longest:  # name what makes the multiple (preflight.context_parallel.sequence_multiple)
        parts = [f"tp {layout.tp} under sequence parallelism"] if layout.sequence_parallel and layout.tp > 1 else []
        parts += [f"2 x cp {layout.cp}"] if layout.cp > 1 else []
        why = f", padded to {padded} (a multiple of {layout.seq_len_multiple}: {' x '.join(parts)})"
    raise LayoutError(
        f"actor.max_tokens_per_micro_batch = {budget} cannot hold the longest sequence, data.max_prompt_len + "
        f"rollout.max_new_tokens = {longest}{why}: raise it to at least {padded}"
    )


def check_positions(cfg: Config, dims: ModelDims) -> None:
    """The longest sequence, data.max_prompt_len + rollout.max_new_tokens, within the model's
    max_position_embeddings: beyond it the engine refuses the prompt (or RoPE runs past what the model learnt)."""
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if not dims.max_positions or longest <= dims.max_positions:
        return
    room = dims.max_positions - cfg.data.max_prompt_len
    fix = f"lower rollout.max_new_tokens to at most {room}" if room >= 1 else "lower data.max_prompt_len"
    raise LayoutError(
        f"data.max_prompt_len + rollout.max_new_tokens = {cfg.data.max_prompt_len} + {cfg.rollout.max_new_tokens} "
        f"= {longest} exceeds the model's max_position_embeddings = {dims.max_positions} (config.json): {fix}"
    )


def check_expert_dispatch(layout: Layout, platform: Optional[str]) -> None:
    """Training on CPU with the experts split over EP and ETP: the alltoall dispatcher all-gathers the tokens of
    the ETP ranks, whose counts differ once EP splits the experts (equal with EP = 1), and gloo rejects an uneven
    all-gather, so the first MoE layer's forward aborts. The layout itself builds on CPU (the weight export is
    tested in it); a run cannot train in it. ep > 1 means a MoE model (`validate_layout` refuses it for dense)."""
    if platform == "cpu" and layout.ep > 1 and layout.etp > 1:
        raise LayoutError(
            f"actor.parallel.etp = {layout.etp} with ep = {layout.ep} on CPU: gloo rejects the uneven all-gather "
            f"of the alltoall dispatcher's expert tensor parallel step (the first MoE layer would abort); "
            f"set actor.parallel.etp = 1"
        )


def check_before_build(cfg: Config, world_size: int, platform: Optional[str]) -> None:
    """What the trainer checks before it builds the actor, for launches without the pre-flight (plain torchrun
    of `mcore-rl train`, launch/ scripts): the allocator setting, the placement's split, the actor's layout (over
    the actor ranks when separate), the expert dispatch and the token budget, as one-line config errors."""
    check_allocator(cfg, platform, os.environ, installed_vllm())
    try:
        split, _ = check_split(cfg, world_size, cfg.model.path)
        actor_ranks = world_size if split is None else split.actor_ranks
        layout = _actor_layout(cfg, actor_ranks, ModelDims.from_hf(cfg.model.path), platform, split)
        check_expert_dispatch(layout, platform)
        check_token_budget(cfg, layout)
        check_positions(cfg, ModelDims.from_hf(cfg.model.path))
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def split_unit(mini_batches: int, dp: int, micro_batch_size: Optional[int]) -> int:
    """What a step's sample count must be a multiple of: `mini_batches`, and with fixed-size micro-batches also
    dp x micro_batch_size (None: token-budget micro-batches, which take any count per DP rank)."""
    return mini_batches * (dp * micro_batch_size if micro_batch_size else 1)


def check_step_split(
    samples: int,
    mini_batches: int,
    dp: int,
    micro_batch_size: Optional[int],
    source: str = "data.prompts_per_step x rollout.n",
) -> None:
    """The rule of `split_unit`, with the fix: the pre-flight checks it for the configured step, and
    `batch.plan_mini_batches` for the samples it is given (a step of dynamic sampling's merged groups)."""
    splits = mini_batches if micro_batch_size is None else dp * mini_batches
    if samples % splits:
        raise LayoutError(
            f"a step's {samples} samples ({source}) must split evenly over "
            f"{'' if micro_batch_size is None else f'dp {dp} x '}algo.mini_batches {mini_batches} = {splits}: "
            f"make prompts_per_step * n a multiple of {splits}"
        )
    per_rank = samples // splits
    if micro_batch_size is not None and per_rank % micro_batch_size:
        raise LayoutError(
            f"each DP rank's mini-batch of {per_rank} samples must split into micro-batches of "
            f"actor.parallel.micro_batch_size = {micro_batch_size}: use a micro_batch_size in {divisors(per_rank)}"
        )
