#!/usr/bin/env bash
# DDP under torchrun, on one node or several: run this once on every node, with the same --run_id.
#
#   node 0:  scripts/torchrun.sh --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --run_id exp1 -- --trainer.max_epochs 5
#   node 1:  scripts/torchrun.sh --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --run_id exp1 -- --trainer.max_epochs 5
#   one node: scripts/torchrun.sh   (every GPU, or 2 CPU processes with gloo when there is none)
#
# Options: --nnodes N (1), --nproc_per_node N (the GPU count, or 2), --node_rank R (0: the node that hosts the
# rendezvous), --master_addr HOST (node 0's address, 127.0.0.1), --master_port PORT (29500), --run_id NAME (runs/NAME;
# required with several nodes), --max_restarts N (3), --config FILE (configs/default.yaml; configs/ddp.yaml is
# added). Everything after `--` goes to `python -m project fit`.
#
# A rank that dies takes its group down and torchrun starts it again, up to --max_restarts times; the c10d
# rendezvous (a store on node 0) makes every node's workers restart together. Every rank derives its run directory
# from --run_id (torchrun's --rdzv_id), so all ranks and restarts write to one runs/NAME.
set -euo pipefail
cd "$(dirname "$0")/.."

nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port=29500 run_id="" config=configs/default.yaml nproc=""
max_restarts=3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) nnodes=$2; shift 2 ;;
    --nproc_per_node) nproc=$2; shift 2 ;;
    --node_rank) node_rank=$2; shift 2 ;;
    --master_addr) master_addr=$2; shift 2 ;;
    --master_port) master_port=$2; shift 2 ;;
    --run_id) run_id=$2; shift 2 ;;
    --max_restarts) max_restarts=$2; shift 2 ;;
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

# is_host: node 0 serves the rendezvous store (torchrun's guess from the host name fails with two agents on one host).
# Workers start a store of their own each attempt: on the rendezvous store a restarted rank read the dead attempt's
# addresses (gloo: "connection refused").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec "$PY" -m torch.distributed.run \
  --nnodes "$nnodes" --nproc_per_node "$nproc" --max_restarts "$max_restarts" \
  --rdzv_backend c10d --rdzv_endpoint "$master_addr:$master_port" --rdzv_id "$run_id" \
  --rdzv_conf "is_host=$([[ $node_rank == 0 ]] && echo 1 || echo 0)" \
  -m project fit --config "$config" --config configs/ddp.yaml \
  --trainer.devices "$nproc" --trainer.num_nodes "$nnodes" "$@"
