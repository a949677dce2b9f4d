"""Hugging Face checkpoint <-> Megatron-Core model chunks, behind a small interface of ours.

`ModelBridge` builds the Megatron `GPTModel` chunks of this rank for a HF checkpoint folder, loads
HF weights into any TP/PP/EP/ETP layout and names every local parameter (`param_infos`: its canonical name,
global layer and expert, TP split) for the exporter (mcore_rl/weight_sync/exporter.py), which gathers full
HF-named tensors back. mbridge supplies the model config mapping, the HF<->Megatron name mapping and the
fused-tensor formats (qkv, gate/up); sharding, loading and gathering are ours so that they work with both the
Transformer Engine layer spec (CUDA with TE, NPU via MindSpeed) and the local pure-torch spec (CPU, CUDA without
TE: `Platform.uses_transformer_engine`), whose
parameter names differ:
    local  decoder.layers.L.input_layernorm.weight                 (TE: ...self_attention.linear_qkv.layer_norm_weight)
    local  decoder.layers.L.pre_mlp_layernorm.weight  dense MLP     (TE: ...mlp.linear_fc1.layer_norm_weight)
    local  decoder.layers.L.pre_mlp_layernorm.weight  MoE           (TE: the same name: MoE keeps a separate norm)
    local  decoder.layers.L.mlp.experts.local_experts.E.linear_fcN.weight  (TE: ...mlp.experts.linear_fcN.weightE)
Names are translated to the TE form ("canonical") before mbridge maps them to HF names.

Tied embeddings (Qwen2.5-3B: `tie_word_embeddings`): the HF checkpoint has `model.embed_tokens.weight` and no
`lm_head.weight`. Megatron keeps one weight when one stage holds both ends; with PP > 1 the last stage holds a
copy as `output_layer.weight`, loaded from the same HF tensor and kept in step by Megatron's all-reduce of the
two copies' gradients over the embedding group (`finalize_model_grads`). Export yields the first stage's
`model.embed_tokens.weight` only, so the stream has each checkpoint name exactly once.
Swapping mbridge for Megatron-Bridge means re-implementing `_MbridgeBackend` only.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Optional

import torch

from mcore_rl.compat import mbridge as compat_mbridge
from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.compat import transformers as compat_transformers
from mcore_rl.config import ModelConfig
from mcore_rl.models.hf_io import torch_dtype
from mcore_rl.models.shards import split_shards
from mcore_rl.platform import Platform
from mcore_rl.preflight.layout import Layout

# Fused kernels that need Transformer Engine / Apex; the local spec must run without them. Flags the installed
# megatron-core does not know (moe_router_fusion before 0.14) are dropped by compat.megatron.known_config_fields.
_NO_FUSION = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    moe_grouped_gemm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
)


def load_hf_config(path: str):
    """AutoConfig with `rope_theta` as config.json states it (top level or in rope_parameters; mbridge reads
    hf_config.rope_theta): see compat.transformers."""
    return compat_transformers.load_config(path)


class RMSNorm(torch.nn.Module):
    """RMSNorm as Qwen3 computes it (fp32 statistics), usable under sequence parallelism.

    Megatron's torch norm wrapper asserts `not sequence_parallel`; like TE's norm we instead mark the
    weight so Megatron all-reduces its gradient over TP (each TP rank saw part of the sequence or,
    for q/k norms, part of the heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _replace_module(spec, old: type, new: type) -> None:
    """Swap module class `old` for `new` everywhere in a (nested) layer spec."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (list, tuple)):
        for s in spec:
            _replace_module(s, old, new)
        return
    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        _replace_module(spec.submodules, old, new)
        return
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if value is old:
                setattr(spec, f.name, new)
            else:
                _replace_module(value, old, new)


_OUTPUT_LAYER = "output_layer.weight"
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """Where one local parameter sits in the full model."""

    canonical: str  # TE-style name with global layer index and, for experts, the GLOBAL expert id
    is_expert: bool
    partition_dim: int  # -1 when not split over TP / ETP
    tied_copy: bool = False  # last stage's copy of a tied embedding: loaded, never exported


class _MbridgeBackend:
    """The mbridge pieces we use: config building, name mapping, HF <-> fused Megatron formats."""

    def __init__(self, hf_config, dtype: torch.dtype, extra_config: dict, use_te: bool):
        self.use_te = use_te
        self._hf_names: dict[str, list[str]] = {}
        self.impl = compat_mbridge.bridge_from_config(hf_config, dtype, extra_config)
        self._own_direct_mapping(bool(getattr(hf_config, "tie_word_embeddings", False)))
        if not use_te:
            self.impl._get_transformer_layer_spec = self._local_layer_spec

    def _own_direct_mapping(self, tied: bool) -> None:
        """Give this instance its own top-level name mapping, with the output layer mapped by OUR tie flag.

        mbridge's Qwen2 bridge (and Qwen3's, which inherits it) remaps the output layer for tied embeddings by
        writing into the CLASS-level `_DIRECT_MAPPING` dict, so a tied model built earlier in the process would
        send a later untied model's `lm_head` to `model.embed_tokens`."""
        mapping = dict(type(self.impl)._DIRECT_MAPPING)
        if _OUTPUT_LAYER in mapping:
            mapping[_OUTPUT_LAYER] = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.impl._DIRECT_MAPPING = mapping

    @property
    def config(self):
        return self.impl.config

    def _local_layer_spec(self, vp_stage: Optional[int] = None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        kwargs = {"normalization": "RMSNorm"}
        # vp_stage appeared in megatron-core 0.13; 0.12 (Ascend stacks) builds the current stage.
        self.impl.has_vp_stage = compat_megatron.builds_with_vp_stage()
        if self.impl.has_vp_stage:
            kwargs["vp_stage"] = vp_stage
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from mcore_rl.models.segment_attention import SegmentDotProductAttention  # Megatron: where a spec is built

        spec = get_gpt_decoder_block_spec(self.impl.config, use_transformer_engine=False, **kwargs)
        _replace_module(spec, WrappedTorchNorm, RMSNorm)
        # packed rows attend per segment (Platform.packed_attention "segments"), not through a [T, T] mask
        _replace_module(spec, DotProductAttention, SegmentDotProductAttention)
        spec.layer_norm = RMSNorm
        return spec

    def provider(self):
        return self.impl._model_provider([])

    def hf_names(self, canonical: str) -> list[str]:
        if canonical not in self._hf_names:  # a pure function of the name, asked for every parameter each export
            self._hf_names[canonical] = list(self.impl._weight_name_mapping_mcore_to_hf(canonical))
        return self._hf_names[canonical]

    def to_mcore(self, canonical: str, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.impl._weight_to_mcore_format(canonical, hf_tensors)

    def to_hf(self, canonical: str, full: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        return self.impl._weight_to_hf_format(canonical, full)

    def gated(self) -> bool:
        return bool(self.impl.config.gated_linear_unit)


def _te_norm_name(name: str, moe: bool) -> str:
    """A layer parameter's local-spec norm name in its TE form (module docstring); other names unchanged."""
    name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if not moe:
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return name


class ModelBridge:
    """One HF checkpoint folder and the Megatron model built from it.

    `build_model(layout, ...)` takes the layout bound to Megatron's process groups (see
    mcore_rl.megatron.parallel.init_parallel) and keeps it for loading and exporting. Model chunks are plain
    `GPTModel`s (one per virtual pipeline stage); wrappers (DDP, Float16Module) are looked through by
    `load_hf_weights` and by the exporter (mcore_rl/weight_sync/exporter.py).
    """

    def __init__(self, hf_path: str, platform: Platform):
        self.hf_path = hf_path
        self.platform = platform
        self.hf_config = load_hf_config(hf_path)
        self._backend: Optional[_MbridgeBackend] = None
        self._layout: Optional[Layout] = None
        self._infos: dict[int, tuple[weakref.ref, dict[str, ParamInfo]]] = {}  # id(chunk) -> (chunk, its infos)

    # ---- build -------------------------------------------------------------------------------
    def megatron_config_overrides(self, layout: Layout, model_cfg: ModelConfig) -> dict:
        use_te = self.platform.uses_transformer_engine
        extra = dict(
            sequence_parallel=layout.sequence_parallel,
            moe_token_dispatcher_type=model_cfg.moe_token_dispatcher,
            moe_router_dtype=model_cfg.moe_router_dtype,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            use_cpu_initialization=self.platform.name == "cpu",
        )
        extra.update(self.platform.context_parallel_config(layout.cp))  # TE's CP attention on CUDA
        if model_cfg.recompute:
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if layout.num_layers_in_first_stage is not None:
            extra["num_layers_in_first_pipeline_stage"] = layout.num_layers_in_first_stage
        if layout.num_layers_in_last_stage is not None:
            extra["num_layers_in_last_pipeline_stage"] = layout.num_layers_in_last_stage
        if not use_te:
            extra.update(compat_megatron.known_config_fields(_NO_FUSION))
        return extra

    def build_model(self, layout: Layout, model_cfg: ModelConfig) -> list[torch.nn.Module]:
        """This rank's model chunks (several with virtual pipeline stages), on the platform's device.

        `layout` must be bound to the process groups (init_parallel); it is kept for load / export."""
        from megatron.core import tensor_parallel

        extra = self.megatron_config_overrides(layout, model_cfg)
        self._layout = layout
        self._backend = _MbridgeBackend(
            self.hf_config, torch_dtype(model_cfg.dtype), extra, use_te=self.platform.uses_transformer_engine
        )
        provider = self._backend.provider()
        vpp = layout.vpp  # needs megatron-core >= 0.13: validate_layout (compat.megatron.layout_problem) checked it
        first, last = layout.is_first_stage, layout.is_last_stage
        chunks = []
        for vp_stage in range(vpp or 1):
            if vpp:  # the first virtual chunk of the first stage embeds, the last of the last stage projects
                pre, post = first and vp_stage == 0, last and vp_stage == vpp - 1
                chunk = provider(pre_process=pre, post_process=post, vp_stage=vp_stage)
            else:
                chunk = provider(pre_process=first, post_process=last)
            for p in chunk.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            _mark_experts_expert_parallel(chunk)
            chunks.append(chunk.to(self.platform.device))
        return chunks

    @property
    def transformer_config(self):
        return self.backend.config

    @property
    def backend(self) -> _MbridgeBackend:
        if self._backend is None:
            raise RuntimeError("ModelBridge.build_model() must run before loading or exporting weights")
        return self._backend

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("ModelBridge.build_model() must run before loading or exporting weights")
        return self._layout

    # ---- names -------------------------------------------------------------------------------
    def param_infos(self, chunk: torch.nn.Module) -> dict[str, ParamInfo]:
        """Local parameter name -> where it sits in the full model (global layer, global expert); computed once
        per chunk (a model's structure and names do not change)."""
        cached = self._infos.get(id(chunk))
        if cached is None or cached[0]() is not chunk:
            cached = (weakref.ref(chunk), self._compute_param_infos(chunk))
            self._infos = {k: v for k, v in self._infos.items() if v[0]() is not None}
            self._infos[id(chunk)] = cached
        return cached[1]

    def _compute_param_infos(self, chunk: torch.nn.Module) -> dict[str, ParamInfo]:
        model = compat_megatron.gpt_model(chunk)
        layer_map = (
            {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
            if hasattr(model, "decoder")
            else {}
        )
        moe_layers = (
            {i for i, layer in enumerate(model.decoder.layers) if hasattr(layer.mlp, "router")}
            if hasattr(model, "decoder")
            else set()
        )
        num_experts = self.transformer_config.num_moe_experts or 0
        ep_size, ep_rank = self.layout.ep, self.layout.ranks.ep
        # The last stage's output layer is a copy of the embedding when they are tied and live on different stages
        tied_copy = bool(getattr(model, "share_embeddings_and_output_weights", False)) and not getattr(
            model, "pre_process", True
        )
        infos = {}
        for name, param in model.named_parameters():
            canonical = name
            m = _LAYER.match(name)
            if m:
                local_layer = int(m.group(1))
                canonical = f"decoder.layers.{layer_map[local_layer]}." + name[m.end() :]
                canonical = _te_norm_name(canonical, moe=local_layer in moe_layers)
            is_expert = ".mlp.experts." in canonical
            e = _LOCAL_EXPERT.search(canonical)
            if e:  # local spec: experts.local_experts.E.linear_fcN.weight
                local_id, fc = int(e.group(1)), e.group(2)
                canonical = canonical[: e.start()] + f".mlp.experts.{fc}.weight{local_id}"
            if is_expert:  # local expert id -> global id
                prefix, local_id = canonical.rsplit(".weight", 1)
                canonical = f"{prefix}.weight{int(local_id) + ep_rank * (num_experts // ep_size)}"
            tp_split = getattr(param, "tensor_model_parallel", False)
            infos[name] = ParamInfo(
                canonical,
                is_expert,
                int(param.partition_dim) if tp_split else -1,
                tied_copy=tied_copy and name == _OUTPUT_LAYER,
            )
        return infos

    # ---- load --------------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, chunks: list[torch.nn.Module], path: Optional[str] = None) -> None:
        """Fill this rank's shards from HF safetensors. Each rank reads only the tensors it holds;
        no collectives, so any rank subset may call it."""
        from mbridge.core.safetensor_io import SafeTensorIO

        backend = self.backend
        io = SafeTensorIO(path or self.hf_path)
        layout = self.layout
        tp, etp = (layout.tp, layout.ranks.tp), (layout.etp, layout.ranks.etp)
        for chunk in chunks:
            params = dict(compat_megatron.gpt_model(chunk).named_parameters())
            infos = self.param_infos(chunk)
            wanted = {n: backend.hf_names(i.canonical) for n, i in infos.items()}
            hf = io.load_some_hf_weight(sorted({h for names in wanted.values() for h in names}))
            for name, info in infos.items():
                full = backend.to_mcore(info.canonical, [hf[h] for h in wanted[name]])
                size, rank = etp if info.is_expert else tp
                shard = split_shards(info.canonical, full, size, info.partition_dim, backend.gated())[rank]
                param = params[name]
                if shard.shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint shard {tuple(shard.shape)} != model shard {tuple(param.shape)} "
                        f"(from {wanted[name]}); the checkpoint does not match config.json"
                    )
                param.copy_(shard)


def _mark_experts_expert_parallel(chunk: torch.nn.Module) -> None:
    """Route every expert's gradient through the expert-DP reduction, whatever the layout.

    Megatron marks experts (`allreduce=False`) only when ep > 1. With ep == 1 and etp < tp the
    experts are replicated over TP ranks that route different tokens (sequence parallel), and as
    dense params they are reduced over DP only: the TP replicas silently drift apart. Marking them
    always is exact (with ep == etp/tp == 1 the expert-DP group IS the DP group) and keeps the
    optimizer layout-independent (dense + expert optimizers), so checkpoints load across layouts."""
    for name, p in chunk.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False
