"""Parallel layout validation: pure Python, no Megatron import, no process group.

`validate_layout` checks a `ParallelConfig` against a world size and the model's dimensions before any
process starts, and returns the one `Layout` object (DP, expert DP, layers per stage, padding multiple, ...);
`mcore_rl.megatron.parallel.init_parallel` later binds this process's ranks and groups to it. Each violated rule
raises `LayoutError` with one line naming the constraint, the numbers and a fix, so that a wrong layout
fails in a second instead of after minutes of model loading on 32 devices.

The rules mirror what Megatron-Core asserts later (parallel_state, TransformerConfig, the embedding):
  world = tp * pp * cp * dp                          (parallel_state: world divisible by model size)
  tp | attention heads, tp | query groups            (attention splits heads and KV groups over TP)
  pp | layers, or explicit uneven first/last stages  (TransformerConfig pipeline split)
  ep | experts; etp | expert FFN size                (experts and their FFN split over EP x ETP)
  ep * etp | tp * cp * dp                            (MoE parallel folding: EP x ETP x EDP = TP x CP x DP)
  tp | vocabulary                                    (VocabParallelEmbedding; see `_check_vocab`)
  MoE with tp > 1 needs sequence parallel            (Megatron raises in training; turned on with a warning)
  cp > 1: the actor splits every sequence over the CP ranks (mcore_rl/megatron/context_parallel.py); the
          attention across them is the local spec's (CPU), TE's (CUDA; refused at start without TE) or
          MindSpeed's ring attention (NPU): preflight.context_parallel
  etp == 1 on NPU: MindSpeed's grouped linear shards experts on the other dimension (export untested)
  virtual_pp null (or 1): the actor does not run interleaved pipeline stages (`virtual_pp_refusal`)
  layouts the installed megatron-core cannot run    (compat.megatron.layout_problem: version read from the
                                                     package metadata, Megatron itself is not imported)
The rules of the run as a whole (architecture, engine, how a step's samples split) are in `preflight.run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.config import ParallelConfig
from mcore_rl.preflight import context_parallel

# Megatron-LM's default `--make-vocab-size-divisible-by`; its vocabulary padding multiple is this x TP.
MEGATRON_VOCAB_DIVISIBLE_BY = 128
VIRTUAL_PP_UNSUPPORTED = "interleaved (virtual) pipeline stages are not supported by the actor yet (every pass would need >= pp micro-batches)"


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the rule, the numbers and a fix."""


@dataclass(frozen=True)
class ModelDims:
    """The model dimensions that constrain a parallel layout."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int  # routed experts; 0 for a dense model
    vocab_size: int
    hidden: int
    moe_ffn_hidden_size: int = 0  # per-expert FFN size (0: unknown / dense)
    moe_top_k: int = 0
    head_dim: int = 0  # 0: hidden / heads
    ffn_hidden_size: int = 0  # dense MLP size (intermediate_size)
    tie_embeddings: bool = False
    model_type: str = ""  # HF config.json `model_type` ("" when not known: the architecture is not checked)
    max_positions: int = 0  # max_position_embeddings: the longest sequence the model encodes (0: not known)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelDims":
        """From a Hugging Face config object, a dict, a config.json path or a checkpoint folder."""
        if isinstance(hf_config, ModelDims):
            return hf_config
        source = "the model config"
        if isinstance(hf_config, (str, os.PathLike)):
            path = os.fspath(hf_config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise LayoutError(
                    f"model config {path} does not exist: point model.path at a Hugging Face checkpoint folder with a config.json"
                )
            try:
                with open(path) as f:
                    hf_config = json.load(f)
            except (OSError, ValueError) as e:
                raise LayoutError(
                    f"model config {path} is unreadable ({type(e).__name__}: {e}): restore the file"
                ) from None
            if not isinstance(hf_config, dict):
                raise LayoutError(f"model config {path} is not a JSON object: restore the file")
            source = path
        get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
        required = ("num_hidden_layers", "num_attention_heads", "vocab_size", "hidden_size")
        missing = [k for k in required if not isinstance(get(k), int) or isinstance(get(k), bool)]
        if missing:
            raise LayoutError(
                f"{source} lacks integer {', '.join(missing)}: it is incomplete; restore it from the model's release"
            )
        _check_model_sizes(get, source)
        heads = get("num_attention_heads")
        num_experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
        return cls(
            num_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(heads),
            num_query_groups=int(get("num_key_value_heads") or heads),
            num_experts=int(num_experts),
            vocab_size=int(get("vocab_size")),
            hidden=int(get("hidden_size")),
            moe_ffn_hidden_size=int(get("moe_intermediate_size") or 0) if num_experts else 0,
            moe_top_k=int(get("num_experts_per_tok") or 0) if num_experts else 0,
            head_dim=int(get("head_dim") or 0),
            ffn_hidden_size=int(get("intermediate_size") or 0),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            model_type=str(get("model_type") or ""),
            max_positions=int(get("max_position_embeddings") or 0),
        )


# Sizes a model config must give as integers >= 1 when present (the required ones always); a count of experts
# may be 0 (dense). Zero layers or a negative width would otherwise make a plan that "fits" in negative bytes.
_POSITIVE_SIZES = (
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "hidden_size",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "max_position_embeddings",
)
_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_model_sizes(get: Any, source: str) -> None:
    for key in _POSITIVE_SIZES + _COUNTS:
        value = get(key)
        if value is None:
            continue
        least = 0 if key in _COUNTS else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LayoutError(
                f"{source}: {key} = {value!r} must be an integer >= {least}: fix the config.json (or restore it "
                f"from the model's release)"
            )


@dataclass(frozen=True)
class Ranks:
    """This process's coordinates in each parallel dimension (set by `init_parallel`)."""

    rank: int  # in the whole job
    dp: int  # data-parallel rank: which share of a mini-batch this process trains on
    tp: int
    pp: int  # pipeline stage
    cp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class Groups:
    """The process groups of one layout (torch.distributed groups, fetched once from Megatron)."""

    tp: Any
    pp: Any
    dp: Any  # data parallel without context parallel
    dp_cp: Any  # data x context parallel: where DDP averages gradients
    ep: Any
    etp: Any
    cp: Any = None  # context parallel: the ranks holding the other parts of this rank's sequences


@dataclass(frozen=True)
class Layout:
    """One parallel layout of the actor: the sizes the pre-flight derives from config + world size, and,
    once `init_parallel` created Megatron's groups, this process's `ranks` and the `groups` themselves.

    Built by `validate_layout` (pure Python, before any process exists) and passed explicitly to
    whatever needs sizes, ranks or groups. `warnings` lists what was adjusted and why.
    """

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int  # expert data parallel: tp * cp * dp / (ep * etp)
    vpp: Optional[int]
    sequence_parallel: bool  # effective value (auto-on for MoE with tp > 1, off for tp == 1)
    micro_batch_size: int
    layers_per_stage: tuple[int, ...]
    num_layers_in_first_stage: Optional[int]  # uneven pipeline (None: even split)
    num_layers_in_last_stage: Optional[int]
    padded_vocab_size: int
    seq_len_multiple: int  # every packed/padded sequence length must be a multiple of this
    warnings: tuple[str, ...] = ()
    # rollout.placement=separate: the ranks that generate beside the world_size actor ranks (0: colocated, every
    # rank does both); preflight.placement
    rollout_ranks: int = 0
    bound_ranks: Optional[Ranks] = None  # set by bind(); read through `ranks`
    bound_groups: Optional[Groups] = None  # set by bind(); read through `groups`

    def bind(self, ranks: Ranks, groups: Groups) -> "Layout":
        """This layout with the process's coordinates and groups (after Megatron created them)."""
        return dataclasses.replace(self, bound_ranks=ranks, bound_groups=groups)

    @property
    def ranks(self) -> Ranks:
        if self.bound_ranks is None:
            raise RuntimeError("this Layout has no process groups yet: build it with init_parallel(...)")
        return self.bound_ranks

    @property
    def groups(self) -> Groups:
        if self.bound_groups is None:
            raise RuntimeError("this Layout has no process groups yet: build it with init_parallel(...)")
        return self.bound_groups

    @property
    def is_first_stage(self) -> bool:
        return self.ranks.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.ranks.pp == self.pp - 1

    def pad_length(self, length: int) -> int:
        """`length` rounded up to the sequence-length multiple (sequence / context parallel splits)."""
        return -(-length // self.seq_len_multiple) * self.seq_len_multiple


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_sizes(p: ParallelConfig, world_size: int) -> None:
    sizes = {
        "world_size": world_size,
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
        "ep": p.ep,
        "etp": p.expert_tp,
        "micro_batch_size": p.micro_batch_size,
    }
    if p.virtual_pp is not None:
        sizes["virtual_pp"] = p.virtual_pp
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            key = name if name == "world_size" else f"actor.parallel.{name}"
            raise LayoutError(f"{key} = {value!r} must be an integer >= 1: set it to 1 or more")


def _check_world(p: ParallelConfig, world_size: int) -> int:
    model = p.tp * p.pp * p.cp
    if world_size % model:
        raise LayoutError(
            f"world size {world_size} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model}: "
            f"use a world size that is a multiple of {model}, or lower tp/pp/cp to divide {world_size}"
        )
    return world_size // model


def _check_heads(p: ParallelConfig, dims: ModelDims) -> None:
    for what, n in (("attention heads", dims.num_attention_heads), ("query groups (KV heads)", dims.num_query_groups)):
        if n % p.tp:
            ok = divisors(math.gcd(dims.num_attention_heads, dims.num_query_groups))
            raise LayoutError(f"tp = {p.tp} must divide the model's {n} {what}: use tp in {ok}")


def _stage_layers(p: ParallelConfig, dims: ModelDims) -> tuple[int, ...]:
    first, last = p.num_layers_in_first_stage, p.num_layers_in_last_stage
    n = dims.num_layers
    if first is None and last is None:
        if n % p.pp:
            raise LayoutError(
                f"pp = {p.pp} must divide the model's {n} layers: use pp in {divisors(n)}, or set "
                f"actor.parallel.num_layers_in_first_stage / num_layers_in_last_stage for uneven stages"
            )
        stages = (n // p.pp,) * p.pp
    else:
        if p.pp < 2:
            raise LayoutError(
                f"uneven pipeline stages (first={first}, last={last}) need pp >= 2, got pp = {p.pp}: remove them or raise pp"
            )
        for name, v in (("num_layers_in_first_stage", first), ("num_layers_in_last_stage", last)):
            if v is not None and v < 1:
                raise LayoutError(f"actor.parallel.{name} = {v} must be >= 1: give every stage at least one layer")
        middle_stages = p.pp - (first is not None) - (last is not None)
        middle_layers = n - (first or 0) - (last or 0)
        if (
            middle_layers < 0
            or (middle_stages == 0) != (middle_layers == 0)
            or (middle_stages and middle_layers % middle_stages)
        ):
            raise LayoutError(
                f"uneven stages: {n} layers minus first={first} and last={last} leaves {middle_layers} layers for "
                f"{middle_stages} middle stages, which must split evenly: adjust the first/last stage sizes"
            )
        mid = (middle_layers // middle_stages,) * middle_stages if middle_stages else ()
        stages = ((first,) if first is not None else ()) + mid + ((last,) if last is not None else ())
    return stages


def virtual_pp_refusal(value: Any) -> Optional[str]:
    """Why `actor.parallel.virtual_pp = value` cannot train (None: it can). Interleaved pipeline stages need a
    data iterator per model chunk and at least pp micro-batches in every pass (the forward-only log-prob
    passes and the merged packed passes too), which needs filler micro-batches the actor does not build."""
    if value is None or value == 1:
        return None
    return f"actor.parallel.virtual_pp = {value}: {VIRTUAL_PP_UNSUPPORTED}; set actor.parallel.virtual_pp: null (or 1)"


def _virtual_pp(p: ParallelConfig, warnings: list[str]) -> Optional[int]:
    """The virtual pipeline size Megatron gets: None, the plain schedule (1, one chunk per stage, is the same)."""
    problem = virtual_pp_refusal(p.virtual_pp)
    if problem:
        raise LayoutError(problem)
    if p.virtual_pp == 1:
        warnings.append("virtual_pp = 1 is the plain pipeline schedule: treated as null")
    return None


def _check_experts(p: ParallelConfig, dims: ModelDims) -> None:
    etp = p.expert_tp
    if dims.num_experts == 0:
        if p.ep > 1:
            raise LayoutError(
                f"ep = {p.ep} needs a Mixture-of-Experts model, but this model is dense: set actor.parallel.ep = 1"
            )
        return
    if dims.num_experts % p.ep:
        raise LayoutError(
            f"ep = {p.ep} must divide the model's {dims.num_experts} experts: use ep in {divisors(dims.num_experts)}"
        )
    if dims.moe_ffn_hidden_size and dims.moe_ffn_hidden_size % etp:
        raise LayoutError(
            f"expert tensor parallel etp = {etp} must divide the expert FFN size {dims.moe_ffn_hidden_size}: "
            f"use etp in {[d for d in divisors(dims.moe_ffn_hidden_size) if d <= 8]} (etp defaults to tp; set actor.parallel.etp)"
        )


def _check_expert_folding(p: ParallelConfig, dp: int, world_size: int) -> int:
    etp = p.expert_tp
    dense = p.tp * p.cp * dp
    expert = p.ep * etp
    if dense % expert:
        need = p.pp * math.lcm(p.tp * p.cp, expert)
        fits = [e for e in divisors(dense) if dense % (e * etp) == 0]
        raise LayoutError(
            f"ep*etp = {p.ep}*{etp} = {expert} must divide tp*cp*dp = {p.tp}*{p.cp}*{dp} = {dense} "
            f"(world {world_size} = tp{p.tp} x pp{p.pp} x cp{p.cp} x dp{dp}; MoE folding EP x ETP x EDP = TP x CP x DP): "
            f"use ep in {fits} at etp={etp}, or a world size that is a multiple of {need}"
        )
    return dense // expert


def _check_vocab(p: ParallelConfig, dims: ModelDims) -> int:
    # Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by (128) x TP; our bridge
    # builds the embedding with the checkpoint's own vocabulary, so it must split evenly over TP.
    if dims.vocab_size % p.tp:
        multiple = MEGATRON_VOCAB_DIVISIBLE_BY * p.tp
        padded = -(-dims.vocab_size // multiple) * multiple
        raise LayoutError(
            f"tp = {p.tp} must divide the vocabulary size {dims.vocab_size} (the embedding and output layer are split over TP): "
            f"use tp in {[d for d in divisors(dims.vocab_size) if d <= 64]}, or pad the checkpoint's embedding/lm_head rows "
            f"to {padded} (Megatron-LM's padding: a multiple of make_vocab_size_divisible_by {MEGATRON_VOCAB_DIVISIBLE_BY} x tp {p.tp})"
        )
    return dims.vocab_size


def _sequence_parallel(p: ParallelConfig, dims: ModelDims, warnings: list[str]) -> bool:
    if p.tp == 1:
        if p.sequence_parallel:
            warnings.append("sequence_parallel turned off: it needs tp > 1 (Megatron raises otherwise)")
        return False
    if dims.num_experts and not p.sequence_parallel:
        warnings.append(f"sequence_parallel turned on: Megatron requires it for MoE training with tp = {p.tp} > 1")
        return True
    return p.sequence_parallel


def _check_platform(p: ParallelConfig, dims: ModelDims, platform: Optional[str], te: Optional[bool]) -> None:
    problem = context_parallel.platform_problem(p.cp, platform, te)  # where a CP attention is configured
    if problem:
        raise LayoutError(problem)
    if platform == "npu" and dims.num_experts and p.expert_tp > 1:  # a dense model has no expert layers
        raise LayoutError(
            f"actor.parallel.etp = {p.expert_tp} on NPU: MindSpeed's grouped expert linear shards on the opposite "
            f"dimension to Transformer Engine's, so the weight export would cut experts wrongly (untested); "
            f"set actor.parallel.etp = 1"
        )


def validate_layout(
    parallel: ParallelConfig,
    world_size: int,
    dims: Any,
    platform: Optional[str] = None,
    transformer_engine: Optional[bool] = None,
) -> Layout:
    """Check `parallel` for `world_size` processes and this model; raise LayoutError on the first violation.

    `dims` is a ModelDims or anything `ModelDims.from_hf` accepts (HF config object, dict, config.json path,
    checkpoint folder). `platform` ("cpu" | "cuda" | "npu" | None) enables platform-specific rules;
    `transformer_engine`: whether the TE layer spec is built (None: not known, as before launch).
    """
    dims = ModelDims.from_hf(dims)
    p = parallel
    _check_sizes(p, world_size)
    warnings: list[str] = []
    vpp = _virtual_pp(p, warnings)
    dp = _check_world(p, world_size)
    _check_heads(p, dims)
    stages = _stage_layers(p, dims)
    _check_experts(p, dims)
    edp = _check_expert_folding(p, dp, world_size)
    padded_vocab = _check_vocab(p, dims)
    _check_platform(p, dims, platform, transformer_engine)
    sp = _sequence_parallel(p, dims, warnings)
    problem = compat_megatron.layout_problem(p.tp, p.ep, p.expert_tp, sp, vpp, moe=bool(dims.num_experts))
    if problem:
        raise LayoutError(problem)
    seq_multiple = context_parallel.sequence_multiple(p.cp, p.tp, sp)
    return Layout(
        world_size=world_size,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        dp=dp,
        ep=p.ep,
        etp=p.expert_tp,
        edp=edp,
        vpp=vpp,
        sequence_parallel=sp,
        micro_batch_size=p.micro_batch_size,
        layers_per_stage=stages,
        num_layers_in_first_stage=p.num_layers_in_first_stage,
        num_layers_in_last_stage=p.num_layers_in_last_stage,
        padded_vocab_size=padded_vocab,
        seq_len_multiple=seq_multiple,
        warnings=tuple(warnings),
    )
