#!/bin/bash
# Test script (not a reference run): DAPO with the DAPO recipe's trainer and a Megatron actor TP2 x PP2 on
# 2 nodes x 8: group filtering by accuracy with three times the train batch generated per batch and a cap of
# 6 generation batches, the overlong buffer where the recipe's config declares it, decoupled clips, token-mean.
NNODES=${NNODES:-2}; GPUS=${GPUS:-8}
train_prompts=64
gen_prompts=$((train_prompts * 3))
response=$((1024 * 4))
buffer=$((1024 * 1))
python3 -m recipe.dapo.main_dapo --config-path config --config-name dapo_megatron_trainer \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
    algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=6 \
    data.train_files=data/dapo-math-17k.parquet data.val_files=data/aime-2024.parquet \
    data.prompt_key=prompt data.truncation=left \
    data.train_batch_size=$train_prompts data.gen_batch_size=$gen_prompts \
    data.max_prompt_length=1024 data.max_response_length=$response \
    actor_rollout_ref.model.path=/models/Qwen3-8B-Base \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((1024 + response)) \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.optim.clip_grad=1.0 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=$buffer \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.logger=['console','wandb'] trainer.project_name=verl_dapo trainer.experiment_name=qwen3_8b_dapo \
    trainer.nnodes=$NNODES trainer.n_gpus_per_node=$GPUS \
    trainer.save_freq=10 trainer.test_freq=10 trainer.total_training_steps=100 $@
