"""Convert between Hugging Face checkpoints and Megatron dist checkpoints (torch_dist).

  hf-to-mcore: HF folder -> Megatron checkpoint (model only) in the given layout
  mcore-to-hf: Megatron checkpoint (from training or hf-to-mcore) -> HF safetensors + config + tokenizer

Any layout works in either direction; run under torchrun with tp*pp*ep-compatible process counts,
e.g. `torchrun --nproc_per_node 2 -m mcore_rl.convert hf-to-mcore --hf M --out C --tp 2`
(`mcore-rl convert ...` and `tools/convert_checkpoint.py ...` are the same program).
A plain single process runs as layout 1x1x1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from mcore_rl.config import Config, ConfigError, ModelConfig, ParallelConfig
from mcore_rl.models.hf_io import DTYPES
from mcore_rl.platform import get_platform
from mcore_rl.preflight.inputs import check_model_type, check_weights
from mcore_rl.preflight.layout import LayoutError, ModelDims, validate_layout


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    parser.add_argument(
        "--hf",
        required=True,
        help="HF checkpoint folder (source for hf-to-mcore; config/tokenizer source for mcore-to-hf)",
    )
    parser.add_argument("--ckpt", help="Megatron checkpoint folder to read (mcore-to-hf)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--platform", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    parser.add_argument("--max-shard-gb", type=float, default=4.0)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.direction == "mcore-to-hf" and not args.ckpt:
        parser.error("mcore-to-hf needs --ckpt (the Megatron checkpoint folder to read)")
    return args


class ConvertError(ValueError):
    """A bad argument or input folder; printed as one line, exit status 2 (like `mcore-rl train`)."""


def check_args(args: argparse.Namespace) -> None:
    """Inputs exist and sizes are sane, before Megatron or torch.distributed start."""
    if not os.path.isfile(os.path.join(args.hf, "config.json")):
        raise ConvertError(f"--hf {args.hf} has no config.json: point it at a Hugging Face checkpoint folder")
    if args.ckpt is not None and not os.path.isfile(os.path.join(args.ckpt, "metadata.json")):
        raise ConvertError(
            f"--ckpt {args.ckpt} is not a Megatron dist checkpoint (no metadata.json): give a checkpoints/step_N/actor "
            f"folder or an hf-to-mcore output"
        )
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConvertError(f"--out {args.out} is a file: give a directory")
    held = sorted(os.listdir(args.out)) if os.path.isdir(args.out) else []
    if held:  # an earlier export's shards and index would stay next to the new ones, and readers disagree
        raise ConvertError(
            f"--out {args.out} is not empty ({len(held)} entries, e.g. {', '.join(held[:3])}): write into a new "
            f"or empty folder, or remove the old one first"
        )
    for flag in ("tp", "pp", "ep", "etp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConvertError(f"--{flag} = {value} must be >= 1")
    if args.max_shard_gb <= 0:
        raise ConvertError(f"--max-shard-gb = {args.max_shard_gb} must be > 0")
    _check_model_and_layout(args)
    if args.direction == "mcore-to-hf":
        _check_checkpoint_matches(args.ckpt, args.hf)


def checkpoint_dims(ckpt: str) -> dict[str, int]:
    """The model sizes a Megatron dist checkpoint's tensor metadata (`.metadata`, global shapes) shows: layers
    (the stacked layer axis), hidden size and vocabulary rows (the embedding; padded), routed experts (the
    router's rows; 0 without a router), the dense MLP's size (its gated fc1 holds 2 x intermediate_size rows)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        tensors = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - torch raises what its reader met (OSError, pickle errors ...)
        raise ConvertError(
            f"--ckpt {ckpt}: its tensor metadata (.metadata) is unreadable ({type(e).__name__}: {e}): give a "
            f"checkpoints/step_N/actor folder or an hf-to-mcore output"
        ) from None
    # the sharded tensors' own keys (Megatron's), the same in a training checkpoint and an hf-to-mcore output
    shapes = {key: tuple(meta.size) for key, meta in tensors.items() if getattr(meta, "size", None) is not None}
    embedding = shapes.get("embedding.word_embeddings.weight")
    qkv = shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    if embedding is None or qkv is None:
        raise ConvertError(
            f"--ckpt {ckpt} holds no GPT model (no embedding or attention weights): give the actor's folder"
        )
    router = shapes.get("decoder.layers.mlp.router.weight")
    dims = {"num_hidden_layers": qkv[0], "hidden_size": embedding[1], "num_experts": router[1] if router else 0}
    dense_fc1 = shapes.get("decoder.layers.mlp.linear_fc1.weight")
    if dense_fc1 is not None:
        dims["intermediate_size"] = dense_fc1[1] // 2
    return {**dims, "vocab_rows": embedding[0]}


def _check_checkpoint_matches(ckpt: str, hf: str) -> None:
    """--hf's config.json describes the model in --ckpt: a MoE checkpoint with a dense config (or other sizes)
    would fail in the load with a KeyError or a shape error; say which field differs first."""
    dims = ModelDims.from_hf(hf)
    config = {
        "num_hidden_layers": dims.num_layers,
        "hidden_size": dims.hidden,
        "num_experts": dims.num_experts,
        "intermediate_size": dims.ffn_hidden_size,
    }
    found = checkpoint_dims(ckpt)
    experts = found["num_experts"], config["num_experts"]
    if experts[0] != experts[1]:
        held, given = (f"a MoE model ({n} routed experts)" if n else "a dense model (no experts)" for n in experts)
        raise ConvertError(
            f"--ckpt {ckpt} holds {held}, but --hf {hf}/config.json describes {given}: give the --hf folder of the "
            f"model the checkpoint was trained from"
        )
    for field, value in found.items():
        if field in config and config[field] != value:
            raise ConvertError(
                f"--ckpt {ckpt} holds a model with {field} = {value}, but --hf {hf}/config.json has {field} = "
                f"{config[field]}: give the --hf folder of the model the checkpoint was trained from"
            )
    if found["vocab_rows"] < dims.vocab_size:  # the checkpoint's rows are the vocabulary padded up
        raise ConvertError(
            f"--ckpt {ckpt} has an embedding of {found['vocab_rows']} rows, but --hf {hf}/config.json has "
            f"vocab_size = {dims.vocab_size}: give the --hf folder of the model the checkpoint was trained from"
        )


def _check_model_and_layout(args: argparse.Namespace) -> None:
    """--hf is a supported architecture (and, as the weights' source, complete); the layout fits the processes
    torchrun started (WORLD_SIZE) and the model."""
    try:
        (check_weights if args.direction == "hf-to-mcore" else check_model_type)(args.hf)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        validate_layout(parallel, world, args.hf, platform=None if args.platform == "auto" else args.platform)
    except (ConfigError, LayoutError) as e:
        raise ConvertError(str(e).replace("model.path = ", "--hf ")) from None


def convert(args: argparse.Namespace) -> None:
    """Run one conversion (collective under torchrun)."""
    import torch

    platform = get_platform(args.platform)
    platform.adapt_megatron()  # before Megatron is imported (on CPU: without TorchDynamo, as in the trainer)
    # Megatron (seconds to import) only for a conversion whose arguments passed check_args
    from mcore_rl.megatron.actor import Actor

    cfg = Config(platform=platform.name, model=ModelConfig(path=args.hf, dtype=args.dtype))
    cfg.actor.parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    from_hf = args.direction == "hf-to-mcore"
    actor = Actor(cfg, platform, with_optimizer=False, load_weights=from_hf)
    if from_hf:
        actor.save_checkpoint(args.out, extra={"converted_from": os.path.abspath(args.hf)})
    else:
        actor.load_checkpoint(args.ckpt, load_optimizer=False)
        actor.save_hf(args.out, source_dir=args.hf, max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"{args.direction}: wrote {args.out}", flush=True)
    _leave()


def _leave() -> None:
    """End this rank now: every file is written and every rank passed the barrier. Python's multiprocessing
    finalizers first: megatron-core's checkpoint writer forks a multiprocessing Manager (its results queue), a
    child holding this rank's pipes and, forked after the process groups, their sockets. Then not through the
    process groups' teardown: on megatron-core 0.12.1 / torch 2.7.1 a rank hung now and then in
    destroy_process_group after the barrier (torchrun waited until the CI stage's 300 s timeout, "wrote" already
    printed; py-spy: the main thread in destroy_process_group), and a process that leaves with a gloo group up can
    abort in its C++ destructors ("terminate called without an active exception"); os._exit runs neither."""
    import multiprocessing.util

    multiprocessing.util._exit_function()  # what the interpreter's exit runs: the Manager shut down, children joined
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    args = parse_args(argv, prog)
    try:
        check_args(args)
    except ConvertError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process checks: say it once
            print(f"{prog or 'mcore-rl convert'}: error: {e}", file=sys.stderr)
        return 2
    convert(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
