#!/usr/bin/env bash
# Multi-node training with torchrun: run this same command on every node.
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 address> NPROC_PER_NODE=8 \
#     launch/torchrun_multinode.sh configs/qwen3_30b_a3b/npu32_tp4_pp4_ep8.yaml [key=value ...]
#
# Environment: PLATFORM (cpu|cuda|npu; default: npu where torch_npu is installed, else none) exports that
# platform's environment first (python -m mcore_rl.platform env PLATFORM CONFIG: on npu HCCL_CONNECT_TIMEOUT,
# HCCL_EXEC_TIMEOUT, TASK_QUEUE_ENABLE, ...; docs/devices.md), NNODES (default 1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# NPROC_PER_NODE (8), PYTHON (python), MODEL_CONFIG (optional config.json for the pre-flight check when
# model.path is not readable on this node), DRY_RUN=1 (print the torchrun command instead of running it).
# Every node first checks the config and the parallel layout for NNODES x NPROC_PER_NODE processes, so an
# impossible layout fails in seconds on every node instead of after the model has loaded.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: [NNODES=.. NODE_RANK=.. MASTER_ADDR=.. NPROC_PER_NODE=..] $0 CONFIG [key=value ...]" >&2
  exit 2
fi
CONFIG=$1; shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ -z "${PLATFORM:-}" ]] && "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch_npu") is None)' 2>/dev/null; then
  PLATFORM=npu
fi
if (( NODE_RANK < 0 || NODE_RANK >= NNODES )); then
  echo "torchrun_multinode.sh: NODE_RANK=$NODE_RANK must lie in [0, NNODES=$NNODES): give each node its own rank" >&2
  exit 2
fi

# The run's world comes from the environment; record it in the config so the saved config matches the run.
OVERRIDES=("$@" "trainer.nnodes=$NNODES" "trainer.nproc=$NPROC_PER_NODE")
if [[ -n "${PLATFORM:-}" ]]; then  # with the config: also what it decides (HCCL_EXEC_TIMEOUT, TASK_QUEUE_ENABLE, ...)
  PLATFORM_ENV=$("$PYTHON" -m mcore_rl.platform env "$PLATFORM" "$CONFIG" "${OVERRIDES[@]}")
  eval "$PLATFORM_ENV"
fi
CHECK=("$PYTHON" -m mcore_rl.cli check "$CONFIG" "${OVERRIDES[@]}" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE")
if [[ -n "${MODEL_CONFIG:-}" ]]; then CHECK+=(--model-config "$MODEL_CONFIG"); fi
# --node: this node runs the job, so its allocator setting and free disk are checked too (not for a dry run,
# which may print the command on another machine)
if [[ "${DRY_RUN:-0}" != "1" ]]; then CHECK+=(--node); fi
"${CHECK[@]}"

CMD=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     -m mcore_rl.cli train "$CONFIG" "${OVERRIDES[@]}")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  if [[ -n "${PLATFORM_ENV:-}" ]]; then echo "$PLATFORM_ENV"; fi
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
# Supervised: SIGTERM / SIGINT to this script's process reach every worker (they stop after the current
# step), and processes the workers leave behind are stopped when torchrun exits (mcore_rl/supervise.py).
exec "$PYTHON" -m mcore_rl.supervise "${CMD[@]}"
