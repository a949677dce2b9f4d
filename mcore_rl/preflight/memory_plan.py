"""Per-rank device memory of a run, by phase, before anything starts: pure Python, no Megatron import.

`plan_memory(cfg, layout, dims, device_gib)` counts, for the most loaded pipeline stage, the bytes one
rank holds in each phase of a step, from the model's dimensions (`ModelDims`), the layout that
`validate_run` derived (`Layout`) and the config. `mcore-rl plan` prints the table, the peak, a verdict
against the device memory and, for a plan that does not fit, the levers that would make it fit.

What each phase holds (see docs/memory.md for the derivations):

  rollout    the engine: weights at rollout.tp + its KV cache (vLLM reserves gpu_memory_utilization x
             device, or weights + kv_cache_gb); the actor's state stays resident (parameters, gradient
             buffers, optimizer state after the first step) and the reference model's parameters (KL),
             unless actor.offload moves them to the host (mcore_rl.megatron.offload: then none of them).
  log-probs  the old-log-prob / reference pass: resident state + one layer's forward working set + the
             log-prob head (the last hidden states and the fused log-prob chunk: no [tokens, V/tp] logits,
             see mcore_rl.megatron.logprobs.fused_output_log_probs) (the engine is asleep); with actor.offload
             the reference model is on the device in this phase only.
  update     resident state + the activations kept for backward (all layers, or one layer's input each
             under full recompute plus one recomputed layer) + the log-prob head with its backward (d hidden,
             the output weight's fp32 gradient accumulator) + the largest parameter's gradient before DDP
             accumulates it; the optimizer step itself.
A micro-batch is micro_batch_size right-padded sequences of max_prompt_len + max_new_tokens, or with a token
budget (actor.max_tokens_per_micro_batch; the forward-only passes: actor.max_tokens_per_forward_micro_batch)
one packed row of that many tokens.
  save       resident state after the step (the checkpoint writer stages tensors on the host).

Resident actor state per rank (P_dense parameters replicated over DP x CP, P_expert over expert DP):
  parameters (model dtype) + gradient buffer (fp32 with grad_reduce_in_fp32, else the model dtype)
  + distributed optimizer shard: fp32 main parameters (half-precision models only), fp32 Adam moments
    (2 x 4 bytes), fp32 main gradients when the buffer is half precision; sharded over DP x CP for
    dense parameters and over expert DP for expert parameters; a fraction `optimizer_offload_fraction`
    of it lives on the host instead (Megatron's HybridDeviceOptimizer).
Activation bytes are the tensors autograd keeps in Megatron's layers as built by this project (local
attention, our RMSNorm, SequentialMLP experts, alltoall dispatcher); device kernels (TE, MindSpeed)
keep fewer, so on a device the activation rows are an upper estimate.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Optional

from mcore_rl.config import Config
from mcore_rl.preflight.host_chunks import HOST_CHUNK_BYTES, pinned_bytes
from mcore_rl.preflight.layout import Layout, LayoutError, ModelDims
from mcore_rl.preflight.run import validate_run

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq (fp32 each)
# Share of the device the runtime keeps outside tensors (allocator caches, communicator buffers,
# kernels): the verdict keeps this headroom.
RUNTIME_RESERVE = 0.08
# vLLM's own non-KV, non-weight memory beyond the weights (activations of its profile run, graphs),
# when kv_cache_gb is given instead of gpu_memory_utilization.
ENGINE_OVERHEAD_GIB = 2.0
# tokens x V/tp values per chunk of the fused log-prob head (mcore_rl.megatron.logprobs projects this many at a
# time): ~64M fp32 values (256 MiB) per [chunk, V/tp] temporary; smaller chunks make thin matrix products and
# re-read the whole fp32 weight-gradient accumulator once per chunk. Defined here, where the plan counts it.
LOGPROB_CHUNK_ELEMENTS = 1 << 26
# fp32 [chunk, V/tp] temporaries alive at once in fused_output_log_probs' forward (z, shifted, exp) and backward
# (log p, g, g's fp32 copy for the weight gradient), plus one in the model dtype (the projection's output / g's cast)
LOGPROB_CHUNK_TEMPS = 3


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline stage `stage` holds."""

    stage: int
    dense: int  # replicated over DP x CP (the distributed optimizer shards them over it)
    expert: int  # replicated over expert DP
    largest: int  # elements of the largest single parameter (its gradient exists once before accumulation)
    first: bool
    last: bool

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _head_dim(dims: ModelDims) -> int:
    return dims.head_dim or dims.hidden // dims.num_attention_heads


def layer_params(dims: ModelDims, layout: Layout) -> tuple[int, int, int]:
    """(dense, expert, largest) parameters of one transformer layer on one rank."""
    h, tp = dims.hidden, layout.tp
    d = _head_dim(dims)
    q, kv = dims.num_attention_heads * d, dims.num_query_groups * d
    qkv = h * (q + 2 * kv) // tp
    proj = q * h // tp
    norms = 2 * h + 2 * d  # input / pre-MLP norms, q / k norms (replicated over TP)
    if dims.num_experts:
        ffn = dims.moe_ffn_hidden_size // layout.etp
        per_expert = 3 * h * ffn  # fc1 (gate + up) and fc2
        router = dims.num_experts * h
        expert = dims.num_experts // layout.ep * per_expert
        return qkv + proj + norms + router, expert, max(qkv, 2 * h * ffn, router)
    ffn = dims.ffn_hidden_size // tp
    return qkv + proj + norms + 3 * h * ffn, 0, max(qkv, 2 * h * ffn)


def stage_params(dims: ModelDims, layout: Layout) -> list[StageParams]:
    """Parameters per rank of every pipeline stage (embedding on the first, norm + output layer on the last)."""
    dense, expert, largest = layer_params(dims, layout)
    table = dims.vocab_size * dims.hidden // layout.tp
    out = []
    for s, layers in enumerate(layout.layers_per_stage):
        first, last = s == 0, s == layout.pp - 1
        d = layers * dense + (table if first else 0)
        if last:
            d += dims.hidden + (0 if (dims.tie_embeddings and first) else table)
        big = max(largest, table if (first or last) else 0)
        out.append(StageParams(s, d, layers * expert, big, first, last))
    return out


def total_params(dims: ModelDims) -> int:
    """Parameters of the whole model (one copy, no parallelism)."""
    whole = Layout(
        world_size=1,
        tp=1,
        pp=1,
        cp=1,
        dp=1,
        ep=1,
        etp=1,
        edp=1,
        vpp=None,
        sequence_parallel=False,
        micro_batch_size=1,
        layers_per_stage=(dims.num_layers,),
        num_layers_in_first_stage=None,
        num_layers_in_last_stage=None,
        padded_vocab_size=dims.vocab_size,
        seq_len_multiple=1,
    )
    return stage_params(dims, whole)[0].total


def checkpoint_bytes(cfg: Config, dims: ModelDims) -> int:
    """Bytes of one checkpoint on disk: the weights in model.dtype plus the optimizer's fp32 state of every
    parameter (main copy, exp_avg, exp_avg_sq), whatever the layout (mcore_rl.megatron.checkpoint)."""
    return total_params(dims) * (DTYPE_BYTES[cfg.model.dtype] + (1 + ADAM_MOMENTS) * FP32)


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int


@dataclass(frozen=True)
class Phase:
    name: str
    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)


@dataclass(frozen=True)
class StateBytes:
    """The actor's resident state on one rank (device side)."""

    params: int
    grads: int
    main_params: int  # fp32 copy of this rank's shard (half-precision models)
    moments: int  # Adam exp_avg + exp_avg_sq of this rank's shard
    main_grads: int  # fp32 copy of the shard's gradients when the buffer is half precision
    host: int  # optimizer bytes kept on the host (optimizer_offload_fraction)

    @property
    def optimizer(self) -> int:
        return self.main_params + self.moments + self.main_grads


def state_bytes(cfg: Config, layout: Layout, sp: StageParams) -> StateBytes:
    b = DTYPE_BYTES[cfg.model.dtype]
    o = cfg.actor.optim
    grad_b = FP32 if (o.grad_reduce_in_fp32 or b == FP32) else b
    if o.use_distributed_optimizer:
        shard = math.ceil(sp.dense / (layout.dp * layout.cp)) + math.ceil(sp.expert / layout.edp)
    else:
        shard = sp.total
    main_params = shard * FP32 if b != FP32 else 0
    moments = shard * FP32 * ADAM_MOMENTS
    main_grads = shard * FP32 if grad_b != FP32 else 0
    device = 1.0 - o.optimizer_offload_fraction
    opt = main_params + moments + main_grads
    return StateBytes(
        params=sp.total * b,
        grads=sp.total * grad_b,
        main_params=int(main_params * device),
        moments=int(moments * device),
        main_grads=int(main_grads * device),
        host=opt - int(opt * device),
    )


@dataclass(frozen=True)
class Tokens:
    """Token counts of one micro-batch on one rank."""

    seq: int  # row length: a padded sequence (prompt + response), or a packed row (the token budget)
    attn: int  # tokens of this CP rank: rows * seq / cp
    local: int  # tokens in sequence-parallel regions: attn / tp under sequence parallelism
    rows: int = 1  # rows of the micro-batch: micro_batch_size padded sequences, or one packed row


def token_budget(cfg: Config, forward: bool = False) -> Optional[int]:
    """The micro-batch token budget (None: fixed-size micro-batches); `forward`: the forward-only passes'."""
    budget = cfg.actor.max_tokens_per_micro_batch
    if forward and budget is not None:
        return cfg.actor.max_tokens_per_forward_micro_batch or budget
    return budget


def micro_batch_tokens(cfg: Config, layout: Layout, forward: bool = False) -> Tokens:
    """The largest micro-batch a step can reach: micro_batch_size sequences right-padded to max_prompt_len +
    max_new_tokens, or with a token budget one packed row of budget tokens (padded for TP + SP)."""
    budget = token_budget(cfg, forward)
    if budget is None:
        rows, seq = layout.micro_batch_size, layout.pad_length(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    else:
        rows, seq = 1, layout.pad_length(budget)
    attn = rows * seq // layout.cp
    local = attn // layout.tp if layout.sequence_parallel else attn
    return Tokens(seq, attn, local, rows)


def layer_activation_bytes(dims: ModelDims, layout: Layout, tok: Tokens, b: int) -> int:
    """Bytes one transformer layer keeps for backward on one rank (no recompute).

    Attention (T = tokens of this CP rank, t = T / tp under sequence parallelism, q = heads * head_dim; with
    context parallelism a rank's queries attend over its sequences' keys / values gathered from all cp ranks):
      input norm: fp32 input + normalised output (4 + b) t h, and the QKV linear's input b t h
      q / k norms: (4 + b) T (q + kv) / tp; rotated q and the context: 2 b T q / tp; the GQA-expanded k and v
      of the whole sequences (cp T tokens): 2 b cp T q / tp
      scores: fp32 softmax output + its cast, (4 + b) per score (b = 4: the same tensor), this rank's queries
      over the whole sequence's keys: mbs * heads/tp * (s / cp) * s
    MoE (k = top-k, f = expert FFN / etp, E = experts): pre-MLP norm (4 + b) t h, router input in fp32
      4 t h (b < 4), router probabilities 3 x 4 t E; per routed row (t k of them): the sorted tokens and
      the expert outputs before unpermute 2 b h, fc1 output + SiLU + product 4 b f.
    Dense MLP (f = FFN / tp): fc1 input b t h, fc1 output + SiLU + product 4 b T f.
    """
    h, tp = dims.hidden, layout.tp
    d = _head_dim(dims)
    q, kv = dims.num_attention_heads * d, dims.num_query_groups * d
    t, T = tok.local, tok.attn
    half = b if b != FP32 else 0  # a cast to fp32 of an fp32 tensor is the tensor itself
    attn = (FP32 + half + b) * t * h
    attn += (FP32 + half) * T * (q + kv) // tp + 2 * b * T * q // tp + 2 * b * T * layout.cp * q // tp
    heads = dims.num_attention_heads // tp
    attn += (FP32 + half) * tok.rows * heads * (tok.seq // layout.cp) * tok.seq
    if dims.num_experts:
        f = dims.moe_ffn_hidden_size // layout.etp
        rows = t * dims.moe_top_k
        mlp = (FP32 + half) * t * h + (FP32 * t * h if b != FP32 else 0) + 3 * FP32 * t * dims.num_experts
        mlp += rows * (2 * b * h + 4 * b * f)
    else:
        f = dims.ffn_hidden_size // tp
        mlp = (FP32 + half) * t * h + b * t * h + 4 * b * T * f
    return attn + mlp


def head_bytes(dims: ModelDims, layout: Layout, tok: Tokens, b: int, backward: bool) -> int:
    """The log-prob head on the last stage (the actor's path: the model stops at the last hidden states and
    fused_output_log_probs projects one chunk of tokens at a time; no [T, V/tp] logits exist):
    the hidden states [T, h] as the loss holds them (fp32 from Float16Module, b < 4, and the cast back to the
    model dtype for the projection), the chunk's temporaries (LOGPROB_CHUNK_TEMPS fp32 [chunk, V/tp] + one in
    the model dtype); in backward also d hidden [T, h] and the fp32 accumulator of the output weight's
    gradient [V/tp, h] (its cast to the model dtype is the "largest parameter's gradient" item)."""
    v, h = dims.vocab_size // layout.tp, dims.hidden
    half = b if b != FP32 else 0
    chunk = min(tok.attn, max(1, LOGPROB_CHUNK_ELEMENTS // v)) * v * (FP32 * LOGPROB_CHUNK_TEMPS + half)
    out = tok.attn * h * (FP32 + half) + chunk
    if backward:
        out += tok.attn * h * b + v * h * FP32
    return out


@dataclass(frozen=True)
class EngineBytes:
    weights: int
    kv_cache: int
    kv_tokens: int  # tokens the KV cache holds on this rank's replica
    needed_tokens: int  # tokens of all the replica's samples at once


def engine_bytes(cfg: Config, dims: ModelDims, layout: Layout, device_bytes: Optional[int]) -> EngineBytes:
    """The rollout engine on one rank: vLLM at rollout.tp (weights, KV cache), or the embedded engine
    (a full copy of the model, KV cache of all this rank's samples). The samples split over the ranks that
    generate: every rank, or the separate placement's rollout ranks."""
    r = cfg.rollout
    generating = layout.rollout_ranks or layout.world_size
    b = DTYPE_BYTES[cfg.model.dtype]
    seq = cfg.data.max_prompt_len + r.max_new_tokens
    samples = cfg.data.prompts_per_step * r.n
    d = _head_dim(dims)
    kv_per_token = 2 * dims.num_layers * dims.num_query_groups * d * b  # K and V, whole model
    if r.engine == "embedded":
        weights = total_params(dims) * b
        mine = -(-samples // generating)
        return EngineBytes(weights, kv_per_token * mine * seq, mine * seq, mine * seq)
    weights = total_params(dims) * b // r.tp
    per_rank_token = kv_per_token // min(r.tp, dims.num_query_groups)  # KV heads replicate beyond their count
    if r.kv_cache_gb is not None:
        kv = int(r.kv_cache_gb * GIB)
    elif device_bytes is not None:
        kv = max(0, int(r.gpu_memory_utilization * device_bytes) - weights - int(ENGINE_OVERHEAD_GIB * GIB))
    else:
        kv = 0
    replicas = generating // r.tp
    need = -(-samples // replicas) * seq
    return EngineBytes(weights, kv, kv // max(per_rank_token, 1), need)


@dataclass(frozen=True)
class MemoryPlan:
    phases: tuple[Phase, ...]
    stage: int  # the pipeline stage the table shows (the most loaded one)
    device_bytes: Optional[int]
    state: StateBytes
    engine: EngineBytes
    notes: tuple[str, ...]
    levers: tuple[str, ...]  # what would make a misfit fit (empty when it fits)
    role: str = ""  # separate placement: "actor" or "rollout" (preflight.role_memory); "": colocated, both

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def usable_bytes(self) -> Optional[int]:
        return None if self.device_bytes is None else int(self.device_bytes * (1 - RUNTIME_RESERVE))

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_bytes is None else self.peak.total <= self.usable_bytes

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        width = max(len(i.name) for p in self.phases for i in p.items) + 2
        where = "" if self.role == "rollout" else f", pipeline stage {self.stage}"
        lines = [f"per-rank device memory{f' of one {self.role} rank' if self.role else ''}{where} (GiB)"]
        for p in self.phases:
            lines.append(f"  {p.name:<{width}} {_gib(p.total):>8}")
            lines += [f"    {i.name:<{width - 2}} {_gib(i.bytes):>8}" for i in p.items if i.bytes]
        lines.append(f"  peak: {self.peak.name} {_gib(self.peak.total)} GiB")
        if self.state.host:
            lines.append(f"  host: optimizer state offloaded {_gib(self.state.host)} GiB per rank")
        lines += [f"  note: {n}" for n in self.notes]
        if self.device_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(
                f"verdict: {verdict} on a {_gib(self.device_bytes)} GiB device "
                f"(usable {_gib(self.usable_bytes)} GiB after {RUNTIME_RESERVE:.0%} runtime reserve)"
            )
            lines += [f"  to fit: {lever}" for lever in self.levers]
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _phases(cfg: Config, dims: ModelDims, layout: Layout, sp: StageParams, device_bytes: Optional[int]):
    b = DTYPE_BYTES[cfg.model.dtype]
    st = state_bytes(cfg, layout, sp)
    tok = micro_batch_tokens(cfg, layout)
    tok_fwd = micro_batch_tokens(cfg, layout, forward=True)
    layers = layout.layers_per_stage[sp.stage]
    act = layer_activation_bytes(dims, layout, tok, b)
    ref = sp.total * b if cfg.algo.kl_coef > 0 else 0
    eng = engine_bytes(cfg, dims, layout, device_bytes)
    actor = [
        Item("actor parameters", st.params),
        Item("actor gradient buffer", st.grads),
        Item("optimizer shard (after step 1)", st.optimizer),
    ]
    # actor.offload: the reference model is on the device during its own pass (the log-probs phase) only
    resident = actor + [Item("reference parameters", 0 if cfg.actor.offload else ref)]
    with_ref = actor + [Item("reference parameters", ref)]
    rollout = Phase("rollout", tuple(engine_items(cfg, eng, device_bytes) + ([] if cfg.actor.offload else resident)))
    head_fwd = head_bytes(dims, layout, tok_fwd, b, backward=False) if sp.last else 0
    act_fwd = layer_activation_bytes(dims, layout, tok_fwd, b)
    logprob = Phase(
        "log-probs",
        tuple(with_ref + [Item("one layer's forward", act_fwd), Item("hidden states + log-prob chunk", head_fwd)]),
    )
    # 1F1B keeps up to pp - stage micro-batches in flight on stage `stage`.
    in_flight = min(layout.pp - sp.stage, _micro_batches(cfg, layout))
    if cfg.model.recompute:
        kept = in_flight * layers * tok.local * dims.hidden * b + act  # layer inputs + one recomputed layer
        act_name = "activations (full recompute)"
    else:
        kept = in_flight * layers * act
        act_name = "activations"
    head_bwd = head_bytes(dims, layout, tok, b, backward=True) if sp.last else 0
    update = Phase(
        "update",
        tuple(
            resident
            + [
                Item(act_name, kept),
                Item("hidden states, log-prob chunk, gradients", head_bwd),
                Item("largest parameter's gradient", sp.largest * b),
            ]
        ),
    )
    save = Phase("save", tuple(resident + _save_items(cfg, layout, sp)))
    if layout.rollout_ranks:  # separate: no engine on the actor's ranks; they send the export bucket by bucket
        send = Phase("weight send", tuple(resident + [sync_bucket(cfg, dims)]))
        return (logprob, update, save, send), st, eng, act
    return (rollout, logprob, update, save), st, eng, act


def engine_items(cfg: Config, eng: EngineBytes, device_bytes: Optional[int]) -> list[Item]:
    """The engine's rows: vLLM sized by gpu_memory_utilization x the device as one, else its parts."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.kv_cache_gb is None and device_bytes is not None:
        return [
            Item(
                f"engine (gpu_memory_utilization {cfg.rollout.gpu_memory_utilization})",
                eng.weights + eng.kv_cache + int(ENGINE_OVERHEAD_GIB * GIB),
            )
        ]
    overhead = int(ENGINE_OVERHEAD_GIB * GIB) if cfg.rollout.engine == "vllm" else 0
    return [
        Item("engine weights", eng.weights),
        Item("engine KV cache", eng.kv_cache),
        Item("engine runtime", overhead),
    ]


def sync_bucket(cfg: Config, dims: ModelDims) -> Item:
    """One bucket of the weight sync across the separate placement's split, on either side: rollout.sync_bucket_mb
    of full HF tensors (at most the whole model), or the largest tensor (the embedding) where that is bigger."""
    b = DTYPE_BYTES[cfg.model.dtype]
    bucket = min(int(cfg.rollout.sync_bucket_mb * (1 << 20)), total_params(dims) * b)
    return Item("weight sync bucket", max(bucket, dims.vocab_size * dims.hidden * b))


def _save_items(cfg: Config, layout: Layout, sp: StageParams) -> list[Item]:
    """What a checkpoint save adds (mcore_rl.megatron.checkpoint: distributed-optimizer state in the
    "fully_reshardable" format, gathered with gloo into host memory of DP rank 0; Megatron's torch_dist
    writer copies device tensors to the host). Nothing on an accelerator. On platform=cpu the host IS
    the device: the writer clones every tensor that is a view of a larger storage (parameters in DDP's
    flat buffers, shards of a split tensor: counted as one copy of the parameters), and DP rank 0 holds
    the gathered fp32 state (param, exp_avg, exp_avg_sq) of every parameter, plus its own shard of the
    largest buffer, that buffer's gathered list and its concatenation."""
    if cfg.platform != "cpu":
        return []
    items = [Item("checkpoint: writer's copies of parameter views (cpu)", sp.total * DTYPE_BYTES[cfg.model.dtype])]
    if cfg.actor.optim.use_distributed_optimizer:
        biggest, shards = max((sp.dense, layout.dp * layout.cp), (sp.expert, layout.edp))
        host = 3 * FP32 * sp.total + 3 * FP32 * biggest // shards + 2 * FP32 * biggest
        items.append(Item("checkpoint: gathered optimizer state (cpu)", host))
    return items


def _micro_batches(cfg: Config, layout: Layout) -> int:
    """Micro-batches of one mini-batch on one rank (with a token budget: when every sequence is the longest)."""
    samples = cfg.data.prompts_per_step * cfg.rollout.n // (layout.dp * cfg.algo.mini_batches)
    budget = token_budget(cfg)
    per_micro = (
        layout.micro_batch_size if budget is None else budget // (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    )
    return max(1, samples // max(1, per_micro))


def plan_memory(
    cfg: Config, layout: Layout, dims: ModelDims, device_gib: Optional[float] = None, with_levers: bool = True
):
    """The memory plan of `cfg` in `layout` (from `validate_run`) for a model of `dims`; for a misfit
    (and `with_levers`) also the single changes that would make it fit. A `MemoryPlan`, or for the separate
    placement a `role_memory.RolePlans` (one plan per role, the same fits / peak / table)."""
    dims = ModelDims.from_hf(dims)
    if layout.rollout_ranks:
        from mcore_rl.preflight.role_memory import plan_roles

        return plan_roles(cfg, layout, dims, device_gib, with_levers)
    return rank_plan(cfg, layout, dims, device_gib, with_levers)


def rank_plan(
    cfg: Config, layout: Layout, dims: ModelDims, device_gib: Optional[float] = None, with_levers: bool = True
) -> MemoryPlan:
    """The plan of a rank that trains: colocated, every rank; separate, an actor rank (`plan_memory`)."""
    device_bytes = None if device_gib is None else int(device_gib * GIB)
    best = None
    for sp in stage_params(dims, layout):
        phases, st, eng, act = _phases(cfg, dims, layout, sp, device_bytes)
        peak = max(p.total for p in phases)
        if best is None or peak > best[0]:
            best = (peak, sp, phases, st, eng)
    _, sp, phases, st, eng = best
    notes = []
    if cfg.actor.offload:
        ref = sp.total * DTYPE_BYTES[cfg.model.dtype] if cfg.algo.kl_coef > 0 else 0
        pinned = pinned_bytes(st.params + st.optimizer) + pinned_bytes(ref)  # actor and reference: own chunks
        notes.append(
            f"actor.offload: host memory per rank {_gib(st.params + st.optimizer + ref)} GiB (actor parameters and "
            f"optimizer state during rollout, reference parameters outside their pass; gradients are released, "
            f"not copied), pinned in {HOST_CHUNK_BYTES >> 20} MiB chunks: {_gib(pinned)} GiB per rank, "
            f"beside the engine's own sleep backup"
        )
    if cfg.rollout.engine == "vllm" and not layout.rollout_ranks:
        notes.append(
            f"vLLM KV cache holds ~{eng.kv_tokens:,} tokens per replica; all its samples at once need {eng.needed_tokens:,}"
        )
    plan = MemoryPlan(
        phases, sp.stage, device_bytes, st, eng, tuple(notes), (), "actor" if layout.rollout_ranks else ""
    )
    if plan.fits is False and with_levers:
        plan = replace(plan, levers=tuple(levers(cfg, layout, dims, plan)))
    return plan


def levers(cfg: Config, layout: Layout, dims: ModelDims, plan: MemoryPlan) -> list[str]:
    """Each change that alone brings the peak under the usable device memory, with its new peak."""
    out = []
    candidates = []
    o = cfg.actor.optim
    if not o.use_distributed_optimizer:
        candidates.append(
            ("actor.optim.use_distributed_optimizer=true", _with(cfg, "actor.optim.use_distributed_optimizer", True))
        )
    if o.grad_reduce_in_fp32 and cfg.model.dtype != "float32":
        candidates.append(
            ("actor.optim.grad_reduce_in_fp32=false", _with(cfg, "actor.optim.grad_reduce_in_fp32", False))
        )
    if not cfg.model.recompute:
        candidates.append(("model.recompute=true", _with(cfg, "model.recompute", True)))
    if not cfg.actor.offload and not layout.rollout_ranks:  # separate: nothing to offload for
        candidates.append(("actor.offload=true", _with(cfg, "actor.offload", True)))
    if o.optimizer_offload_fraction < 1.0 and cfg.platform != "cpu":
        candidates.append(
            ("actor.optim.optimizer_offload_fraction=1.0", _with(cfg, "actor.optim.optimizer_offload_fraction", 1.0))
        )
    if cfg.rollout.engine == "vllm":
        for util in (0.5, 0.4, 0.3):
            if util < cfg.rollout.gpu_memory_utilization:
                candidates.append(
                    (f"rollout.gpu_memory_utilization={util}", _with(cfg, "rollout.gpu_memory_utilization", util))
                )
    if cfg.rollout.max_new_tokens > 1024:
        half = cfg.rollout.max_new_tokens // 2
        shorter = _with(cfg, "rollout.max_new_tokens", half)
        label = f"rollout.max_new_tokens={half}"
        if token_budget(cfg) is not None:  # the budget holds the longest sequence: it shrinks with it
            budget = cfg.data.max_prompt_len + half
            shorter = _with(
                _with(shorter, "actor.max_tokens_per_micro_batch", budget),
                "actor.max_tokens_per_forward_micro_batch",
                None,
            )
            label += f" + actor.max_tokens_per_micro_batch={budget}"
        candidates.append((f"{label} (token budget)", shorter))
    for label, c in candidates:
        p = rank_plan(c, layout, dims, plan.device_bytes / GIB, with_levers=False)
        if p.fits:
            out.append(f"{label} -> peak {_gib(p.peak.total)} GiB ({p.peak.name})")
    out += layout_levers(cfg, layout, dims, plan)
    if not out:
        out.append("no single change suffices: combine the levers above, or a layout with more ranks (dp / ep / pp)")
    return out


def layout_levers(cfg: Config, layout: Layout, dims: ModelDims, plan: MemoryPlan, count: int = 2) -> list[str]:
    """Other layouts of the same world size (tp, pp, ep; etp 1; cp as it is, or 2x / 4x it: context parallelism
    divides the activations of long sequences) that fit, lowest peak first."""
    found = []
    world = layout.world_size + layout.rollout_ranks  # the whole job: validate_run splits it again
    for tp, pp, cp, ep in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), _cp_sizes(layout.cp), (1, 2, 4, 8, 16, 32, 64)):
        if (tp, pp, cp, ep) == (layout.tp, layout.pp, layout.cp, layout.ep) or world % (tp * pp * cp):
            continue
        c = cfg
        for key, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", 1)):
            c = _with(c, f"actor.parallel.{key}", value)
        try:
            lay = validate_run(c, world, dims)
        except LayoutError:
            continue
        p = rank_plan(c, lay, dims, plan.device_bytes / GIB, with_levers=False)
        if p.fits:
            sizes = f"tp{tp} pp{pp}" + (f" cp{cp}" if cp > 1 else "") + f" ep{ep} etp1"
            found.append(
                (
                    p.peak.total,
                    f"layout {sizes} (dp{lay.dp}, edp{lay.edp}) -> peak {_gib(p.peak.total)} GiB ({p.peak.name})",
                )
            )
    return [text for _, text in sorted(found)[:count]]


def _cp_sizes(cp: int) -> tuple[int, ...]:
    """The context-parallel sizes a layout lever tries: the run's, and 2x / 4x it."""
    return (cp, 2 * cp, 4 * cp)


def _with(cfg: Config, dotted: str, value) -> Config:
    section, *rest = dotted.split(".")
    if not rest:
        return replace(cfg, **{section: value})
    return replace(cfg, **{section: _with(getattr(cfg, section), ".".join(rest), value)})
