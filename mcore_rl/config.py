"""Run configuration: plain dataclasses, one per concern.

Data flows one way: config -> platform -> actor / engine -> trainer. Every component reads its
parameters from its own section here; nothing is read from globals or environment side channels.
Loading from YAML, dotted overrides and validation live in `load_config` below.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional, Sequence, get_type_hints

from mcore_rl.algo_config import AlgoConfig, check_algo, check_proximal
from mcore_rl.typed_yaml import (
    ConfigError,
    coerce,
    literal_choices,
    parse_override_value,
    read_yaml,
)

# The choices of enum-like keys, declared once: validation (`CHOICES`) reads these (the algo section's: algo_config).
PlatformName = Literal["auto", "cpu", "cuda", "npu"]
# float16 is left out: the actor fails in Megatron with it (found at start-up, not before); use bfloat16.
DtypeName = Literal["float32", "bfloat16"]
TokenDispatcher = Literal["alltoall", "allgather"]
RouterDtype = Literal["fp32", "fp64"]
DecayStyle = Literal["constant", "linear", "cosine"]
EngineName = Literal["embedded", "vllm"]
VerifyFallback = Literal["rebuild", "error"]
# colocated: every rank generates, then trains; separate: rollout ranks generate while actor ranks train (docs/architecture.md)
PlacementName = Literal["colocated", "separate"]

# Keys that existed once: loading a config that still sets one names what replaced it.
REMOVED_KEYS = {
    "algo.use_rollout_logprobs_as_old": (
        "exactly on-policy updates now skip the old-log-prob pass by themselves, taking the update's own "
        "log-probs (algo.old_log_prob_pass=auto, the default): delete the key"
    ),
}


@dataclass
class ParallelConfig:
    """Megatron layout of the actor. DP is derived: world = tp * pp * cp * dp."""

    tp: int = 1  # tensor model parallel
    pp: int = 1  # pipeline model parallel
    ep: int = 1  # expert model parallel
    etp: Optional[int] = None  # expert tensor parallel; None -> same as tp
    cp: int = 1  # context parallel
    sequence_parallel: bool = False  # required by Megatron for MoE with tp > 1 (turned on automatically)
    micro_batch_size: int = 1  # sequences per micro-batch
    virtual_pp: Optional[int] = None  # interleaved pipeline chunks per stage: > 1 refused (preflight/layout.py)
    num_layers_in_first_stage: Optional[int] = None  # uneven pipeline: layers on the first stage
    num_layers_in_last_stage: Optional[int] = None  # uneven pipeline: layers on the last stage

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face checkpoint folder (config.json + safetensors + tokenizer)
    dtype: DtypeName = "float32"  # params and compute
    recompute: bool = False  # full activation recomputation
    moe_token_dispatcher: TokenDispatcher = "alltoall"
    moe_router_dtype: RouterDtype = "fp32"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_style: DecayStyle = "constant"
    decay_steps: Optional[int] = None  # steps of the lr decay (after warmup); None -> trainer.steps
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True  # DDP gradient buffer in fp32 (false: the model dtype, half the bytes)
    # Megatron's HybridDeviceOptimizer: this fraction of the optimizer state and its step on the host
    # (0: off). Needs an accelerator and the distributed optimizer.
    optimizer_offload_fraction: float = 0.0


@dataclass
class ActorConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Token budget of one micro-batch (padding removal: sequences packed into rows, see mcore_rl.batch);
    # at least data.max_prompt_len + rollout.max_new_tokens padded to the layout's multiple (preflight.run.
    # check_token_budget). None: fixed-size micro-batches of
    # parallel.micro_batch_size right-padded sequences.
    max_tokens_per_micro_batch: Optional[int] = None
    # Forward-only passes (old-policy, reference, sync probe) may merge consecutive packed micro-batches up to
    # this larger budget (no activations are kept for backward). None: the training budget. Not with R2
    # (its routes are recorded per training micro-batch).
    max_tokens_per_forward_micro_batch: Optional[int] = None
    # Around rollout the actor's parameters, gradient buffers and optimizer state live in host memory (back on
    # the device before the old-log-prob pass), and the reference model (algo.kl_coef > 0) lives there except
    # during its own pass; a colocated vLLM engine wakes its weights, takes the sync, then its KV cache
    # (docs/memory.md, "Offload around rollout").
    offload: bool = False


@dataclass
class RolloutConfig:
    engine: EngineName = "embedded"
    n: int = 8  # samples per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    tp: int = 1  # vLLM tensor-parallel size; world / tp data-parallel replicas
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: Optional[float] = None  # vLLM KV cache per process in GiB (overrides gpu_memory_utilization)
    sync_bucket_mb: float = 256.0
    verify_every: int = 1  # verify the weight sync every k syncs (0: never)
    verify_tolerance: Optional[float] = None  # bound on the mean |engine - actor| log-prob (nats); None: per dtype
    verify_high_tolerance: Optional[float] = None  # bound on its 0.99 quantile; None: per dtype (docs/devices.md)
    verify_fallback: VerifyFallback = "rebuild"
    rebuild_dir: Optional[str] = None  # node-local folder for a vLLM rebuild's weight copy (one per node); None: TMPDIR
    enforce_eager: bool = True
    placement: PlacementName = "colocated"  # separate: rollout on rollout.ranks of its own, the actor on the rest
    ranks: Optional[int] = None  # separate: ranks that generate (replicas of rollout.tp each); None: half the world
    max_staleness: Optional[int] = None  # weight versions a trained token may lag; None: 0 colocated, 1 separate
    # separate: generate continuously, taking each new weight version between decode steps (docs/async.md)
    streaming: bool = False


@dataclass
class DataConfig:
    train_path: str = ""
    val_path: str = ""
    prompt_key: str = "prompt"
    max_prompt_len: int = 256
    prompts_per_step: int = 8
    shuffle: bool = True
    seed: int = 1


@dataclass
class RewardConfig:
    fn: str = "task"  # task | math | module:function
    overlong_buffer: int = 0  # DAPO overlong penalty buffer length in tokens (0: off)
    overlong_penalty: float = 1.0
    max_error_rate: float = 0.5  # stop the run when more than this fraction of a batch's rewards fail
    # per batch; the reward runs in a worker process (0: in the trainer, no timeout; the built-in task always is)
    timeout_s: float = 300.0


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0: only at the end
    keep_last: int = 2
    resume: str = "auto"  # auto | never | PATH
    save_hf: bool = True  # at the end, export the trained actor as a Hugging Face folder: RUN_DIR/hf
    move_old_run: bool = False  # a fresh start in a run_dir holding another run: move that run to previous_runs/
    # resume from a checkpoint without CHECKSUMS.json (written by hand or by another tool): loaded unverified
    trust_unverified: bool = False
    # resume from a checkpoint whose trainer state only a full unpickling reads (written before the plain-tensor
    # form): unpickling runs any code the file holds, so only for checkpoints from a trusted source (a warning)
    trust_pickle: bool = False


@dataclass
class TrainerConfig:
    steps: int = 100
    val_every: int = 0
    val_prompts: int = 64
    seed: int = 1
    run_dir: str = "runs/default"
    nproc: int = 1  # processes started by `mcore-rl train` when not already under torchrun
    nnodes: int = 1  # machines of `nproc` processes each (world size = nnodes * nproc); launch/ scripts
    log_every: int = 1
    tensorboard: bool = True
    plots: bool = True  # RUN_DIR/plots at the end (false: draw them later with `mcore-rl plot RUN_DIR`)
    wandb: bool = False
    wandb_project: str = "mcore-rl"
    max_consecutive_skips: int = 3  # optimizer steps skipped in a row (NaN/inf loss or grad norm) before stopping
    # every library warning at start-up (also MCORE_RL_VERBOSE=1); else the known ones are hidden behind one line
    verbose: bool = False
    # rank 0 writes the first N of its scored samples of every rollout round to RUN_DIR/samples.jsonl: the
    # response with its special tokens, length, finish reason, task reward and overlong penalty (0: off)
    sample_log: int = 0
    # how long a collective may wait (the process group's timeout, and HCCL_EXEC_TIMEOUT on NPU); null: derived
    # from rollout.max_new_tokens (collective_timeout_minutes below, docs/devices.md "Collective timeout")
    collective_timeout_minutes: Optional[float] = None
    # Ascend: deterministic matmuls and HCCL reductions, so the engine's log-probs match training's
    # (mcore_rl.platform.ascend_env.DETERMINISTIC_ENV; docs/devices.md); no effect on cpu / cuda
    deterministic: bool = False


@dataclass
class Config:
    platform: PlatformName = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ----------------------------------------------------------------------------------------------------
# Loading, overrides, validation
# ----------------------------------------------------------------------------------------------------

log = logging.getLogger(__name__)


def _choices(cls: type, prefix: str = "") -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for name, tp in get_type_hints(cls).items():
        if is_dataclass(tp):
            out.update(_choices(tp, f"{prefix}{name}."))
        elif (choices := literal_choices(tp)) is not None:
            out[f"{prefix}{name}"] = choices
    return out


def _unknown_key(key: str, section_cls: type, prefix: str) -> ConfigError:
    if f"{prefix}{key}" in REMOVED_KEYS:
        return ConfigError(f"'{prefix}{key}' was removed: {REMOVED_KEYS[prefix + key]}")
    valid = [f.name for f in fields(section_cls)]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    where = prefix.rstrip(".") or "the top level"
    return ConfigError(f"unknown key '{prefix}{key}' in {where}; valid keys: {', '.join(valid)}.{hint}")


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """A dataclass instance from a nested dict, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(str(key), cls, prefix)
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` into the nested dict `data`, checking the path against the dataclasses."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' has no '=': write it as key=value, e.g. algo.loss=sapo")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    cls: type = Config
    node = data
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        hints = get_type_hints(cls)
        if part not in hints or part not in {f.name for f in fields(cls)}:
            raise _unknown_key(part, cls, prefix)
        tp = hints[part]
        last = i == len(parts) - 1
        if is_dataclass(tp):
            if last:
                raise ConfigError(
                    f"'{dotted}' is a section, not a value: set one of its keys, e.g. {dotted}.{fields(tp)[0].name}=..."
                )
            sub = node.get(part)
            if sub is None:
                sub = node[part] = {}
            elif not isinstance(sub, dict):
                raise ConfigError(f"{prefix}{part}: expected a mapping of keys, got {sub!r}")
            node, cls = sub, tp
        elif not last:
            raise ConfigError(f"'{prefix}{part}' is a value, not a section: '{dotted}' does not exist")
        else:
            node[part] = parse_override_value(raw, tp)


CONFIG_WARNED_ENV = "MCORE_RL_CONFIG_WARNED"  # set by the launcher for its workers once it printed the warnings


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), validate: bool = True) -> Config:
    """YAML file (or defaults when `path` is None) + dotted overrides -> a validated Config."""
    data = read_yaml(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    cfg = _build(Config, data)
    if validate:
        warnings = validate_config(cfg)
        # under torchrun every rank loads the config: warn once (not at all when `mcore-rl train` already did)
        if os.environ.get("RANK", "0") == "0" and not os.environ.get(CONFIG_WARNED_ENV):
            for warning in warnings:
                log.warning("config: %s", warning)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically: a crash never leaves half a file)."""
    import yaml

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Allowed values of enum-like keys (dotted key -> choices), derived from the Literal types above.
CHOICES: dict[str, tuple] = _choices(Config)


def _check_choices(cfg: Config) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            close = difflib.get_close_matches(str(value), [str(c) for c in choices if c is not None], n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{key} = {value!r} is not one of: {shown}.{hint}")


def _float_values(obj: Any, prefix: str = ""):
    """(dotted key, value) of every float field of a config, nested sections included."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from _float_values(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value


def _check_ranges(cfg: Config) -> None:
    import math

    for key, v in _float_values(cfg):
        _require(math.isfinite(v), f"{key} = {v} is not a finite number: give a finite value")
    a, r, o = cfg.algo, cfg.rollout, cfg.actor.optim
    _require(
        0 <= cfg.reward.max_error_rate <= 1,
        f"reward.max_error_rate = {cfg.reward.max_error_rate} must lie in [0, 1] (1: never stop for reward errors)",
    )
    positive_ints = {
        "algo.ppo_epochs": a.ppo_epochs,
        "algo.mini_batches": a.mini_batches,
        "algo.dynamic_sampling_max_rounds": a.dynamic_sampling_max_rounds,
        "rollout.n": r.n,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.tp": r.tp,
        "data.max_prompt_len": cfg.data.max_prompt_len,
        "data.prompts_per_step": cfg.data.prompts_per_step,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "trainer.steps": cfg.trainer.steps,
        "trainer.nproc": cfg.trainer.nproc,
        "trainer.nnodes": cfg.trainer.nnodes,
        "trainer.log_every": cfg.trainer.log_every,
        "trainer.val_prompts": cfg.trainer.val_prompts,
        "trainer.max_consecutive_skips": cfg.trainer.max_consecutive_skips,
    }
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget is not None:
        positive_ints["actor.max_tokens_per_micro_batch"] = budget
    elif cfg.actor.max_tokens_per_forward_micro_batch is not None:
        _require(
            False,
            "actor.max_tokens_per_forward_micro_batch is set but actor.max_tokens_per_micro_batch is not: "
            "set the training budget too (packing), or unset the forward one",
        )
    for key, v in positive_ints.items():
        _require(v >= 1, f"{key} = {v} must be >= 1: set it to 1 or more")
    non_negative = {
        "algo.kl_coef": a.kl_coef,
        "algo.entropy_coef": a.entropy_coef,
        "actor.optim.weight_decay": o.weight_decay,
        "actor.optim.clip_grad": o.clip_grad,
        "actor.optim.warmup_steps": o.warmup_steps,
        "actor.optim.min_lr": o.min_lr,
        "reward.overlong_buffer": cfg.reward.overlong_buffer,
        "reward.overlong_penalty": cfg.reward.overlong_penalty,
        "reward.timeout_s": cfg.reward.timeout_s,
        "rollout.verify_every": r.verify_every,
        "checkpoint.save_every": cfg.checkpoint.save_every,
        "trainer.val_every": cfg.trainer.val_every,
        "trainer.sample_log": cfg.trainer.sample_log,
    }
    for key, v in non_negative.items():
        _require(v >= 0, f"{key} = {v} must be >= 0 (0 turns it off where that applies)")
    positive = {
        "actor.optim.lr": o.lr,
        "actor.optim.adam_eps": o.adam_eps,
        "algo.temperature": a.temperature,
        "rollout.temperature": r.temperature,
        "rollout.sync_bucket_mb": r.sync_bucket_mb,
    }
    for key, v in positive.items():
        _require(v > 0, f"{key} = {v} must be > 0")
    timeout = cfg.trainer.collective_timeout_minutes
    _require(
        timeout is None or timeout > 0,
        f"trainer.collective_timeout_minutes = {timeout} must be > 0, or null to derive it from rollout.max_new_tokens",
    )
    for key in ("verify_tolerance", "verify_high_tolerance"):
        v = getattr(r, key)
        _require(v is None or v > 0, f"rollout.{key} = {v} must be > 0, or null for the model dtype's default")
    for key, v in {"actor.optim.adam_beta1": o.adam_beta1, "actor.optim.adam_beta2": o.adam_beta2}.items():
        _require(0 <= v < 1, f"{key} = {v} must lie in [0, 1)")
    _require(0 < r.top_p <= 1, f"rollout.top_p = {r.top_p} must lie in (0, 1]; 1 disables nucleus sampling")
    _require(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k = {r.top_k} must be -1 (off) or >= 1")
    _require(
        0 < r.gpu_memory_utilization <= 1,
        f"rollout.gpu_memory_utilization = {r.gpu_memory_utilization} must lie in (0, 1]",
    )
    _require(
        0 <= o.optimizer_offload_fraction <= 1,
        f"actor.optim.optimizer_offload_fraction = {o.optimizer_offload_fraction} must lie in [0, 1] (0: off)",
    )
    _require(o.min_lr <= o.lr, f"actor.optim.min_lr = {o.min_lr} exceeds actor.optim.lr = {o.lr}: lower min_lr")
    _require(
        o.decay_steps is None or o.decay_steps >= 1,
        f"actor.optim.decay_steps = {o.decay_steps} must be >= 1 or null (null: trainer.steps)",
    )


def _no_effect_with_embedded(r: RolloutConfig) -> list[str]:
    """vLLM's keys set with the embedded engine: a warning each (like other keys without effect), so a
    value the user meant for vLLM is not silently dropped."""
    if r.engine != "embedded":
        return []
    defaults = RolloutConfig()
    return [
        f"rollout.{key} = {getattr(r, key)} has no effect with rollout.engine=embedded (it generates with the "
        f"actor's own weights and layout, without a KV cache pool): remove it, or set rollout.engine=vllm"
        for key in ("tp", "gpu_memory_utilization", "kv_cache_gb")
        if getattr(r, key) != getattr(defaults, key)
    ]


def _overlong_rules(cfg: Config) -> list[str]:
    """The penalty's buffer lies within the response budget (`rewards.overlong.OverlongPenalty` refuses it on
    every rank otherwise); overlong filtering with a budget of one token keeps almost nothing: the stop token
    counts toward rollout.max_new_tokens (a response is cut when its last token is not a stop token), so only
    a response that is the stop token alone, an empty answer, is not masked."""
    buffer, budget = cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens
    _require(
        buffer <= budget,
        f"reward.overlong_buffer = {buffer} exceeds rollout.max_new_tokens = {budget}: the penalty's buffer is the "
        f"last tokens of the response budget; set reward.overlong_buffer to at most {budget} (0: off)",
    )
    if not (cfg.algo.overlong_filtering and budget == 1):
        return []
    return [
        "algo.overlong_filtering with rollout.max_new_tokens = 1 masks every response but an empty one: a response "
        "is cut (and masked) unless its last token is a stop token, which counts toward max_new_tokens; raise "
        "rollout.max_new_tokens to the answer's length + 1, or set algo.overlong_filtering=false"
    ]


def _check_combinations(cfg: Config) -> list[str]:
    a, r, o = cfg.algo, cfg.rollout, cfg.actor.optim
    warnings: list[str] = []
    decay_steps = o.decay_steps or cfg.trainer.steps
    _require(
        o.decay_style == "constant" or o.warmup_steps < decay_steps,
        f"actor.optim.warmup_steps = {o.warmup_steps} must be < the decay steps {decay_steps} for decay_style = "
        f"{o.decay_style}: lower warmup_steps or raise actor.optim.decay_steps / trainer.steps",
    )
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget is not None:  # that the longest sequence fits it needs the layout's padding: preflight.run
        forward = cfg.actor.max_tokens_per_forward_micro_batch
        _require(
            forward is None or forward >= budget,
            f"actor.max_tokens_per_forward_micro_batch = {forward} < actor.max_tokens_per_micro_batch = {budget}: "
            f"the forward-only budget must be at least the training one (or null)",
        )
        _require(
            not (cfg.model.moe_token_dispatcher == "allgather" and cfg.actor.parallel.ep > 1),
            "packed micro-batches (actor.max_tokens_per_micro_batch) differ in length between data-parallel ranks, "
            "which the allgather token dispatcher cannot exchange with ep > 1: use model.moe_token_dispatcher=alltoall",
        )
    _require(
        a.temperature == r.temperature,
        f"algo.temperature = {a.temperature} differs from rollout.temperature = {r.temperature}: the trainer's log-probs "
        f"must use the sampling temperature; set both to the same value",
    )
    _require(
        r.n >= 2,
        f"rollout.n = {r.n}: group advantages ({a.adv_estimator}) need at least 2 samples per prompt; set rollout.n >= 2",
    )
    o = cfg.actor.optim
    if o.optimizer_offload_fraction > 0:
        _require(
            cfg.platform != "cpu",
            "actor.optim.optimizer_offload_fraction > 0 moves optimizer state from the device to the host, "
            "which is the same memory on platform=cpu: set it to 0",
        )
        _require(
            o.use_distributed_optimizer,
            "actor.optim.optimizer_offload_fraction > 0 runs Megatron's HybridDeviceOptimizer on the distributed "
            "optimizer's shards: set actor.optim.use_distributed_optimizer=true",
        )
    if r.engine == "vllm" and r.kv_cache_gb is not None and cfg.platform == "npu":
        warnings.append(
            "rollout.kv_cache_gb is ignored by vLLM-Ascend (0.10 - 0.12 size the KV cache from "
            "gpu_memory_utilization and the process's peak; docs/memory.md): set rollout.gpu_memory_utilization"
        )
    if cfg.actor.offload and cfg.platform == "cpu":
        warnings.append(
            "actor.offload on platform=cpu copies the actor's state between two places in the same memory: it "
            "saves nothing there (it is for devices whose memory the rollout engine needs)"
        )
    _require(
        cfg.trainer.run_dir.strip() != "",
        f"trainer.run_dir = {cfg.trainer.run_dir!r} is empty: checkpoints, metrics and plots would land in the "
        f"working directory; set it, e.g. trainer.run_dir=runs/my_run",
    )
    warnings += _no_effect_with_embedded(r)
    warnings += _overlong_rules(cfg)
    _require(
        re.fullmatch(r"task|math|[\w.]+:\w+", cfg.reward.fn) is not None,
        f"reward.fn = {cfg.reward.fn!r}: use 'task', 'math' or 'package.module:function'",
    )
    return warnings


def _check_placement(r: RolloutConfig) -> None:
    """rollout.placement's own rules (the split against the world and the devices: mcore_rl.preflight)."""
    _require(
        not r.streaming or r.placement == "separate",
        f"rollout.streaming=true with rollout.placement={r.placement}: streaming generates on rollout ranks of their "
        f"own while the actor trains; set rollout.placement=separate (or rollout.streaming=false)",
    )
    if r.placement == "colocated":  # rollout.ranks there has no effect: a warning of the pre-flight's
        _require(
            r.max_staleness in (None, 0),
            f"rollout.max_staleness = {r.max_staleness}: a colocated run generates with the newest weights (0); "
            f"generating ahead needs rollout.placement=separate",
        )
        return
    if r.streaming:
        _require(
            r.max_staleness is None or r.max_staleness >= 0,
            f"rollout.max_staleness = {r.max_staleness}: a token's lag in weight versions is never negative; use 0 "
            f"(exactly the synchronous run), 1 or 2",
        )
        return
    _require(
        r.max_staleness in (None, 0, 1),
        f"rollout.max_staleness = {r.max_staleness}: the separate placement generates at most one step ahead; use 1 "
        f"(one-step off-policy) or 0 (waits: exactly the colocated run), or rollout.streaming=true for larger lags",
    )


# The collective timeout when trainer.collective_timeout_minutes is null. After each rollout every rank waits in
# a collective for the slowest replica, so the timeout must outlast one replica's longest generation: this many
# minutes for everything else (loading, a checkpoint save, a rebuild), plus SECONDS_PER_RESPONSE_TOKEN for each
# token of the longest response - an assumed worst decode rate of 10 tokens/s per sequence (a full batch on a slow
# eager engine; docs/devices.md "Collective timeout").
BASE_COLLECTIVE_MINUTES = 30.0
SECONDS_PER_RESPONSE_TOKEN = 0.1


def collective_timeout_minutes(cfg: Config) -> float:
    """trainer.collective_timeout_minutes, or when null the derived value (whole minutes)."""
    if cfg.trainer.collective_timeout_minutes is not None:
        return float(cfg.trainer.collective_timeout_minutes)
    decode_minutes = cfg.rollout.max_new_tokens * SECONDS_PER_RESPONSE_TOKEN / 60
    return BASE_COLLECTIVE_MINUTES + float(math.ceil(decode_minutes))


def validate_config(cfg: Config) -> list[str]:
    """Raise ConfigError on a bad value or an impossible combination; return non-fatal warnings."""
    _check_choices(cfg)
    _check_placement(cfg.rollout)
    warnings = check_algo(cfg.algo) + check_proximal(cfg.algo, cfg.rollout.placement, cfg.rollout.max_staleness)
    _check_ranges(cfg)
    return warnings + _check_combinations(cfg)


def check_paths(cfg: Config) -> None:
    """Inputs that must exist before training starts (not needed for `mcore-rl check`)."""
    path = cfg.model.path
    _require(
        bool(path),
        "model.path is empty: set it to a Hugging Face checkpoint folder (mcore-rl make-tiny --out DIR makes one)",
    )
    _require(
        os.path.isfile(os.path.join(path, "config.json")),
        f"model.path = {path} has no config.json: point it at a Hugging Face checkpoint folder",
    )
    _require(
        bool(cfg.data.train_path),
        "data.train_path is empty: set it to a parquet/jsonl prompt file (mcore-rl make-task --out DIR)",
    )
    _require(
        os.path.exists(cfg.data.train_path),
        f"data.train_path = {cfg.data.train_path} does not exist: fix the path or run mcore-rl make-task",
    )
    if cfg.trainer.val_every > 0:
        _require(
            bool(cfg.data.val_path) and os.path.exists(cfg.data.val_path),
            f"trainer.val_every = {cfg.trainer.val_every} needs data.val_path, but {cfg.data.val_path!r} does not exist: "
            f"fix the path or set trainer.val_every=0",
        )
