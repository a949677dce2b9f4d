#!/bin/bash
# Test script (not a reference run): GRPO with an FSDP actor on 1 node x 8, fixed-size micro-batches, offload,
# a custom reward function file, and keys this converter does not carry over.
set -x
export DATA=${DATA:-$HOME/data}
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="['data/math/train.parquet', 'data/math/extra.parquet']" \
    data.val_files=data/math/test.parquet \
    data.train_batch_size=64 \
    data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=/models/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.n=4 \
    custom_reward_function.path=rewards/my_math.py \
    custom_reward_function.name=score \
    ++trainer.val_before_train=False \
    trainer.nnodes=1 trainer.n_gpus_per_node=8 \
    trainer.total_training_steps=50 "$@" 2>&1 | tee train.log
