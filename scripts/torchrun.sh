#!/usr/bin/env bash
# Multi-node (or single-node) DDP under torchrun: run this once on every node.
#
#   node 0:  scripts/torchrun.sh --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --run_id exp1 -- --trainer.max_epochs 5
#   node 1:  scripts/torchrun.sh --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --run_id exp1 -- --trainer.max_epochs 5
#   one node: scripts/torchrun.sh   (every GPU, or 2 CPU processes with gloo when there is none)
#
# Options (all optional on one node):
#   --nnodes N             number of nodes (default 1)
#   --nproc_per_node N     processes per node = devices per node (default: GPU count, or 2 without GPU)
#   --node_rank R          this node's rank, 0..N-1 (default 0)
#   --master_addr HOST     address of node 0, reachable from every node (default 127.0.0.1)
#   --master_port PORT     free TCP port on node 0 (default 29500)
#   --run_id NAME          run directory runs/NAME (torchrun's --rdzv_id); required with several nodes, the same
#                          on all of them
#   --config FILE          training config (default configs/default.yaml; configs/ddp.yaml is always added)
# Everything after `--` goes to `python -m project fit`.
#
# Every rank parses the command line on its own, so the run directory is named here, once: torchrun hands
# --rdzv_id to every rank, which writes to runs/<rdzv_id> (a per-process timestamp could differ between ranks).
# Lightning checks that --trainer.devices x --trainer.num_nodes equals torchrun's world size; this script sets both
# from the options.
set -euo pipefail
cd "$(dirname "$0")/.."

nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port=29500 run_id="" config=configs/default.yaml nproc=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) nnodes=$2; shift 2 ;;
    --nproc_per_node) nproc=$2; shift 2 ;;
    --node_rank) node_rank=$2; shift 2 ;;
    --master_addr) master_addr=$2; shift 2 ;;
    --master_port) master_port=$2; shift 2 ;;
    --run_id) run_id=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "torchrun.sh: unknown option '$1' (training flags go after --; see the header of $0)" >&2; exit 2 ;;
  esac
done

if [[ -z "$nproc" ]]; then
  nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$nproc" -gt 0 ]] || nproc=2  # no GPU: CPU processes with gloo
fi
if [[ -z "$run_id" ]]; then
  if [[ "$nnodes" -gt 1 ]]; then
    echo "torchrun.sh: with --nnodes $nnodes, pass --run_id NAME, the same on every node, so all ranks write to runs/NAME." >&2
    exit 2
  fi
  run_id=$(date +%Y%m%d-%H%M%S)
fi
PY=${PY:-python}

exec "$PY" -m torch.distributed.run \
  --nnodes "$nnodes" --nproc_per_node "$nproc" --node_rank "$node_rank" \
  --master_addr "$master_addr" --master_port "$master_port" --rdzv_id "$run_id" \
  -m project fit --config "$config" --config configs/ddp.yaml \
  --trainer.devices "$nproc" --trainer.num_nodes "$nnodes" "$@"
