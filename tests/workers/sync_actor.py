"""The Megatron actor side of the weight-sync workers (embedded and vLLM engines): a 2-process actor in a
named layout, its full-vocabulary logits, and its log-probs as the reference that verify_sync compares to."""

import torch
import torch.distributed as dist

from mcore_rl.config import ModelConfig, ParallelConfig
from mcore_rl.megatron.parallel import init_parallel
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.platform import get_platform

LAYOUTS = {"tp2": ParallelConfig(tp=2, sequence_parallel=True), "ep2": ParallelConfig(ep=2)}


def build_actor(layout: str, actor_ckpt: str):
    """(bridge, model in eval mode, the bound Layout) for LAYOUT loaded from the HF folder."""
    platform = get_platform("cpu")
    bridge = ModelBridge(actor_ckpt, platform)
    bound = init_parallel(LAYOUTS[layout], platform, bridge.hf_config)
    (model,) = bridge.build_model(bound, ModelConfig(path=actor_ckpt, dtype="float32"))
    bridge.load_hf_weights([model], actor_ckpt)
    model.eval()
    return bridge, model, bound


def tp_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    group, size = tp_group()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def actor_forward(model, seq: list[int], tp: int) -> torch.Tensor:
    """Full-vocabulary fp32 logits [len(seq), V]; right-padded to a multiple of tp for sequence parallelism."""
    width = -(-len(seq) // tp) * tp
    ids = torch.tensor([seq + [0] * (width - len(seq))])
    logits = model(input_ids=ids, position_ids=torch.arange(width)[None], attention_mask=None)
    return gather_last_dim(logits.float())[0, : len(seq)]


def actor_logprobs(model, tp: int):
    """reference_logprob_fn for verify_sync: log-probs of the tokens at positions >= prompt_len."""

    @torch.no_grad()
    def logprobs(sequences, prompt_lens, temperature):
        out = []
        for s, p in zip(sequences, prompt_lens):
            lp = torch.log_softmax(actor_forward(model, s, tp) / temperature, -1)[:-1]
            out.append(lp.gather(-1, torch.tensor(s[1:])[:, None])[p - 1 :, 0])
        return out

    return logprobs
