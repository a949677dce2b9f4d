"""verl's keys: the table every key of a script lands in, verl's defaults, and the docs' table.

Every verl key the converter knows is in `KNOWN` (mapped by the rules, or not needed / not supported here
with the reason); its verl default is read from `verl_schema.yaml` (the keys the rules rely on, as verl's
generated trainer configs list them). What verl ignores (GSPO / SAPO's `loss_agg_mode`, GSPO's
`clip_ratio_c`, ...) is listed as "no effect in verl" and the preset gets what ran.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

Status = Literal["mapped", "not needed", "not supported", "no effect in verl", "unknown"]
STATUSES: tuple[Status, ...] = ("mapped", "not needed", "not supported", "no effect in verl", "unknown")

SCHEMA_PATH = Path(__file__).with_name("verl_schema.yaml")

A = "actor_rollout_ref.actor."
M = A + "megatron."
F = A + "fsdp_config."
OT = M + "override_transformer_config."
R = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."
OB = "reward_model.reward_kwargs.overlong_buffer_cfg."


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
