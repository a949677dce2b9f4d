"""The model dimensions a check reads (a config.json) and the report of a run that passed the checks: what
`mcore-rl check` / `plan` print, and what `mcore-rl from-verl --check` shows for the converted preset."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mcore_rl.config import Config, ConfigError
from mcore_rl.preflight.context_parallel import split_summary
from mcore_rl.preflight.layout import Layout, ModelDims
from mcore_rl.preflight.placement import describe_roles, split_of


def model_dims(cfg: Config, model_config: Optional[str] = None) -> ModelDims:
    """Dimensions from --model-config (a config.json) or from model.path's config.json."""
    source = model_config or cfg.model.path
    if not source:
        raise ConfigError(
            "model.path is empty and no --model-config given: set model.path or pass --model-config CONFIG_JSON"
        )
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        flag = "--model-config" if model_config else "model.path"
        raise ConfigError(
            f"{flag} = {source} has no config.json: point it at a Hugging Face checkpoint folder or pass "
            f"--model-config with the model's config.json (e.g. configs/qwen3_30b_a3b/config.json)"
        )
    return ModelDims.from_hf(path)


def describe_run(cfg: Config, layout: Layout, nnodes: int, nproc: int) -> str:
    """What `mcore-rl check` / `plan` print for a run that passed: the layout, the batch split, engine, algorithm."""
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    per_rank = samples / (layout.dp * cfg.algo.mini_batches)
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget is None:
        split = f"{per_rank:g} sequences per DP rank each, micro-batches of {layout.micro_batch_size} sequences"
    else:  # DP shares are balanced by tokens, so a rank's sequence count varies around the mean
        split = f"~{per_rank:g} sequences per DP rank each, packed into micro-batches of <= {budget} tokens"
    roles = split_of(cfg.rollout, layout.world_size + layout.rollout_ranks) if layout.rollout_ranks else None
    generating = layout.world_size if roles is None else roles.rollout_ranks
    lines = [
        f"world {layout.world_size + layout.rollout_ranks} ({nnodes} node(s) x {nproc} processes)",
        *(describe_roles(roles, cfg.rollout.engine, nproc) if roles else []),
        f"actor: tp{layout.tp} pp{layout.pp} cp{layout.cp} dp{layout.dp} | ep{layout.ep} etp{layout.etp} edp{layout.edp}"
        f" | sequence_parallel {'on' if layout.sequence_parallel else 'off'} | layers per stage {list(layout.layers_per_stage)}"
        + (f" x vpp{layout.vpp}" if layout.vpp else "")
        + f" | vocab {layout.padded_vocab_size}"
        + ("" if roles is None else f" | on its {layout.world_size} rank{'s' if layout.world_size > 1 else ''}"),
        f"batch: {cfg.data.prompts_per_step} prompts x n {cfg.rollout.n} = {samples} samples/step -> {cfg.algo.mini_batches} "
        f"mini-batch(es), {split}",
        f"rollout: {cfg.rollout.engine}"
        + (f" tp{cfg.rollout.tp} x {generating // cfg.rollout.tp} replicas" if cfg.rollout.engine == "vllm" else ""),
        f"algo: {cfg.algo.loss} ({cfg.algo.agg_mode}), adv {cfg.algo.adv_estimator}, routing replay {cfg.algo.routing_replay or 'off'}"
        + _old_log_probs(cfg, roles is not None),
    ]
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    lines += filter(
        None, [split_summary(layout.cp, layout.tp, layout.sequence_parallel, longest, budget, cfg.platform)]
    )
    return "\n".join(lines + [f"warning: {w}" for w in layout.warnings])


def _old_log_probs(cfg: Config, separate: bool) -> str:
    """Where the old policy's log-probs come from. One step off (separate, rollout.max_staleness null or > 0) the
    samples come from the weights before the last update, so the proximal pass runs whatever algo says."""
    if separate and cfg.rollout.max_staleness != 0 and cfg.algo.proximal == "loglinear":
        return ", proximal log-probs interpolated by each token's version lag (algo.proximal=loglinear, no pass)"
    if separate and cfg.rollout.max_staleness != 0:
        return ", old log-probs from the proximal pass (the samples are up to one update stale)"
    if cfg.algo.old_from_update:
        return ", old log-probs from the update (exactly on-policy)"
    return ", old log-probs from a separate pass"
