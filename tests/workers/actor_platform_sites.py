"""Each CPU adaptation in mcore_rl.platform.cpu_adapt exercised at its Megatron call site (plain python,
world 1). Run in a subprocess by tests/test_platform.py so the patches never leak into pytest.

Arguments: --results (tests/workers/harness.py). Result: {site: "ok" or the error it raised} for every site."""

import torch

from tests.workers.harness import worker_args, write_result


def check(outcome: dict, name, fn):
    """Run one site's check; record "ok" or the error, so one broken site does not hide the others."""
    try:
        fn()
    except Exception as e:  # reported to the test, which fails naming the site
        outcome[name] = f"{type(e).__name__}: {e}"
    else:
        outcome[name] = "ok"


def main():
    args = worker_args(__doc__)
    outcome = {}
    import sys

    from mcore_rl.platform import cpu_adapt, get_platform

    compile_fn = torch.compile
    platform = get_platform("cpu")
    platform.adapt_megatron()
    # patch 9: Megatron imported without TorchDynamo, torch.compile itself restored afterwards
    dynamo_after_import = "torch._dynamo" in sys.modules
    snapshot = {n: getattr(torch, n) for n in cpu_adapt._FACTORIES}
    snapshot.update(current_device=torch.cuda.current_device, tensor_cuda=torch.Tensor.cuda)
    platform.adapt_megatron()  # twice: must change nothing
    again = {n: getattr(torch, n) for n in cpu_adapt._FACTORIES}
    again.update(current_device=torch.cuda.current_device, tensor_cuda=torch.Tensor.cuda)
    assert all(snapshot[k] is again[k] for k in snapshot), "second apply() re-wrapped something"
    outcome["idempotent"] = "ok"

    info = platform.init_distributed()
    assert (info.rank, info.world_size) == (0, 1), info
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    mpu.initialize_model_parallel()

    def factories():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert not torch.empty(4, pin_memory=True).is_pinned()
        assert torch.ones(2).cuda().device.type == "cpu"

    def seeding():
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        with tracker.fork():
            a = torch.rand(4)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        with tracker.fork():
            b = torch.rand(4)
        assert torch.equal(a, b), "model-parallel RNG region is not reproducible"

    def rotary():
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        emb = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000)(8)
        inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
        want = torch.outer(torch.arange(8).float(), inv)
        assert torch.allclose(emb[:, 0, 0, :16], want), "rotary frequencies differ from the formula"

    def streams():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pass
        s.record_event().synchronize()
        torch.cuda.synchronize()

    def clip_grads():
        from megatron.core.optimizer import clip_grads as cg

        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 3.0)
        cg.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
        assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6))), p.grad
        assert p.type() == "torch.FloatTensor", "Tensor.type() leaked the CUDA name outside the wrapped call"

    def eager_fusions():
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_swiglu

        assert torch.compile is compile_fn, "torch.compile was not restored after Megatron's import"
        assert not dynamo_after_import, "importing Megatron still imported TorchDynamo"
        assert jit.jit_fuser(check) is check, "jit_fuser still compiles modules imported later"
        x = torch.randn(4, 6)
        gate, up = x.chunk(2, dim=-1)
        got = fused_bias_swiglu.swiglu(x)  # decorated by jit_fuser at import: now the plain function
        assert torch.allclose(got, torch.nn.functional.silu(gate) * up, atol=1e-6)

    def split_sizes_to_numpy():
        from megatron.core.transformer.moe import moe_utils

        out = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
        assert out.tolist() == [1, 2] and not torch.is_tensor(out)

    def checkpoint_writer():
        # patch 10: a dist-checkpoint save writes its buckets in this process (no Manager, no fork per bucket),
        # and the files load back exactly (megatron-core 0.12 forks a caller per save: left as it is there)
        import tempfile

        import psutil
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        from mcore_rl.compat import megatron as compat_megatron

        compat_megatron.apply_shims()  # as the actor does (0.12's _write_item)
        weight = torch.randn(6, 4)
        with tempfile.TemporaryDirectory() as folder:
            state = {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0), "extra": {"step": 3}}
            dist_checkpointing.save(state, folder)
            started = psutil.Process().children(recursive=True)
            if compat_megatron.sync_save_writes_here():
                assert not started, f"the save started processes: {[p.cmdline()[:3] for p in started]}"
            target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 4), replica_id=0)}
            loaded = dist_checkpointing.load(target, folder)
            assert torch.equal(loaded["w"], weight), "the written tensor does not load back exactly"
            assert dist_checkpointing.load_common_state_dict(folder)["extra"] == {"step": 3}

    for name, fn in [
        ("factories", factories),
        ("seeding", seeding),
        ("rotary", rotary),
        ("streams", streams),
        ("clip_grads", clip_grads),
        ("split_sizes", split_sizes_to_numpy),
        ("eager_fusions", eager_fusions),
        ("checkpoint_writer", checkpoint_writer),
    ]:
        check(outcome, name, fn)
    write_result(args.results, **outcome)


if __name__ == "__main__":
    main()
