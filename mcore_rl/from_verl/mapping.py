"""verl's overrides -> this project's config: the rules, and the table every key of a script lands in.

Every verl key the converter knows is in `KNOWN` (mapped by the rules below, or not needed / not supported
here with the reason); its verl default is read from `verl_schema.yaml` (the keys this module relies on, as
verl's generated trainer configs list them). A setting the script leaves at verl's default gets verl's
default, not this project's: the preset states what the verl run ran. What verl ignores (GSPO / SAPO's
`loss_agg_mode`, GSPO's `clip_ratio_c`, ...) is listed as "no effect in verl" and the preset gets what ran.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from mcore_rl.from_verl.hydra import HydraCommand, parse_value

Status = Literal["mapped", "not needed", "not supported", "no effect in verl", "unknown"]
STATUSES: tuple[Status, ...] = ("mapped", "not needed", "not supported", "no effect in verl", "unknown")
Strategy = Literal["megatron", "fsdp"]

SCHEMA_PATH = Path(__file__).with_name("verl_schema.yaml")

A = "actor_rollout_ref.actor."
M = A + "megatron."
F = A + "fsdp_config."
OT = M + "override_transformer_config."
R = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."
OB = "reward_model.reward_kwargs.overlong_buffer_cfg."


class ConversionError(ValueError):
    """A value the rules cannot read (a word where a number belongs); the message names the override."""


@dataclass(frozen=True)
class Known:
    """A verl key (or every key under a prefix ending in '.*') and what becomes of it here."""

    key: str
    target: str  # this project's key(s) it sets; "" if none
    rule: str  # how it maps, or why it is not needed / not supported
    status: Optional[Status] = None  # fixed status; None: decided by the rules from the run's values


def _k(key: str, target: str, rule: str) -> Known:
    return Known(key, target, rule)


def _nn(key: str, why: str) -> Known:
    return Known(key, "", why, "not needed")


def _ns(key: str, why: str) -> Known:
    return Known(key, "", why, "not supported")


KERNEL = "a kernel / compilation choice: the same math here (the platform picks the kernels)"
PACKED = (
    "padding never changes a result here; sequences are packed without padding whenever a token budget is set "
    "(use_dynamic_bsz -> actor.max_tokens_per_micro_batch)"
)
FUSIONS = (
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "moe_permute_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "moe_grouped_gemm",
    "attention_backend",
    "deallocate_pipeline_outputs",
    "moe_shared_expert_overlap",
    "cross_entropy_loss_fusion",
)

KNOWN: tuple[Known, ...] = (
    # cluster
    _k("trainer.nnodes", "trainer.nnodes", "machines"),
    _k("trainer.n_gpus_per_node", "trainer.nproc", "devices (processes) per machine; world = nnodes x n_gpus_per_node"),
    _k("trainer.device", "platform", "cuda -> cuda, npu -> npu; not set: auto (detected at start)"),
    # actor layout
    _k(A + "strategy", "actor.parallel", "megatron: its sizes below; fsdp / fsdp2: data parallelism over the world"),
    _k(M + "tensor_model_parallel_size", "actor.parallel.tp", "same meaning"),
    _k(M + "pipeline_model_parallel_size", "actor.parallel.pp", "same meaning"),
    _k(M + "expert_model_parallel_size", "actor.parallel.ep", "same meaning"),
    _k(M + "expert_tensor_parallel_size", "actor.parallel.etp", "same meaning (null: the tensor-parallel size)"),
    _k(M + "virtual_pipeline_model_parallel_size", "actor.parallel.virtual_pp", "same meaning"),
    _k(M + "context_parallel_size", "actor.parallel.cp", "same meaning (`mcore-rl check` says whether cp > 1 runs)"),
    _k(M + "sequence_parallel", "actor.parallel.sequence_parallel", "same meaning; off when TP is 1"),
    _k(M + "use_distributed_optimizer", "actor.optim.use_distributed_optimizer", "same meaning"),
    _k(OT + "num_layers_in_first_pipeline_stage", "actor.parallel.num_layers_in_first_stage", "same meaning"),
    _k(OT + "num_layers_in_last_pipeline_stage", "actor.parallel.num_layers_in_last_stage", "same meaning"),
    _k(
        F + "ulysses_sequence_parallel_size",
        "",
        "> 1 is not supported: this project splits sequences over devices only by context parallelism; every "
        "device holds whole sequences (data parallelism over the world) and the token budget is the SP group's",
    ),
    _k(A + "ulysses_sequence_parallel_size", "", "as fsdp_config.ulysses_sequence_parallel_size"),
    _k(F + "fsdp_size", "", "-1 (or the world): one sharding group, as the distributed optimizer over all DP ranks"),
    # offload
    _k(
        M + "param_offload",
        "actor.offload",
        "any offload flag -> actor.offload (parameters, gradients and optimizer "
        "state on the host around rollout, where the engine needs the memory)",
    ),
    _k(M + "grad_offload", "actor.offload", "as param_offload"),
    _k(M + "optimizer_offload", "actor.offload", "as param_offload"),
    _k(F + "param_offload", "actor.offload", "as megatron.param_offload"),
    _k(F + "optimizer_offload", "actor.offload", "as megatron.param_offload"),
    _ns(
        F + "offload_policy", "FSDP2's CPU offload policy: actor.offload moves the actor's state around rollout instead"
    ),
    # model
    _k(MODEL + "path", "model.path", "same meaning"),
    _k(M + "dtype", "model.dtype", "bfloat16 / float32 (float16 is not supported: bfloat16 instead)"),
    _k(F + "dtype", "model.dtype", "FSDP's compute dtype: bfloat16 / float32"),
    _nn(F + "model_dtype", "the distributed optimizer keeps fp32 master weights whatever model.dtype is"),
    _k(
        OT + "recompute_granularity",
        "model.recompute",
        "full -> recompute (here: uniform, 1 layer per checkpoint); selective -> not supported (full instead)",
    ),
    _k(OT + "recompute_method", "model.recompute", "uniform (block: uniform here)"),
    _k(OT + "recompute_num_layers", "model.recompute", "1 (more: 1 here, the least memory)"),
    _k(OT + "recompute_modules", "model.recompute", "with granularity selective only (not supported)"),
    _k(
        MODEL + "enable_gradient_checkpointing",
        "model.recompute",
        "FSDP actor: full recompute; the Megatron actor ignores it in verl (no effect)",
    ),
    _k(
        OT + "moe_router_dtype",
        "model.moe_router_dtype",
        "fp32 / fp64; not set: verl's router runs in the model dtype, here fp32 (the lowest choice)",
    ),
    _k(
        OT + "moe_token_dispatcher_type",
        "model.moe_token_dispatcher",
        "alltoall / allgather; not set: alltoall (mbridge's default in verl)",
    ),
    *(_nn(OT + name, KERNEL) for name in FUSIONS),
    _ns(OT + "*", "passed to Megatron's TransformerConfig by verl; here the bridge builds that config"),
    _nn(M + "use_mbridge", "the model is always built through mbridge here"),
    _nn(M + "vanilla_mbridge", "the model is always built through mbridge here"),
    _nn(M + "use_dist_checkpointing", "checkpoints are always Megatron dist-checkpoints; the start is the HF folder"),
    _ns(M + "dist_checkpointing_path", "the run starts from the Hugging Face folder in model.path"),
    _nn(M + "seed", "initialisation comes from the checkpoint; trainer.seed seeds sampling and data order"),
    _ns(M + "override_ddp_config.*", "DDP options are chosen here (overlap, bucket sizes)"),
    _ns(M + "override_mcore_model_config.*", "the bridge builds the model config from the HF config"),
    _nn(M + "use_remove_padding", PACKED),
    _nn(MODEL + "use_remove_padding", PACKED),
    _nn(A + "use_remove_padding", PACKED),
    _nn(MODEL + "trust_remote_code", "Qwen3 / Qwen3-MoE / Qwen2 are built in (no remote code)"),
    _nn(MODEL + "use_shm", "the checkpoint is read from model.path"),
    _nn(MODEL + "use_fused_kernels", KERNEL),
    _nn(MODEL + "fused_kernel_options.*", KERNEL),
    _nn(MODEL + "use_liger", KERNEL),
    _nn(MODEL + "hf_config_path", "the config is model.path/config.json"),
    _ns(MODEL + "tokenizer_path", "the tokenizer is read from model.path"),
    _ns(MODEL + "external_lib", "the architectures are built in"),
    _ns(MODEL + "custom_chat_template", "prompts use the tokenizer's own chat template"),
    _ns(MODEL + "enable_activation_offload", "activations stay on the device (model.recompute saves their memory)"),
    _ns(MODEL + "override_config.*", "the model config is the checkpoint's config.json"),
    _k(MODEL + "lora_rank", "", "0: full fine-tuning (LoRA is not supported)"),
    _ns(MODEL + "lora.*", "LoRA is not supported: full fine-tuning"),
    _ns(MODEL + "mtp.*", "multi-token prediction is not supported"),
    _nn(A + "use_torch_compile", KERNEL),
    _nn(F + "use_torch_compile", KERNEL),
    _nn(A + "use_fused_kernels", KERNEL),
    _nn(A + "entropy_checkpointing", "log-probs and entropy come from the chunked fused head (no full logits kept)"),
    _nn(A + "entropy_from_logits_with_chunking", "log-probs and entropy come from the chunked fused head"),
    _nn(F + "entropy_checkpointing", "log-probs and entropy come from the chunked fused head"),
    _nn(F + "entropy_from_logits_with_chunking", "log-probs and entropy come from the chunked fused head"),
    _nn(F + "wrap_policy.*", "FSDP wrapping: the distributed optimizer shards by parameter buckets"),
    _nn(F + "reshard_after_forward", "FSDP only"),
    _nn(F + "forward_prefetch", "FSDP only"),
    _nn(F + "use_orig_params", "FSDP only"),
    _nn(F + "strategy", "fsdp / fsdp2: both are data parallelism here"),
    _nn(F + "seed", "initialisation comes from the checkpoint"),
    _nn(A + "calculate_entropy", "entropy is always a metric"),
    _nn(A + "checkpoint.*", "a checkpoint always holds model, optimizer and run state"),
    _nn(A + "profiler.*", "profiling is not part of a run's config"),
    _nn("global_profiler.*", "profiling is not part of a run's config"),
    _nn(A + "data_loader_seed", "trainer.seed / data.seed order the data"),
    _ns(A + "shuffle", "true: mini-batches are taken in order here"),
    _ns(A + "loss_scale_factor", "the loss is normalised by global counts (algo.agg_mode)"),
    _ns(A + "use_prefix_grouper", "not supported"),
    _ns(A + "freeze_vision_tower", "text models only"),
    # batch
    _k("data.train_batch_size", "data.prompts_per_step", "prompts per step (both count prompts)"),
    _k(
        A + "ppo_mini_batch_size",
        "algo.mini_batches",
        "prompts per mini-batch (verl multiplies it by rollout.n for "
        "samples): mini_batches = train_batch_size / ppo_mini_batch_size",
    ),
    _k(A + "ppo_epochs", "algo.ppo_epochs", "same meaning"),
    _k(
        A + "use_dynamic_bsz",
        "actor.max_tokens_per_micro_batch",
        "true: micro-batches by a token budget "
        "(ppo_max_token_len_per_gpu); false: ppo_micro_batch_size_per_gpu sequences a micro-batch",
    ),
    _k(
        A + "ppo_max_token_len_per_gpu",
        "actor.max_tokens_per_micro_batch",
        "with use_dynamic_bsz: the budget "
        "(x ulysses_sequence_parallel_size: verl's budget is the SP group's, here one device holds it)",
    ),
    _k(A + "ppo_micro_batch_size_per_gpu", "actor.parallel.micro_batch_size", "without use_dynamic_bsz"),
    _k(
        A + "ppo_micro_batch_size",
        "actor.parallel.micro_batch_size",
        "global (deprecated in verl): / data-parallel size",
    ),
    _k(
        R + "log_prob_max_token_len_per_gpu",
        "actor.max_tokens_per_forward_micro_batch",
        "forward-only passes' budget (old log-probs); not with routing replay R2",
    ),
    _k(
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor.max_tokens_per_forward_micro_batch",
        "the reference pass's budget; the larger of the two forward budgets is used",
    ),
    _k(R + "log_prob_use_dynamic_bsz", "actor.max_tokens_per_forward_micro_batch", "true: the forward budget applies"),
    _nn("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "follows the rollout's log_prob_use_dynamic_bsz"),
    _nn(
        R + "log_prob_micro_batch_size_per_gpu", "forward passes take the training micro-batches or the forward budget"
    ),
    _nn(R + "log_prob_micro_batch_size", "forward passes take the training micro-batches or the forward budget"),
    _nn("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "forward passes take the training micro-batches"),
    _nn(
        "actor_rollout_ref.ref.*",
        "the reference model is built in the actor's layout; it is on the host outside its pass with actor.offload",
    ),
    _k(R + "n", "rollout.n", "samples per prompt"),
    # loss
    _k(
        A + "policy_loss.loss_mode",
        "algo.loss",
        "vanilla -> grpo (PPO-clip), gspo -> gspo, sapo -> sapo; others are not supported (grpo instead)",
    ),
    _k(
        A + "loss_agg_mode",
        "algo.agg_mode",
        "vanilla: same meaning; gspo / sapo: no effect in verl (its loss always aggregates seq-mean-token-mean)",
    ),
    _k(
        A + "clip_ratio",
        "algo.clip_low, algo.clip_high",
        "only where clip_ratio_low / _high are null (verl's defaults of 0.2 take precedence); sapo: no effect",
    ),
    _k(A + "clip_ratio_low", "algo.clip_low", "grpo / gspo; sapo: no effect in verl (no clipping)"),
    _k(A + "clip_ratio_high", "algo.clip_high", "grpo / gspo; sapo: no effect in verl (no clipping)"),
    _k(
        A + "clip_ratio_c",
        "algo.dual_clip",
        "vanilla: always applied in verl (default 3); gspo / sapo: no effect in verl (no dual clip)",
    ),
    _k(A + "tau_pos", "algo.tau_pos", "sapo; other losses: no effect in verl"),
    _k(A + "tau_neg", "algo.tau_neg", "sapo; other losses: no effect in verl"),
    _k(A + "use_kl_loss", "algo.kl_coef", "true: kl_coef = kl_loss_coef; false: kl_coef = 0"),
    _k(A + "kl_loss_coef", "algo.kl_coef", "with use_kl_loss"),
    _k(
        A + "kl_loss_type",
        "algo.kl_type",
        "kl / k1 -> k1, mse / k2 -> k2, low_var_kl / k3 -> k3 (abs, full and "
        "the straight-through '+' forms are not supported: k3)",
    ),
    _k("algorithm.use_kl_in_reward", "", "true is not supported (KL is a loss term here: algo.kl_coef)"),
    _k("algorithm.kl_ctrl.kl_coef", "", "with use_kl_in_reward only"),
    _k("algorithm.kl_ctrl.type", "", "with use_kl_in_reward only"),
    _k("algorithm.kl_penalty", "", "with use_kl_in_reward only"),
    _nn("algorithm.kl_ctrl.*", "with use_kl_in_reward only"),
    _k(A + "entropy_coeff", "algo.entropy_coef", "same meaning"),
    _k(
        "algorithm.adv_estimator",
        "algo.adv_estimator",
        "grpo -> grpo (drgrpo without std normalisation); gae and "
        "the others are not supported (group advantages instead)",
    ),
    _k("algorithm.norm_adv_by_std_in_grpo", "algo.adv_estimator", "false -> drgrpo"),
    _nn("algorithm.gamma", "outcome rewards with group advantages: no discounting"),
    _nn("algorithm.lam", "outcome rewards with group advantages: no GAE"),
    _k("algorithm.rollout_correction.rollout_is", "algo.rollout_is", "token / sequence: same meaning"),
    _k("algorithm.rollout_correction.rollout_is_threshold", "algo.rollout_is_cap", "the weight's upper bound"),
    _ns("algorithm.rollout_correction.rollout_rs", "rejection sampling: algo.rollout_is=icepop masks instead"),
    _ns("algorithm.rollout_correction.rollout_rs_threshold", "rejection sampling is not supported"),
    _ns("algorithm.rollout_correction.bypass_mode", "the old-log-prob pass is decided by algo.old_log_prob_pass"),
    _ns("algorithm.rollout_correction.*", "not supported"),
    _ns("algorithm.use_pf_ppo", "not supported"),
    _ns("algorithm.pf_ppo.*", "not supported"),
    _k(A + "router_replay.mode", "algo.routing_replay", "disabled -> off, R2 -> r2, R3 -> r3"),
    _k(R + "enable_rollout_routing_replay", "algo.routing_replay", "with router_replay.mode R3"),
    _nn(A + "router_replay.*", "routes are recorded in memory, not in files"),
    _nn(A + "policy_loss.*", "parameters of losses that are not supported here"),
    # optimiser
    _k(A + "optim.lr", "actor.optim.lr", "same meaning"),
    _k(A + "optim.weight_decay", "actor.optim.weight_decay", "same meaning"),
    _k(A + "optim.clip_grad", "actor.optim.clip_grad", "the gradient-norm clip (Megatron actor)"),
    _k(A + "grad_clip", "actor.optim.clip_grad", "the gradient-norm clip (FSDP actor)"),
    _k(A + "optim.betas", "actor.optim.adam_beta1, actor.optim.adam_beta2", "same meaning"),
    _k(A + "optim.lr_warmup_steps", "actor.optim.warmup_steps", "same meaning (-1: from lr_warmup_steps_ratio)"),
    _k(A + "optim.lr_warmup_steps_ratio", "actor.optim.warmup_steps", "x total steps, rounded down"),
    _k(A + "optim.lr_decay_style", "actor.optim.decay_style", "constant / linear / cosine (Megatron actor)"),
    _k(A + "optim.lr_scheduler_type", "actor.optim.decay_style", "constant / cosine (FSDP actor)"),
    _k(A + "optim.warmup_style", "actor.optim.decay_style", "deprecated FSDP spelling of lr_scheduler_type"),
    _k(A + "optim.min_lr", "actor.optim.min_lr", "same meaning (Megatron actor)"),
    _k(A + "optim.min_lr_ratio", "actor.optim.min_lr", "x lr (FSDP actor)"),
    _k(A + "optim.lr_decay_steps", "actor.optim.decay_steps", "same meaning"),
    _k(A + "optim.optimizer", "", "adam / AdamW: Megatron's Adam with decoupled weight decay; others not supported"),
    _nn(A + "optim.optimizer_impl", "Megatron's optimizer"),
    _ns(A + "optim.lr_warmup_init", "warm-up starts at 0"),
    _nn(A + "optim.total_training_steps", "set by verl's trainer from trainer.total_training_steps"),
    _nn(A + "optim.num_cycles", "the cosine schedule decays once"),
    _nn(A + "optim.weight_decay_incr_style", "constant weight decay"),
    _nn(A + "optim.use_checkpoint_opt_param_scheduler", "the scheduler state is in every checkpoint"),
    _ns(A + "optim.override_optimizer_config.*", "optimizer options are the actor.optim keys"),
    _ns(A + "optim.*", "not supported"),
    # rollout
    _k(R + "name", "rollout.engine", "vllm -> vllm, hf -> embedded; sglang is not supported (vllm instead)"),
    _k(R + "tensor_model_parallel_size", "rollout.tp", "same meaning"),
    _k(R + "data_parallel_size", "", "derived here: world / rollout.tp engine replicas"),
    _k(R + "expert_parallel_size", "", "> 1 is not supported: experts are tensor-parallel inside each replica"),
    _k(R + "pipeline_model_parallel_size", "", "> 1 is not supported: each replica is TP only"),
    _k(R + "gpu_memory_utilization", "rollout.gpu_memory_utilization", "same meaning"),
    _k(R + "enforce_eager", "rollout.enforce_eager", "same meaning"),
    _k(R + "temperature", "rollout.temperature, algo.temperature", "sampling and training log-probs use it"),
    _k(R + "top_p", "rollout.top_p", "same meaning"),
    _k(R + "top_k", "rollout.top_k", "same meaning (0 or -1: off)"),
    _k(R + "do_sample", "", "false is not supported: training samples"),
    _k(R + "val_kwargs.do_sample", "", "validation here is greedy, one sample per prompt (pass@1)"),
    _k(R + "val_kwargs.temperature", "", "validation here is greedy (temperature 0)"),
    _k(R + "val_kwargs.n", "", "validation here takes one sample per prompt"),
    _k(R + "val_kwargs.top_p", "", "validation here is greedy"),
    _k(R + "val_kwargs.top_k", "", "validation here is greedy"),
    _k(R + "checkpoint_engine.update_weights_bucket_megabytes", "rollout.sync_bucket_mb", "the weight-sync bucket"),
    _nn(R + "checkpoint_engine.*", "weights go actor -> engine through the bridge, bucketed"),
    _nn(R + "mode", "the engine is colocated and runs synchronously"),
    _nn(R + "free_cache_engine", "the engine always sleeps (frees its KV cache) during training"),
    _nn(R + "calculate_log_probs", "the engine's log-probs are always kept"),
    _nn(R + "prompt_length", "data.max_prompt_len"),
    _nn(R + "response_length", "rollout.max_new_tokens"),
    _nn(R + "dtype", "the engine runs in model.dtype"),
    _nn(R + "load_format", "weights come from the actor"),
    _nn(R + "layered_summon", "weights come from the actor, bucketed"),
    _nn(R + "multi_stage_wake_up", "the engine always wakes in two phases (weights, then KV cache)"),
    _nn(R + "disable_log_stats", "engine logging"),
    _nn(R + "skip_tokenizer_init", "engine start-up detail"),
    _nn(R + "agent.*", "single-turn generation"),
    _ns(R + "enable_chunked_prefill", "vLLM's own default is used"),
    _ns(R + "max_num_batched_tokens", "vLLM's own default is used"),
    _ns(R + "max_num_seqs", "vLLM's own default is used"),
    _ns(R + "enable_prefix_caching", "vLLM's own default is used"),
    _ns(R + "max_model_len", "the engine's length is data.max_prompt_len + rollout.max_new_tokens"),
    _ns(R + "cudagraph_capture_sizes", "vLLM's own default is used"),
    _ns(R + "engine_kwargs.*", "engine options are not passed through"),
    _ns(R + "ignore_eos", "generation stops at EOS"),
    _ns(R + "over_sample_rate", "every sample of a step is generated"),
    _ns(R + "multi_turn.*", "single-turn generation"),
    _ns(R + "quantization", "the engine runs in model.dtype"),
    _ns(R + "trace.*", "not supported"),
    _ns(R + "skip_rollout", "not supported"),
    # data
    _k("data.train_files", "data.train_path", "one file (a list of several: the first)"),
    _k("data.val_files", "data.val_path", "one file (a list of several: the first)"),
    _k("data.prompt_key", "data.prompt_key", "same meaning"),
    _k("data.max_prompt_length", "data.max_prompt_len", "same meaning"),
    _k("data.max_response_length", "rollout.max_new_tokens", "same meaning"),
    _k("data.shuffle", "data.shuffle", "same meaning"),
    _k("data.seed", "data.seed", "same meaning (null: 1)"),
    _k("data.val_max_samples", "trainer.val_prompts", "> 0: same meaning"),
    _nn("data.filter_overlong_prompts", "too-long prompts are always filtered out and counted"),
    _nn("data.filter_overlong_prompts_workers", "too-long prompts are always filtered out and counted"),
    _k("data.truncation", "", "error / left / right: here a too-long prompt is dropped and counted, never cut"),
    _nn("data.return_raw_chat", "prompts are chat messages, tokenised with the chat template"),
    _nn("data.return_full_prompt", "prompts are chat messages, tokenised with the chat template"),
    _nn("data.dataloader_num_workers", "the data is read in the trainer"),
    _nn("data.val_batch_size", "validation runs trainer.val_prompts prompts at once"),
    _nn("data.tokenizer", "the tokenizer is model.path's"),
    _nn("data.use_shm", "data is read from its path"),
    _nn("data.reward_fn_key", "the reward is reward.fn for every row"),
    _nn("data.trust_remote_code", "no remote code"),
    _ns("data.train_max_samples", "the whole train file is used"),
    _ns("data.custom_cls.*", "rows in verl's layout are read by the built-in reader"),
    _ns("data.sampler.*", "the data order is a seeded shuffle"),
    _ns("data.datagen.*", "not supported"),
    _ns("data.apply_chat_template_kwargs.*", "the chat template is applied with its defaults"),
    # reward
    _k(
        "reward_model.reward_manager",
        "reward.fn",
        "naive / dapo / prime -> math (math-verify: boxed / final-answer "
        "equivalence); verl scores by data_source (DAPO-Math, GSM8K, MATH: math answers)",
    ),
    _k("reward_manager.name", "reward.fn", "as reward_model.reward_manager"),
    _nn("reward_manager.*", "the reward function is reward.fn"),
    _k("reward_model.enable", "", "true (a reward model) is not supported: rule-based rewards"),
    _k("custom_reward_function.path", "reward.fn", "not supported as a file: reward.fn takes package.module:function"),
    _k("custom_reward_function.name", "reward.fn", "with custom_reward_function.path"),
    _k(OB + "enable", "reward.overlong_buffer", "dapo reward manager: true -> the buffer below (false: 0)"),
    _k(OB + "len", "reward.overlong_buffer", "same meaning"),
    _k(OB + "penalty_factor", "reward.overlong_penalty", "same meaning"),
    _nn(OB + "log", "the reward's parts are metrics"),
    _k(
        "reward_model.reward_kwargs.max_resp_len",
        "",
        "verl measures overlong against it; here against rollout.max_new_tokens (the same when equal)",
    ),
    _nn("reward_model.launch_reward_fn_async", "rewards run in a worker process per rank"),
    _ns("reward_model.*", "reward models are not supported: rule-based rewards"),
    # trainer
    _k("trainer.total_training_steps", "trainer.steps", "same meaning"),
    _k(
        "trainer.total_epochs",
        "trainer.steps",
        "with total_training_steps: no effect; alone: not supported (the dataset size decides verl's steps)",
    ),
    _k("trainer.save_freq", "checkpoint.save_every", "-1 -> 0 (at the end only)"),
    _k("trainer.test_freq", "trainer.val_every", "-1 -> 0 (no validation)"),
    _k("trainer.val_before_train", "", "true is not supported: validation runs every trainer.val_every steps"),
    _k("trainer.logger", "trainer.wandb", "wandb in the list -> trainer.wandb; console and tensorboard are always on"),
    _k("trainer.project_name", "trainer.wandb_project", "same meaning"),
    _k("trainer.experiment_name", "trainer.run_dir", "runs/EXPERIMENT_NAME"),
    _nn("trainer.default_local_dir", "checkpoints go to trainer.run_dir"),
    _k("trainer.resume_mode", "checkpoint.resume", "auto -> auto, disable -> never, resume_path -> resume_from_path"),
    _k("trainer.resume_from_path", "checkpoint.resume", "with resume_mode=resume_path"),
    _k("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", "same meaning (null: keep all; here at least 1)"),
    _ns("trainer.log_val_generations", "validation logs its reward, not the generations"),
    _nn("trainer.balance_batch", "data-parallel shares are always balanced by tokens"),
    _nn("trainer.critic_warmup", "no critic"),
    _nn("trainer.use_legacy_worker_impl", "one implementation"),
    _nn("trainer.default_hdfs_dir", "checkpoints go to trainer.run_dir"),
    _nn("trainer.del_local_ckpt_after_load", "the last checkpoint.keep_last are kept"),
    _nn("trainer.esi_redundant_time", "checkpoints every checkpoint.save_every steps"),
    _nn("trainer.ray_wait_register_center_timeout", "launch detail (launch/)"),
    _ns("trainer.rollout_data_dir", "samples are not dumped"),
    _ns("trainer.validation_data_dir", "samples are not dumped"),
    _nn("trainer.*", "not needed"),
    _nn("critic.*", "no critic: group advantages"),
    _nn("ray_kwargs.*", "launch detail (launch/)"),
    _nn("transfer_queue.*", "step data moves through the trainer's own step-data path"),
    _nn("actor_rollout_ref.hybrid_engine", "the engine is always colocated with the actor"),
    _nn("actor_rollout_ref.nccl_timeout", "launch detail"),
)

# Keys that a script adds with '+' (not in verl's trainer configs): where verl reads them.
ADDITIONS = {
    OB + "enable": "verl's dapo reward manager (reward_kwargs.overlong_buffer_cfg)",
    OB + "len": "verl's dapo reward manager",
    OB + "penalty_factor": "verl's dapo reward manager",
    OB + "log": "verl's dapo reward manager",
    "reward_model.reward_kwargs.max_resp_len": "verl's dapo reward manager",
    **{
        OT + name: "Megatron's TransformerConfig (override_transformer_config is a free-form mapping)"
        for name in (
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "moe_router_dtype",
            "moe_token_dispatcher_type",
            *(f for f in FUSIONS if f != "attention_backend"),
        )
    },
}


def known_entry(key: str) -> Optional[Known]:
    """The entry for a key: exact, else the longest matching 'prefix.*'."""
    exact = {k.key: k for k in KNOWN}
    if key in exact:
        return exact[key]
    best = None
    for entry in KNOWN:
        if entry.key.endswith(".*") and key.startswith(entry.key[:-1]):
            if best is None or len(entry.key) > len(best.key):
                best = entry
    return best


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    import yaml

    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


# ------------------------------------------------------------------------------------------- the conversion


@dataclass
class Setting:
    value: Any
    source: str  # the verl override (or default, or rule) it came from


@dataclass
class Row:
    key: str  # as written in the script (+ / ++ kept)
    value: str
    status: Status
    target: str
    why: str


@dataclass
class Conversion:
    settings: dict[str, Setting] = field(default_factory=dict)  # dotted project key -> value and source
    rows: dict[str, Row] = field(default_factory=dict)  # by verl key
    notes: list[str] = field(default_factory=list)
    strategy: Strategy = "megatron"

    @property
    def world(self) -> int:
        return int(self.settings["trainer.nnodes"].value) * int(self.settings["trainer.nproc"].value)


class VerlRun:
    """A script's overrides over verl's defaults, for one actor strategy."""

    def __init__(self, command: HydraCommand, out: Conversion):
        self.command = command
        self.out = out
        self.overrides = command.overrides
        self.strategy: Strategy = self._strategy()
        out.strategy = self.strategy

    def _strategy(self) -> Strategy:
        given = self.overrides.get(A + "strategy")
        if given is not None:
            return "megatron" if str(given.value) == "megatron" else "fsdp"
        name = (self.command.config_name or "").removesuffix(".yaml")
        if name:
            return "megatron" if "megatron" in name else "fsdp"
        if any(k.startswith(M) for k in self.overrides):
            self.out.notes.append(
                "no --config-name: the Megatron actor's keys are set, so the Megatron actor is assumed"
            )
            return "megatron"
        return "fsdp"

    def _check_known(self, key: str) -> None:
        if known_entry(key) is None:
            raise KeyError(f"from_verl: {key} is read but not in KNOWN (add it with its rule)")

    def given(self, key: str) -> bool:
        self._check_known(key)
        o = self.overrides.get(key)
        return o is not None and o.form != "~"

    def default(self, key: str) -> Any:
        """verl's default for this actor strategy; `${oc.select:OTHER,FALLBACK}` follows OTHER."""
        self._check_known(key)
        entry = load_schema()["keys"].get(key)
        if entry is None:
            return None  # a '+' addition: absent unless the script adds it
        value = entry.get(self.strategy, entry.get("fsdp" if self.strategy == "megatron" else "megatron"))
        m = re.fullmatch(r"\$\{oc\.select:([\w.]+),(.*)\}", value) if isinstance(value, str) else None
        if m:
            other = m.group(1)
            if known_entry(other) is not None and (self.given(other) or other in load_schema()["keys"]):
                return self.get(other)
            return parse_value(m.group(2))
        return value

    def get(self, key: str) -> Any:
        """The script's value (a Hydra interpolation `${other.key}` of a known key followed), else verl's default."""
        if not self.given(key):
            return self.default(key)
        value = self.overrides[key].value
        m = re.fullmatch(r"\$\{([\w.]+)\}", value) if isinstance(value, str) else None
        if m and m.group(1) != key and known_entry(m.group(1)) is not None:
            return self.get(m.group(1))
        return value

    def as_int(self, key: str, fallback: Optional[int] = None) -> int:
        return self._number(key, int, fallback)

    def as_float(self, key: str, fallback: Optional[float] = None) -> float:
        return self._number(key, float, fallback)

    def _number(self, key: str, kind: type, fallback: Any) -> Any:
        value = self.get(key)
        if value is None or value == "":
            if fallback is not None:
                return fallback
            raise ConversionError(f"{self.source(key)}: this key needs a number; give it one in the script")
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            what = "an integer" if kind is int else "a number"
            raise ConversionError(f"{self.source(key)}: expected {what}, got {value!r}; fix it in the script") from None

    def source(self, key: str) -> str:
        if self.given(key):
            return self.overrides[key].text
        return f"{key} not set: verl's default {_show(self.default(key))}"

    def mark(self, key: str, status: Status, target: str = "", why: str = "") -> None:
        """Record what became of a key the script sets (no row for keys it leaves at verl's default)."""
        if not self.given(key):
            return
        o = self.overrides[key]
        entry = known_entry(key)
        self.out.rows[key] = Row(o.form + key, o.raw, status, target or (entry.target if entry else ""), why)

    def set(self, target: str, value: Any, *keys: str, source: Optional[str] = None) -> None:
        """Set a project key from verl keys (marked mapped), with the source comment."""
        text = source or "; ".join(self.source(k) for k in keys)
        self.out.settings[target] = Setting(value, text)
        for key in keys:
            if key not in self.out.rows:
                self.mark(key, "mapped", target)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _int(value: Any, key: str, notes: list[str]) -> Optional[int]:
    try:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(value)
    except (TypeError, ValueError):
        notes.append(f"{key} = {value!r} is not an integer: left out")
        return None


# ------------------------------------------------------------------------------------------------ the rules


def _cluster(run: VerlRun) -> None:
    run.set("trainer.nnodes", _int(run.get("trainer.nnodes"), "trainer.nnodes", run.out.notes) or 1, "trainer.nnodes")
    nproc = _int(run.get("trainer.n_gpus_per_node"), "trainer.n_gpus_per_node", run.out.notes) or 1
    run.set("trainer.nproc", nproc, "trainer.n_gpus_per_node")
    if run.given("trainer.device"):
        device = str(run.get("trainer.device"))
        if device in ("cuda", "npu", "cpu"):
            run.set("platform", device, "trainer.device")
        else:
            run.mark("trainer.device", "not supported", "platform", f"{device}: cuda / npu / cpu only (auto instead)")
            run.set("platform", "auto", source=f"trainer.device={device} is not a platform here: auto")
    else:
        run.set("platform", "auto", source="trainer.device not set: auto (the platform found at start)")


def _layout(run: VerlRun) -> None:
    if run.strategy == "megatron":
        tp = _int(run.get(M + "tensor_model_parallel_size"), "tp", run.out.notes) or 1
        run.set("actor.parallel.tp", tp, M + "tensor_model_parallel_size")
        run.set("actor.parallel.pp", run.get(M + "pipeline_model_parallel_size"), M + "pipeline_model_parallel_size")
        run.set("actor.parallel.ep", run.get(M + "expert_model_parallel_size"), M + "expert_model_parallel_size")
        run.set("actor.parallel.etp", run.get(M + "expert_tensor_parallel_size"), M + "expert_tensor_parallel_size")
        run.set("actor.parallel.cp", run.get(M + "context_parallel_size"), M + "context_parallel_size")
        if run.get(M + "virtual_pipeline_model_parallel_size") is not None:
            vpp = M + "virtual_pipeline_model_parallel_size"
            run.set("actor.parallel.virtual_pp", run.get(vpp), vpp)
        else:
            run.mark(M + "virtual_pipeline_model_parallel_size", "mapped", "actor.parallel.virtual_pp", "null: off")
        sp = _truthy(run.get(M + "sequence_parallel")) and tp > 1
        run.set("actor.parallel.sequence_parallel", sp, M + "sequence_parallel")
        for side in ("first", "last"):
            key = OT + f"num_layers_in_{side}_pipeline_stage"
            if run.given(key):
                run.set(f"actor.parallel.num_layers_in_{side}_stage", run.get(key), key)
        dist = M + "use_distributed_optimizer"
        run.set("actor.optim.use_distributed_optimizer", _truthy(run.get(dist)), dist)
        run.mark(A + "strategy", "mapped", "actor.parallel", "megatron")
        return
    # FSDP: every device holds a shard of everything -> data parallelism over the world, optimizer state sharded
    source = f"{run.source(A + 'strategy')} (FSDP): data parallelism over the world"
    for dim in ("tp", "pp", "ep"):
        run.set(f"actor.parallel.{dim}", 1, source=source)
    run.set("actor.optim.use_distributed_optimizer", True, source=f"{source}; FSDP shards the optimizer state")
    run.mark(A + "strategy", "mapped", "actor.parallel", "FSDP -> data parallelism over the world (tp = pp = ep = 1)")
    for key in (F + "ulysses_sequence_parallel_size", A + "ulysses_sequence_parallel_size"):
        sp = run.as_int(key, 1)
        if sp > 1:
            run.mark(
                key,
                "not supported",
                "",
                (
                    f"Ulysses sequence parallelism {sp}: context parallelism is this project's way to split sequences "
                    f"and is refused today; instead every device holds whole sequences (DP over the world) and takes "
                    f"the SP group's token budget (ppo_max_token_len_per_gpu x {sp})"
                ),
            )
        else:
            run.mark(key, "not needed", "", "1: no sequence parallelism")
    size = run.get(F + "fsdp_size")
    if size in (-1, None):
        run.mark(F + "fsdp_size", "not needed", "", "-1: one sharding group over all devices")
    else:
        run.mark(F + "fsdp_size", "not supported", "", f"{size}: hybrid sharding; here one group over all DP ranks")


def ulysses(run: VerlRun) -> int:
    if run.strategy != "fsdp":
        return 1
    key = A + "ulysses_sequence_parallel_size"
    if not run.given(key):
        key = F + "ulysses_sequence_parallel_size"
    return max(1, run.as_int(key, 1))


def _offload(run: VerlRun) -> None:
    keys = (
        (M + "param_offload", M + "grad_offload", M + "optimizer_offload")
        if run.strategy == "megatron"
        else (F + "param_offload", F + "optimizer_offload")
    )
    on = [k for k in keys if _truthy(run.get(k))]
    given = [k for k in keys if run.given(k)]
    run.set(
        "actor.offload",
        bool(on),
        *given,
        source="; ".join(run.source(k) for k in (given or keys[:1]))
        + (
            " - verl moves them to the host whenever they are not in use; here actor.offload moves parameters, "
            "gradients and optimizer state to the host around rollout"
            if on
            else ""
        ),
    )
    other = (
        (F + "param_offload", F + "optimizer_offload")
        if run.strategy == "megatron"
        else (M + "param_offload", M + "grad_offload", M + "optimizer_offload")
    )
    for key in other:
        run.mark(key, "no effect in verl", "", f"the {run.strategy} actor does not read it")


def _model(run: VerlRun) -> None:
    run.set("model.path", run.get(MODEL + "path"), MODEL + "path")
    dkey = M + "dtype" if run.strategy == "megatron" else F + "dtype"
    dtype = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}.get(
        str(run.get(dkey))
    )
    if dtype is None:
        run.mark(dkey, "not supported", "model.dtype", f"{run.get(dkey)}: bfloat16 instead (float16 fails in Megatron)")
        dtype = "bfloat16"
    run.set("model.dtype", dtype, dkey)
    if run.strategy == "megatron":
        _megatron_recompute(run)
        run.mark(
            MODEL + "enable_gradient_checkpointing",
            "no effect in verl",
            "",
            "the Megatron actor recomputes per override_transformer_config.recompute_*",
        )
        key = OT + "moe_router_dtype"
        if run.given(key) and str(run.get(key)) in ("fp32", "fp64"):
            run.set("model.moe_router_dtype", str(run.get(key)), key)
        elif run.given(key):
            run.mark(key, "not supported", "model.moe_router_dtype", f"{run.get(key)}: fp32 instead (fp32 / fp64)")
            run.set("model.moe_router_dtype", "fp32", source=f"{run.source(key)}: fp32 instead")
        else:
            run.set(
                "model.moe_router_dtype",
                "fp32",
                source=(f"{key} not set: verl's MoE router runs in the model dtype; fp32 here (choices fp32 / fp64)"),
            )
        key = OT + "moe_token_dispatcher_type"
        value = str(run.get(key)) if run.given(key) else "alltoall"
        if value not in ("alltoall", "allgather"):
            run.mark(key, "not supported", "model.moe_token_dispatcher", f"{value}: alltoall instead")
            value = "alltoall"
        run.set(
            "model.moe_token_dispatcher",
            value,
            key,
            source=None if run.given(key) else (f"{key} not set: alltoall (mbridge's default in verl)"),
        )
    else:
        key = MODEL + "enable_gradient_checkpointing"
        run.set("model.recompute", _truthy(run.get(key)), key)


def _megatron_recompute(run: VerlRun) -> None:
    keys = [OT + k for k in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")]
    granularity = run.get(keys[0])
    given = [k for k in keys if run.given(k)]
    if granularity in (None, "null", "none", ""):
        run.set("model.recompute", False, *given, source=f"{run.source(keys[0])}: no recompute")
        for k in keys[1:]:
            run.mark(k, "no effect in verl", "", "recompute_granularity is not set")
        return
    if granularity == "selective":
        run.mark(
            keys[0],
            "not supported",
            "model.recompute",
            "selective recompute: here recompute is full (uniform, 1 layer) or off; full instead",
        )
        run.set(
            "model.recompute", True, source=f"{run.source(keys[0])}: full recompute instead (selective is not here)"
        )
        return
    run.set("model.recompute", True, *given)
    method, layers = run.get(keys[1]), run.get(keys[2])
    if method not in (None, "uniform"):
        run.mark(keys[1], "mapped", "model.recompute", f"{method}: uniform here (every layer recomputed)")
    if layers not in (None, 1):
        run.mark(keys[2], "mapped", "model.recompute", f"{layers}: 1 here (the least memory)")


def _batch(run: VerlRun) -> None:
    notes = run.out.notes
    prompts = _int(run.get("data.train_batch_size"), "data.train_batch_size", notes) or 1
    run.set("data.prompts_per_step", prompts, "data.train_batch_size")
    mini = _int(run.get(A + "ppo_mini_batch_size"), "ppo_mini_batch_size", notes) or prompts
    key = A + "ppo_mini_batch_size"
    rule = f"{prompts} prompts / {mini} prompts per mini-batch (verl counts prompts, x rollout.n samples)"
    if mini <= 0 or prompts % mini:
        count = max(1, math.ceil(prompts / max(mini, 1)))
        run.mark(
            key,
            "not supported",
            "algo.mini_batches",
            f"{rule} is not whole: verl's last mini-batch is smaller; {count} equal mini-batches here",
        )
        run.set("algo.mini_batches", count, source=f"{run.source(key)}: {rule}, rounded up")
    else:
        run.set("algo.mini_batches", prompts // mini, key, source=f"{run.source(key)}: {rule}")
    run.set("algo.ppo_epochs", run.get(A + "ppo_epochs"), A + "ppo_epochs")
    run.set("rollout.n", run.get(R + "n"), R + "n")
    _micro_batches(run)


def _micro_batches(run: VerlRun) -> None:
    dyn_key, budget_key = A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu"
    sp = ulysses(run)
    if _truthy(run.get(dyn_key)):
        budget = run.as_int(budget_key) * sp
        rule = f" x ulysses {sp} (the SP group's budget, on one device here)" if sp > 1 else ""
        run.set(
            "actor.max_tokens_per_micro_batch",
            budget,
            dyn_key,
            budget_key,
            source=f"{run.source(dyn_key)}; {run.source(budget_key)}{rule}",
        )
        for key in (A + "ppo_micro_batch_size_per_gpu", A + "ppo_micro_batch_size"):
            run.mark(key, "no effect in verl", "", "use_dynamic_bsz: micro-batches by tokens")
        forward = _forward_budget(run, sp)
        if forward is not None and forward.value > budget:
            run.out.settings["actor.max_tokens_per_forward_micro_batch"] = forward
        return
    run.mark(budget_key, "no effect in verl", "", "use_dynamic_bsz is false")
    key = A + "ppo_micro_batch_size_per_gpu"
    run.set("actor.max_tokens_per_micro_batch", None, dyn_key, source=f"{run.source(dyn_key)}: sequences a micro-batch")
    if run.get(key) is None and run.given(A + "ppo_micro_batch_size"):
        key = A + "ppo_micro_batch_size"
        dp = max(1, run.out.world // _model_parallel(run))
        per_gpu = max(1, run.as_int(key) // dp)
        run.set("actor.parallel.micro_batch_size", per_gpu, key, source=f"{run.source(key)} / dp {dp} (global in verl)")
        return
    run.set("actor.parallel.micro_batch_size", run.as_int(key, 1), key)


def _model_parallel(run: VerlRun) -> int:
    """tp x pp x cp of the actor as converted so far (the data-parallel size is world / this)."""
    size = 1
    for dim in ("tp", "pp", "cp"):
        setting = run.out.settings.get(f"actor.parallel.{dim}")
        size *= int(setting.value) if setting and setting.value else 1
    return size


def _forward_budget(run: VerlRun, sp: int) -> Optional[Setting]:
    keys = (R + "log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")
    given = [k for k in keys if run.given(k)]
    use_key = R + "log_prob_use_dynamic_bsz"
    if not given or (run.given(use_key) and not _truthy(run.get(use_key))):
        for k in given:
            run.mark(k, "no effect in verl", "", "log_prob_use_dynamic_bsz is false")
        return None
    value = max(run.as_int(k) for k in given) * sp
    for k in given:
        run.mark(k, "mapped", "actor.max_tokens_per_forward_micro_batch")
    run.mark(use_key, "mapped", "actor.max_tokens_per_forward_micro_batch")
    return Setting(
        value,
        "; ".join(run.source(k) for k in given)
        + (f" x ulysses {sp}" if sp > 1 else "")
        + " (the larger forward budget)",
    )


def _loss(run: VerlRun) -> None:
    mode_key = A + "policy_loss.loss_mode"
    mode = str(run.get(mode_key))
    loss = {"vanilla": "grpo", "gspo": "gspo", "sapo": "sapo"}.get(mode)
    if loss is None:
        run.mark(mode_key, "not supported", "algo.loss", f"{mode}: grpo (PPO-clip) instead")
        run.set("algo.loss", "grpo", source=f"{run.source(mode_key)} is not supported: grpo instead")
        loss = "grpo"
    else:
        run.set("algo.loss", loss, mode_key, source=f"{run.source(mode_key)} -> {loss}")
    agg_key = A + "loss_agg_mode"
    if loss == "grpo":
        agg = str(run.get(agg_key))
        if agg not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            run.mark(agg_key, "not supported", "algo.agg_mode", f"{agg}: token-mean instead")
            agg = "token-mean"
        run.set("algo.agg_mode", agg, agg_key)
    else:
        run.mark(
            agg_key, "no effect in verl", "algo.agg_mode", f"verl's {mode} loss always aggregates seq-mean-token-mean"
        )
        run.set(
            "algo.agg_mode",
            "seq-mean-token-mean",
            source=(
                f"verl's {mode} loss always aggregates seq-mean-token-mean"
                + (f" ({run.overrides[agg_key].text} has no effect there)" if run.given(agg_key) else "")
            ),
        )
    _clips(run, loss, mode)
    for key, target in ((A + "tau_pos", "algo.tau_pos"), (A + "tau_neg", "algo.tau_neg")):
        if loss == "sapo":
            run.set(target, run.as_float(key), key)
        else:
            run.mark(key, "no effect in verl", target, f"read by the sapo loss only ({mode} here)")
    run.set("algo.entropy_coef", run.as_float(A + "entropy_coeff", 0.0), A + "entropy_coeff")
    _kl(run)
    _advantages(run)
    _rollout_correction(run)
    _routing_replay(run)


def _clips(run: VerlRun, loss: str, mode: str) -> None:
    ratio, low_key, high_key, c_key = (
        A + k for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    )
    if loss == "sapo":
        for key in (ratio, low_key, high_key, c_key):
            run.mark(key, "no effect in verl", "", "the sapo loss has no clipping (a soft gate)")
        return
    # verl: clip_ratio_low / _high when not null (their defaults are 0.2), else clip_ratio
    low_src = low_key if run.get(low_key) is not None else ratio
    high_src = high_key if run.get(high_key) is not None else ratio
    run.set("algo.clip_low", run.as_float(low_src), low_src)
    run.set("algo.clip_high", run.as_float(high_src), high_src)
    if ratio not in (low_src, high_src):
        run.mark(ratio, "no effect in verl", "", "clip_ratio_low / clip_ratio_high are set (verl's defaults are 0.2)")
    if loss == "grpo":
        run.set(
            "algo.dual_clip",
            run.as_float(c_key),
            c_key,
            source=(f"{run.source(c_key)} - verl's vanilla loss always applies the dual clip"),
        )
    else:
        run.mark(c_key, "no effect in verl", "algo.dual_clip", f"verl's {mode} loss has no dual clip")
        run.set(
            "algo.dual_clip",
            None,
            source=f"verl's {mode} loss has no dual clip"
            + (f" ({run.overrides[c_key].text} has no effect there)" if run.given(c_key) else ""),
        )


def _kl(run: VerlRun) -> None:
    use, coef, kind = A + "use_kl_loss", A + "kl_loss_coef", A + "kl_loss_type"
    if _truthy(run.get(use)):
        run.set("algo.kl_coef", run.as_float(coef), use, coef)
        name = str(run.get(kind))
        kl = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}.get(name)
        if kl is None:
            run.mark(kind, "not supported", "algo.kl_type", f"{name}: k3 (low_var_kl) instead")
            kl = "k3"
        run.set("algo.kl_type", kl, kind, source=f"{run.source(kind)} -> {kl}")
    else:
        run.set("algo.kl_coef", 0.0, use, source=f"{run.source(use)}: no KL term")
        for key in (coef, kind):
            run.mark(key, "no effect in verl", "", "use_kl_loss is false")
    in_reward = "algorithm.use_kl_in_reward"
    if _truthy(run.get(in_reward)):
        run.mark(
            in_reward,
            "not supported",
            "",
            "KL in the reward: here KL is a loss term (algo.kl_coef); no KL penalty in the reward instead",
        )
        for key in ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type", "algorithm.kl_penalty"):
            run.mark(key, "not supported", "", "KL in the reward is not supported")
    else:
        run.mark(in_reward, "mapped", "", "false: no KL in the reward (none here either)")
        for key in ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type", "algorithm.kl_penalty"):
            run.mark(key, "no effect in verl", "", "use_kl_in_reward is false")


def _advantages(run: VerlRun) -> None:
    key, norm = "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"
    estimator = str(run.get(key))
    if estimator == "grpo":
        value = "grpo" if _truthy(run.get(norm)) else "drgrpo"
        run.set("algo.adv_estimator", value, key, *([norm] if run.given(norm) else []))
        return
    run.mark(
        key,
        "not supported",
        "algo.adv_estimator",
        f"{estimator}: group advantages (grpo) instead"
        + (" - gae needs a critic, which this project does not train" if estimator == "gae" else ""),
    )
    run.set("algo.adv_estimator", "grpo", source=f"{run.source(key)} is not supported: grpo instead")
    if not run.given(key):
        run.out.notes.append(f"{key} is not set: verl's default {estimator} is not supported here; grpo instead")
    run.mark(norm, "no effect in verl", "", "adv_estimator is not grpo")


def _rollout_correction(run: VerlRun) -> None:
    key, cap = "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"
    mode = run.get(key)
    if mode in (None, "null", "none"):
        run.mark(key, "mapped", "algo.rollout_is", "null: off")
        run.mark(cap, "no effect in verl", "", "rollout_is is off")
        return
    if mode not in ("token", "sequence"):
        run.mark(key, "not supported", "algo.rollout_is", f"{mode}: off instead")
        return
    run.set("algo.rollout_is", mode, key)
    run.set("algo.rollout_is_cap", run.as_float(cap), cap)


def _routing_replay(run: VerlRun) -> None:
    key, r3 = A + "router_replay.mode", R + "enable_rollout_routing_replay"
    mode = str(run.get(key) or "disabled")
    value = {"disabled": None, "R2": "r2", "R3": "r3"}.get(mode, "invalid")
    if value == "invalid":
        run.mark(key, "not supported", "algo.routing_replay", f"{mode}: off instead (disabled / R2 / R3)")
        value = None
    if value is not None or run.given(key):
        run.set("algo.routing_replay", value, key, source=f"{run.source(key)} -> {_show(value)}")
    if run.given(r3):
        run.mark(
            r3,
            "mapped",
            "algo.routing_replay",
            "the engine returns its routes for R3 by itself" if value == "r3" else "used by R3 only",
        )


def _optim(run: VerlRun) -> None:
    lr = run.as_float(A + "optim.lr")
    run.set("actor.optim.lr", lr, A + "optim.lr")
    run.set("actor.optim.weight_decay", run.as_float(A + "optim.weight_decay"), A + "optim.weight_decay")
    clip_key = A + "optim.clip_grad" if run.strategy == "megatron" else A + "grad_clip"
    run.set("actor.optim.clip_grad", run.as_float(clip_key), clip_key)
    other = A + "grad_clip" if run.strategy == "megatron" else A + "optim.clip_grad"
    run.mark(other, "no effect in verl", "", f"the {run.strategy} actor clips by {clip_key.split('.')[-1]}")
    betas = run.get(A + "optim.betas")
    if isinstance(betas, list) and len(betas) == 2:
        try:
            beta1, beta2 = float(betas[0]), float(betas[1])
        except (TypeError, ValueError):
            raise ConversionError(f"{run.source(A + 'optim.betas')}: expected two numbers") from None
        run.set("actor.optim.adam_beta1", beta1, A + "optim.betas")
        run.set("actor.optim.adam_beta2", beta2, A + "optim.betas")
    name = str(run.get(A + "optim.optimizer"))
    if name.lower() in ("adam", "adamw"):
        run.mark(A + "optim.optimizer", "mapped", "", "Megatron's Adam with decoupled weight decay (AdamW)")
    else:
        run.mark(A + "optim.optimizer", "not supported", "", f"{name}: Adam (decoupled weight decay) instead")
    _schedule(run, lr)


def _schedule(run: VerlRun, lr: float) -> None:
    steps_key, ratio_key = A + "optim.lr_warmup_steps", A + "optim.lr_warmup_steps_ratio"
    steps = run.as_int(steps_key, -1)
    if steps >= 0:
        run.set("actor.optim.warmup_steps", steps, steps_key)
        run.mark(ratio_key, "no effect in verl", "", "lr_warmup_steps is set")
    else:
        total = run.out.settings.get("trainer.steps")
        ratio = run.as_float(ratio_key, 0.0)
        warm = int(ratio * total.value) if total and total.value else 0
        run.set(
            "actor.optim.warmup_steps",
            warm,
            ratio_key,
            source=(f"{run.source(ratio_key)} x {total.value if total else '?'} steps (lr_warmup_steps -1)"),
        )
        run.mark(steps_key, "mapped", "actor.optim.warmup_steps", "-1: from lr_warmup_steps_ratio")
    if run.strategy == "megatron":
        key = A + "optim.lr_decay_style"
        style = str(run.get(key))
        run.set("actor.optim.min_lr", run.as_float(A + "optim.min_lr", 0.0), A + "optim.min_lr")
    else:
        key = A + "optim.lr_scheduler_type"
        if run.given(A + "optim.warmup_style") and not run.given(key):
            key = A + "optim.warmup_style"
        style = str(run.get(key))
        ratio = run.as_float(A + "optim.min_lr_ratio", 0.0)
        run.set(
            "actor.optim.min_lr",
            ratio * lr,
            A + "optim.min_lr_ratio",
            source=(f"{run.source(A + 'optim.min_lr_ratio')} x lr"),
        )
    if style not in ("constant", "linear", "cosine"):
        run.mark(key, "not supported", "actor.optim.decay_style", f"{style}: constant instead")
        style = "constant"
    run.set("actor.optim.decay_style", style, key)
    if run.given(A + "optim.lr_decay_steps") and run.get(A + "optim.lr_decay_steps") is not None:
        run.set("actor.optim.decay_steps", run.as_int(A + "optim.lr_decay_steps"), A + "optim.lr_decay_steps")


def _rollout(run: VerlRun) -> None:
    name = str(run.get(R + "name"))
    engine = {"vllm": "vllm", "hf": "embedded"}.get(name)
    if not run.given(R + "name"):
        run.set("rollout.engine", "vllm", source=f"{R}name not set (verl requires it): vllm")
    elif engine is None:
        run.mark(R + "name", "not supported", "rollout.engine", f"{name}: vllm instead")
        run.set("rollout.engine", "vllm", source=f"{run.source(R + 'name')} is not supported: vllm instead")
    else:
        run.set("rollout.engine", engine, R + "name")
    tp = _int(run.get(R + "tensor_model_parallel_size"), "rollout tp", run.out.notes) or 1
    run.set("rollout.tp", tp, R + "tensor_model_parallel_size")
    dp = run.as_int(R + "data_parallel_size", 1)
    world = run.out.world
    why = f"{tp} x {dp}: here world {world} / rollout.tp {tp} = {world // max(tp, 1)} replicas"
    run.mark(R + "data_parallel_size", "mapped", "", why)
    for key, what in (
        (R + "expert_parallel_size", "experts are tensor-parallel in each replica"),
        (R + "pipeline_model_parallel_size", "each replica is tensor-parallel only"),
    ):
        size = run.as_int(key, 1)
        run.mark(key, "mapped" if size == 1 else "not supported", "", "1" if size == 1 else f"{size}: {what}")
    run.set("rollout.gpu_memory_utilization", run.as_float(R + "gpu_memory_utilization"), R + "gpu_memory_utilization")
    run.set("rollout.enforce_eager", _truthy(run.get(R + "enforce_eager")), R + "enforce_eager")
    temperature = run.as_float(R + "temperature")
    run.set("rollout.temperature", temperature, R + "temperature")
    run.set("algo.temperature", temperature, R + "temperature")
    run.set("rollout.top_p", run.as_float(R + "top_p"), R + "top_p")
    top_k = run.as_int(R + "top_k")
    run.set("rollout.top_k", -1 if top_k <= 0 else top_k, R + "top_k")
    if not _truthy(run.get(R + "do_sample")):
        run.mark(R + "do_sample", "not supported", "", "false: training samples here")
    else:
        run.mark(R + "do_sample", "mapped", "", "true: sampling")
    _validation_sampling(run)
    bucket = R + "checkpoint_engine.update_weights_bucket_megabytes"
    if run.given(bucket):
        run.set("rollout.sync_bucket_mb", run.as_float(bucket), bucket)


def _validation_sampling(run: VerlRun) -> None:
    keys = [R + f"val_kwargs.{k}" for k in ("do_sample", "temperature", "n", "top_p", "top_k")]
    greedy = not _truthy(run.get(keys[0])) or run.as_float(keys[1], 0) == 0
    one = run.as_int(keys[2], 1) == 1
    for key in keys:
        if greedy and one:
            run.mark(key, "not needed", "", "validation here is greedy pass@1, as these settings")
        else:
            run.mark(
                key, "not supported", "", "validation here is greedy pass@1 (one greedy sample per prompt), not sampled"
            )


def _one_file(run: VerlRun, key: str, target: str) -> None:
    value = run.get(key)
    if isinstance(value, list):
        if len(value) > 1:
            run.mark(key, "not supported", target, f"{len(value)} files: the first only ({value[0]})")
        value = value[0] if value else ""
    run.set(target, str(value or ""), key)


def _data(run: VerlRun) -> None:
    _one_file(run, "data.train_files", "data.train_path")
    _one_file(run, "data.val_files", "data.val_path")
    run.set("data.prompt_key", str(run.get("data.prompt_key")), "data.prompt_key")
    run.set("data.max_prompt_len", run.as_int("data.max_prompt_length"), "data.max_prompt_length")
    run.set("rollout.max_new_tokens", run.as_int("data.max_response_length"), "data.max_response_length")
    run.set("data.shuffle", _truthy(run.get("data.shuffle")), "data.shuffle")
    if run.get("data.seed") is not None:
        run.set("data.seed", run.as_int("data.seed"), "data.seed")
    samples = run.as_int("data.val_max_samples", -1)
    if samples > 0:
        run.set("trainer.val_prompts", samples, "data.val_max_samples")
    else:
        run.mark(
            "data.val_max_samples",
            "not supported",
            "trainer.val_prompts",
            "-1 (all): validation here takes trainer.val_prompts prompts",
        )
    trunc = str(run.get("data.truncation"))
    run.mark(
        "data.truncation",
        "not needed" if trunc == "error" else "not supported",
        "",
        (
            "error: too-long prompts are dropped and counted here (verl stops)"
            if trunc == "error"
            else f"{trunc}: here a too-long prompt is dropped and counted, never cut"
        ),
    )


def _reward(run: VerlRun) -> None:
    manager_key = "reward_model.reward_manager"
    if run.given("reward_manager.name") and not run.given(manager_key):
        manager_key = "reward_manager.name"
    manager = str(run.get(manager_key))
    if manager in ("naive", "dapo", "prime"):
        run.set(
            "reward.fn",
            "math",
            manager_key,
            source=(
                f"{run.source(manager_key)}: verl scores by data_source (math answers for DAPO-Math / GSM8K / MATH); "
                f"math here (math-verify)"
            ),
        )
    else:
        run.mark(manager_key, "not supported", "reward.fn", f"{manager}: math instead")
        run.set("reward.fn", "math", source=f"{run.source(manager_key)} is not supported: math instead")
    if _truthy(run.get("reward_model.enable")):
        run.mark("reward_model.enable", "not supported", "", "a reward model: rule-based reward.fn instead")
    else:
        run.mark("reward_model.enable", "not needed", "", "false: rule-based rewards")
    path = run.get("custom_reward_function.path")
    if path:
        name = run.get("custom_reward_function.name")
        why = (
            f"{path}: reward.fn takes package.module:function - make the file importable and set "
            f"reward.fn=MODULE:{name}; math meanwhile"
        )
        run.mark("custom_reward_function.path", "not supported", "reward.fn", why)
        run.mark("custom_reward_function.name", "not supported", "reward.fn", "with custom_reward_function.path")
    else:
        run.mark("custom_reward_function.name", "no effect in verl", "", "custom_reward_function.path is not set")
    _overlong(run, manager)


def _overlong(run: VerlRun, manager: str) -> None:
    enable, length, factor = OB + "enable", OB + "len", OB + "penalty_factor"
    max_resp = "reward_model.reward_kwargs.max_resp_len"
    keys = (enable, length, factor, max_resp)
    if manager != "dapo":
        for key in keys:
            run.mark(key, "no effect in verl", "", f"read by the dapo reward manager only ({manager} here)")
        run.set("reward.overlong_buffer", 0, source=f"{run.source('reward_model.reward_manager')}: no overlong penalty")
        return
    if not _truthy(run.get(enable)):
        run.set("reward.overlong_buffer", 0, enable, source=f"{run.source(enable)}: no overlong penalty")
        for key in (length, factor, max_resp):
            run.mark(key, "no effect in verl", "", "overlong_buffer_cfg.enable is false")
        return
    buffer = run.as_int(length, 0)
    if buffer <= 0:
        run.mark(enable, "not supported", "reward.overlong_buffer", "enabled without overlong_buffer_cfg.len: off")
        run.set("reward.overlong_buffer", 0, source=f"{run.source(enable)} without a length: off")
        return
    run.set("reward.overlong_buffer", buffer, enable, length)
    run.set("reward.overlong_penalty", run.as_float(factor, 1.0), factor)
    response = run.as_int("data.max_response_length")
    if run.given(max_resp):
        same = run.as_int(max_resp) == response
        run.mark(
            max_resp,
            "mapped" if same else "not supported",
            "",
            (
                "= data.max_response_length (overlong is measured against rollout.max_new_tokens here)"
                if same
                else f"{run.get(max_resp)} != data.max_response_length {response}: here the penalty is measured against "
                f"rollout.max_new_tokens"
            ),
        )


def _trainer(run: VerlRun) -> None:
    steps_key, epochs_key = "trainer.total_training_steps", "trainer.total_epochs"
    steps = run.as_int(steps_key, -1)
    if steps >= 0:
        run.set("trainer.steps", steps, steps_key)
        run.mark(epochs_key, "not needed", "", "total_training_steps decides the steps")
    else:
        run.mark(
            epochs_key,
            "not supported",
            "trainer.steps",
            "verl's steps = epochs x (dataset rows / "
            "train_batch_size); the dataset is not read here: set trainer.steps",
        )
        run.out.notes.append("trainer.total_training_steps is not set: trainer.steps stays at 100; set it by hand")
    save = run.as_int("trainer.save_freq")
    run.set("checkpoint.save_every", max(save, 0), "trainer.save_freq")
    test = run.as_int("trainer.test_freq")
    run.set("trainer.val_every", max(test, 0), "trainer.test_freq")
    if _truthy(run.get("trainer.val_before_train")):
        run.mark(
            "trainer.val_before_train",
            "not supported",
            "",
            "true: validation here runs every trainer.val_every steps, the first after step val_every",
        )
    else:
        run.mark("trainer.val_before_train", "mapped", "", "false: none before step 1 (none here either)")
    logger = run.get("trainer.logger")
    loggers = logger if isinstance(logger, list) else [logger]
    run.set("trainer.wandb", "wandb" in [str(x) for x in loggers], "trainer.logger")
    if run.given("trainer.project_name"):
        run.set("trainer.wandb_project", str(run.get("trainer.project_name")), "trainer.project_name")
    name = run.get("trainer.experiment_name")
    run.set("trainer.run_dir", f"runs/{name}", "trainer.experiment_name")
    mode = str(run.get("trainer.resume_mode"))
    if mode == "resume_path":
        run.set(
            "checkpoint.resume",
            str(run.get("trainer.resume_from_path")),
            "trainer.resume_mode",
            "trainer.resume_from_path",
        )
    elif mode in ("auto", "disable"):
        run.set("checkpoint.resume", "auto" if mode == "auto" else "never", "trainer.resume_mode")
        run.mark("trainer.resume_from_path", "no effect in verl", "", f"resume_mode={mode}")
    else:
        run.mark("trainer.resume_mode", "not supported", "checkpoint.resume", f"{mode}: auto instead")
    keep = run.as_int("trainer.max_actor_ckpt_to_keep", 0)
    if keep >= 1:
        run.set("checkpoint.keep_last", keep, "trainer.max_actor_ckpt_to_keep")
    elif run.given("trainer.max_actor_ckpt_to_keep"):
        run.mark(
            "trainer.max_actor_ckpt_to_keep",
            "not supported",
            "checkpoint.keep_last",
            f"{keep}: keep-all is not a choice here; checkpoint.keep_last 2",
        )


RULES: tuple[Callable[[VerlRun], None], ...] = (
    _cluster,
    _trainer,
    _layout,
    _offload,
    _model,
    _batch,
    _loss,
    _optim,
    _rollout,
    _data,
    _reward,
)


def convert(command: HydraCommand) -> Conversion:
    """All rules over the script's overrides; every key the script sets gets a row."""
    out = Conversion()
    run = VerlRun(command, out)
    for rule in RULES:
        rule(run)
    for key, o in command.overrides.items():
        if key in out.rows:
            continue
        entry = known_entry(key)
        if o.form == "~":
            out.rows[key] = Row(o.text, "", "not supported", "", "deleting a key: verl's default stays")
        elif entry is None:
            out.rows[key] = Row(o.form + key, o.raw, "unknown", "", "not a key this converter knows: not carried over")
        elif entry.status is not None:
            out.rows[key] = Row(o.form + key, o.raw, entry.status, entry.target, entry.rule)
        else:  # a key the rules read only in some cases (e.g. SAPO's taus with GSPO) and did not here
            out.rows[key] = Row(o.form + key, o.raw, "no effect in verl", entry.target, entry.rule)
    for word in command.other_args:
        out.rows[word] = Row(word, "", "unknown", "", "not a Hydra override (key=value): not carried over")
    for key in command.repeated:
        out.notes.append(f"{key} is given more than once: the last value is used")
    return out


def doc_table() -> str:
    """The mapping table of docs/from-verl.md, from `KNOWN` (tests/test_from_verl.py keeps the doc equal to it)."""
    short = {A: "A.", M: "M.", F: "F.", OT: "OT.", R: "R.", MODEL: "MODEL.", OB: "OB."}
    lines = ["| verl key | here | rule |", "|---|---|---|"]
    for entry in KNOWN:
        key = entry.key
        for prefix in sorted(short, key=len, reverse=True):
            if key.startswith(prefix):
                key = short[prefix] + key[len(prefix) :]
                break
        here = entry.target or "-"
        rule = entry.rule if entry.status is None else f"{entry.status}: {entry.rule}"
        lines.append(f"| `{key}` | {here} | {rule.replace('|', '/')} |")
    return "\n".join(lines)
