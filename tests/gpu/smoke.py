"""GPU smoke suite: the CUDA path end to end on ONE GPU in at most ~5 minutes (`make test-gpu`).

    python tests/gpu/smoke.py [--out gpu_smoke_summary.txt] [--gspo-steps 80] [--dry-run]

Stages (one process, world 1; each records ok / FAILED / not run with its numbers, and a failure does not stop
the others):
  env        versions; Transformer Engine and vLLM presence (the suite's target machine has neither)
  nccl       default group "cpu:gloo,cuda:nccl"; the small-collectives rule on it (device tensors, no float64,
             a CPU tensor refused on an nccl-only group); Megatron's subgroups inherit the backend
  parity     Megatron actor (local layer spec: no Transformer Engine) vs Hugging Face logits, fp32 and bf16
  train      one optimizer step (finite loss, weights moved)
  sync       bf16 actor -> embedded engine on the GPU, verified with the bf16 defaults + weight-level check
  memory     peak device memory (torch.cuda.max_memory_allocated)
  gspo       a short GSPO run on the tiny task: reward of the last steps above the first steps
  vllm       vLLM engine sync + verification, or "not run: vLLM not installed"
`--dry-run` parses the arguments, checks the environment and prints the plan without touching a GPU (runs in
the normal test suite). The one-screen summary is printed and written to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STAGES = ("env", "nccl", "parity", "train", "sync", "memory", "gspo", "vllm")
BUDGET_S = 300  # the whole suite; a rerun must fit in a 15-minute device lend


@dataclass
class Result:
    stage: str
    status: str  # ok | FAILED | not run
    detail: str
    seconds: float = 0.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU smoke suite (one GPU, <= 5 minutes)")
    p.add_argument("--out", default="gpu_smoke_summary.txt", help="summary file (default: %(default)s)")
    p.add_argument(
        "--gspo-steps", type=int, default=150, help="most GSPO steps on the tiny task (default: %(default)s)"
    )
    p.add_argument("--work", default=None, help="folder for the tiny model, task data and run (default: a temp dir)")
    p.add_argument("--only", nargs="*", choices=STAGES, default=None, help="run only these stages")
    p.add_argument("--dry-run", action="store_true", help="check arguments and environment, print the plan")
    p.add_argument(
        "--platform", choices=("cuda", "cpu"), default="cuda", help="cpu: rehearse the stages' code without a GPU"
    )
    args = p.parse_args(argv)
    if args.gspo_steps < 20:
        p.error("--gspo-steps must be >= 20 (the reward test compares the first and last 10 steps)")
    return args


def _version(distribution: str) -> str:
    """Installed version from package metadata (no import: the dry run stays fast)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment() -> dict[str, str]:
    """What the suite needs and what it found (no GPU work)."""
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available",
        "megatron-core": _version("megatron-core"),
        "mbridge": _version("mbridge"),
        "transformers": _version("transformers"),
        "transformer_engine": "present" if importlib.util.find_spec("transformer_engine") else "absent",
        "vllm": "present" if importlib.util.find_spec("vllm") else "absent",
    }


def missing_requirements(env: dict[str, str]) -> list[str]:
    out = [m for m in ("megatron-core", "mbridge", "transformers") if env[m] == "absent"]
    if env["cuda"] == "not available":
        out.append("a CUDA device")
    return out


# ------------------------------------------------------------------------------------------------ stages
def stage_env(ctx) -> str:
    return ", ".join(f"{k} {v}" for k, v in ctx["env"].items())


def stage_nccl(ctx) -> str:
    import torch
    import torch.distributed as dist

    from mcore_rl.platform import collectives, get_platform
    from mcore_rl.platform.collectives import CollectiveRuleError

    if ctx["platform"] != "cuda":
        raise NotRun("needs CUDA")
    platform = get_platform("cuda")
    platform.init_distributed()
    backend = dist.get_backend()
    assert backend == "cpu:gloo,cuda:nccl", backend
    assert collectives.group_device().type == "cuda"
    big = 2.0**40 + 0.125
    assert collectives.sum_floats([big]) == [big] and collectives.sum_ints([3]) == [3]
    assert collectives.all_agree([1, 2]) and collectives.max_floats([0.5]) == [0.5]
    nccl_only = dist.new_group([0], backend="nccl")
    for bad, why in ((torch.zeros(2), "cpu"), (torch.zeros(2, dtype=torch.float64, device="cuda"), "float64")):
        try:
            collectives.all_reduce_small(bad, group=nccl_only)
        except CollectiveRuleError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"{why} tensor accepted on an nccl-only group")
    return f"default group {backend}; small collectives on {collectives.group_device()}; cpu / float64 refused"


def _tiny_paths(ctx) -> tuple[str, str]:
    if "model" not in ctx:
        from mcore_rl.data.task import make_task_dataset
        from mcore_rl.models.tiny import make_tiny_checkpoint

        work = Path(ctx["work"])
        ctx["model"] = str(make_tiny_checkpoint(work / "tiny-qwen3-moe", seed=0))
        ctx["train"], _ = make_task_dataset(work / "task", train_size=512, val_size=16, seed=0, fmt="parquet")
    return ctx["model"], str(ctx["train"])


def _actor(ctx, dtype: str):
    from mcore_rl.config import load_config
    from mcore_rl.megatron.actor import Actor

    model, _ = _tiny_paths(ctx)
    cfg = load_config(
        None, [f"platform={ctx['platform']}", f"model.path={model}", f"model.dtype={dtype}", "actor.optim.lr=1e-3"]
    )
    return Actor(cfg)


def _batch():
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 128, (4, 16), generator=g)
    return tokens


def stage_parity(ctx) -> str:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from mcore_rl.batch import MicroBatch

    model, _ = _tiny_paths(ctx)
    tokens = _batch()
    device = ctx["device"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(tokens.to(device)).logits.float(), -1)
    del hf
    out = []
    for dtype, mean_tol, max_tol in (("float32", 1e-4, 1e-3), ("bfloat16", 0.05, 0.5)):
        actor = _actor(ctx, dtype)
        (logits,) = actor.forward_only(
            [MicroBatch(tokens)],
            lambda head, mb: tensor_parallel.gather_from_tensor_model_parallel_region(head.logits()),
        )
        diff = (torch.log_softmax(logits.float(), -1) - want).abs()
        mean, worst = float(diff.mean()), float(diff.max())
        assert mean <= mean_tol and worst <= max_tol, f"{dtype}: mean {mean:.3g} max {worst:.3g}"
        out.append(f"{dtype} |dlogp| mean {mean:.2g} max {worst:.2g}")
        ctx[f"actor_{dtype}"] = actor
    backend = dist.get_backend(mpu.get_data_parallel_group())
    assert backend == dist.get_backend(), backend
    return "; ".join(out) + f"; Megatron's groups inherit {backend}"


def stage_train(ctx) -> str:
    import torch
    from megatron.core import parallel_state as mpu

    from mcore_rl.batch import MicroBatch

    actor = ctx.get("actor_float32") or _actor(ctx, "float32")
    tokens = _batch()
    before = [p.detach().clone() for p in actor.model[0].parameters()]

    def loss_fn(head, mb):
        labels = torch.roll(mb.tokens, -1, dims=1)
        lp, _ = head.log_probs(labels, 1.0, mpu.get_tensor_model_parallel_group())
        return -lp.mean(), {}

    metrics = actor.train_step([MicroBatch(tokens)], loss_fn)
    moved = sum(not torch.equal(a, b) for a, b in zip(before, actor.model[0].parameters()))
    assert metrics["update_successful"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"])), metrics
    assert moved > 0, "no parameter changed"
    return f"loss {metrics['loss']:.4g}, grad norm {metrics['grad_norm']:.3g}, {moved} tensors moved"


def stage_sync(ctx) -> str:
    from mcore_rl.rollout.embedded import EmbeddedEngine
    from mcore_rl.rollout.weight_sync import ProbeBatch, default_tolerance, sync_weights, verify_sync

    model, _ = _tiny_paths(ctx)
    actor = ctx.get("actor_bfloat16") or _actor(ctx, "bfloat16")
    engine = EmbeddedEngine(model, dtype="bfloat16", device=ctx["device"])
    stats = sync_weights(actor.export_hf_weights(), engine, bucket_mb=64)
    probe = ProbeBatch.random(actor.hf_config.vocab_size, seed=1)
    reference = actor.probe_log_probs
    report = verify_sync(engine, reference, probe, default_tolerance("bfloat16"), fingerprints=stats.fingerprints)
    assert report.passed and report.weights.differ == 0, report.summary()
    return f"{stats.summary()}; {report.summary()}"


def stage_memory(ctx) -> str:
    import torch

    if ctx["platform"] != "cuda":
        raise NotRun("needs CUDA")
    return f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"


def stage_gspo(ctx) -> str:
    from mcore_rl.config import load_config
    from mcore_rl.trainer import Trainer

    model, train = _tiny_paths(ctx)
    steps = ctx["gspo_steps"]
    cfg = load_config(
        REPO / "configs" / "tiny" / "gspo_cpu.yaml",
        [
            f"platform={ctx['platform']}",
            f"model.path={model}",
            f"data.train_path={train}",
            "data.val_path=",
            "actor.parallel.ep=1",
            "trainer.nproc=1",
            f"trainer.steps={steps}",
            "trainer.val_every=0",
            "trainer.tensorboard=false",
            f"trainer.run_dir={Path(ctx['work']) / 'gspo_run'}",
            "checkpoint.save_hf=false",
        ],
    )
    trainer = Trainer(cfg)
    rewards: list[float] = []
    while len(rewards) < steps:  # stop early once the rise is plain (saves device time)
        rewards.append(trainer.train_step()["reward/mean"])
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        if len(rewards) >= 30 and last > first + 0.3:
            break
    assert last > first + 0.05, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    return f"{len(rewards)} steps: reward {first:.3f} (first 10) -> {last:.3f} (last 10)"


def stage_vllm(ctx) -> str:
    if importlib.util.find_spec("vllm") is None:
        raise NotRun("vLLM not installed")
    from mcore_rl.config import RolloutConfig
    from mcore_rl.rollout.vllm_engine import VllmEngine
    from mcore_rl.rollout.weight_sync import ProbeBatch, default_tolerance, sync_weights, verify_sync

    model, _ = _tiny_paths(ctx)
    actor = ctx.get("actor_bfloat16") or _actor(ctx, "bfloat16")
    engine = VllmEngine(RolloutConfig(tp=1, gpu_memory_utilization=0.3), model, dtype="bfloat16", max_model_len=256)
    stats = sync_weights(actor.export_hf_weights(), engine, bucket_mb=64)
    report = verify_sync(
        engine,
        actor.probe_log_probs,
        ProbeBatch.random(actor.hf_config.vocab_size, seed=2),
        default_tolerance("bfloat16"),
        fingerprints=stats.fingerprints,
    )
    engine.close()
    assert report.passed, report.summary()
    return report.summary()


class NotRun(Exception):
    """A stage that cannot run here (the reason is reported as 'not run: ...')."""


STAGE_FNS: dict[str, Callable] = {
    "env": stage_env,
    "nccl": stage_nccl,
    "parity": stage_parity,
    "train": stage_train,
    "sync": stage_sync,
    "memory": stage_memory,
    "gspo": stage_gspo,
    "vllm": stage_vllm,
}


def run_stage(name: str, ctx) -> Result:
    start = time.perf_counter()
    try:
        detail = STAGE_FNS[name](ctx)
        status = "ok"
    except NotRun as e:
        status, detail = "not run", str(e)
    except Exception as e:  # noqa: BLE001 - every stage reports; the exit code carries the failure
        status, detail = "FAILED", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return Result(name, status, detail, time.perf_counter() - start)


def summary(results: list[Result], total_s: float, dry_run: bool) -> str:
    head = "GPU smoke suite" + (" (dry run: nothing ran on a GPU)" if dry_run else "")
    lines = [f"{head} - {total_s:.0f} s of a {BUDGET_S} s budget"]
    for r in results:
        lines.append(f"  {r.stage:<7} {r.status:<8} {r.seconds:6.1f} s  {r.detail}"[:400])
    failed = [r.stage for r in results if r.status == "FAILED"]
    lines.append(f"result: {'FAILED: ' + ', '.join(failed) if failed else 'ok'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    env = environment()
    stages = args.only or list(STAGES)
    if args.dry_run:
        missing = missing_requirements(env)
        plan = [Result("env", "ok", stage_env({"env": env}))]
        plan += [
            Result(s, "planned", "needs: " + (", ".join(missing) if missing else "nothing missing"))
            for s in stages
            if s != "env"
        ]
        text = summary(plan, time.perf_counter() - start, dry_run=True)
    else:
        missing = [m for m in missing_requirements(env) if args.platform == "cuda" or m != "a CUDA device"]
        if missing:
            print(
                f"GPU smoke suite cannot start: missing {', '.join(missing)} (see README, 'GPU smoke suite')",
                file=sys.stderr,
            )
            return 2
        with tempfile.TemporaryDirectory(prefix="mcore_rl_gpu_smoke_") as tmp:
            device = "cuda:0" if args.platform == "cuda" else "cpu"
            ctx = {"env": env, "work": args.work or tmp, "gspo_steps": args.gspo_steps, "platform": args.platform}
            ctx["device"] = device
            results = [run_stage(s, ctx) for s in stages]
        text = summary(results, time.perf_counter() - start, dry_run=False)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 1 if "result: FAILED" in text else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
