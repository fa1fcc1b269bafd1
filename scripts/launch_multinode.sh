#!/usr/bin/env bash
# Launch one recipe across N nodes: run this same command on EVERY node.
#
#   scripts/launch_multinode.sh ACCELERATE_CONFIG RECIPE [--key value ...]
#
# Reads the variables cluster runtimes set on each node (defaults = one local node):
#   NUM_NODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
#   LOCAL_WORLD_SIZE (GPUs on this node; CPU: the config's processes per machine).
# NCCL_SOCKET_IFNAME, HF_HOME and HF_TOKEN pass through the environment untouched.
# Underneath it is plain `accelerate launch` (torchrun): no home-made launcher.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 ACCELERATE_CONFIG RECIPE [--key value ...]" >&2
  exit 2
fi
config=$1
recipe=$2
shift 2

detect_local_world_size() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | wc -l
  else
    # No GPU: the config's processes per machine (num_processes / num_machines), read as accelerate reads it.
    python -m sft_recipes.launch processes-per-node "$config"
  fi
}

NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-$(detect_local_world_size)} || exit 2  # a config it cannot read: its error: line
WORLD_SIZE=$((NUM_NODES * LOCAL_WORLD_SIZE))

# Before any process starts: a GPU recipe on a machine without GPUs, or a recipe (with these overrides) the
# run would refuse, is one `error:` line and exit 2 -- not torchrun's report of every failed rank.
python -m sft_recipes.preflight_launch "$config" "$recipe" --processes-per-node "$LOCAL_WORLD_SIZE" \
  --world-size "$WORLD_SIZE" -- "$@" || exit 2

echo "[launch] node ${NODE_RANK}/${NUM_NODES}: ${LOCAL_WORLD_SIZE} processes here, world size ${WORLD_SIZE}," \
     "rendezvous ${MASTER_ADDR}:${MASTER_PORT}, NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<unset>}," \
     "HF_TOKEN $([[ -n ${HF_TOKEN:-} ]] && echo set || echo unset)" >&2

exec accelerate launch \
  --config_file "$config" \
  --num_machines "$NUM_NODES" \
  --machine_rank "$NODE_RANK" \
  --num_processes "$WORLD_SIZE" \
  --main_process_ip "$MASTER_ADDR" \
  --main_process_port "$MASTER_PORT" \
  scripts/sft.py "$recipe" "$@"
