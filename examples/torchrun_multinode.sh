#!/usr/bin/env bash
# Multi-node training with torchrun: run this same command on every node. Lightning sees torchrun's variables
# (TorchElasticEnvironment); the strategy gives each node consecutive ranks, so TP and EP stay on NVLink when
# tp and etp*ep divide the GPUs per node (here TP2 and EP8 on 8-GPU nodes; DP and EDP go between nodes).
#
#   RDZV_ENDPOINT=node0:29500 NNODES=2 bash examples/torchrun_multinode.sh --data.path /shared/tokens.bin
#
# The token file must be readable from every node. Extra arguments go to `lightning-moe fit`.
set -euo pipefail
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG=${CONFIG:-configs/qwen3-30b-a3b-4layer.yaml}
TP=${TP:-2}
EP=${EP:-8}

torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:?host:port of the first node}" --rdzv-id "${RDZV_ID:-lmoe}" \
  -m lightning_moe.cli fit --config "$CONFIG" \
  --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS_PER_NODE" \
  --trainer.strategy.init_args.tensor_parallel_size "$TP" \
  --trainer.strategy.init_args.expert_parallel_size "$EP" \
  "$@"
