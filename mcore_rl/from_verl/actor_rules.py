"""The rules for the cluster, the actor's layout, offload, the model and the micro-batches."""

from __future__ import annotations

import math
from typing import Optional

from mcore_rl.from_verl.keys import MODEL, OT, A, F, M, R
from mcore_rl.from_verl.verl_run import Setting, VerlRun, int_or_note, truthy
from mcore_rl.preflight import context_parallel
from mcore_rl.preflight.layout import VIRTUAL_PP_UNSUPPORTED, virtual_pp_refusal


def cluster(run: VerlRun) -> None:
    run.set(
        "trainer.nnodes", int_or_note(run.get("trainer.nnodes"), "trainer.nnodes", run.out.notes) or 1, "trainer.nnodes"
    )
    nproc = int_or_note(run.get("trainer.n_gpus_per_node"), "trainer.n_gpus_per_node", run.out.notes) or 1
    run.set("trainer.nproc", nproc, "trainer.n_gpus_per_node")
    if run.given("trainer.device"):
        device = str(run.get("trainer.device"))
        if device in ("cuda", "npu", "cpu"):
            run.set("platform", device, "trainer.device")
        else:
            run.mark("trainer.device", "not supported", "platform", f"{device}: cuda / npu / cpu only (auto instead)")
            run.set("platform", "auto", source=f"trainer.device={device} is not a platform here: auto")
    else:
        run.set("platform", "auto", source="trainer.device not set: auto (the platform found at start)")


def layout(run: VerlRun) -> None:
    if run.strategy == "megatron":
        tp = int_or_note(run.get(M + "tensor_model_parallel_size"), "tp", run.out.notes) or 1
        run.set("actor.parallel.tp", tp, M + "tensor_model_parallel_size")
        run.set("actor.parallel.pp", run.get(M + "pipeline_model_parallel_size"), M + "pipeline_model_parallel_size")
        run.set("actor.parallel.ep", run.get(M + "expert_model_parallel_size"), M + "expert_model_parallel_size")
        run.set("actor.parallel.etp", run.get(M + "expert_tensor_parallel_size"), M + "expert_tensor_parallel_size")
        run.set("actor.parallel.cp", run.get(M + "context_parallel_size"), M + "context_parallel_size")
        _virtual_pipeline(run)
        sp = truthy(run.get(M + "sequence_parallel")) and tp > 1
        run.set("actor.parallel.sequence_parallel", sp, M + "sequence_parallel")
        for side in ("first", "last"):
            key = OT + f"num_layers_in_{side}_pipeline_stage"
            if run.given(key):
                run.set(f"actor.parallel.num_layers_in_{side}_stage", run.get(key), key)
        dist = M + "use_distributed_optimizer"
        run.set("actor.optim.use_distributed_optimizer", truthy(run.get(dist)), dist)
        run.mark(A + "strategy", "mapped", "actor.parallel", "megatron")
        return
    # FSDP: every device holds a shard of everything -> data parallelism over the world, optimizer state sharded
    source = f"{run.source(A + 'strategy')} (FSDP): data parallelism over the world"
    for dim in ("tp", "pp", "ep"):
        run.set(f"actor.parallel.{dim}", 1, source=source)
    run.set("actor.optim.use_distributed_optimizer", True, source=f"{source}; FSDP shards the optimizer state")
    run.mark(A + "strategy", "mapped", "actor.parallel", "FSDP -> data parallelism over the world (tp = pp = ep = 1)")
    _ulysses_as_context_parallel(run)
    size = run.get(F + "fsdp_size")
    if size in (-1, None):
        run.mark(F + "fsdp_size", "not needed", "", "-1: one sharding group over all devices")
    else:
        run.mark(F + "fsdp_size", "not supported", "", f"{size}: hybrid sharding; here one group over all DP ranks")


def _virtual_pipeline(run: VerlRun) -> None:
    """Interleaved stages cannot train here (the pre-flight refuses virtual_pp > 1): the plain pipeline instead."""
    key = M + "virtual_pipeline_model_parallel_size"
    size = run.get(key)
    if virtual_pp_refusal(size):
        why = f"{size}: {VIRTUAL_PP_UNSUPPORTED}; the plain pipeline instead (virtual_pp: null)"
        run.mark(key, "not supported", "actor.parallel.virtual_pp", why)
    else:
        run.mark(
            key, "mapped", "actor.parallel.virtual_pp", "null: off" if size is None else "1: the plain pipeline (null)"
        )


def _ulysses_key(run: VerlRun) -> str:
    key = A + "ulysses_sequence_parallel_size"
    return key if run.given(key) else F + "ulysses_sequence_parallel_size"


def ulysses(run: VerlRun) -> int:
    """The FSDP actor's Ulysses sequence-parallel size (1 for the Megatron actor, which has CP instead)."""
    return max(1, run.as_int(_ulysses_key(run), 1)) if run.strategy == "fsdp" else 1


def _ulysses_as_context_parallel(run: VerlRun) -> None:
    """Ulysses SP n -> actor.parallel.cp = n: both split each sequence's tokens over n devices (the same math);
    where cp > 1 cannot run (the pre-flight's platform rule) every device holds whole sequences instead."""
    keys = (F + "ulysses_sequence_parallel_size", A + "ulysses_sequence_parallel_size")
    sp = ulysses(run)
    if sp == 1:
        for key in keys:
            run.mark(key, "not needed", "", "1: no sequence parallelism")
        return
    why = context_parallel.refusal(str(run.get("trainer.device")))  # where the verl run ran (default cuda)
    given = [k for k in keys if run.given(k)]
    if why is None:
        run.set(
            "actor.parallel.cp",
            sp,
            *given,
            source=f"{run.source(_ulysses_key(run))}: Megatron context parallelism of the same size - each "
            f"sequence's tokens split over {sp} devices in load-balanced chunks, keys / values exchanged; not "
            f"Ulysses' all-to-all over heads (the same math)",
        )
        return
    for key in given:
        run.mark(
            key,
            "not supported",
            "actor.parallel.cp",
            f"Ulysses sequence parallelism {sp} would be context parallelism {sp} here, which this platform cannot "
            f"run ({why}); instead every device holds whole sequences (DP over "
            f"the world) and takes the SP group's token budget (ppo_max_token_len_per_gpu x {sp})",
        )


def _context_parallel_size(run: VerlRun) -> int:
    setting = run.out.settings.get("actor.parallel.cp")
    return int(setting.value) if setting and setting.value else 1


def offload(run: VerlRun) -> None:
    keys = (
        (M + "param_offload", M + "grad_offload", M + "optimizer_offload")
        if run.strategy == "megatron"
        else (F + "param_offload", F + "optimizer_offload")
    )
    on = [k for k in keys if truthy(run.get(k))]
    given = [k for k in keys if run.given(k)]
    run.set(
        "actor.offload",
        bool(on),
        *given,
        source="; ".join(run.source(k) for k in (given or keys[:1]))
        + (
            " - verl moves them to the host whenever they are not in use; here actor.offload moves parameters, "
            "gradients and optimizer state to the host around rollout"
            if on
            else ""
        ),
    )
    other = (
        (F + "param_offload", F + "optimizer_offload")
        if run.strategy == "megatron"
        else (M + "param_offload", M + "grad_offload", M + "optimizer_offload")
    )
    for key in other:
        run.mark(key, "no effect in verl", "", f"the {run.strategy} actor does not read it")


def model(run: VerlRun) -> None:
    run.set("model.path", run.get(MODEL + "path"), MODEL + "path")
    dkey = M + "dtype" if run.strategy == "megatron" else F + "dtype"
    dtype = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}.get(
        str(run.get(dkey))
    )
    if dtype is None:
        run.mark(dkey, "not supported", "model.dtype", f"{run.get(dkey)}: bfloat16 instead (float16 fails in Megatron)")
        dtype = "bfloat16"
    run.set("model.dtype", dtype, dkey)
    if run.strategy == "megatron":
        _megatron_recompute(run)
        run.mark(
            MODEL + "enable_gradient_checkpointing",
            "no effect in verl",
            "",
            "the Megatron actor recomputes per override_transformer_config.recompute_*",
        )
        key = OT + "moe_router_dtype"
        if run.given(key) and str(run.get(key)) in ("fp32", "fp64"):
            run.set("model.moe_router_dtype", str(run.get(key)), key)
        elif run.given(key):
            run.mark(key, "not supported", "model.moe_router_dtype", f"{run.get(key)}: fp32 instead (fp32 / fp64)")
            run.set("model.moe_router_dtype", "fp32", source=f"{run.source(key)}: fp32 instead")
        else:
            run.set(
                "model.moe_router_dtype",
                "fp32",
                source=(f"{key} not set: verl's MoE router runs in the model dtype; fp32 here (choices fp32 / fp64)"),
            )
        key = OT + "moe_token_dispatcher_type"
        value = str(run.get(key)) if run.given(key) else "alltoall"
        if value not in ("alltoall", "allgather"):
            run.mark(key, "not supported", "model.moe_token_dispatcher", f"{value}: alltoall instead")
            value = "alltoall"
        run.set(
            "model.moe_token_dispatcher",
            value,
            key,
            source=None if run.given(key) else (f"{key} not set: alltoall (mbridge's default in verl)"),
        )
    else:
        key = MODEL + "enable_gradient_checkpointing"
        run.set("model.recompute", truthy(run.get(key)), key)


def _megatron_recompute(run: VerlRun) -> None:
    keys = [OT + k for k in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")]
    granularity = run.get(keys[0])
    given = [k for k in keys if run.given(k)]
    if granularity in (None, "null", "none", ""):
        run.set("model.recompute", False, *given, source=f"{run.source(keys[0])}: no recompute")
        for k in keys[1:]:
            run.mark(k, "no effect in verl", "", "recompute_granularity is not set")
        return
    if granularity == "selective":
        run.mark(
            keys[0],
            "not supported",
            "model.recompute",
            "selective recompute: here recompute is full (uniform, 1 layer) or off; full instead",
        )
        run.set(
            "model.recompute", True, source=f"{run.source(keys[0])}: full recompute instead (selective is not here)"
        )
        return
    run.set("model.recompute", True, *given)
    method, layers = run.get(keys[1]), run.get(keys[2])
    if method not in (None, "uniform"):
        run.mark(keys[1], "mapped", "model.recompute", f"{method}: uniform here (every layer recomputed)")
    if layers not in (None, 1):
        run.mark(keys[2], "mapped", "model.recompute", f"{layers}: 1 here (the least memory)")


def batch(run: VerlRun) -> None:
    notes = run.out.notes
    prompts = int_or_note(run.get("data.train_batch_size"), "data.train_batch_size", notes) or 1
    run.set("data.prompts_per_step", prompts, "data.train_batch_size")
    mini = int_or_note(run.get(A + "ppo_mini_batch_size"), "ppo_mini_batch_size", notes) or prompts
    key = A + "ppo_mini_batch_size"
    rule = f"{prompts} prompts / {mini} prompts per mini-batch (verl counts prompts, x rollout.n samples)"
    if mini <= 0 or prompts % mini:
        count = max(1, math.ceil(prompts / max(mini, 1)))
        run.mark(
            key,
            "not supported",
            "algo.mini_batches",
            f"{rule} is not whole: verl's last mini-batch is smaller; {count} equal mini-batches here",
        )
        run.set("algo.mini_batches", count, source=f"{run.source(key)}: {rule}, rounded up")
    else:
        run.set("algo.mini_batches", prompts // mini, key, source=f"{run.source(key)}: {rule}")
    run.set("algo.ppo_epochs", run.get(A + "ppo_epochs"), A + "ppo_epochs")
    run.set("rollout.n", run.get(R + "n"), R + "n")
    _micro_batches(run)


def _micro_batches(run: VerlRun) -> None:
    dyn_key, budget_key = A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu"
    sp = ulysses(run)
    if truthy(run.get(dyn_key)):
        budget = run.as_int(budget_key) * sp
        where = "split over the CP group" if _context_parallel_size(run) == sp else "on one device"
        rule = f" x ulysses {sp} (the SP group's budget, {where} here)" if sp > 1 else ""
        run.set(
            "actor.max_tokens_per_micro_batch",
            budget,
            dyn_key,
            budget_key,
            source=f"{run.source(dyn_key)}; {run.source(budget_key)}{rule}",
        )
        for key in (A + "ppo_micro_batch_size_per_gpu", A + "ppo_micro_batch_size"):
            run.mark(key, "no effect in verl", "", "use_dynamic_bsz: micro-batches by tokens")
        forward = _forward_budget(run, sp)
        if forward is not None and forward.value > budget:
            run.out.settings["actor.max_tokens_per_forward_micro_batch"] = forward
        return
    run.mark(budget_key, "no effect in verl", "", "use_dynamic_bsz is false")
    key = A + "ppo_micro_batch_size_per_gpu"
    run.set("actor.max_tokens_per_micro_batch", None, dyn_key, source=f"{run.source(dyn_key)}: sequences a micro-batch")
    if run.get(key) is None and run.given(A + "ppo_micro_batch_size"):
        key = A + "ppo_micro_batch_size"
        dp = max(1, run.out.world // _model_parallel(run))
        per_gpu = max(1, run.as_int(key) // dp)
        run.set("actor.parallel.micro_batch_size", per_gpu, key, source=f"{run.source(key)} / dp {dp} (global in verl)")
        return
    run.set("actor.parallel.micro_batch_size", run.as_int(key, 1), key)


def _model_parallel(run: VerlRun) -> int:
    """tp x pp x cp of the actor as converted so far (the data-parallel size is world / this)."""
    size = 1
    for dim in ("tp", "pp", "cp"):
        setting = run.out.settings.get(f"actor.parallel.{dim}")
        size *= int(setting.value) if setting and setting.value else 1
    return size


def _forward_budget(run: VerlRun, sp: int) -> Optional[Setting]:
    keys = (R + "log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")
    given = [k for k in keys if run.given(k)]
    use_key = R + "log_prob_use_dynamic_bsz"
    if not given or (run.given(use_key) and not truthy(run.get(use_key))):
        for k in given:
            run.mark(k, "no effect in verl", "", "log_prob_use_dynamic_bsz is false")
        return None
    value = max(run.as_int(k) for k in given) * sp
    for k in given:
        run.mark(k, "mapped", "actor.max_tokens_per_forward_micro_batch")
    run.mark(use_key, "mapped", "actor.max_tokens_per_forward_micro_batch")
    return Setting(
        value,
        "; ".join(run.source(k) for k in given)
        + (f" x ulysses {sp}" if sp > 1 else "")
        + " (the larger forward budget)",
    )
