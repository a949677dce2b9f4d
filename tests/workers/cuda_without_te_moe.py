"""A Megatron MoE forward and backward with what a CUDA process without Transformer Engine gets (plain python,
world 1, CPU): the CPU adaptation's device routing alone (`cpu_adapt.route_devices`: no speed-up, no library fix)
and the compatibility shims every platform gets (`init_parallel` -> `compat.megatron.apply_shims`).

The tiny Qwen3-MoE on the local spec (the spec CUDA builds without TE), HF weights loaded; logits of a batch and
the router weights' gradients of `(logits * probe).sum()`, saved for the test to compare with Hugging Face's.

Arguments: --model-dir, --ref (the test's .pt: tokens, probe), --results. Result: what was in force, the logits'
and router gradients' file."""

import sys

import torch

from tests.workers.harness import worker_args, write_result


def routing_only_platform():
    """Platform("cpu") whose adaptation is the device routing alone: CUDA's adapt_megatron changes nothing, and a
    CPU process cannot run Megatron without the routing."""
    import dataclasses

    from mcore_rl.platform import Platform, cpu_adapt

    @dataclasses.dataclass(frozen=True)
    class RoutingOnly(Platform):
        def adapt_megatron(self, cp: int = 1) -> None:
            cpu_adapt.route_devices()

    return RoutingOnly("cpu")


def main():
    args = worker_args(__doc__, model_dir=str, ref=str)
    from mcore_rl.compat import megatron as compat_megatron
    from mcore_rl.config import ModelConfig, ParallelConfig
    from mcore_rl.megatron.parallel import init_parallel
    from mcore_rl.models.bridge import ModelBridge

    platform = routing_only_platform()
    bridge = ModelBridge(args.model_dir, platform)
    layout = init_parallel(ParallelConfig(), platform, bridge.hf_config)
    from megatron.core import jit
    from megatron.core.transformer.moe import moe_utils

    (model,) = bridge.build_model(layout, ModelConfig(path=args.model_dir, dtype="float32"))
    bridge.load_hf_weights([model])
    model.eval()  # no dropout, no auxiliary loss: the logits and gradients HF computes
    ref = torch.load(args.ref)
    tokens = ref["tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, None)
    (logits * ref["probe"]).sum().backward()
    routers = {
        i: layer.mlp.router.weight.grad.clone()
        for i, layer in enumerate(model.decoder.layers)
        if hasattr(layer.mlp, "router")
    }
    out = args.ref.replace(".pt", "_megatron.pt")
    torch.save({"logits": logits.detach(), "router_grads": routers}, out)
    write_result(
        args.results,
        out=out,
        shims=[s.name for s in compat_megatron.shims()],
        te_general_gemm=repr(getattr(moe_utils, "te_general_gemm", "undefined")),
        jit_fuser_compiles=jit.jit_fuser is torch.compile,
        dynamo_loaded="torch._dynamo" in sys.modules,
        spec=type(model.decoder.layers[0].self_attention.core_attention).__name__,
    )


if __name__ == "__main__":
    main()
