"""Checkpoint save at one layout, load at another (run under torchrun by tests/test_checkpoint.py).

Arguments: --work-dir --model-dir --tp --ep --etp --n-micro --dist-opt (0/1) --mode, --results (harness.py).
  --mode save: load HF, train step 1, save checkpoint, record logits, train step 2, record weights.
  --mode load: build without HF weights, load the checkpoint, compare logits, train step 2, compare weights.
Result per rank: the step's loss and lr; after load also the differences from the uninterrupted run.
actor.offload (save mode): after step 1 the saved actor's state goes to the host and back (a walk of model and
optimizer finds every parameter / gradient / optimizer storage at 0 bytes, then every byte restored), so the
checkpoint and step 2 come from a reloaded actor; a twin that never offloads takes the same steps and must end
bit-identical. With the distributed optimizer a bf16 pair (fp32 main parameters of their own) does the same.
Save mode's result: what the walk found (`offload`), how many tensors the twin comparison covered.
"""

import dataclasses
import os

import torch

from tests.workers.actor_common import full_logits, global_batch, my_micro_batches, nll_loss
from tests.workers.harness import worker_args, write_result
from tests.workers.offload_checks import offload_round_trip, same_weights


def check_offload_pair(cfg, platform, batch, loss_fn) -> dict:
    """Two actors from `cfg`, the same two steps; one goes to the host and back between them."""
    from mcore_rl.megatron.actor import Actor

    moved, twin = Actor(cfg, platform), Actor(cfg, platform)
    for a in (moved, twin):
        a.train_step(batch, loss_fn)
    counts = offload_round_trip(moved)
    for a in (moved, twin):
        a.train_step(batch, loss_fn)
    counts["twin_tensors"] = same_weights(moved, twin)
    return counts


def main():
    args = worker_args(
        __doc__, work_dir=str, model_dir=str, tp=int, ep=int, etp=int, n_micro=int, dist_opt=int, mode=("save", "load")
    )
    work, model_dir, mode = args.work_dir, args.model_dir, args.mode
    tp, ep, etp, n_micro, dist_opt = args.tp, args.ep, args.etp, args.n_micro, args.dist_opt
    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor
    from mcore_rl.platform import get_platform

    cfg = Config(platform="cpu", model=ModelConfig(path=model_dir))
    cfg.actor.parallel = ParallelConfig(tp=tp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    cfg.actor.optim = OptimConfig(
        lr=1e-2,
        adam_eps=1e-3,
        clip_grad=1.0,
        warmup_steps=1,
        decay_style="linear",
        decay_steps=4,
        use_distributed_optimizer=bool(dist_opt),
    )
    platform = get_platform("cpu")
    actor = Actor(cfg, platform, load_weights=(mode == "save"))
    rank = torch.distributed.get_rank()
    tokens, mask = global_batch()
    loss_fn = nll_loss(mask.sum())
    ckpt = os.path.join(work, "ckpt")
    twin = None
    if mode == "save":
        twin = Actor(cfg, platform)  # never offloaded: the same training without actor.offload
        batch = my_micro_batches(tokens, mask, n_micro)
        for a in (actor, twin):
            a.train_step(batch, loss_fn)
        counts = offload_round_trip(actor)
        actor.save_checkpoint(ckpt, extra={"step": 1, "note": "after one step"})
    else:
        extra = actor.load_checkpoint(ckpt)
        assert extra == {"step": 1, "note": "after one step"}, extra
    logits = torch.cat(actor.forward_only([MicroBatch(tokens)], full_logits))
    metrics = actor.train_step(my_micro_batches(tokens, mask, n_micro), loss_fn)
    weights = {n: t.clone() for n, t in actor.export_hf_weights()}
    report = {"loss": metrics["loss"], "lr": metrics["lr"]}
    if twin is not None:
        twin.train_step(my_micro_batches(tokens, mask, n_micro), loss_fn)
        counts["twin_tensors"] = same_weights(actor, twin)
        if dist_opt:
            bf16 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
            counts["bf16"] = check_offload_pair(bf16, platform, my_micro_batches(tokens, mask, n_micro), loss_fn)
        report["offload"] = counts
    if mode == "save":
        if rank == 0:
            torch.save(
                {"logits": logits, "weights": weights, "metrics": metrics}, os.path.join(work, "uninterrupted.pt")
            )
    else:
        want = torch.load(os.path.join(work, "uninterrupted.pt"))
        d_logits = (logits - want["logits"]).abs().max().item()
        assert d_logits <= 1e-5, f"logits after loading differ by {d_logits}"
        assert abs(metrics["lr"] - want["metrics"]["lr"]) < 1e-12, (metrics["lr"], want["metrics"]["lr"])
        assert abs(metrics["loss"] - want["metrics"]["loss"]) < 1e-5, (metrics["loss"], want["metrics"]["loss"])
        worst = max((weights[k] - want["weights"][k]).abs().max().item() for k in weights)
        assert worst <= 1e-6, f"resumed step differs from the uninterrupted one by {worst}"
        report.update(logits_diff=d_logits, weights_diff=worst, want_loss=want["metrics"]["loss"])
        report.update(want_lr=want["metrics"]["lr"])
    torch.distributed.barrier()
    write_result(args.results, **report)


if __name__ == "__main__":
    main()
