"""The actor: Megatron model chunks + optimizer + LR schedule, driven through Megatron's pipeline
schedules so that one code path serves every TP/PP/EP/DP layout.

Two entry points, both collective over all ranks of the job:
  forward_only(micro_batches, post_fn) -> list[Tensor]   per-micro-batch results of post_fn
  train_step(micro_batches, loss_fn)   -> dict[str, float] reduced metrics

Conventions the caller relies on:
  * post_fn / loss_fn receive the last stage's logits [b, s, V/tp] in fp32, vocabulary-parallel over
    TP (use tensor_parallel.vocab_parallel_cross_entropy or the helpers in mcore_rl.megatron.logprobs);
    note that vocab_parallel_cross_entropy modifies its input in place.
  * loss_fn returns (loss, metrics) where `loss` is already divided by GLOBAL counts, so the sum of
    loss_fn outputs over all micro-batches of all data-parallel ranks IS the global loss. We undo
    Megatron's division by the micro-batch count and DDP's average over DP x CP, so gradients equal
    the gradient of that global loss for any layout and any number of micro-batches.
  * Sequences are right-padded (the causal mask makes pads invisible to real tokens; Megatron's RoPE
    uses positions 0..s-1, so left padding would shift positions). Mask pads in the loss.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mcore_rl.config import Config, OptimConfig
from mcore_rl.megatron.parallel import ParallelInfo, init_parallel
from mcore_rl.models.bridge import ModelBridge
from mcore_rl.platform import Platform, get_platform

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """`b` right-padded sequences of length `s`, plus per-token tensors for the loss (`extras`)."""

    tokens: torch.Tensor  # [b, s] long
    position_ids: Optional[torch.Tensor] = None  # [b, s]; default 0..s-1
    attention_mask: Optional[torch.Tensor] = None  # None: causal; else [b, 1, s, s] bool, True = masked
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. loss_mask, old_logprobs, advantages

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"MicroBatch.tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        if self.position_ids is None:
            b, s = self.tokens.shape
            self.position_ids = torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)

    def to(self, device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t
        return MicroBatch(
            move(self.tokens),
            move(self.position_ids),
            move(self.attention_mask),
            {k: move(v) for k, v in self.extras.items()},
        )


PostFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], "tuple[torch.Tensor, dict]"]


def _build_optimizer(chunks, optim: OptimConfig, dtype: torch.dtype, total_steps: int):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if optim.decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"actor.optim.decay_style {optim.decay_style!r} unknown; choose constant, linear or cosine")
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
    )
    optimizer = get_megatron_optimizer(config, chunks)
    decay_steps = optim.decay_steps or total_steps
    if optim.warmup_steps >= max(decay_steps, 1) and optim.decay_style != "constant":
        raise ValueError(
            f"actor.optim.warmup_steps = {optim.warmup_steps} must be < decay steps {decay_steps}: "
            f"lower warmup_steps or raise decay_steps / trainer.steps"
        )
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


def _wrap_ddp(chunks, transformer_config, use_distributed_optimizer: bool, dtype: torch.dtype):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
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


class Actor:
    """Model chunks (DDP-wrapped) + Megatron optimizer + LR scheduler of one process."""

    def __init__(
        self, cfg: Config, platform: Optional[Platform] = None, with_optimizer: bool = True, load_weights: bool = True
    ):
        from megatron.core.distributed import finalize_model_grads

        self.cfg = cfg
        self.platform = platform or get_platform(cfg.platform)
        self.bridge = ModelBridge(cfg.model.path, self.platform)
        self.info: ParallelInfo = init_parallel(
            cfg.actor.parallel, self.platform, self.bridge.hf_config, seed=cfg.trainer.seed
        )
        self.parallel = self.info.effective_parallel(cfg.actor.parallel)
        chunks = self.bridge.build_model(self.parallel, cfg.model, sequence_parallel=self.info.sequence_parallel)
        if load_weights:
            self.bridge.load_hf_weights(chunks)
        self.dtype = chunks[0].config.params_dtype
        self.tf_config = self.bridge.transformer_config
        self.model = _wrap_ddp(chunks, self.tf_config, cfg.actor.optim.use_distributed_optimizer, self.dtype)
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        self.optimizer = self.scheduler = None
        if with_optimizer:
            self.optimizer, self.scheduler = _build_optimizer(
                self.model, cfg.actor.optim, self.dtype, cfg.trainer.steps
            )

    # ---- helpers -----------------------------------------------------------------------------
    @property
    def chunks(self) -> list[torch.nn.Module]:
        return self.model

    def _check(self, micro_batches: list[MicroBatch]) -> int:
        if not micro_batches:
            raise ValueError("no micro-batches given: pass at least one MicroBatch per rank")
        shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
        multiple = self.info.layout.seq_len_multiple
        for _, s in shapes:
            if s % multiple:
                raise ValueError(
                    f"sequence length {s} is not a multiple of {multiple} (sequence parallel over tp = "
                    f"{self.info.tp}): right-pad micro-batches to a multiple of {multiple}"
                )
        return max(s for _, s in shapes)

    def _run_schedule(self, micro_batches: list[MicroBatch], loss_func_for: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq_len = self._check(micro_batches)
        device = self.platform.device
        batches = iter([mb.to(device) for mb in micro_batches])

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb.tokens, mb.position_ids, mb.attention_mask)
            return output, functools.partial(loss_func_for, mb)  # the schedule calls loss_func(output)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=micro_batches[0].tokens.shape[0],
            forward_only=forward_only,
        )

    def _from_last_stage(self, obj):
        """Broadcast a Python object from the last pipeline stage to every stage."""
        from megatron.core import parallel_state as mpu

        if self.info.pp == 1:
            return obj
        group = mpu.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[-1]
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ---- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch], post_fn: PostFn) -> list[torch.Tensor]:
        """post_fn(logits [b, s, V/tp] fp32, micro_batch) on the last stage, one result per micro-batch.

        Results are detached and broadcast from the last pipeline stage, so EVERY rank returns the
        same list (tensors on the platform device); TP/CP ranks of the last stage compute them
        redundantly, DP ranks return results for their own micro-batches.
        """
        for m in self.model:
            m.eval()

        def collect(mb, output):
            result = post_fn(output.float(), mb).detach()
            return torch.zeros((), device=output.device), {"result": result}

        stored = self._run_schedule(micro_batches, collect, forward_only=True)
        results = [d["result"].cpu() for d in stored] if self.info.is_last_stage else None
        results = self._from_last_stage(results)
        return [r.to(self.platform.device) for r in results]

    # ---- train -------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (every DP rank passes its share).

        Returns, identical on every rank: `loss` (the global loss: sum of loss_fn outputs over all
        micro-batches and DP x CP ranks), each loss_fn metric summed the same way (so normalise
        metrics by global counts inside loss_fn, like the loss), `grad_norm` (global, before clipping),
        `lr` (used for this step) and `update_successful` (1.0 / 0.0).
        """
        from megatron.core import parallel_state as mpu

        if self.optimizer is None:
            raise RuntimeError("Actor was built with with_optimizer=False; train_step needs the optimizer")
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Megatron divides each micro-batch loss by the micro-batch count and multiplies it by cp, and
        # DDP averages gradients over dp x cp: scaling by n_micro * dp makes the result a plain sum.
        scale = len(micro_batches) * mpu.get_data_parallel_world_size(with_context_parallel=False)

        def loss_and_metrics(mb, output):
            loss, metrics = loss_fn(output.float(), mb)
            record = {"loss": loss.detach().clone().float()}
            record.update({k: torch.as_tensor(v, dtype=torch.float32).detach().clone() for k, v in metrics.items()})
            return loss * scale, record

        stored = self._run_schedule(micro_batches, loss_and_metrics, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(stored) if self.info.is_last_stage else None
        metrics = self._from_last_stage(metrics)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(lr),
            update_successful=float(bool(update_successful)),
        )
        return metrics

    def _reduce_metrics(self, stored: list[dict]) -> dict[str, float]:
        from megatron.core import parallel_state as mpu

        keys = sorted(stored[0])
        local = torch.stack([sum(d[k].to(torch.float64).cpu() for d in stored) for k in keys])
        local = local.to(self.platform.device)
        torch.distributed.all_reduce(local, group=mpu.get_data_parallel_group(with_context_parallel=True))
        return {k: float(v) for k, v in zip(keys, local.cpu())}

    # ---- weights -----------------------------------------------------------------------------
    def export_hf_weights(self):
        """See ModelBridge.export_hf_weights: collective, every rank gets every full tensor."""
        return self.bridge.export_hf_weights(self.model)
