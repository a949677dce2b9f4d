"""The actor: the only object that talks to Megatron. Model chunks + optimizer + LR schedule of one
process, driven through Megatron's pipeline schedules so that one code path serves every
TP/PP/EP/CP/DP layout, plus the passes the RL loop needs:

  log_probs(micro_batches, ...)        old-policy / reference log-probs (+ entropy, + R2 route recording)
  probe_log_probs(sequences, ...)      the reference for weight-sync verification
  train_policy(mini_batch, algo, on_policy)  one optimizer step of the policy loss (replaying routes under
                                       R2/R3; on_policy: old log-probs from the update's own forward)
  masked_sum(values, micro_batches)    a per-token quantity summed over response tokens of all DP ranks
  export_hf_weights() / save_hf(dir)   full Hugging Face tensors (collective) / an HF folder
  save_checkpoint(dir) / load_checkpoint(dir)
  Actor.frozen(cfg)                    the reference model: no DDP wrapper, no gradients, no optimizer
  offload() / reload() / resident()    state to host memory and back (actor.offload; mcore_rl.megatron.offload)

All of them are collective over the ranks of the job. The generic entry points under them:
  forward_only(micro_batches, post_fn) -> list[Tensor]   per-micro-batch results of post_fn
  train_step(micro_batches, loss_fn)   -> dict[str, float] reduced metrics

Conventions the caller relies on:
  * post_fn / loss_fn receive, on the last stage, an `OutputHead`: the last hidden states [b, s, h] and
    this rank's output-weight shard [V/tp, h] (vocabulary-parallel over TP), not logits: the model stops
    before its output projection (mcore_rl.compat.megatron.output_hidden_states) and the log-probs come
    from `OutputHead.log_probs` (fused_output_log_probs), so no [tokens, V/tp] logits tensor exists in
    forward or backward. Use the helpers in mcore_rl.megatron.policy_loss.
  * loss_fn returns (loss, metrics) where `loss` is already divided by GLOBAL counts, so the sum of
    loss_fn outputs over all micro-batches of all data-parallel ranks IS the global loss. We undo
    Megatron's division by the micro-batch count and DDP's average over DP x CP, so gradients equal
    the gradient of that global loss for any layout and any number of micro-batches.
  * Sequences are right-padded (the causal mask makes pads invisible to real tokens; Megatron's RoPE
    uses positions 0..s-1, so left padding would shift positions) or packed (`MicroBatch.seq_lengths`:
    one row of concatenated sequences, attention confined to each, see mcore_rl.megatron.attention_inputs;
    outputs keep the packed alignment). Mask pads in the loss.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, Optional

import torch

from mcore_rl import safety
from mcore_rl.batch import (
    MicroBatch,
    MiniBatch,
    forward_groups,
    merge_packed,
    pack_token_lists,
    partition_by_tokens,
    unpack_rows,
)
from mcore_rl.compat.megatron import drop_received_activations, output_hidden_states
from mcore_rl.compat.megatron_optim import StepOutcome, guarded_step
from mcore_rl.compat.megatron_state import actor_state
from mcore_rl.config import AlgoConfig, Config, OptimConfig
from mcore_rl.megatron import checkpoint
from mcore_rl.megatron.attention_inputs import model_inputs
from mcore_rl.megatron.context_parallel import packed_params, plan_shard, shard, take_local, unshard
from mcore_rl.megatron.logprobs import OutputHead
from mcore_rl.megatron.offload import HostOffload
from mcore_rl.megatron.parallel import init_parallel
from mcore_rl.megatron.policy_loss import make_log_prob_fn, make_policy_loss_fn
from mcore_rl.megatron.routing_replay import RecordedRoutes, RoutingReplay
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.models.hf_io import write_hf_folder
from mcore_rl.platform import Platform, collectives, get_platform
from mcore_rl.preflight.layout import Layout
from mcore_rl.run_dir import OutputWriteError, write_failure
from mcore_rl.weight_sync.exporter import HFExporter

logger = logging.getLogger(__name__)

PostFn = Callable[[OutputHead, MicroBatch], torch.Tensor]
LossFn = Callable[[OutputHead, MicroBatch], "tuple[torch.Tensor, dict]"]


def _build_optimizer(chunks, optim: OptimConfig, dtype: torch.dtype, total_steps: int):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        # HybridDeviceOptimizer (megatron-core 0.12.1 and 0.16.1 both have these fields)
        optimizer_cpu_offload=optim.optimizer_offload_fraction > 0,
        optimizer_offload_fraction=optim.optimizer_offload_fraction,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    decay_steps = optim.decay_steps or total_steps  # warmup < decay steps: checked at load (config.py)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(decay_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _wrap_ddp(chunks, transformer_config, optim: OptimConfig, dtype: torch.dtype):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=optim.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if dtype != torch.float32:  # casts inputs/outputs around a half-precision model
            chunk = Float16Module(transformer_config, chunk)
        wrapped.append(
            DistributedDataParallel(
                config=transformer_config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
            )
        )
    return wrapped


def _freeze(chunks, transformer_config, dtype: torch.dtype):
    """The reference model's chunks: no DDP (so no gradient buffers), parameters without gradients."""
    from megatron.core.transformer.module import Float16Module

    frozen = []
    for chunk in chunks:
        chunk.requires_grad_(False)
        frozen.append(Float16Module(transformer_config, chunk) if dtype != torch.float32 else chunk)
    return frozen


class Actor:
    """Model chunks (DDP-wrapped, or frozen) + Megatron optimizer + LR scheduler of one process."""

    def __init__(
        self,
        cfg: Config,
        platform: Optional[Platform] = None,
        with_optimizer: bool = True,
        load_weights: bool = True,
        frozen: bool = False,
    ):
        """`frozen`: the reference model (see `Actor.frozen`); implies no optimizer."""
        from megatron.core.distributed import finalize_model_grads

        self.cfg = cfg
        self.platform = platform or get_platform(cfg.platform)
        self.bridge = ModelBridge(cfg.model.path, self.platform)
        self.layout: Layout = init_parallel(
            cfg.actor.parallel, self.platform, self.bridge.hf_config, seed=cfg.trainer.seed
        )
        chunks = self.bridge.build_model(self.layout, cfg.model)
        self.exporter = HFExporter(self.bridge)
        if load_weights:
            self.bridge.load_hf_weights(chunks)
        self.dtype = chunks[0].config.params_dtype
        self.tf_config = self.bridge.transformer_config
        self.optimizer = self.scheduler = None
        self.replay = None  # RoutingReplay, when cfg.algo.routing_replay is set (enable_routing_replay)
        # the reference model never changes: its host copy is made once (HostOffload.read_only)
        self._host = HostOffload(self.platform, read_only=frozen)
        if frozen:
            self.model = _freeze(chunks, self.tf_config, self.dtype)
            return
        self.model = _wrap_ddp(chunks, self.tf_config, cfg.actor.optim, self.dtype)
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        if with_optimizer:
            self.optimizer, self.scheduler = _build_optimizer(
                self.model, cfg.actor.optim, self.dtype, cfg.trainer.steps
            )

    @classmethod
    def frozen(cls, cfg: Config, platform: Optional[Platform] = None) -> "Actor":
        """The KL reference: the initial policy in the same layout, forward only (no DDP, no gradients)."""
        return cls(cfg, platform, with_optimizer=False, frozen=True)

    # ---- host memory (actor.offload) ---------------------------------------------------------
    def offload(self) -> int:
        """Parameters, DDP's parameter / gradient buffers, module buffers and optimizer state (main parameters,
        Adam moments) to host memory; their device storages are released (resized to 0 bytes). Gradients are
        released without a copy (they are zeroed before the next use). Returns the bytes released; collective
        only in that every rank should do it at the same point. Idempotent."""
        state = actor_state(self.model, self.optimizer)
        return self._host.offload(state.kept, state.gradients)

    def reload(self) -> int:
        """Undo `offload`: the same storages get their bytes back, bit for bit (gradients: zeros)."""
        return self._host.reload()

    @property
    def offloaded(self) -> bool:
        return self._host.offloaded

    @property
    def host_bytes(self) -> int:
        """Host memory holding this actor's offloaded state now."""
        return self._host.host_bytes

    @contextlib.contextmanager
    def resident(self) -> Iterator["Actor"]:
        """On the device inside the block; back to where it was (host or device) after it."""
        was_offloaded = self.offloaded
        self.reload()
        try:
            yield self
        finally:
            if was_offloaded:
                self.offload()

    def _require_resident(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what}: the actor's state is in host memory (offloaded); call reload() first")

    # ---- helpers -----------------------------------------------------------------------------
    @property
    def chunks(self) -> list[torch.nn.Module]:
        return self.model

    @property
    def hf_config(self):
        return self.bridge.hf_config

    def _check(self, micro_batches: list[MicroBatch]) -> int:
        if not micro_batches:
            raise ValueError("no micro-batches given: pass at least one MicroBatch per rank")
        if len({mb.packed for mb in micro_batches}) > 1:
            raise ValueError("a pass mixes packed and right-padded micro-batches: build them with one split_for_rank")
        multiple = self.layout.seq_len_multiple
        for s in {mb.tokens.shape[1] for mb in micro_batches}:
            if s % multiple:
                raise ValueError(
                    f"sequence length {s} is not a multiple of {multiple} (sequence parallel over tp = "
                    f"{self.layout.tp}): right-pad micro-batches to a multiple of {multiple}"
                )
        return max(mb.tokens.shape[1] for mb in micro_batches)

    def _run_schedule(self, micro_batches: list[MicroBatch], loss_func_for: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config

        self._require_resident("a forward / backward pass")
        self._check(micro_batches)
        device = self.platform.device
        mode = self.platform.packed_attention
        plans = [self._cp_plan(mb) for mb in micro_batches]
        inputs = [self._model_inputs(mb.to(device), plan, mode) for mb, plan in zip(micro_batches, plans)]
        # pipeline stages exchange activation shapes first when micro-batches differ in length
        # (packed micro-batches); the schedule reads this flag from the model's config at each p2p call
        shapes = {mb.tokens.shape for mb, _, _ in inputs}
        get_model_config(self.model[0]).variable_seq_lengths = len(shapes) > 1
        seq_len, batch_size = self._schedule_shape(shapes)
        cp_group = self.layout.groups.cp if self.layout.cp > 1 else None
        batches = iter(inputs)

        def forward_step(data_iterator, model):
            mb, attention_mask, extra = next(data_iterator)
            with output_hidden_states(model) as weight:  # last stage: [b, s, h], not logits
                output = model(mb.tokens, mb.position_ids, attention_mask, **extra)
            # the schedule calls loss_func(output) on the last stage
            return output, lambda hidden: loss_func_for(mb, OutputHead(hidden, weight, cp_group))

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=batch_size,
            forward_only=forward_only,
        )
        # the schedule leaves the last received activation [s, b, h] on each later stage's decoder: drop it, so that
        # nothing of the pass stays on the device (while offloaded, during rollout)
        drop_received_activations(self.model)
        return outputs, plans

    def _schedule_shape(self, shapes: set) -> tuple[int, int]:
        """(seq_length, micro_batch_size) for Megatron's schedule from the [b, s] of the micro-batches as this rank
        computes them: its p2p activations between stages are [seq_length / cp (/ tp under SP), b, h], so under
        context parallelism (a rank's part of the rows: one packed row of T / cp tokens) it is given T."""
        return max(s[1] for s in shapes) * self.layout.cp, max(s[0] for s in shapes)

    def _cp_plan(self, mb: MicroBatch):
        """The context-parallel split of `mb` (None at cp = 1): mcore_rl.megatron.context_parallel."""
        if self.layout.cp == 1:
            return None
        local_multiple = self.layout.tp if self.layout.sequence_parallel else 1
        return plan_shard(mb, self.layout.cp, self.layout.ranks.cp, local_multiple)

    def _model_inputs(self, mb: MicroBatch, plan, mode: str):
        """(micro-batch as this rank computes it, attention mask, extra forward kwargs)."""
        if plan is None:
            return (mb, *model_inputs(mb, mode))
        local = shard(mb, plan)
        return local, None, {"packed_seq_params": packed_params(plan, self.layout.groups.cp, mb.tokens.device)}

    def _unshard(self, result: torch.Tensor, plan) -> torch.Tensor:
        """A forward-only result of this rank's part of the sequences -> the whole micro-batch (cp > 1)."""
        if plan is None:
            return result
        return unshard(result, plan, self.layout.groups.cp)

    def _from_last_stage(self, obj):
        """Broadcast a Python object from the last pipeline stage to every stage."""
        if self.layout.pp == 1:
            return obj
        group = self.layout.groups.pp
        src = torch.distributed.get_process_group_ranks(group)[-1]
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ---- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch], post_fn: PostFn) -> list[torch.Tensor]:
        """post_fn(OutputHead, micro_batch) on the last stage, one result per micro-batch.

        Results are detached and broadcast from the last pipeline stage, so EVERY rank returns the
        same list (tensors on the platform device); TP/CP ranks of the last stage compute them
        redundantly, DP ranks return results for their own micro-batches.
        """
        for m in self.model:
            m.eval()

        def collect(mb, head):
            result = post_fn(head, mb).detach()
            return torch.zeros((), device=head.hidden.device), {"result": result}

        stored, plans = self._run_schedule(micro_batches, collect, forward_only=True)
        results = None
        if self.layout.is_last_stage:
            results = [self._unshard(d["result"], plan).cpu() for d, plan in zip(stored, plans)]
        results = self._from_last_stage(results)
        return [r.to(self.platform.device) for r in results]

    def log_probs(
        self,
        micro_batches: list[MicroBatch],
        temperature: Optional[float] = None,
        with_entropy: bool = False,
        record_routes: bool = False,
    ) -> list[torch.Tensor]:
        """Next-token log-probs [b, s] per micro-batch ([2, b, s] with entropy), at `temperature`
        (default algo.temperature). `record_routes` (R2): store the experts every router chose in each
        micro-batch's `replay_routes`, for `train_policy` to replay."""
        temperature = self.cfg.algo.temperature if temperature is None else temperature
        post_fn = make_log_prob_fn(temperature, self.layout.groups.tp, with_entropy)
        if not record_routes:
            return self._forward_merged(micro_batches, post_fn)
        with self._require_replay().recording() as recorded:
            out = self.forward_only(micro_batches, post_fn)
        self._store_routes(micro_batches, recorded.routes)
        return out

    def _forward_merged(self, micro_batches: list[MicroBatch], post_fn: PostFn) -> list[torch.Tensor]:
        """forward_only, merging consecutive packed micro-batches up to actor.max_tokens_per_forward_micro_batch;
        results are cut back to one per given micro-batch (packed alignment). Every DP rank runs the same
        number of forwards (the max over DP; fillers make up the rest): expert all-to-alls span DP ranks."""
        budget = self.cfg.actor.max_tokens_per_forward_micro_batch
        if budget is None or not micro_batches or not micro_batches[0].packed:
            return self.forward_only(micro_batches, post_fn)
        groups = forward_groups(micro_batches, budget)
        count = collectives.max_ints([len(groups)], group=self.layout.groups.dp)[0]
        groups += [[] for _ in range(count - len(groups))]
        multiple = self.layout.seq_len_multiple
        merged = [merge_packed([micro_batches[i] for i in g], multiple) for g in groups]
        out = []
        for group, result in zip(groups, self.forward_only(merged, post_fn)):
            out += list(result.split([micro_batches[i].num_tokens for i in group], dim=-1)) if group else []
        return out

    def probe_log_probs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float):
        """Reference for sync verification: log-probs of each sequence's tokens after its prompt.
        Packed under the actor's token budget (actor.max_tokens_per_micro_batch), like the training passes."""
        budget = self.cfg.actor.max_tokens_per_forward_micro_batch or self.cfg.actor.max_tokens_per_micro_batch
        if budget is None:
            seq_len = self.layout.pad_length(max(map(len, sequences)))
            tokens = torch.zeros(len(sequences), seq_len, dtype=torch.long)
            for i, s in enumerate(sequences):
                tokens[i, : len(s)] = torch.tensor(s)
            (lp,) = self.log_probs([MicroBatch(tokens=tokens)], temperature=temperature)
            return [lp[i, p - 1 : len(s) - 1].cpu() for i, (s, p) in enumerate(zip(sequences, prompt_lens))]
        multiple = self.layout.seq_len_multiple
        parts = partition_by_tokens([len(s) for s in sequences], 1, budget, multiple)[0]
        micro = [pack_token_lists([sequences[i] for i in part], multiple) for part in parts]
        out: list = [None] * len(sequences)
        for part, mb, lp in zip(parts, micro, self.log_probs(micro, temperature=temperature)):
            for i, piece in zip(part, unpack_rows(lp.cpu(), mb)):
                out[i] = piece[0, prompt_lens[i] - 1 : len(sequences[i]) - 1]
        return out

    def masked_sum(self, values: list[torch.Tensor], micro_batches: list[MicroBatch]) -> float:
        """Sum of per-token `values` (one [b, s] tensor per micro-batch) over the response tokens of
        every data-parallel rank's micro-batches."""
        local = math.fsum(float((v.cpu() * mb.loss_mask).sum()) for v, mb in zip(values, micro_batches))
        return collectives.sum_floats([local], group=self.layout.groups.dp)[0]

    def check_weights_finite(self, what: str, fix: Optional[str] = None) -> None:
        """Collective: raises safety.TrainingHalted on every rank when any rank's weights hold NaN/inf
        (`what` starts the message), so nothing non-finite reaches the engine, a checkpoint or an export."""
        self._require_resident("check_weights_finite")
        named = ((name, p.data) for chunk in self.model for name, p in chunk.named_parameters())
        safety.check_weights_finite(named, what, fix=fix)

    # ---- train -------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (every DP rank passes its share).

        Returns, identical on every rank: `loss` (the global loss: sum of loss_fn outputs over all
        micro-batches and DP x CP ranks), each loss_fn metric summed the same way (so normalise
        metrics by global counts inside loss_fn, like the loss), `grad_norm` (global, before clipping),
        `lr` (used for this step), `update_successful` (1.0 / 0.0) and `skipped_steps` (its complement:
        1.0 when the step was skipped because the loss or the gradient norm was NaN/inf).
        """
        if self.optimizer is None:
            raise RuntimeError(
                "Actor was built without an optimizer (with_optimizer=False / frozen); train_step needs one"
            )
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Megatron divides each micro-batch loss by the micro-batch count and multiplies it by cp, and
        # DDP averages gradients over dp x cp: scaling by n_micro * dp makes the result a plain sum.
        scale = len(micro_batches) * self.layout.dp

        def loss_and_metrics(mb, head):
            loss, metrics = loss_fn(head, mb)
            record = {"loss": loss.detach().clone().float()}
            record.update({k: torch.as_tensor(v, dtype=torch.float32).detach().clone() for k, v in metrics.items()})
            return loss * scale, record

        stored, _ = self._run_schedule(micro_batches, loss_and_metrics, forward_only=False)
        metrics = self._reduce_metrics(stored) if self.layout.is_last_stage else None
        metrics = self._from_last_stage(metrics)  # the same values on every rank
        lr = self.optimizer.param_groups[0]["lr"]
        outcome = self._step_if_finite(metrics["loss"])
        metrics.update(
            grad_norm=outcome.grad_norm,
            lr=float(lr),
            update_successful=float(outcome.applied),
            skipped_steps=float(not outcome.applied),
        )
        return metrics

    def _step_if_finite(self, loss: float):
        """The optimizer step, skipped on every rank when the global loss or gradient norm is not finite
        (the LR schedule then stays where it is, as in Megatron's own loop)."""
        if not math.isfinite(loss):
            return StepOutcome(False, float("nan"))
        outcome = guarded_step(self.optimizer)
        if outcome.applied:
            self.scheduler.step(increment=1)
        return outcome

    def train_policy(self, mini_batch: MiniBatch, algo: AlgoConfig, on_policy: bool = False) -> dict[str, float]:
        """One optimizer step of the policy loss over this rank's share of `mini_batch`; under routing
        replay the update routes with each micro-batch's `replay_routes` (R2: recorded by `log_probs`,
        R3: the engine's, from `routed_experts`) and the metrics include the routing mismatch.

        `on_policy` (AlgoConfig.old_from_update: one mini-batch, one epoch, no R3): no old-policy pass ran;
        the update's own log-probs, detached, are the old ones (see make_policy_loss_fn) and the metrics
        include the policy's `entropy`. Under R2 the update routes naturally and records its routes into
        each micro-batch's `replay_routes` (they are the old policy's routes; nothing is replayed)."""
        if on_policy and algo.routing_replay == "r3":
            raise ValueError(
                "on_policy update under routing_replay=r3: the update replays the engine's routes, so the old "
                "policy (natural routes) differs from it; run the old-policy pass (AlgoConfig.old_from_update)"
            )
        loss_fn = make_policy_loss_fn(algo, mini_batch.counts, self.layout.groups.tp, on_policy=on_policy)
        micro = mini_batch.micro_batches
        if self.replay is None:
            return self.train_step(micro, loss_fn)
        if on_policy:
            with self.replay.recording() as recorded:
                metrics = self.train_step(micro, loss_fn)
            self._store_routes(micro, recorded.routes)
            return metrics
        with self.replay.replaying(self._replay_routes(micro)):
            metrics = self.train_step(micro, loss_fn)
        return {**metrics, **self.replay.mismatch_metrics()}

    def _reduce_metrics(self, stored: list[dict]) -> dict[str, float]:
        keys = sorted(stored[0])
        per_key = torch.stack([torch.stack([d[k].float() for d in stored]) for k in keys]).cpu()  # one host copy
        local = [math.fsum(row) for row in per_key.tolist()]
        totals = collectives.sum_floats(local, group=self.layout.groups.dp_cp)
        return dict(zip(keys, totals))

    # ---- routing replay ----------------------------------------------------------------------
    def enable_routing_replay(self) -> None:
        """Wrap every MoE router of this rank for record / replay (cfg.algo.routing_replay). Collective over PP."""
        self.replay = RoutingReplay.install(self.model, self.layout)

    def _require_replay(self):
        if self.replay is None:
            raise RuntimeError("routing replay is not enabled: call Actor.enable_routing_replay() first")
        return self.replay

    def _local_tokens(self, values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """A per-token field [b, s, ...] of `mb` as this rank computes it: itself, or under context parallelism
        this CP rank's part ([1, T / cp, ...], the split of the forward passes)."""
        plan = self._cp_plan(mb)
        if plan is None:
            return values
        return take_local(values, plan)

    def _store_routes(self, micro_batches: list[MicroBatch], routes) -> None:
        """Recorded routes -> each micro-batch's `replay_routes` (the mismatch metric counts response tokens only)."""
        valid = [self._local_tokens(mb.loss_mask > 0, mb) for mb in micro_batches]
        for mb, mb_routes in zip(micro_batches, self.replay.with_valid(routes, valid).micro_batches):
            mb.replay_routes = mb_routes

    def _replay_routes(self, micro_batches: list[MicroBatch]):
        for mb in micro_batches:
            if mb.replay_routes is None:  # R3: the engine's routes, in the router's order (kept for later epochs)
                mb.require("routed_experts", "route_valid")
                routes, valid = (self._local_tokens(t, mb) for t in (mb.routed_experts, mb.route_valid))
                (mb.replay_routes,) = self.replay.routes_from_rollout([routes], [valid]).micro_batches
        return RecordedRoutes([mb.replay_routes for mb in micro_batches])

    # ---- weights -----------------------------------------------------------------------------
    def export_hf_weights(self, receive: bool = True, receiver=None):
        """See HFExporter.export: collective, every rank gets every full tensor; `receiver` (what a rollout
        engine offers, mcore_rl/weight_sync/receiver.py) lets the export write into the engine's memory."""
        self._require_resident("export_hf_weights")
        return self.exporter.export(self.model, receive=receive, receiver=receiver)

    def save_hf(self, out_dir: str, source_dir: Optional[str] = None, max_shard_bytes: int = 4 << 30) -> None:
        """Write the model as a Hugging Face folder (rank 0 writes; every rank takes part in the gathers).
        `source_dir`: a HF folder whose tokenizer / generation files are copied next to the weights."""
        from pathlib import Path

        writer = torch.distributed.get_rank() == 0
        stream = self.export_hf_weights(receive=writer)
        failed = None  # rank 0's reason, for every rank
        if writer:
            try:
                write_hf_folder(stream, out_dir, source_dir, self.hf_config, max_shard_bytes=max_shard_bytes)
            except Exception as e:  # a full disk (safetensors' own error type): the other ranks still take part
                # in the gathers below
                failed = write_failure(e, Path(out_dir))[0]
        for _ in stream:
            pass
        failed = collectives.from_rank0(failed)
        if failed is not None:
            raise OutputWriteError(f"the Hugging Face export {out_dir} was not written ({failed})")

    def save_checkpoint(self, directory: str, extra: Optional[dict] = None) -> None:
        """Model + optimizer + scheduler as a Megatron dist checkpoint, loadable into any layout (collective)."""
        self._require_resident("save_checkpoint")
        checkpoint.save_checkpoint(self, directory, extra)

    def load_checkpoint(self, directory: str, load_optimizer: bool = True) -> dict:
        """Load a checkpoint written by `save_checkpoint` (any layout); returns its `extra` (collective)."""
        self._require_resident("load_checkpoint")
        return checkpoint.load_checkpoint(self, directory, load_optimizer=load_optimizer)
