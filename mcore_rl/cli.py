"""`mcore-rl` command line: make-tiny, make-task, check, plan, train, plot, convert, from-verl.

`train CONFIG [key=value ...]` validates the config and the parallel layout first (seconds, no process
started), then runs torchrun (mcore_rl.torchrun, in a fork of itself) with trainer.nproc processes on this
machine (on CPU forked from it too, torch and the loaded inputs with them: mcore_rl.torchrun.ForkedWorker);
inside torchrun (LOCAL_RANK / WORLD_SIZE set, also by launch/ scripts) it runs the trainer.
Bad input exits with status 2 and one line `mcore-rl: error: ...` naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from mcore_rl.algo_config import LOSSES
from mcore_rl.compat import describe_versions
from mcore_rl.config import CONFIG_WARNED_ENV, Config, ConfigError, check_paths, load_config
from mcore_rl.data.dataset import PromptInputs
from mcore_rl.data.task import MULTI_TOKEN_KINDS as WARM_START_KINDS
from mcore_rl.data.task import TASK_KINDS
from mcore_rl.models.tiny import ARCHS
from mcore_rl.preflight.check import describe_run, model_dims
from mcore_rl.preflight.inputs import check_run_inputs, check_tokenizer
from mcore_rl.preflight.layout import Layout, LayoutError
from mcore_rl.preflight.node import check_node, rebuild_bytes
from mcore_rl.preflight.run import validate_run
from mcore_rl.run_dir import OutputWriteError, check_run_dir, write_failure

EXIT_BAD_INPUT = 2


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ


def preflight(
    cfg: Config, world_size: int, model_config: Optional[str] = None, platform: Optional[str] = None
) -> Layout:
    """Config is already validated by load_config; check the layout and batch split for `world_size`."""
    return validate_run(cfg, world_size, model_dims(cfg, model_config), platform=platform)


# ---------------------------------------------------------------------------------------------- commands


def _output_dir(out: str) -> None:
    """--out of make-tiny / make-task: a directory (made when absent), not a file, writable."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create it ({e.strerror}): give a writable directory") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"--out {out} is not writable: give a writable directory")


def cmd_make_tiny(args) -> int:
    from mcore_rl.models.tiny import make_tiny_checkpoint

    if args.warm_start:
        from mcore_rl.models.warm_start import check_fits, warm_start

        task = _task_spec(args.warm_start, args.task_length, args.task_min_length, "--task-")
        fits = check_fits(task)
        if fits:
            raise ConfigError(f"--task-length {task.length}: {fits}")
        _output_dir(args.out)
        path = warm_start(
            args.out,
            args.warm_start,
            seed=args.seed,
            arch=args.arch,
            log=print,
            length=task.length,
            min_length=task.min_length,
        )
        print(f"tiny {args.arch} checkpoint, warm-started on the {args.warm_start} task, written to {path}")
        return 0
    if args.task_length is not None or args.task_min_length is not None:
        raise ConfigError("--task-length / --task-min-length shape the warm start's task: add --warm-start reverse")
    _output_dir(args.out)
    path = make_tiny_checkpoint(args.out, seed=args.seed, arch=args.arch)
    print(f"tiny {args.arch} checkpoint written to {path}")
    return 0


def _task_spec(kind: str, length: Optional[int], min_length: Optional[int], flag: str):
    """The task's TaskSpec from the command line's lengths, checked before anything is written."""
    from mcore_rl.data.task import MULTI_TOKEN_KINDS, TaskSpec, default_length

    if kind not in MULTI_TOKEN_KINDS and min_length is not None:
        raise ConfigError(f"{flag}min-length applies to the reverse task only: add --kind reverse or drop it")
    shortest = TaskSpec.min_length if min_length is None else min_length
    try:
        return TaskSpec(kind=kind, length=default_length(kind, length), min_length=shortest)
    except ValueError as e:
        raise ConfigError(f"{flag}length / {flag}min-length: {e}") from None


def cmd_make_task(args) -> int:
    from mcore_rl.data.task import make_task_dataset

    for flag, value in (("--train-size", args.train_size), ("--val-size", args.val_size)):
        if value < 1:
            raise ConfigError(f"{flag} = {value} must be >= 1")
    spec = _task_spec(args.kind, args.length, args.min_length, "--")
    _output_dir(args.out)
    train, val = make_task_dataset(
        args.out, train_size=args.train_size, val_size=args.val_size, seed=args.seed, spec=spec, fmt=args.format
    )
    print(f"task data written: {train} {val}")
    return 0


def _world(args, cfg: Config) -> tuple[int, int, int]:
    """(world, nnodes, nproc) from --world-size, --nnodes/--nproc-per-node, or the config's trainer section."""
    nnodes = args.nnodes if args.nnodes is not None else cfg.trainer.nnodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.trainer.nproc
    if args.world_size is not None:
        if args.nnodes is not None or args.nproc_per_node is not None:
            raise ConfigError("give either --world-size or --nnodes/--nproc-per-node, not both")
        return args.world_size, 1, args.world_size
    return nnodes * nproc, nnodes, nproc


def cmd_check(args) -> int:
    cfg = load_config(args.config, args.overrides)
    world, nnodes, nproc = _world(args, cfg)
    layout = preflight(cfg, world, args.model_config)
    stack = check_stack(cfg, cfg.platform, getattr(args, "version_of", None))
    if getattr(args, "node", False):  # this node runs the job (launch/torchrun_multinode.sh): its env and disk
        check_node(cfg, None if cfg.platform == "auto" else cfg.platform, model_dims(cfg, args.model_config))
    print(f"OK: {args.config}")
    print(describe_run(cfg, layout, nnodes, nproc))
    print(describe_versions())
    print("\n".join(stack.lines()))
    print("\n".join(_environment_lines(cfg)))
    return 0


def _environment_lines(cfg: Config) -> list[str]:
    """The collective timeout and the environment in force on the run's platform (auto: this machine's)."""
    from mcore_rl.platform.ascend_env import RunEnvironment, describe_environment

    platform = cfg.platform if cfg.platform != "auto" else _resolve_platform(cfg)
    return describe_environment(platform, RunEnvironment.of(cfg), os.environ)


def cmd_plan(args) -> int:
    """The per-rank memory plan by phase (same inputs as `check`; per role in the separate placement); exit 1
    when it does not fit the device. --from-run: the split of the separate placement from a run's times."""
    from mcore_rl.preflight.memory_plan import plan_memory

    cfg = load_config(args.config, args.overrides)
    world, nnodes, nproc = _world(args, cfg)
    dims = model_dims(cfg, args.model_config)
    if args.device_memory is not None and not (0 < args.device_memory < math.inf):  # NaN fails both
        raise ConfigError(
            f"--device-memory = {args.device_memory} must be a finite number of GiB > 0, e.g. --device-memory 80"
        )
    if args.from_run is not None:
        from mcore_rl.preflight.split_plan import split_report

        print(f"plan --from-run: {args.config} on {nnodes} node(s) x {nproc} processes")
        print(split_report(args.from_run, cfg, world, dims, args.device_memory))
        return 0
    layout = validate_run(cfg, world, dims)
    plan = plan_memory(cfg, layout, dims, args.device_memory)
    print(f"plan: {args.config}")
    print(describe_run(cfg, layout, nnodes, nproc))
    print(plan.table())
    rebuild = rebuild_bytes(cfg, dims)
    if rebuild:
        print(
            f"disk: needs {rebuild / 1e9:.1f} GB free per node at rollout.rebuild_dir ({cfg.rollout.rebuild_dir or 'null: TMPDIR'}) "
            f"for the rebuild fallback's Hugging Face folder (rollout.verify_fallback=rebuild)"
        )
    return 1 if plan.fits is False else 0


def _resolve_platform(cfg: Config) -> str:
    from mcore_rl.platform import get_platform

    try:
        return get_platform(cfg.platform).name
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"platform = {cfg.platform}: {e}") from None


def check_stack(cfg: Config, platform: Optional[str], version_of=None):
    """The installed combination judged by the support matrix (mcore_rl.preflight.support); a combination that cannot
    work (e.g. a vLLM-Ascend whose torch no MindSpeed release runs on, or one older than the engine's floor)
    raises ConfigError before any process starts. `version_of`: distribution -> version (tests pass theirs)."""
    from mcore_rl.preflight import support

    report = support.check_installed(platform, cfg.rollout.engine == "vllm", version_of or support.installed)
    if report.refusals:
        raise ConfigError("installed stack outside the support matrix: " + "; ".join(report.refusals))
    return report


class InputError(ValueError):
    """A training input (dataset, reward function, tokenizer) is unusable."""


def check_inputs(cfg: Config) -> PromptInputs:
    """Load what a run reads first - reward function, tokenizer, datasets - so bad inputs fail here,
    in seconds and before any process starts, instead of on every rank after Megatron is up. Returns the
    tokenizer and the prompt sets, for the ranks `mcore-rl train` forks."""
    from mcore_rl.data import PromptInputs, load_prompt_dataset
    from mcore_rl.data.dataset import DatasetFileError
    from mcore_rl.rewards import resolve_reward_fn

    try:
        resolve_reward_fn(cfg.reward.fn)
        if cfg.algo.loss not in LOSSES:  # a 'module:Class' loss: imported here, not first on every rank
            from mcore_rl.algos import build_loss

            build_loss(cfg.algo)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        except Exception as e:
            raise ValueError(
                f"model.path = {cfg.model.path}: cannot load its tokenizer ({type(e).__name__}: {e}); "
                f"the folder needs tokenizer files next to config.json"
            ) from e
        check_tokenizer(tokenizer, cfg.model.path)
        paths = {"data.train_path": cfg.data.train_path}
        val_path = PromptInputs.val_path_of(cfg)  # set where the run validates (check_paths)
        if val_path is not None:
            paths["data.val_path"] = val_path
        sets = {}
        for name, path in paths.items():
            try:
                sets[name] = load_prompt_dataset(path, tokenizer, cfg.data.max_prompt_len, cfg.data.prompt_key)
            except DatasetFileError as e:  # says what the file is, not which setting names it
                raise ValueError(f"{name} = {e}") from None
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise InputError(str(e)) from None
    return PromptInputs(PromptInputs.key_of(cfg), tokenizer, sets["data.train_path"], sets.get("data.val_path"))


def check_resume(cfg: Config) -> None:
    """A resume whose config changes what the checkpoint cannot follow (world size, data, seed, model)
    fails here, before any process starts (mcore_rl.preflight.resume_changes; the trainer logs the applied ones).
    resume=auto compares with the checkpoint the ranks will take: one whose saved config is damaged is skipped."""
    from mcore_rl.preflight.resume_changes import CONFIG_FILE, check_resume_changes
    from mcore_rl.run_dir import check_pickles, resolve_resume_checked

    resume = resolve_resume_checked(cfg, files=(CONFIG_FILE,))
    if resume is not None:
        check_resume_changes(cfg, resume.path)
        check_pickles(resume.path, cfg.checkpoint.trust_pickle)  # nothing in it can run code when unpickled


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)  # a bad config fails before torch is imported
    from mcore_rl.platform.library_warnings import hide_known_warnings, verbose_requested

    if not verbose_requested(cfg.trainer.verbose):
        hide_known_warnings()  # the launcher's own imports too (torch, transformers); workers: trainer.run
    check_paths(cfg)
    if inside_torchrun():
        from mcore_rl.safety import StopRequested, TrainingHalted
        from mcore_rl.supervise import die_with_launcher, report_crash, tell_launcher
        from mcore_rl.trainer import run

        watch = die_with_launcher()  # a kill -9 of `mcore-rl train` (or of torchrun) ends this worker too
        try:
            run(cfg, inputs=getattr(args, "inputs", None))
        except (TrainingHalted, ConfigError, OutputWriteError) as e:  # a clear reason, not a crash
            stopped = isinstance(e, StopRequested)
            line = f"mcore-rl: {'' if stopped else 'error: '}{e}"
            # stopped as asked: exit 0 here (torchrun reports no failure); the launcher exits 128 + signal
            code = 0 if stopped else EXIT_BAD_INPUT if isinstance(e, ConfigError) else 1
            tell_launcher(128 + e.signum if stopped and e.signum else code, line)  # printed once, last
            return code
        except Exception as e:  # a crash: its traceback stays above; the launcher's last line names it
            report_crash(e)
            raise
        finally:
            watch.release()
        return 0
    if cfg.trainer.nnodes > 1:
        raise ConfigError(
            f"trainer.nnodes = {cfg.trainer.nnodes}: `mcore-rl train` starts one machine; start every node with "
            f"launch/torchrun_multinode.sh (or launch/ray_launch.py), or set trainer.nnodes=1"
        )
    platform = _resolve_platform(cfg)
    layout = preflight(cfg, cfg.trainer.nproc, platform=platform)
    check_stack(cfg, platform, args.version_of)
    check_node(cfg, platform, model_dims(cfg))
    check_run_inputs(cfg)
    from mcore_rl.preflight.memory_plan import checkpoint_bytes

    check_run_dir(cfg, checkpoint_bytes(cfg, model_dims(cfg)))
    check_resume(cfg)
    inputs = check_inputs(cfg)
    for warning in layout.warnings:
        print(f"mcore-rl: warning: {warning}", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "mcore_rl.torchrun",  # torchrun, its failure report kept in RUN_DIR/torchrun.log
        str(Path(cfg.trainer.run_dir) / "torchrun.log"),
        "--standalone",
        f"--nproc_per_node={cfg.trainer.nproc}",
        "-m",
        "mcore_rl.cli",
        "train",
        args.config,
        *args.overrides,
    ]
    print(f"mcore-rl: {cfg.trainer.nproc} process(es) on {platform}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # without it every rank spins all cores (0.5 s stalls on small CPUs)
    from mcore_rl.platform import Platform, RunEnvironment

    Platform(platform).apply_environment(env, RunEnvironment.of(cfg))  # NPU: before torch_npu starts in a rank
    env[CONFIG_WARNED_ENV] = "1"  # the config's warnings were printed here: rank 0 need not repeat them
    if cfg.rollout.placement == "separate":  # a dead rank's report names its role (mcore_rl.torchrun.rank_role)
        from mcore_rl.separate import split_sizes
        from mcore_rl.torchrun import ACTOR_RANKS_ENV

        env[ACTOR_RANKS_ENV] = str(split_sizes(cfg.rollout, cfg.trainer.nproc * cfg.trainer.nnodes))
    from mcore_rl.platform import get_platform
    from mcore_rl.supervise import run_supervised
    from mcore_rl.torchrun import ForkedWorker
    from mcore_rl.torchrun import main as torchrun_main

    # SIGTERM/SIGINT reach every worker; nothing is left running. torchrun's agent runs in a fork of this process
    # (torch is imported here already: a fresh `python -m mcore_rl.torchrun` spent ~1 s importing it again).
    # On CPU torchrun forks the ranks from its agent too, and they take over the tokenizer and prompt sets loaded
    # above (PromptInputs) instead of loading them again. With the embedded engine only: vLLM's own processes and
    # threads have not been run from a forked rank.
    forks = get_platform(platform).forks_workers and cfg.rollout.engine == "embedded"
    worker = ForkedWorker(lambda argv: main(argv, inputs=inputs)) if forks else None
    return run_supervised(cmd, env, target=lambda: torchrun_main(cmd[3:], worker=worker))


def cmd_plot(args) -> int:
    from mcore_rl.plot import plot_run

    if args.out is not None:
        _output_dir(args.out)
    out = Path(args.out) if args.out is not None else Path(args.run_dir) / "plots"
    try:
        paths = plot_run(args.run_dir, args.out)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # a full disk, a read-only RUN_DIR/plots
        reason, _ = write_failure(e, out)
        raise ConfigError(f"the plots in {out} were not all written ({reason}): free space or give --out") from None
    print(f"{len(paths)} plots written; overview: {paths[0]}")
    return 0


def cmd_convert(args) -> int:
    from mcore_rl.convert import main as convert_main

    argv = args.args[1:] if args.args[:1] == ["--"] else args.args
    try:
        return convert_main(argv, prog="mcore-rl convert")
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def cmd_from_verl(args) -> int:
    from mcore_rl.from_verl import ConversionError, ShellError, run

    try:
        return run(args)
    except (ShellError, ConversionError) as e:
        raise ConfigError(f"{args.source}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-rl", description="Megatron-Core RL post-training (GRPO / GSPO / SAPO) for MoE models"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny checkpoint (Qwen3-MoE, Qwen3 or Qwen2) + tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arch", choices=ARCHS, default=ARCHS[0], help="qwen3-moe (default) | qwen3 (dense) | qwen2 (dense)"
    )
    p.add_argument(
        "--warm-start",
        choices=WARM_START_KINDS,
        default=None,
        help="train it briefly (supervised) on this multi-token task kind until it answers in the format",
    )
    p.add_argument("--task-length", type=int, default=None, help="the warm start's longest prompt (reverse: 12)")
    p.add_argument("--task-min-length", type=int, default=None, help="the warm start's shortest prompt (reverse: 2)")
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("make-task", help="write the embedded task's train/val prompt sets")
    p.add_argument("--out", required=True)
    p.add_argument("--train-size", type=int, default=4096)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    p.add_argument(
        "--kind",
        choices=TASK_KINDS,
        default=TASK_KINDS[0],
        help="majority (default, one-token) | reverse (multi-token)",
    )
    p.add_argument("--length", type=int, default=None, help="symbols per prompt (reverse: the longest; 12, else 16)")
    p.add_argument("--min-length", type=int, default=None, help="reverse: the shortest prompt (2)")
    p.set_defaults(func=cmd_make_task)

    for name, func, text in (
        ("check", cmd_check, "validate a config and its layout without starting anything"),
        ("plan", cmd_plan, "per-rank device memory by phase, its peak and a verdict (no process, no weights)"),
        ("train", cmd_train, "train (starts torchrun with trainer.nproc processes, or runs inside one)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("config")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.loss=sapo actor.parallel.tp=2")
        if name in ("check", "plan"):
            p.add_argument("--world-size", type=int)
            p.add_argument("--nnodes", type=int)
            p.add_argument("--nproc-per-node", type=int)
            p.add_argument("--model-config", help="the model's config.json (default: model.path/config.json)")
        if name == "check":
            p.add_argument(
                "--node",
                action="store_true",
                help="this node runs the job: also check its allocator settings and free disk (launch/ scripts)",
            )
        if name == "plan":
            p.add_argument(
                "--device-memory", type=float, help="device memory in GiB (e.g. 64, 80, 141) for the verdict"
            )
            p.add_argument(
                "--from-run",
                metavar="RUN_DIR",
                help="a colocated run's folder: print the actor / rollout split of the separate placement that "
                "balances the roles on CONFIG's cluster, from the run's measured phase times",
            )
        p.set_defaults(func=func)

    p = sub.add_parser("plot", help="write PNG curves of a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--out", help="output folder (default RUN_DIR/plots)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("from-verl", help="turn a verl launch script (or command line) into a checked preset")
    p.add_argument("source", help="the launch script, or the command line in quotes")
    p.add_argument("overrides", nargs="*", help="the script's own arguments ($1 ... / $@), e.g. trainer.nnodes=4")
    p.add_argument("--out", help="the preset to write (default: SCRIPT_NAME.yaml)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a key is not carried over or the check fails")
    p.add_argument("--model-config", help="the model's config.json for the layout check (default: model.path's)")
    p.set_defaults(func=cmd_from_verl)

    # No help of its own: `mcore-rl convert --help` shows the converter's.
    p = sub.add_parser(
        "convert", help="convert checkpoints HF <-> Megatron (mcore_rl.convert; args passed through)", add_help=False
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: Optional[Sequence[str]] = None, version_of=None, inputs: Optional[PromptInputs] = None) -> int:
    """`version_of` (distribution -> installed version or None) replaces the installed metadata for the
    support-matrix check of `check` / `train` (tests pass the combination they judge). `inputs`: the launcher's
    loaded tokenizer and prompt sets, in the ranks it forked (the trainer loads its own where they do not match)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.version_of = version_of
    args.inputs = inputs
    if args.command == "convert":
        args.args = list(args.args) + extra
    elif extra:
        # Overrides after an option (`check cfg.yaml --world-size 8 algo.loss=sapo`) land here.
        bad = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except (ConfigError, LayoutError, InputError) as e:
        print(f"mcore-rl: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
