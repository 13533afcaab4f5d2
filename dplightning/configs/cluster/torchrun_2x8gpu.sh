#!/bin/bash
# DP-SGD on 2 nodes x 8 GPUs with torchrun: run once per node with NODE_RANK=0 and NODE_RANK=1.
#   MASTER_ADDR=node0.example NODE_RANK=0 bash configs/cluster/torchrun_2x8gpu.sh TASK_CONFIG [more arguments]
#   MASTER_ADDR=node0.example NODE_RANK=0 bash configs/cluster/torchrun_2x8gpu.sh   # the quickstart, 16 per process
# batch_size is per process: q = batch_size x 16 / N (see dp_ddp_2x8gpu.yaml).
set -euo pipefail
if [ $# -eq 0 ]; then set -- configs/quickstart.yaml --data.init_args.batch_size 16; fi
TASK_CONFIG=$1
shift
torchrun --nnodes 2 --nproc_per_node 8 --node_rank "${NODE_RANK:?set NODE_RANK}" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
    -m dplightning.cli fit --config "$TASK_CONFIG" --config configs/cluster/dp_ddp_2x8gpu.yaml "$@"
