"""The environment an Ascend job runs in: what mcore-rl sets (`ASCEND_ENV`, and what the run's config decides), what
it passes through from the cluster, and the report `mcore-rl check` prints. Every variable with its source:
docs/devices.md, "Ascend environment". Set with `setdefault`: a value already in the environment wins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from mcore_rl.config import Config, collective_timeout_minutes

# Set on every Ascend job, config or not (the launchers export these too).
ASCEND_ENV = {
    # vllm-ascend < 0.13 wake_up() raises while weights are in FRACTAL_NZ layout (its default); RL
    # sleeps and wakes the engine every step.
    "VLLM_ASCEND_ENABLE_NZ": "0",
    # HCCL's link set-up timeout (CANN default 120 s) is too short for 32+ ranks loading a 30B model.
    "HCCL_CONNECT_TIMEOUT": "1800",
    # HCCL's buffer per communicator, MB (CANN default 200): MindSpeed-RL's runtime environment's value.
    "HCCL_BUFFSIZE": "256",
    # torch_npu binds each rank's threads to the CPU cores of its NPU (verl's Ascend GSPO guide).
    "CPU_AFFINITY_CONF": "1",
}
# Per cluster (network interfaces, the host's free ports): passed through as found, never set here. The
# launchers may fill the interface names from MASTER_ADDR's route; `mcore-rl check` prints what is in force.
ASCEND_PASS_THROUGH = ("GLOO_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_IF_IP", "HCCL_IF_BASE_PORT")
# trainer.deterministic: the variables verl's Ascend consistency guide sets so that the engine's log-probs match
# training's (fixed matmul K order in ATB and CANN, deterministic HCCL reductions).
DETERMINISTIC_ENV = {"CLOSE_MATMUL_K_SHIFT": "1", "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "HCCL_DETERMINISTIC": "true"}
DEFAULT_COLLECTIVE_TIMEOUT_MINUTES = 30.0


@dataclass(frozen=True)
class RunEnvironment:
    """What of a run's config the process environment depends on."""

    collective_timeout_minutes: float = DEFAULT_COLLECTIVE_TIMEOUT_MINUTES
    graph_mode: bool = False  # the engine captures graphs (vLLM-Ascend with rollout.enforce_eager false)
    deterministic: bool = False

    @classmethod
    def of(cls, cfg: Config) -> "RunEnvironment":
        return cls(
            collective_timeout_minutes=collective_timeout_minutes(cfg),
            graph_mode=cfg.rollout.engine == "vllm" and not cfg.rollout.enforce_eager,
            deterministic=cfg.trainer.deterministic,
        )


def ascend_environment(run: Optional[RunEnvironment] = None) -> dict[str, str]:
    """The variables an Ascend job gets: `ASCEND_ENV`, and with a run's settings also those its config decides."""
    wanted = dict(ASCEND_ENV)
    if run is None:
        return wanted
    # HCCL's own execution timeout (its CANN default was not read here) must not end a wait the group still allows.
    wanted["HCCL_EXEC_TIMEOUT"] = str(round(run.collective_timeout_minutes * 60))
    # torch_npu's task queue: level 2 eager; vLLM-Ascend's graph mode needs 1 (verl's Ascend GSPO guide).
    wanted["TASK_QUEUE_ENABLE"] = "1" if run.graph_mode else "2"
    if run.deterministic:
        wanted.update(DETERMINISTIC_ENV)
    return wanted


def describe_environment(platform: str, run: RunEnvironment, env: Mapping[str, str]) -> list[str]:
    """What `mcore-rl check` prints: the collective timeout and, on NPU, every variable with where its value in
    force comes from (set by mcore-rl, already in the environment, or per-cluster)."""
    lines = [f"collective timeout: {run.collective_timeout_minutes:g} min (trainer.collective_timeout_minutes)"]
    if platform != "npu":
        return lines
    lines.append("environment (npu):")
    for key, value in ascend_environment(run).items():
        found = env.get(key)
        if found is None or found == value:
            lines.append(f"  {key}={value}  (set by mcore-rl)")
        else:
            lines.append(f"  {key}={found}  (from the environment; mcore-rl would set {value})")
    for key in ASCEND_PASS_THROUGH:
        found = env.get(key)
        lines.append(f"  {key}={found}  (per-cluster, passed through)" if found else f"  {key} unset  (per-cluster)")
    return lines
