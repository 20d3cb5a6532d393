#!/usr/bin/env bash
# Launch `omniscale train CONFIG.yaml [train args]` under torchrun on this node.
#
#   tools/launch/torchrun.sh CONFIG.yaml [--set k=v ...] [--no-progress] [--resume RUN_DIR]
#
# Environment (defaults in brackets):
#   NNODES          nodes in the job [1]
#   NPROC_PER_NODE  ranks on this node [one per GPU: CUDA_VISIBLE_DEVICES, else nvidia-smi;
#                   1 without GPUs]
#   NODE_RANK       this node's index, 0..NNODES-1 [0]
#   MASTER_ADDR     host of the rendezvous, reachable from every node [127.0.0.1]
#   MASTER_PORT     its port [29500]
#   RDZV_ID         rendezvous id, the same on every node of a job [omniscale]
#   PLANE_URL       an external data plane (`omniscale plane serve --host 0.0.0.0 ...`);
#                   unset on one node: global rank 0 embeds the plane. Required for NNODES > 1.
#   PLANE_TOKEN     its bearer token (handed to the ranks as OMNISCALE_PLANE_TOKEN, never on
#                   a command line: `ps` shows those)
#   PLANE_FILE      instead of the two above: a file whose first line is the URL and second
#                   the token (what tools/launch/slurm_node.sh writes)
#   PLANE_TLS_ROOT  for a grpc+tls:// plane: the CA certificate to check it against
#   PYTHON          the interpreter with omniscale installed [python]
#
# One node, 8 GPUs:    tools/launch/torchrun.sh configs/demo_omni.yaml
# Two nodes (on each): NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=node0 PLANE_URL=grpc+tls://node0:8815 \
#                      PLANE_TOKEN=... PLANE_TLS_ROOT=plane.pem tools/launch/torchrun.sh CONFIG.yaml
# Tested by tests/tools/test_launch_scripts.py.
set -euo pipefail

die() { echo "torchrun.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: tools/launch/torchrun.sh CONFIG.yaml [omniscale train args ...]"

gpus_here() {
    # Slurm and container runtimes narrow CUDA_VISIBLE_DEVICES; nvidia-smi lists every GPU.
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        local -a ids
        IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        nvidia-smi -L | grep -c '^GPU'
    else
        echo 1  # a CPU box: one rank (gloo); set NPROC_PER_NODE for more
    fi
}

PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(gpus_here)}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

if [[ -n "${PLANE_FILE:-}" ]]; then
    [[ -r "$PLANE_FILE" ]] || die "PLANE_FILE=$PLANE_FILE: cannot read it"
    { read -r PLANE_URL || true; read -r PLANE_TOKEN || true; } <"$PLANE_FILE"
    [[ -n "$PLANE_URL" ]] || die "PLANE_FILE=$PLANE_FILE: no URL on its first line"
fi

plane_args=()
if [[ -n "${PLANE_URL:-}" ]]; then
    plane_args=(--plane "$PLANE_URL")
    # the ranks read the token and the CA from the environment: nothing secret in `ps`
    [[ -z "${PLANE_TOKEN:-}" ]] || export OMNISCALE_PLANE_TOKEN="$PLANE_TOKEN"
    [[ -z "${PLANE_TLS_ROOT:-}" ]] || export OMNISCALE_PLANE_TLS_ROOT="$PLANE_TLS_ROOT"
elif [[ "$NNODES" -gt 1 ]]; then
    # the embedded plane listens on loopback: other nodes could not reach it
    die "NNODES=$NNODES needs an external data plane: set PLANE_URL and PLANE_TOKEN (or PLANE_FILE) of an \`omniscale plane serve --host 0.0.0.0\` every node reaches (tools/launch/slurm.sbatch starts one)"
fi

# `python -m torch.distributed.run` is torchrun, from the interpreter that has omniscale.
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "${RDZV_ID:-omniscale}" \
    -m omniscale train "$@" "${plane_args[@]}"
