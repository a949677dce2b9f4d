#!/bin/bash
# Test script (not a reference run): GRPO (verl's vanilla loss) with a Megatron actor TP2 x PP2 on 2 nodes x 8,
# uneven pipeline stages, selective recompute, KL loss, a cosine schedule with a warm-up ratio.
NNODES=${NNODES:-2}; GPUS=${GPUS:-8}
TP=2 PP=2
lr=2e-6
cat > /dev/null <<-'NOTES'
	lr=9  # text of a here-document, not an assignment
	NOTES
python3 -m verl.trainer.main_ppo --config-path config --config-name ppo_megatron_trainer \
    algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=False \
    data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet \
    data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=2048 \
    actor_rollout_ref.model.path=/models/Qwen3-8B \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.clip_ratio=0.3 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0.001 \
    actor_rollout_ref.actor.optim.lr=$lr \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1 \
    actor_rollout_ref.actor.optim.lr_decay_style=cosine \
    actor_rollout_ref.actor.optim.min_lr=1e-7 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP \
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=17 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=19 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.top_k=0 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    trainer.logger=['console','wandb'] trainer.project_name=verl_grpo trainer.experiment_name=qwen3_8b_grpo \
    trainer.nnodes=$NNODES trainer.n_gpus_per_node=$GPUS \
    trainer.save_freq=-1 trainer.test_freq=5 trainer.total_training_steps=200 $@
