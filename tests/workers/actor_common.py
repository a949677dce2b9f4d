"""Shared pieces of the actor/checkpoint workers: the fixed global batch and a global-token-mean NLL."""

import torch


def global_batch():
    """4 right-padded sequences of 16 tokens and their loss mask (deterministic)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 128, (4, 16), generator=g)
    lengths = torch.tensor([16, 11, 7, 14])
    return tokens, torch.arange(16)[None] < (lengths[:, None] - 1)


def my_micro_batches(tokens, loss_mask, n_micro: int):
    """This DP rank's rows of the global batch, split into n_micro micro-batches."""
    from megatron.core import parallel_state as mpu

    from mcore_rl.batch import MicroBatch

    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    per_rank = tokens.shape[0] // dp
    size = per_rank // n_micro
    assert size * n_micro == per_rank, (per_rank, n_micro)
    rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank, size)
    return [MicroBatch(tokens[r : r + size], loss_mask=loss_mask[r : r + size].float()) for r in rows]


def nll_loss(global_tokens):
    """loss_fn: masked next-token NLL summed, divided by the GLOBAL token count."""
    from megatron.core import tensor_parallel

    def loss_fn(head, mb):
        labels = torch.roll(mb.tokens, -1, dims=1)
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            head.logits().transpose(0, 1).contiguous(), labels.t().contiguous()
        ).t()
        mask = mb.loss_mask
        return (nll * mask).sum() / global_tokens, {"tokens": mask.sum()}

    return loss_fn


def full_logits(head, mb):
    """post_fn: the full-vocabulary logits, materialised from the actor's OutputHead and gathered over TP."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(head.logits())
