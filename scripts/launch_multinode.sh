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

# A wrong variable is one error: line naming it, not bash's "x: unbound variable", a Python traceback, a node that
# waits for a rendezvous no other node joins (NODE_RANK past the last node), or accelerate's usage block.
refuse() { echo "error: $1" >&2; exit 2; }
whole_number() { [[ $1 =~ ^[0-9]+$ ]]; }
whole_number "$NUM_NODES" && (( NUM_NODES >= 1 )) ||
  refuse "NUM_NODES=$NUM_NODES: give the number of nodes of the launch, a whole number >= 1 (unset: 1)"
whole_number "$LOCAL_WORLD_SIZE" && (( LOCAL_WORLD_SIZE >= 1 )) ||
  refuse "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE: give the processes (GPUs) of this node, a whole number >= 1 (unset: this node's GPUs)"
whole_number "$NODE_RANK" && (( NODE_RANK < NUM_NODES )) ||
  refuse "NODE_RANK=$NODE_RANK: give this node's rank, 0 to $((NUM_NODES - 1)) for NUM_NODES=$NUM_NODES (unset: 0)"
whole_number "$MASTER_PORT" && (( MASTER_PORT >= 1 && MASTER_PORT <= 65535 )) ||
  refuse "MASTER_PORT=$MASTER_PORT: give node 0's rendezvous port, 1 to 65535, the same on every node (unset: 29500)"
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
