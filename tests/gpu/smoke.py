"""GPU smoke suite: the CUDA path end to end on ONE GPU in at most 5 minutes (docs/gpu-smoke.md).

    python tests/gpu/smoke.py --install            # offline: the carried wheels (.whl/) -> .gpu-site/ (pip --target)
    python tests/gpu/smoke.py [--platform cpu]     # the stages; summary in gpu_smoke_summary.txt
    python tests/gpu/smoke.py --dry-run            # the plan, the carry size, the expected time; runs nothing

The machine it is written for has Python 3.12 in a venv with torch, transformers, triton, safetensors, pyarrow,
pyyaml, numpy, einops, psutil, tqdm and no Transformer Engine, vLLM, megatron-core or mbridge; no network; at most
64 MiB carried to it. So megatron-core and mbridge travel as wheels (tests/gpu/carry.txt) and are installed with
`pip install --no-deps --no-index --target .gpu-site`, which this script puts on sys.path (no venv made from that
venv: it would see the base interpreter's packages, not the venv's).

One process, world 1. Each stage writes one summary line beginning PASS, FAIL or SKIP with its reason; a stage
that raises or runs past its time budget is a FAIL and the next stage still runs; once the suite's budget is
spent the remaining stages are SKIPped. The summary is written even when stages fail. Exit status: 0 when no
line is FAIL, 1 otherwise, 2 for bad arguments or a missing CUDA device (summary written too).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
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

CARRY_LIST = REPO / "tests" / "gpu" / "carry.txt"
DEFAULT_SITE = REPO / ".gpu-site"
DEFAULT_WHEELS = REPO / ".whl"
BUDGET_S = 300  # the whole suite: a run plus a rerun must fit a 15-minute device lend with the machine's start
# The budgets are the GPU's. The CPU rehearsal checks the stages' code, not their time, on a shared 2-core CI
# machine where the GSPO stage took 24 s idle and over 120 s at load 25: there every budget is this many times larger.
CPU_BUDGET_SCALE = 5
CARRY_LIMIT = 64 << 20  # what the device tool carries to the machine


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # past this the stage is stopped and FAILs
    expected_s: int  # estimate on the GPU (tiny models: launch-bound; the CPU rehearsal's times, docs/gpu-smoke.md)
    what: str
    megatron: bool = False  # runs a Megatron forward: the process's first one may pay a first torch.compile


# megatron-core's jit_fuser is torch.compile (torch >= 2.2): its fusions compile on their first call - from 0.16 the
# MoE router's _apply_expert_bias on every forward - so the first stage to run a Megatron forward pays TorchDynamo's
# tracing (and Inductor's code generation for a non-empty graph) on top of its own work. Its budget gets this much
# more; the rehearsal runs with compile on and prints each stage's compile seconds (docs/gpu-smoke.md).
FIRST_COMPILE_S = 60

STAGES = (
    Stage("env", 60, 10, "versions; megatron-core, mbridge, transformers importable; TE / vLLM presence"),
    Stage("nccl", 30, 5, "default group cpu:gloo,cuda:nccl; the small-collectives rule on it"),
    Stage("parity", 60, 10, "Megatron actor (local spec) vs Hugging Face log-probs, fp32 and bf16", True),
    Stage("packed", 30, 3, "packed micro-batch: the segment path + the fused log-prob head vs HF per sequence", True),
    Stage("train", 30, 2, "one optimizer step: finite loss, weights moved", True),
    Stage("offload", 30, 2, "actor state to (pinned) host memory and back, bit-exact; device memory released", True),
    Stage("sync", 30, 3, "bf16 actor -> embedded engine, verified (bf16 tolerances + weight-level check)", True),
    Stage("replay", 60, 5, "routing replay with the embedded engine: R3 (engine routes) and R2 (recorded)", True),
    Stage("checkpoint", 60, 5, "save, train on, load: parameters and optimizer state back bit-exact", True),
    Stage("gspo", 120, 30, "a short GSPO run on the tiny task (the smoke config): reward rises", True),
    Stage("memory", 90, 45, "the memory config's peak device memory vs `mcore-rl plan` (within 15%)", True),
    Stage("vllm", 30, 0, "vLLM engine sync + verification (SKIP: not installed)", True),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
MEMORY_TOLERANCE = 0.15


class Skip(Exception):
    """A stage that cannot run here; the reason goes on its SKIP line."""


class StageTimeout(Exception):
    pass


@dataclass
class Result:
    stage: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU smoke suite (one GPU, <= 5 minutes); docs/gpu-smoke.md")
    p.add_argument("--out", default="gpu_smoke_summary.txt", help="summary file (default: %(default)s)")
    p.add_argument("--platform", choices=("cuda", "cpu"), default="cuda", help="cpu: the same stages on CPU")
    p.add_argument("--site", default=str(DEFAULT_SITE), help="folder of the installed carried wheels (put on sys.path)")
    p.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="--install: folder of the carried wheels")
    p.add_argument("--install", action="store_true", help="install the carried wheels into --site offline, then stop")
    p.add_argument("--dry-run", action="store_true", help="print the plan, the carry size and the expected time")
    p.add_argument("--gspo-steps", type=int, default=150, help="most GSPO steps (default: %(default)s)")
    p.add_argument("--only", nargs="*", choices=STAGE_NAMES, default=None, help="run only these stages")
    p.add_argument("--work", default=None, help="folder for models, data and runs (default: a temporary one)")
    args = p.parse_args(argv)
    if args.gspo_steps < 20:
        p.error("--gspo-steps must be >= 20 (the reward test compares the first and last 10 steps)")
    return args


# ------------------------------------------------------------------------------------------------ carried wheels
def carried_requirements(path: Path = CARRY_LIST) -> list[tuple[str, str]]:
    """(distribution, version) of each `name==version` line of tests/gpu/carry.txt."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: {line!r} must pin one version (name==version): one wheel is carried")
            out.append((name.strip(), version.strip()))
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def select_wheels(wheel_dir: Path, requirements: list[tuple[str, str]], tags=None) -> tuple[list[Path], list[str]]:
    """The wheel of each requirement that this interpreter can install (one per name), and what is missing."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags() if tags is None else tags)
    found: dict[tuple[str, str], Path] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
        if supported & set(wheel_tags):
            found.setdefault((_norm(name), str(version)), wheel)
    picked, missing = [], []
    for name, version in requirements:
        wheel = found.get((_norm(name), version))
        if wheel is None:
            missing.append(f"{name}=={version}")
        else:
            picked.append(wheel)
    return picked, missing


def install(wheel_dir: Path, site: Path) -> int:
    """pip install --no-deps --no-index --target SITE the carried wheels; refuse a missing one before pip runs."""
    requirements = carried_requirements()
    wheels, missing = select_wheels(wheel_dir, requirements)
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if missing:
        print(
            f"mcore-rl: error: {wheel_dir} holds no wheel for {py} of {', '.join(missing)} (tests/gpu/carry.txt): "
            f"run `make gpu-wheels` on a machine with network and carry .whl/ along",
            file=sys.stderr,
        )
        return 1
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
    if subprocess.run(cmd).returncode != 0:
        print(
            f"mcore-rl: error: pip could not install {', '.join(w.name for w in wheels)} into {site}", file=sys.stderr
        )
        return 1
    print(f"installed into {site}: {', '.join(w.name for w in wheels)}")
    return 0


def carry_bytes(repo: Path = REPO) -> tuple[int, int]:
    """(bytes of the files that travel with the checkout: tracked + untracked-not-ignored, bytes of .whl/)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        files = [repo / os.fsdecode(f) for f in listed if f]
    except (OSError, subprocess.CalledProcessError):  # no git (the GPU machine): everything but caches
        files = [p for p in repo.rglob("*") if p.is_file() and not {".git", "__pycache__"} & set(p.parts)]
        files = [p for p in files if not p.is_relative_to(repo / ".whl") and not p.is_relative_to(DEFAULT_SITE)]
    tree = sum(f.stat().st_size for f in files if f.is_file())
    wheels = sum(f.stat().st_size for f in (repo / ".whl").glob("*")) if (repo / ".whl").is_dir() else 0
    return tree, wheels


# ------------------------------------------------------------------------------------------------ environment
def _version(distribution: str) -> str:
    """Installed version from package metadata (no import: the dry run stays fast)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment() -> dict[str, str]:
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


# ------------------------------------------------------------------------------------------------ stages
def stage_env(ctx) -> str:
    env = ctx["env"]
    text = ", ".join(f"{k} {v}" for k, v in env.items())
    missing = [m for m in ("megatron-core", "mbridge", "transformers") if env[m] == "absent"]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not importable (site {ctx['site']}): carry its wheel (tests/gpu/carry.txt, "
            f"make gpu-wheels) and install it (make gpu-install / --install); found {text}"
        )
    import mbridge  # noqa: F401
    import megatron.core  # noqa: F401  (metadata alone does not prove the carried wheel imports)

    return text


def stage_nccl(ctx) -> str:
    import torch
    import torch.distributed as dist

    from mcore_rl.platform import collectives
    from mcore_rl.platform.collectives import CollectiveRuleError

    if ctx["platform"] != "cuda":
        raise Skip("needs CUDA (NCCL); on CPU the default group is gloo")
    _platform(ctx).init_distributed()
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


def _platform(ctx):
    from mcore_rl.platform import get_platform

    return get_platform(ctx["platform"])


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


def _tokens(batch: int = 4, seq: int = 16, seed: int = 0):
    import torch

    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf(ctx):
    """The Hugging Face model of the tiny checkpoint in fp32, built the way the embedded engine builds it (from its
    config, the safetensors copied in): `from_pretrained` after Megatron's CPU adaptation leaves rotary `inv_freq`
    uninitialised (mcore_rl/rollout/embedded.py), so on CPU the reference would depend on the stage order."""
    from mcore_rl.rollout.embedded import EmbeddedEngine

    model, _ = _tiny_paths(ctx)
    engine = EmbeddedEngine(
        model, dtype="float32", device=ctx["device"], return_routed_experts=False, share_weights=False
    )
    return engine.model


def _full_logits(head, mb):
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(head.logits())


def stage_parity(ctx) -> str:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mcore_rl.batch import MicroBatch

    tokens = _tokens()
    with torch.no_grad():
        want = torch.log_softmax(_hf(ctx)(tokens.to(ctx["device"])).logits.float(), -1)
    out = []
    for dtype, mean_tol, max_tol in (("float32", 1e-4, 1e-3), ("bfloat16", 0.05, 0.5)):
        actor = _actor(ctx, dtype)
        (logits,) = actor.forward_only([MicroBatch(tokens)], _full_logits)
        diff = (torch.log_softmax(logits.float(), -1) - want).abs()
        mean, worst = float(diff.mean()), float(diff.max())
        assert mean <= mean_tol and worst <= max_tol, f"{dtype}: mean {mean:.3g} max {worst:.3g}"
        out.append(f"{dtype} |dlogp| mean {mean:.2g} max {worst:.2g}")
        ctx[f"actor_{dtype}"] = actor
    backend = dist.get_backend(mpu.get_data_parallel_group())
    assert backend == dist.get_backend(), backend
    return "; ".join(out) + f"; Megatron's groups inherit {backend}"


def stage_packed(ctx) -> str:
    """Sequences of several lengths in one packed row through the actor's log-probs (the fused head: no logits
    tensor), each compared with the HF model run on that sequence alone."""
    import torch

    from mcore_rl.batch import pack_token_lists, unpack_rows

    actor = ctx.get("actor_float32") or _actor(ctx, "float32")
    platform = actor.platform
    mode = platform.packed_attention
    if not platform.uses_transformer_engine and mode != "segments":
        raise AssertionError(
            f"packed attention {mode!r} without Transformer Engine: Megatron's DotProductAttention refuses "
            f"packed_seq_params; the local spec must take the segment path"
        )
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 11, 16, 7, 9)]
    mb = pack_token_lists(seqs, actor.layout.seq_len_multiple)
    (lp,) = actor.log_probs([mb], temperature=1.0)
    hf = _hf(ctx)
    worst = 0.0
    for seq, piece in zip(seqs, unpack_rows(lp.cpu(), mb)):
        ids = torch.tensor([seq], device=ctx["device"])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        worst = max(worst, float((piece[0, : len(seq) - 1] - ref.cpu()).abs().max()))
    assert worst <= 1e-4, f"packed log-probs differ from HF per sequence by {worst:.3g} (fp32 tolerance 1e-4)"
    return f"{len(seqs)} sequences in one {mb.tokens.shape[1]}-token row, attention {mode}: max |dlogp| {worst:.2g}"


def stage_train(ctx) -> str:
    import torch

    actor = ctx.get("actor_float32") or _actor(ctx, "float32")
    before = [p.detach().clone() for p in actor.model[0].parameters()]
    metrics = actor.train_step([_micro(_tokens())], _nll)
    moved = sum(not torch.equal(a, b) for a, b in zip(before, actor.model[0].parameters()))
    assert metrics["update_successful"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"])), metrics
    assert moved > 0, "no parameter changed"
    return f"loss {metrics['loss']:.4g}, grad norm {metrics['grad_norm']:.3g}, {moved} tensors moved"


def _nll(head, mb):
    import torch
    from megatron.core import parallel_state as mpu

    labels = torch.roll(mb.tokens, -1, dims=1)
    lp, _ = head.log_probs(labels, 1.0, mpu.get_tensor_model_parallel_group())
    return -lp.mean(), {}


def _state(actor) -> dict:
    """Copies of the parameters and of the optimizer's state per parameter (what an offload or a checkpoint
    must give back), by name: a load replaces the optimizer's state tensors and may reorder its dicts."""
    from mcore_rl.compat.megatron_state import _optimizers

    out = {f"model.{n}": p.detach().clone() for i, m in enumerate(actor.model) for n, p in m.named_parameters()}
    for i, opt in enumerate(_optimizers(actor.optimizer) if actor.optimizer is not None else []):
        inner = getattr(opt, "optimizer", None)
        params = [p for group in (inner.param_groups if inner else []) for p in group["params"]]
        for j, param in enumerate(params):
            out[f"optimizer{i}.main{j}"] = param.detach().clone()
            for key, value in sorted(inner.state.get(param, {}).items()):
                if hasattr(value, "detach"):
                    out[f"optimizer{i}.{key}{j}"] = value.detach().clone()
    return out


def _differ(a: dict, b: dict) -> list[str]:
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if not torch.equal(a[k], b[k])]


def stage_offload(ctx) -> str:
    """Offload and reload: every state storage empty while off, device memory down by what was released and the
    host copies in page-locked blocks (CUDA: the pinned allocator's active bytes; its power-of-two rounding shows
    as their ratio to the copies' bytes), everything back bit-exact."""
    import torch

    from mcore_rl.compat.megatron_state import actor_state

    actor = ctx.get("actor_float32") or _actor(ctx, "float32")
    actor.train_step([_micro(_tokens(seed=3))], _nll)  # Adam's state exists from the first step on
    before = _state(actor)
    cuda = ctx["platform"] == "cuda"
    allocated = torch.cuda.memory_allocated() if cuda else 0
    pinned = torch.cuda.host_memory_stats()["active_bytes.current"] if cuda else 0
    released = actor.offload()
    kept = actor_state(actor.model, actor.optimizer).kept
    assert released > 0 and all(t.untyped_storage().nbytes() == 0 for t in kept), "a device storage kept its bytes"
    host = actor.host_bytes
    where = "plain host memory (CPU)"
    if cuda:
        freed = allocated - torch.cuda.memory_allocated()
        pinned = torch.cuda.host_memory_stats()["active_bytes.current"] - pinned
        assert freed >= 0.9 * released, f"device memory fell by {freed} bytes, {released} released"
        assert pinned >= host, f"pinned host memory grew by {pinned} bytes for {host} bytes of host copies"
        where = f"page-locked blocks of {pinned / 2**20:.2f} MiB ({pinned / host:.2f}x the copies)"
    restored = actor.reload()
    differ = _differ(before, _state(actor))
    assert restored == released and not differ, f"{len(differ)} of {len(before)} differ after reload: {differ[:3]}"
    return (
        f"{released / 2**20:.2f} MiB released and back, {len(before)} tensors bit-exact; host copies "
        f"{host / 2**20:.2f} MiB in {where}"
    )


def _micro(tokens):
    from mcore_rl.batch import MicroBatch

    return MicroBatch(tokens)


def stage_sync(ctx) -> str:
    from mcore_rl.rollout.embedded import EmbeddedEngine
    from mcore_rl.weight_sync.buckets import sync_weights
    from mcore_rl.weight_sync.verify import ProbeBatch, default_tolerance, verify_sync

    model, _ = _tiny_paths(ctx)
    actor = ctx.get("actor_bfloat16") or _actor(ctx, "bfloat16")
    engine = EmbeddedEngine(model, dtype="bfloat16", device=ctx["device"])
    stats = sync_weights(actor.export_hf_weights(), engine, bucket_mb=64)
    probe = ProbeBatch.random(actor.hf_config.vocab_size, seed=1)
    report = verify_sync(
        engine, actor.probe_log_probs, probe, default_tolerance("bfloat16"), fingerprints=stats.fingerprints
    )
    assert report.passed and report.weights.differ == 0, report.summary()
    return f"{stats.summary()}; {report.summary()}"


def stage_replay(ctx) -> str:
    """R3: the embedded engine's routed experts replayed in the actor (same weights: no mismatch, same logits at
    real tokens); R2: routes recorded in one forward replayed in the next and in a train step (no mismatch)."""
    import torch

    from mcore_rl.batch import MicroBatch, pad_rollout_routes
    from mcore_rl.megatron.routing_replay import RoutingReplay
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.embedded import EmbeddedEngine

    model, _ = _tiny_paths(ctx)
    actor = _actor(ctx, "float32")
    replay = RoutingReplay.install(actor.chunks, actor.layout)
    engine = EmbeddedEngine(model, device=ctx["device"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 8, 6, 7)]
    samples = [s for group in engine.generate(prompts, 1, SamplingParams(max_new_tokens=6, seed=3)) for s in group]
    seq_len = 16
    tokens = torch.zeros(len(samples), seq_len, dtype=torch.long)
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        tokens[i, : len(ids)] = torch.tensor(ids)
    experts = actor.hf_config.num_experts
    ids, valid = pad_rollout_routes([s.routed_experts for s in samples], seq_len, experts)
    mbs = [MicroBatch(tokens)]
    plain = actor.forward_only(mbs, _full_logits)[0]
    with replay.replaying(replay.routes_from_rollout([ids], [valid])):
        r3_logits = actor.forward_only(mbs, _full_logits)[0]
    r3 = replay.mismatch_metrics()["routing/token_mismatch"]
    r3_gap = float((plain[valid.to(plain.device)] - r3_logits[valid.to(plain.device)]).abs().max())
    assert r3 <= 0.01 and r3_gap < 1e-4, f"R3: token mismatch {r3}, logit gap {r3_gap:.3g}"
    with replay.recording() as rec:
        actor.forward_only(mbs, _full_logits)
    with replay.replaying(rec.routes):
        r2_logits = actor.forward_only(mbs, _full_logits)[0]
    r2 = replay.mismatch_metrics()["routing/token_mismatch"]
    r2_gap = float((plain - r2_logits).abs().max())
    with replay.replaying(rec.routes):
        metrics = actor.train_step(mbs, _nll)
    r2_train = replay.mismatch_metrics()["routing/token_mismatch"]
    assert r2 == 0.0 and r2_train == 0.0 and r2_gap < 1e-5, f"R2: mismatch {r2} / {r2_train}, logit gap {r2_gap:.3g}"
    assert metrics["update_successful"] == 1.0, metrics
    return (
        f"R3 ({len(samples)} engine samples): token mismatch {r3:.3g}, logit gap {r3_gap:.2g}; "
        f"R2: mismatch {r2:.3g} (forward) {r2_train:.3g} (train step), logit gap {r2_gap:.2g}"
    )


def stage_checkpoint(ctx) -> str:
    actor = ctx.get("actor_float32") or _actor(ctx, "float32")
    folder = Path(ctx["work"]) / "checkpoint"
    actor.train_step([_micro(_tokens(seed=1))], _nll)
    saved = _state(actor)
    actor.save_checkpoint(str(folder), extra={"step": 7})
    actor.train_step([_micro(_tokens(seed=2))], _nll)
    moved = _differ(saved, _state(actor))
    assert moved, "the step after the save changed nothing: the resume check would prove nothing"
    extra = actor.load_checkpoint(str(folder))
    differ = _differ(saved, _state(actor))
    assert not differ and extra.get("step") == 7, (
        f"{len(differ)} of {len(saved)} differ after load: {differ[:3]}; {extra}"
    )
    metrics = actor.train_step([_micro(_tokens(seed=2))], _nll)
    assert metrics["update_successful"] == 1.0, metrics
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return f"{size / 2**20:.2f} MiB saved; {len(saved)} tensors (parameters + optimizer state) back bit-exact; step after resume ok"


def _trainer_cfg(ctx, model: str, train: str, run: str, steps: int, extra: tuple[str, ...] = ()):
    from mcore_rl.config import load_config

    return load_config(
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
            f"trainer.run_dir={Path(ctx['work']) / run}",
            "checkpoint.save_hf=false",
            *extra,
        ],
    )


def stage_gspo(ctx) -> str:
    from mcore_rl.trainer import Trainer

    model, train = _tiny_paths(ctx)
    steps = ctx["gspo_steps"]
    trainer = Trainer(_trainer_cfg(ctx, model, train, "gspo_run", steps))
    rewards: list[float] = []
    while len(rewards) < steps:  # stop early once the rise is plain (saves device time)
        rewards.append(trainer.train_step()["reward/mean"])
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        if len(rewards) >= 30 and last > first + 0.3:
            break
    assert last > first + 0.05, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    return f"{len(rewards)} steps: reward {first:.3f} (first 10) -> {last:.3f} (last 10)"


# The memory config: the smoke config at a size where the plan's terms dominate the runtime's fixed costs
# (cuBLAS workspaces; the CUDA context is not counted): ~0.2 B parameters in bf16 with Adam, ~4 GiB. Padded
# micro-batches: for a packed row the plan counts the local spec's [s, s] scores of the whole row, which the
# segment path never holds (docs/gpu-smoke.md), so only the padded layout is a like-for-like comparison.
MEMORY_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    moe_intermediate_size=1024,
)


MEMORY_OVERRIDES = ("model.dtype=bfloat16", "checkpoint.save_every=0", "actor.max_tokens_per_micro_batch=null")


def stage_memory(ctx) -> str:
    """Two trainer steps of the memory config; the allocator's peak (CUDA) against the plan's peak."""
    import torch

    from mcore_rl.models.tiny import TinyModelShape, make_tiny_checkpoint
    from mcore_rl.preflight.layout import ModelDims
    from mcore_rl.preflight.memory_plan import plan_memory
    from mcore_rl.preflight.run import validate_run
    from mcore_rl.trainer import Trainer

    cuda = ctx["platform"] == "cuda"
    _, train = _tiny_paths(ctx)
    shape = TinyModelShape(**MEMORY_SHAPE) if cuda else TinyModelShape()  # CPU: the code path, at the tiny size
    model = str(make_tiny_checkpoint(Path(ctx["work"]) / "memory-model", seed=0, shape=shape))
    cfg = _trainer_cfg(ctx, model, train, "memory_run", 2, MEMORY_OVERRIDES)
    dims = ModelDims.from_hf(Path(model) / "config.json")
    plan = plan_memory(cfg, validate_run(cfg, 1, dims), dims)
    planned = plan.peak.total
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    if not cuda:
        raise Skip(
            f"CPU: torch keeps no allocator peak for host memory (the process's RSS counts the interpreter and "
            f"libraries); ran 2 steps of the memory config at the tiny size, plan peak {planned / 2**20:.1f} MiB "
            f"({plan.peak.name})"
        )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gap = peak / planned - 1
    text = (
        f"measured peak {peak / 2**30:.3f} GiB (allocated above the {base / 2**20:.0f} MiB before), plan "
        f"{planned / 2**30:.3f} GiB ({plan.peak.name}): {gap:+.1%}"
    )
    assert abs(gap) <= MEMORY_TOLERANCE, f"{text}, outside {MEMORY_TOLERANCE:.0%}"
    return text


def stage_vllm(ctx) -> str:
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM not installed (it cannot fit the 64 MiB carry)")
    from mcore_rl.config import RolloutConfig
    from mcore_rl.rollout.vllm_engine import VllmEngine, VllmSettings
    from mcore_rl.weight_sync.buckets import sync_weights
    from mcore_rl.weight_sync.verify import ProbeBatch, default_tolerance, verify_sync

    model, _ = _tiny_paths(ctx)
    actor = ctx.get("actor_bfloat16") or _actor(ctx, "bfloat16")
    settings = VllmSettings.of(RolloutConfig(tp=1, gpu_memory_utilization=0.3), dtype="bfloat16", max_model_len=256)
    engine = VllmEngine(model, settings)
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


STAGE_FNS: dict[str, Callable] = {
    "env": stage_env,
    "nccl": stage_nccl,
    "parity": stage_parity,
    "packed": stage_packed,
    "train": stage_train,
    "offload": stage_offload,
    "sync": stage_sync,
    "replay": stage_replay,
    "checkpoint": stage_checkpoint,
    "gspo": stage_gspo,
    "memory": stage_memory,
    "vllm": stage_vllm,
}


# ------------------------------------------------------------------------------------------------ running
@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise StageTimeout in this (main) thread after `seconds` (SIGALRM; elsewhere: no limit)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise StageTimeout(f"ran past its {seconds} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def budget_scale(platform: str) -> int:
    return 1 if platform == "cuda" else CPU_BUDGET_SCALE


def compile_seconds() -> float:
    """Seconds TorchDynamo has spent compiling in this process (0 while it is not even imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", {}) if utils is not None else {}
    return float(sum(metrics.get("_compile.compile_inner", ())))


def stage_budget(stage: Stage, platform: str) -> int:
    """The stage's budget, with the first compile's allowance while nothing has been compiled in this process."""
    first_compile = FIRST_COMPILE_S if stage.megatron and compile_seconds() == 0 else 0
    return (stage.budget_s + first_compile) * budget_scale(platform)


def run_stage(stage: Stage, ctx, left_s: float) -> Result:
    if left_s < 1:
        return Result(stage.name, "SKIP", f"the suite's {BUDGET_S * budget_scale(ctx['platform'])} s budget is spent")
    start, compiled = time.perf_counter(), compile_seconds()
    try:
        with time_limit(max(1, int(min(stage_budget(stage, ctx["platform"]), left_s)))):
            detail = STAGE_FNS[stage.name](ctx)
        status = "PASS"
    except Skip as e:
        status, detail = "SKIP", str(e)
    except Exception as e:  # noqa: BLE001 - every stage reports; the exit code carries the failure
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    compiled = compile_seconds() - compiled
    if compiled > 0:
        detail += f"; torch.compile {compiled:.1f} s of it"
    return Result(stage.name, status, detail, time.perf_counter() - start)


def summary_line(r: Result) -> str:
    return f"{r.status:<4}  {r.stage:<10} {r.seconds:6.1f} s  {' '.join(r.detail.split())}"[:600]


def summary(results: list[Result], platform: str, total_s: float) -> str:
    failed = [r.stage for r in results if r.status == "FAIL"]
    lines = [f"# GPU smoke suite on {platform}: {total_s:.0f} s of a {BUDGET_S * budget_scale(platform)} s budget"]
    if platform == "cpu":
        lines.append(f"# {REHEARSAL_NOTE}")
    lines += [summary_line(r) for r in results]
    lines.append(f"# result: {'FAIL (' + ', '.join(failed) + ')' if failed else 'no FAIL'}")
    return "\n".join(lines)


def dry_run(stages: list[Stage], platform: str) -> str:
    env = environment()
    tree, wheels = carry_bytes()
    _, missing = select_wheels(DEFAULT_WHEELS, carried_requirements())
    lines = [
        "GPU smoke suite, dry run (nothing runs): " + ", ".join(f"{k} {v}" for k, v in env.items()),
        f"plan on {platform} ({len(stages)} stages; per-stage budget, expected time):",
    ]
    lines += [f"  {s.name:<10} budget {s.budget_s:>3} s  expected ~{s.expected_s:>2} s  {s.what}" for s in stages]
    lines.append(f"the first stage with a Megatron forward gets {FIRST_COMPILE_S} s more: a first torch.compile")
    expected = sum(s.expected_s for s in stages)
    lines.append(
        f"expected time: ~{expected} s of the stages (estimates: the CPU rehearsal's times plus CUDA start-up; "
        f"never measured on a GPU), at most {BUDGET_S} s (the suite's budget)"
    )
    total = tree + wheels
    verdict = "fits" if total <= CARRY_LIMIT else "DOES NOT FIT"
    lines.append(
        f"carry: {total / 2**20:.1f} MiB ({tree / 2**20:.1f} MiB of the checkout's files + {wheels / 2**20:.1f} MiB "
        f"in .whl/): {verdict} in {CARRY_LIMIT >> 20} MiB"
    )
    if missing:
        lines.append(f"carried wheels for this Python missing from .whl/: {', '.join(missing)} (make gpu-wheels)")
    absent = [m for m in ("megatron-core", "mbridge", "transformers") if env[m] == "absent"]
    absent += ["a CUDA device"] if platform == "cuda" and env["cuda"] == "not available" else []
    lines.append(f"missing here for --platform {platform}: {', '.join(absent) if absent else 'nothing'}")
    return "\n".join(lines)


# On CPU the platform's adaptation is the device routing alone (mcore_rl/platform/cpu_adapt.py): no CPU speed-up
# (torch.compile stays on, the checkpoint writer forks as upstream's does), and every library fix comes from
# mcore_rl.compat as on CUDA - so a defect CUDA would meet in Megatron without TE fails here too.
REHEARSAL_NOTE = "cpu adaptation: device routing only (MCORE_RL_CPU_ADAPT=routing); compat shims as on CUDA"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.platform == "cpu":
        os.environ["MCORE_RL_CPU_ADAPT"] = "routing"  # mcore_rl.platform.cpu_adapt.MODE_ENV
    if args.install:
        return install(Path(args.wheels), Path(args.site))
    site = Path(args.site)
    if site.is_dir() and str(site.resolve()) not in map(os.path.abspath, sys.path):
        sys.path.insert(0, str(site.resolve()))
    stages = [s for s in STAGES if args.only is None or s.name in args.only]
    if args.dry_run:
        text = dry_run(stages, args.platform)
        print(text)
        return 0 if "DOES NOT FIT" not in text else 1
    import torch

    start = time.perf_counter()
    env = environment()
    if args.platform == "cuda" and not torch.cuda.is_available():
        print(
            "mcore-rl: error: --platform cuda but torch sees no CUDA device; --platform cpu rehearses", file=sys.stderr
        )
        results = [Result("env", "FAIL", "no CUDA device (torch.cuda.is_available() is False)")]
        results += [Result(s.name, "SKIP", "no CUDA device") for s in stages if s.name != "env"]
        _write(args.out, summary(results, args.platform, time.perf_counter() - start))
        return 2
    with tempfile.TemporaryDirectory(prefix="mcore_rl_gpu_smoke_") as tmp:
        ctx = {
            "env": env,
            "site": str(site),
            "work": args.work or tmp,
            "gspo_steps": args.gspo_steps,
            "platform": args.platform,
            "device": "cuda:0" if args.platform == "cuda" else "cpu",
        }
        results = []
        for stage in stages:
            left = BUDGET_S * budget_scale(args.platform) - (time.perf_counter() - start)
            results.append(run_stage(stage, ctx, left))
            print(summary_line(results[-1]), flush=True)
    text = summary(results, args.platform, time.perf_counter() - start)
    _write(args.out, text)
    return 1 if any(r.status == "FAIL" for r in results) else 0


def _write(out: str, text: str) -> None:
    print(text)
    Path(out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
