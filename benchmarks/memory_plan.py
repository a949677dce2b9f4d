"""The memory plan (`mcore_rl.preflight.memory_plan`, `mcore-rl plan`) against measured per-rank peaks.

For each configuration below, the script writes a Qwen3-MoE config.json (the tiny model's layout at a
size where each rank holds a few hundred MB of model and optimizer state), starts the real actor
under torchrun (gloo, CPU, random weights), and measures on every rank:

  resident   after the first optimizer step (parameters, gradient buffers, optimizer state)
  log-probs  the peak of an old-log-prob pass (Actor.log_probs)
  update     the peak of a second optimizer step (Actor.train_step over the micro-batches)
  save       the peak of a Megatron dist checkpoint save (Actor.save_checkpoint)

and prints them beside the plan's numbers for the same phase and their ratio.

How memory is measured: live tensor bytes, the CPU counterpart of torch.cuda.max_memory_allocated.
Between phases, every distinct tensor storage the garbage collector reaches is summed (parameters,
DDP buffers, optimizer state); during a phase, torch's profiler with profile_memory=True reports each
allocation and free of the CPU allocator, and the high-water mark of its running "Total Allocated"
is added to what lived before. Beside it the script prints the resident-set peak (VmHWM after
writing 5 to /proc/self/clear_refs, with MALLOC_MMAP_THRESHOLD_=65536 so freed buffers leave the
process, as benchmarks/logprob_memory.py does) minus the resident size before the actor was built:
that number also holds what is not a tensor (oneDNN's bf16 kernel scratch, gloo buffers, the heap),
which a device's allocator statistics do not count either.

The rollout phase is not measured here: on CPU the engine is the embedded one, and vLLM's memory is
its own (gpu_memory_utilization); see docs/memory.md.

Run: OMP_NUM_THREADS=1 python benchmarks/memory_plan.py [--only NAME]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MIB = 1 << 20

# name -> (world size, config overrides). Shared shape: see SHAPE.
CONFIGS = {
    "fp32-ep2": (
        2,
        ["actor.parallel.ep=2", "model.dtype=float32", "model.recompute=false"],
    ),
    "bf16-tp2-distopt-recompute": (
        2,
        [
            "actor.parallel.tp=2",
            "actor.parallel.etp=1",
            "actor.parallel.ep=2",
            "model.dtype=bfloat16",
            "model.recompute=true",
            "actor.optim.use_distributed_optimizer=true",
        ],
    ),
    "bf16-dp2-distopt-grad-bf16": (
        2,
        [
            "model.dtype=bfloat16",
            "model.recompute=false",
            "actor.optim.use_distributed_optimizer=true",
            "actor.optim.grad_reduce_in_fp32=false",
        ],
    ),
}
SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=1024,
)
VOCAB = 32768
SEQ = 512  # max_prompt_len + max_new_tokens
COMMON = [
    "platform=cpu",
    "data.max_prompt_len=128",
    f"rollout.max_new_tokens={SEQ - 128}",
    "rollout.n=2",
    "data.prompts_per_step=2",
    "actor.parallel.micro_batch_size=1",
    "algo.mini_batches=1",
]


def write_model_config(out_dir: str) -> str:
    """A Qwen3-MoE config.json of SHAPE (no weights: the actor starts from random ones)."""
    from mcore_rl.models.tiny import TinyModelShape, build_hf_config

    config = build_hf_config(TinyModelShape(**SHAPE))
    config.vocab_size = VOCAB
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    return out_dir


# ------------------------------------------------------------------------------------------ worker side


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _preimport() -> None:
    """Import what the actor imports lazily, so that module memory is in the baseline."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import mcore_rl.megatron.checkpoint  # noqa: F401
    import mcore_rl.models.bridge  # noqa: F401


def worker(model_dir: str, overrides: list[str], out_json: str) -> None:
    import torch

    from mcore_rl.batch import MicroBatch
    from mcore_rl.config import load_config
    from mcore_rl.platform import get_platform
    from mcore_rl.preflight.layout import ModelDims
    from mcore_rl.preflight.memory_plan import plan_memory
    from mcore_rl.preflight.run import validate_run

    cfg = load_config(None, [f"model.path={model_dir}", *COMMON, *overrides])
    platform = get_platform("cpu")
    platform.adapt_megatron()
    _preimport()
    from mcore_rl.megatron.actor import Actor

    world = int(os.environ["WORLD_SIZE"])
    dims = ModelDims.from_hf(model_dir)
    plan = plan_memory(cfg, validate_run(cfg, world, dims), dims)
    gc.collect()
    base = reset_peak()
    actor = Actor(cfg, platform, load_weights=False)
    layout = actor.layout
    seq = layout.pad_length(SEQ)
    n_micro = cfg.data.prompts_per_step * cfg.rollout.n // (layout.dp * layout.micro_batch_size)
    g = torch.Generator().manual_seed(layout.ranks.dp)
    mask = torch.ones(layout.micro_batch_size, seq)
    mask[:, -1] = 0  # the last position has no next token
    micro = [
        MicroBatch(tokens=torch.randint(0, VOCAB, (layout.micro_batch_size, seq), generator=g), loss_mask=mask)
        for _ in range(n_micro)
    ]
    tokens_total = float(n_micro * layout.dp * layout.micro_batch_size * seq)

    def loss_fn(head, mb):  # the actor's own path (fused log-probs from the last hidden states)
        target = torch.roll(mb.tokens, -1, dims=1).to(head.hidden.device)
        lp, ent = head.log_probs(target, 1.0, layout.groups.tp, with_entropy=True)
        loss = -(lp * mb.loss_mask).sum() / tokens_total - 1e-3 * (ent * mb.loss_mask).sum() / tokens_total
        return loss, {}

    actor.train_step(micro, loss_fn)  # step 1 creates the optimizer state
    gc.collect()
    measured = {"resident": live_tensor_bytes()}
    rss = {"resident": rss_bytes() - base}
    measured["log-probs"], rss["log-probs"] = phase_peak(lambda: actor.log_probs(micro, with_entropy=True), base)
    measured["update"], rss["update"] = phase_peak(lambda: actor.train_step(micro, loss_fn), base)
    with tempfile.TemporaryDirectory() as ckpt:
        measured["save"], rss["save"] = phase_peak(lambda: actor.save_checkpoint(ckpt), base)
    planned = {
        "resident": sum(i.bytes for i in plan.phase("save").items if not i.name.startswith("checkpoint")),
        "log-probs": plan.phase("log-probs").total,
        "update": plan.phase("update").total,
        "save": plan.phase("save").total,
    }
    items = {p.name: {i.name: i.bytes for i in p.items} for p in plan.phases}
    rank = torch.distributed.get_rank()
    with open(f"{out_json}.{rank}", "w") as f:
        json.dump({"measured": measured, "rss": rss, "planned": planned, "items": items, "stage": plan.stage}, f)
    torch.distributed.barrier()


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach (parameters, DDP buffers,
    optimizer state, ...): the CPU counterpart of torch.cuda.memory_allocated() between phases."""
    import torch

    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def phase_peak(fn, rss_base: int) -> tuple[int, int]:
    """(live tensor bytes at the phase's peak, resident-set peak minus `rss_base`) while running fn().

    Live tensor bytes: what lived before (live_tensor_bytes) + the high-water mark of the bytes
    allocated during the phase and not yet freed, as torch's profiler reports it for the CPU
    allocator (the "Total Allocated" of its memory events: every allocation and free in between).
    """
    import torch.profiler as tp

    gc.collect()
    before = live_tensor_bytes()
    reset_peak()
    with tp.profile(activities=[tp.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    rss_peak = peak_bytes() - rss_base
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    extra = max((e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"), default=0)
    gc.collect()
    return before + extra, rss_peak


# ------------------------------------------------------------------------------------------ driver side


def run_config(name: str, world: int, overrides: list[str], model_dir: str, tmp: str) -> list[dict]:
    out_json = os.path.join(tmp, f"{name}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **{MMAP_ENV: "65536"})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--standalone",
        os.path.abspath(__file__),
        "--worker",
        model_dir,
        out_json,
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: torchrun failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.load(open(f"{out_json}.{r}")) for r in range(world)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model_dir, out_json, *overrides = sys.argv[2:]
        worker(model_dir, overrides, out_json)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(CONFIGS), help="run one configuration")
    ap.add_argument("--items", action="store_true", help="also print the plan's items per phase")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_config(os.path.join(tmp, "model"))
        for name, (world, overrides) in CONFIGS.items():
            if args.only and name != args.only:
                continue
            ranks = run_config(name, world, overrides, model_dir, tmp)
            print(f"{name} (world {world}; {' '.join(overrides)})")
            for phase in ("resident", "log-probs", "update", "save"):
                # the plan describes the most loaded rank (e.g. DP rank 0 gathers the checkpoint): compare with the max
                m = max(res["measured"][phase] for res in ranks)
                p = ranks[0]["planned"][phase]
                worst = max(worst, abs(p / m - 1))
                per_rank = " / ".join(f"{res['measured'][phase] / MIB:.0f}" for res in ranks)
                rss = " / ".join(f"{res['rss'][phase] / MIB:.0f}" for res in ranks)
                print(
                    f"  {phase:10s} planned {p / MIB:7.0f} MiB  measured {per_rank} MiB (ranks)  plan/max {p / m:.3f}"
                    f"   (resident-set peak {rss} MiB)"
                )
            if args.items:
                for phase, items in ranks[0]["items"].items():
                    shown = ", ".join(f"{k} {v / MIB:.1f}" for k, v in items.items() if v)
                    print(f"    plan {phase}: {shown}")
    print(f"largest |plan/measured - 1| = {worst:.3f} (target <= 0.15)")


if __name__ == "__main__":
    main()
