"""One layout of the actor against independent references (run under torchrun by test_actor_logits.py).

Arguments: --ref-dir --model-dir --tp --pp --ep --etp --n-micro --mode (ref = write the train-step reference;
check = compare), --results (tests/workers/harness.py).
Checks: forward_only logits == HF logits and the actor's log-probs == HF log_softmax (<= 1e-4); at PP1, the
actor's fused path (hidden states + output weight) == Megatron's output-layer logits path: log-probs, entropy
and every parameter's DDP gradient (<= 1e-5; reported as fused_*);
export == checkpoint bit-identical (same names: a tied model exports `model.embed_tokens.weight` once, no
`lm_head`); train_step loss / grad norm / updated weights == the world-1 reference; with tied embeddings over
PP the last stage's output-layer copy equals the first stage's embedding after the step.
Dense models with TP > 1 run with sequence parallel (MoE turns it on by itself).
Result per rank: the measured differences, the step's loss, grad norm and token count, and whether the tied
copies were compared (`tied_copies_checked`).
"""

import os

import torch

from tests.workers.actor_common import full_logits, my_micro_batches, nll_loss
from tests.workers.harness import cpu_megatron, worker_args, write_result
from tests.workers.offload_checks import check_released


def check_tied_copies_in_step(actor) -> bool:
    """With tied embeddings split over pipeline stages, the last stage's output layer must equal the first
    stage's embedding (this TP rank's shard of each), bit for bit. True when there were copies to compare."""
    from mcore_rl.compat.megatron import gpt_model

    model = gpt_model(actor.model[0])
    if not model.share_embeddings_and_output_weights or actor.layout.pp == 1:
        return False
    mine = model.embedding.word_embeddings.weight if model.pre_process else model.output_layer.weight
    group = actor.layout.groups.pp
    copies = [torch.empty_like(mine) for _ in range(actor.layout.pp)]
    torch.distributed.all_gather(copies, mine.detach().contiguous(), group=group)
    assert not torch.equal(copies[0], torch.zeros_like(copies[0])), "tied embedding is all zeros"
    assert torch.equal(copies[0], copies[-1]), (
        f"tied output layer drifted from the embedding by {(copies[0] - copies[-1]).abs().max().item()}"
    )
    return True


def main():
    args = worker_args(
        __doc__, ref_dir=str, model_dir=str, tp=int, pp=int, ep=int, etp=int, n_micro=int, mode=("ref", "check")
    )
    ref_dir, model_dir, mode = args.ref_dir, args.model_dir, args.mode
    tp, pp, ep, etp, n_micro = args.tp, args.pp, args.ep, args.etp, args.n_micro

    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import Config, ModelConfig, OptimConfig, ParallelConfig
    from mcore_rl.megatron.actor import Actor

    platform = cpu_megatron()

    cfg = Config(platform="cpu", model=ModelConfig(path=model_dir))
    cfg.actor.parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    # Huge eps makes Adam's first step ~ lr * grad / eps: the update is linear in the gradient, so a
    # wrong gradient scale (micro-batches, DP averaging) shows up in the weights, not only in grad_norm.
    cfg.actor.optim = OptimConfig(lr=10.0, adam_eps=10.0, clip_grad=0.0, weight_decay=0.0)
    actor = Actor(cfg, platform)
    rank = torch.distributed.get_rank()
    ref = torch.load(os.path.join(ref_dir, "hf_ref.pt"))
    tokens, hf_logits, loss_mask = ref["tokens"], ref["logits"], ref["loss_mask"]

    # -- forward_only: full logits (gathered over TP) and vocab-parallel log-probs of the next token
    mbs = [MicroBatch(tokens[i : i + 2]) for i in range(0, tokens.shape[0], 2)]
    got = torch.cat(actor.forward_only(mbs, full_logits))
    diff = (got - hf_logits).abs().max().item()
    assert diff <= 1e-4, f"logits differ from HF by {diff}"
    # the actor's own path (hidden states + output weight, fused log-probs); the last column has no next token
    lp = torch.cat(actor.log_probs(mbs, temperature=1.0))[:, :-1]
    ref_lp = torch.log_softmax(hf_logits, -1)[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp_diff = (lp - ref_lp).abs().max().item()
    assert lp_diff <= 1e-4, f"log-probs differ from HF by {lp_diff}"

    # -- bad input fails fast with a message naming the numbers (before any collective)
    if actor.layout.sequence_parallel:
        try:
            actor.forward_only([MicroBatch(tokens[:, :15])], full_logits)
        except ValueError as e:
            assert "15" in str(e) and f"multiple of {tp}" in str(e), e
        else:
            raise AssertionError("sequence length 15 under sequence parallel was accepted")

    # -- export: every HF tensor, bit-identical to the checkpoint
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = {name: t.clone() for name, t in actor.export_hf_weights()}
    assert set(exported) == set(ckpt), f"export names differ: {sorted(set(exported) ^ set(ckpt))[:5]}"
    for name, t in ckpt.items():
        assert exported[name].shape == t.shape and torch.equal(exported[name], t), f"export of {name} differs"

    fused = check_fused_equals_logits_path(actor, tokens, loss_mask) if pp == 1 else {}

    # -- train_step: this DP rank's share of the global batch, split into n_micro micro-batches
    metrics = actor.train_step(my_micro_batches(tokens, loss_mask, n_micro), nll_loss(loss_mask.sum()))
    after = {name: t.clone() for name, t in actor.export_hf_weights()}
    tied_checked = check_tied_copies_in_step(actor)
    result = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "tokens": metrics["tokens"], "weights": after}
    report = {k: v for k, v in result.items() if k != "weights"}
    report.update(logits_diff=diff, logprobs_diff=lp_diff, tied_copies_checked=tied_checked, **fused)
    if mode == "ref":
        if rank == 0:
            torch.save(result, os.path.join(ref_dir, "train_ref.pt"))
    else:
        want = torch.load(os.path.join(ref_dir, "train_ref.pt"))
        assert metrics["tokens"] == want["tokens"], (metrics["tokens"], want["tokens"])
        assert abs(metrics["loss"] - want["loss"]) < 1e-5, (metrics["loss"], want["loss"])
        assert abs(metrics["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1.0, want["grad_norm"]), (
            metrics["grad_norm"],
            want["grad_norm"],
        )
        errs = {k: (after[k] - want["weights"][k]).abs().max().item() for k in after}
        worst = max(errs.values())
        moved = max((want["weights"][k] - ckpt[k]).abs().max().item() for k in after)
        assert moved > 1e-3, f"reference step did not move the weights ({moved})"
        assert worst < 1e-5, f"updated weights differ from the world-1 reference by {worst} (step size {moved})"
        report.update(weights_diff=worst, step_size=moved)
    if mode == "check":
        report.update(reference=check_frozen_reference(cfg, platform, actor, mbs, ref_lp))
    torch.distributed.barrier()
    write_result(args.results, **report)


def check_fused_equals_logits_path(actor, tokens, loss_mask) -> dict:
    """The actor's path - the model stopped at the last hidden states, log-probs and entropy from them and the
    output weight (fused_output_log_probs), through the actor's schedule - against today's logits path on the
    same weights: Megatron's own output layer (its sequence-parallel gather, its backward) producing
    [b, s, V/tp] logits, then vocab_parallel_log_probs. Log-probs, entropy and every parameter's gradient in
    DDP's buffer (after finalize_model_grads: DP and sequence-parallel reductions, tied-embedding all-reduce)
    agree to 1e-5 (gradients relative to the largest). Temperature 0.7, a loss on both log-probs and entropy."""
    import time

    from megatron.core.distributed import finalize_model_grads

    from mcore_rl.batch import MicroBatch
    from mcore_rl.megatron.logprobs import vocab_parallel_log_probs
    from mcore_rl.megatron.policy_loss import next_token_log_probs, next_token_targets

    start = time.perf_counter()
    temperature, tp_group = 0.7, actor.layout.groups.tp
    g = torch.Generator().manual_seed(3)
    w_lp, w_h = (torch.randn(tokens.shape, generator=g) * loss_mask for _ in range(2))

    def loss_of(lp, ent):
        return (lp * w_lp).sum() + (ent * w_h).sum()

    def grads():
        return {n: p.main_grad.detach().clone() for m in actor.model for n, p in m.named_parameters()}

    for m in actor.model:
        m.train()
        m.zero_grad_buffer()

    def fused_loss(mb, head):
        lp, ent = next_token_log_probs(head, mb.tokens, temperature, tp_group, with_entropy=True)
        return loss_of(lp, ent), {"lp": lp.detach(), "ent": ent.detach()}

    (stored,), _ = actor._run_schedule([MicroBatch(tokens)], fused_loss, forward_only=False)  # (outputs, CP plans)
    fused = (stored["lp"], stored["ent"], grads())

    for m in actor.model:
        m.zero_grad_buffer()
    mb = MicroBatch(tokens).to(actor.platform.device)
    logits = actor.model[0](mb.tokens, mb.position_ids, mb.attention_mask)  # Megatron's output layer
    lp, ent = vocab_parallel_log_probs(logits.float(), next_token_targets(mb.tokens), temperature, tp_group, True)
    loss_of(lp, ent).backward()
    finalize_model_grads(actor.model)
    today = (lp.detach(), ent.detach(), grads())

    for name, a, b in (("log-probs", fused[0], today[0]), ("entropy", fused[1], today[1])):
        err = (a - b).abs().max().item()
        assert err <= 1e-5, f"fused {name} differ from the logits path by {err}"
    scale = max(t.abs().max().item() for t in today[2].values())
    worst, name = max(((fused[2][n] - today[2][n]).abs().max().item(), n) for n in today[2])
    assert scale > 0 and worst <= 1e-5 * scale, f"fused gradient of {name} differs by {worst} (largest {scale})"
    for m in actor.model:
        m.zero_grad_buffer()
    return {
        "fused_logprobs_diff": (fused[0] - today[0]).abs().max().item(),
        "fused_entropy_diff": (fused[1] - today[1]).abs().max().item(),
        "fused_grad_rel_diff": worst / scale,
        "fused_check_seconds": time.perf_counter() - start,
    }


def check_frozen_reference(cfg, platform, actor, mbs, ref_lp):
    """Actor.frozen: no DDP wrapper, no gradient buffer, nothing requires grad, and the same log-probs as HF.

    The trained actor in the same process is the contrast: its parameters carry DDP's `main_grad`
    views into a gradient buffer; the reference's must carry none, and its buffers must not hold
    anything parameter-sized."""
    from megatron.core.distributed import DistributedDataParallel

    from mcore_rl.megatron.actor import Actor

    assert all(hasattr(p, "main_grad") for m in actor.chunks for p in m.parameters()), "the DDP actor has no main_grad"
    ref = Actor.frozen(cfg, platform)
    params = [p for m in ref.chunks for p in m.parameters()]
    assert params and ref.optimizer is None
    assert not any(isinstance(m, DistributedDataParallel) for m in ref.chunks), "the reference is DDP-wrapped"
    assert not any(p.requires_grad for p in params), "a reference parameter requires grad"
    assert not any(hasattr(p, "main_grad") or p.grad is not None for p in params), (
        "a reference parameter has a gradient"
    )
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for m in ref.chunks for b in m.buffers())
    assert buffer_bytes < param_bytes / 10, (
        f"reference buffers hold {buffer_bytes} bytes beside {param_bytes} of parameters"
    )
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params), "reference parameters share one flat buffer (a DDP param/grad buffer)"
    lp = torch.cat(ref.log_probs(mbs, temperature=1.0))[:, :-1]
    assert not lp.requires_grad
    ref_diff = (lp - ref_lp).abs().max().item()
    assert ref_diff <= 1e-4, f"reference log-probs differ from HF by {ref_diff}"
    with torch.enable_grad():  # even with autograd on, a forward through the reference records no graph
        mb = mbs[0].to(platform.device)
        out = ref.chunks[0](mb.tokens, mb.position_ids, mb.attention_mask) if ref.layout.pp == 1 else None
    assert out is None or not out.requires_grad, "the reference forward recorded an autograd graph"
    # actor.offload: the reference lives on the host except during its own pass (parameters and buffers at 0 bytes)
    ref.offload()
    released = check_released(ref)
    with ref.resident():
        again = torch.cat(ref.log_probs(mbs, temperature=1.0))[:, :-1]
    assert torch.equal(again, lp), "the reference's log-probs changed after a trip to the host"
    check_released(ref)
    assert ref.offloaded and ref.host_bytes == param_bytes + buffer_bytes, (ref.host_bytes, param_bytes, buffer_bytes)
    return {"offloaded_parameters": released["parameters"], "host_bytes": ref.host_bytes}


if __name__ == "__main__":
    main()
