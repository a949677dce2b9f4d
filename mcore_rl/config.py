"""Run configuration: plain dataclasses, one per concern.

Data flows one way: config -> platform -> actor / engine -> trainer. Every component reads its
parameters from its own section here; nothing is read from globals or environment side channels.
Loading from YAML, dotted overrides and validation live in `load_config` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
    virtual_pp: Optional[int] = None  # interleaved pipeline chunks per stage
    num_layers_in_first_stage: Optional[int] = None  # uneven pipeline: layers on the first stage
    num_layers_in_last_stage: Optional[int] = None  # uneven pipeline: layers on the last stage

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face checkpoint folder (config.json + safetensors + tokenizer)
    dtype: str = "float32"  # float32 | bfloat16 | float16 (params and compute)
    recompute: bool = False  # full activation recomputation
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    moe_router_dtype: str = "fp32"


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
    decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = False


@dataclass
class ActorConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class AlgoConfig:
    loss: str = "gspo"  # grpo | gspo | gspo_token | sapo
    agg_mode: str = "seq-mean-token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    adv_estimator: str = "grpo"  # grpo (std-normalised) | drgrpo (no std division)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = None  # c > 1 enables dual clip for A < 0 (grpo)
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05  # sapo
    kl_coef: float = 0.0  # > 0 needs a reference model pass
    kl_type: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0
    rollout_is: Optional[str] = None  # None | token | sequence | icepop
    rollout_is_cap: float = 2.0
    rollout_is_low: float = 0.5  # icepop lower bound
    rollout_is_high: float = 2.0  # icepop upper bound
    temperature: float = 1.0  # must equal rollout.temperature so train log-probs match sampling
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch
    use_rollout_logprobs_as_old: bool = False  # skip the old-log-prob pass when on-policy
    routing_replay: Optional[str] = None  # None | r2 | r3


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | vllm
    n: int = 8  # samples per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    tp: int = 1  # vLLM tensor-parallel size; world / tp data-parallel replicas
    gpu_memory_utilization: float = 0.5
    sync_bucket_mb: float = 256.0
    verify_every: int = 1  # verify the weight sync every k syncs (0: never)
    verify_tolerance: float = 1e-3  # max abs log-prob difference engine vs actor
    verify_fallback: str = "rebuild"  # rebuild | error
    enforce_eager: bool = True


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


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0: only at the end
    keep_last: int = 2
    resume: str = "auto"  # auto | never | PATH


@dataclass
class TrainerConfig:
    steps: int = 100
    val_every: int = 0
    val_prompts: int = 64
    seed: int = 1
    run_dir: str = "runs/default"
    nproc: int = 1  # processes started by `mcore-rl train` when not already under torchrun
    log_every: int = 1
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "mcore-rl"


@dataclass
class Config:
    platform: str = "auto"  # auto | cpu | cuda | npu
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
