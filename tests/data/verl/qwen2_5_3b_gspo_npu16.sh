#!/usr/bin/env bash
# A verl-style version of the Qwen2.5-3B-Instruct GSPO reference run, written for mcore-rl's tests: one node of
# 16 Ascend NPUs (64 GB each), an FSDP actor with Ulysses sequence parallelism 4, sequence-ratio clip 3e-4 / 4e-4,
# 512 prompts per step in mini-batches of 128, n 16, prompts <= 2048 / responses <= 8192 tokens, no overlong
# buffer, lr 1e-6, no KL, 500 steps. Settings the run's record does not give follow
# configs/qwen2_5_3b/npu8_gspo.yaml.
set -xeuo pipefail

export GPUS_PER_NODE=16
NNODES=1

loss_mode=gspo
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
enable_overlong_buffer=false
sp_size=4
# verl's dynamic batching budget is per device of the Ulysses group: the group holds 4 x this
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) / sp_size))
offload=false  # a small model

train_files="['data/dapo-math-17k.parquet']"
test_files="['data/aime-2024.parquet']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=${loss_mode} \
    actor_rollout_ref.actor.loss_agg_mode="seq-mean-token-mean" \
    data.train_files="${train_files}" \
    data.val_files="${test_files}" \
    data.filter_overlong_prompts=true \
    data.train_batch_size=512 \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    actor_rollout_ref.rollout.n=16 \
    algorithm.use_kl_in_reward=false \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.clip_ratio_low=0.0003 \
    actor_rollout_ref.actor.clip_ratio_high=0.0004 \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
    actor_rollout_ref.model.path=/models/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=${offload} \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=${sp_size} \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=${sp_size} \
    reward_model.reward_manager=dapo \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${enable_overlong_buffer} \
    trainer.device=npu \
    trainer.logger='["console"]' \
    trainer.experiment_name=qwen2_5_3b_gspo_npu16_reference \
    trainer.n_gpus_per_node="${GPUS_PER_NODE}" \
    trainer.nnodes="${NNODES}" \
    trainer.val_before_train=false \
    trainer.test_freq=20 \
    trainer.save_freq=20 \
    trainer.max_actor_ckpt_to_keep=2 \
    trainer.total_epochs=10 \
    trainer.total_training_steps=500 \
    $@
