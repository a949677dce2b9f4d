"""The packed-attention path of CUDA without Transformer Engine, checked on CPU (plain python, world 1).

1. The layer spec the bridge builds for `Platform("cuda")` here (no transformer_engine importable) has the
   project's SegmentDotProductAttention as every layer's core attention, and the actor's mode is "segments".
2. A real tiny Qwen3-MoE GPTModel on that local spec, one packed row of three sequences: the logits with the
   segment bounds as the mask, and with Megatron's THD PackedSeqParams (the call that reaches Megatron's
   DotProductAttention assert), both equal each sequence run alone - and plain DotProductAttention does raise it.

Arguments: --model-dir (tiny checkpoint), --results. Result: the checks' values for the test's assertions."""

import torch

from tests.workers.harness import worker_args, write_result

LENGTHS = [5, 9, 3]


def core_attention_classes(spec) -> list[str]:
    return [layer.submodules.self_attention.submodules.core_attention.__name__ for layer in spec.layer_specs]


def logits(model, tokens, mask, **extra):
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        return model(tokens, positions, mask, **extra)[0]


def main():
    args = worker_args(__doc__, model_dir=str)
    from mcore_rl.config import ModelConfig, ParallelConfig
    from mcore_rl.megatron.attention_inputs import model_inputs
    from mcore_rl.megatron.parallel import init_parallel
    from mcore_rl.models.bridge import ModelBridge, _MbridgeBackend
    from mcore_rl.platform import Platform

    cpu = Platform("cpu")
    bridge = ModelBridge(args.model_dir, cpu)
    layout = init_parallel(ParallelConfig(), cpu, bridge.hf_config)
    cuda = Platform("cuda")  # only its decisions are asked for; nothing is placed on a CUDA device
    cuda_extra = bridge.megatron_config_overrides(layout, ModelConfig(path=args.model_dir, dtype="float32"))
    cuda_backend = _MbridgeBackend(bridge.hf_config, torch.float32, cuda_extra, use_te=cuda.uses_transformer_engine)
    cuda_spec = core_attention_classes(cuda_backend.impl._get_transformer_layer_spec())

    (model,) = bridge.build_model(layout, ModelConfig(path=args.model_dir, dtype="float32"))
    bridge.load_hf_weights([model])
    model.eval()
    g = torch.Generator().manual_seed(0)
    row = torch.randint(3, bridge.hf_config.vocab_size, (1, sum(LENGTHS)), generator=g)
    alone, start = [], 0
    for n in LENGTHS:
        alone.append(logits(model, row[:, start : start + n], None))
        start += n
    want = torch.cat(alone, dim=0)

    from mcore_rl.batch import MicroBatch

    mb = MicroBatch(row, seq_lengths=LENGTHS)
    got = {}
    for mode in ("segments", "thd"):
        mask, extra = model_inputs(mb, mode)
        got[mode] = (logits(model, row, mask, **extra) - want).abs().max().item()

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attn = model.decoder.layers[0].self_attention.core_attention
    _, thd = model_inputs(mb, "thd")
    q = torch.zeros(sum(LENGTHS), attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head)
    try:
        DotProductAttention.forward(attn, q, q, q, None, packed_seq_params=thd["packed_seq_params"])
        megatron_refuses = ""
    except AssertionError as e:
        megatron_refuses = str(e)
    write_result(
        args.results,
        cuda_spec=cuda_spec,
        cuda_mode=cuda.packed_attention,
        cuda_te=cuda.uses_transformer_engine,
        built=type(attn).__name__,
        max_diff=got,
        scale=want.abs().max().item(),
        megatron_refuses=megatron_refuses,
    )


if __name__ == "__main__":
    main()
