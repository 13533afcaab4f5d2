#!/bin/bash
# DP-SGD on 2 nodes x 8 GPUs with torchrun: run once per node with NODE_RANK=0 and NODE_RANK=1.
#   MASTER_ADDR=node0.example NODE_RANK=0 bash configs/cluster/torchrun_2x8gpu.sh configs/quickstart.yaml
set -euo pipefail
TASK_CONFIG=${1:-configs/quickstart.yaml}
torchrun --nnodes 2 --nproc_per_node 8 --node_rank "${NODE_RANK:?set NODE_RANK}" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
    -m dplightning.cli fit --config "$TASK_CONFIG" --config configs/cluster/dp_ddp_2x8gpu.yaml
