"""Weight transfer: the actor's Megatron shards out as full Hugging Face tensors, into the rollout engines."""
