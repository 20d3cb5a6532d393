#!/usr/bin/env bash
# One node of a Slurm job: what tools/launch/slurm.sbatch runs on every node (srun, one task
# per node).
#
#   tools/launch/slurm_node.sh CONFIG.yaml [omniscale train args ...]
#
# The first node (SLURM_NODEID 0) prepares the data, starts the data plane on 0.0.0.0 with a
# random token and writes its URL and the token to PLANE_FILE in LAUNCH_DIR (a directory every
# node sees); every node waits for that file, then runs tools/launch/torchrun.sh with it. When
# the first node's ranks are done, its plane is stopped (it snapshots on the way out).
#
# From Slurm: SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST
# (SLURM_GPUS_ON_NODE, SLURM_SUBMIT_DIR, SLURM_RESTART_COUNT when set).
# Environment (defaults in brackets):
#   NPROC_PER_NODE  ranks per node, the same on every node [SLURM_GPUS_ON_NODE, else 1]
#   MASTER_ADDR     rendezvous host [the first host of SLURM_JOB_NODELIST]
#   MASTER_PORT     rendezvous port [15000 + SLURM_JOB_ID % 20000]
#   LAUNCH_DIR      shared directory of the job's plane.log and plane URL file
#                   [${SLURM_SUBMIT_DIR:-$PWD}/omniscale-slurm-$SLURM_JOB_ID]
#   PLANE_ADDR      the name other nodes reach the plane at (a TLS certificate must carry it)
#                   [MASTER_ADDR]
#   PLANE_PORT      the plane's port [0: any free one]
#   PLANE_TLS_CERT, PLANE_TLS_KEY  serve grpc+tls:// with this pair; the ranks check it
#                   against PLANE_TLS_ROOT [PLANE_TLS_CERT]
#   PLANE_INSECURE=1  without a certificate: plain TCP (the token crosses the network in clear
#                   text). One of the two is required: the plane refuses an open port without.
#   PLANE_WAIT      seconds to wait for the plane to start, or for its URL file [600]
#   PYTHON          the interpreter with omniscale installed [python]
# Tested (one simulated node) by tests/tools/test_launch_scripts.py.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "slurm_node.sh: $*" >&2; exit 2; }

first_host() {
    # "node[03-04,07],gpu1" -> node03. scontrol expands every form; without it (a test, a
    # login node without Slurm's tools) the first name or bracket's first number will do.
    if command -v scontrol >/dev/null; then
        local hosts
        hosts=$(scontrol show hostnames "$1")
        echo "${hosts%%$'\n'*}"
        return
    fi
    local prefix=${1%%[\[,]*}
    if [[ $1 == "${prefix}["* ]]; then
        local inside=${1#*\[}
        echo "$prefix${inside%%[-,\]]*}"
    else
        echo "$prefix"
    fi
}

wait_until() {
    # wait_until WHAT CHECK...: poll CHECK for at most PLANE_WAIT seconds (a shared filesystem
    # offers nothing to block on); on time-out one line naming WHAT.
    local what=$1 deadline=$((SECONDS + PLANE_WAIT))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || die "no $what after ${PLANE_WAIT}s"
        sleep 0.2
    done
}

plane_serving() {
    # true once the plane printed its URL (kept in $served); dies if the plane has exited
    served=$(grep -m1 -o 'serving [^ ]*' "$plane_log" 2>/dev/null) && return 0
    kill -0 "$plane_pid" 2>/dev/null ||
        die "the data plane exited: $(tail -n 1 "$plane_log") (log: $plane_log)"
    return 1
}

stop_plane() {
    # SIGTERM: the plane snapshots its state and says "stopped at step N"
    if [[ -n "${plane_pid:-}" ]] && kill -TERM "$plane_pid" 2>/dev/null; then
        wait "$plane_pid" || true
    fi
}

start_plane() {
    # the serve flags that fit the run (dp, sp, batch sizes, ...; tools/launch/plane_args.py),
    # computed with the data prepared, before any rank starts
    local flags token tmp
    local -a serve_flags tls_flags
    flags=$("$PYTHON" -m omniscale.tools.launch.plane_args \
        --world $((NNODES * NPROC_PER_NODE)) "$@")
    mapfile -t serve_flags <<<"$flags"
    if [[ -n "${PLANE_TLS_CERT:-}" ]]; then
        tls_flags=(--tls-cert "$PLANE_TLS_CERT" --tls-key "$PLANE_TLS_KEY")
    else
        tls_flags=(--insecure)
    fi
    token=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')
    plane_log="$LAUNCH_DIR/plane.log"
    # the token through the environment: a command line is visible in `ps`
    OMNISCALE_PLANE_TOKEN="$token" "$PYTHON" -m omniscale plane serve "${serve_flags[@]}" \
        --host 0.0.0.0 --port "${PLANE_PORT:-0}" "${tls_flags[@]}" >"$plane_log" 2>&1 &
    plane_pid=$!
    trap stop_plane EXIT
    trap 'exit 143' TERM  # so that EXIT runs, and the plane stops with the node's task
    trap 'exit 130' INT   # (a background process ignores Ctrl-C)
    wait_until "data plane URL in $plane_log" plane_serving
    local url=${served#serving }  # grpc+tcp://0.0.0.0:PORT: the address others reach
    url="${url%%://*}://$PLANE_ADDR:${url##*:}"
    # written whole then renamed: a waiting node never reads half a file; mode 600 (mktemp)
    tmp=$(mktemp "$LAUNCH_DIR/.plane.XXXXXX")
    printf '%s\n%s\n' "$url" "$token" >"$tmp"
    mv -f "$tmp" "$PLANE_FILE"
    echo "slurm_node.sh: data plane at $url (log $plane_log)"
}

main() {
    [[ $# -ge 1 ]] || die "usage: tools/launch/slurm_node.sh CONFIG.yaml [omniscale train args ...]"
    [[ -n "${SLURM_JOB_ID:-}" ]] || die "SLURM_JOB_ID unset: not in a Slurm job (submit tools/launch/slurm.sbatch)"
    PYTHON=${PYTHON:-python}
    PLANE_WAIT=${PLANE_WAIT:-600}
    NNODES=${SLURM_NNODES:-1}
    NODE_RANK=${SLURM_NODEID:-0}
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
    MASTER_ADDR=${MASTER_ADDR:-$(first_host "${SLURM_JOB_NODELIST:-$(hostname)}")}
    MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 20000))}
    PLANE_ADDR=${PLANE_ADDR:-$MASTER_ADDR}
    LAUNCH_DIR=${LAUNCH_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/omniscale-slurm-$SLURM_JOB_ID}
    # one file per start of the job: a requeued job never reads its last start's plane
    PLANE_FILE="$LAUNCH_DIR/plane-${SLURM_RESTART_COUNT:-0}.url"
    if [[ -z "${PLANE_TLS_CERT:-}" && "${PLANE_INSECURE:-0}" != 1 ]]; then
        die "the data plane listens on 0.0.0.0: set PLANE_TLS_CERT and PLANE_TLS_KEY (a certificate for $PLANE_ADDR), or PLANE_INSECURE=1 for plain TCP"
    fi
    if [[ -n "${PLANE_TLS_CERT:-}" ]]; then
        [[ -n "${PLANE_TLS_KEY:-}" ]] || die "PLANE_TLS_CERT needs PLANE_TLS_KEY (its private key)"
        export PLANE_TLS_ROOT=${PLANE_TLS_ROOT:-$PLANE_TLS_CERT}
    fi

    if [[ "$NODE_RANK" == 0 ]]; then
        mkdir -p "$LAUNCH_DIR"
        rm -f "$PLANE_FILE"
        start_plane "$@"
    else
        wait_until "$PLANE_FILE (the first node starts the data plane)" test -s "$PLANE_FILE"
    fi
    # not exec on the first node: its EXIT trap stops the plane after the ranks are done
    NNODES=$NNODES NODE_RANK=$NODE_RANK NPROC_PER_NODE=$NPROC_PER_NODE \
        MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT PLANE_FILE=$PLANE_FILE \
        PYTHON=$PYTHON RDZV_ID="omniscale-$SLURM_JOB_ID" "$HERE/torchrun.sh" "$@"
}

# A requeued job (node failure, preemption) runs this script again with the same arguments:
# without --resume of the user's, `--resume auto` continues the run from its newest
# checkpoint, or starts it when there is none yet.
with_auto_resume() {
    local arg
    for arg in "$@"; do
        [[ "$arg" == --resume || "$arg" == --resume=* ]] && { printf '%s\0' "$@"; return; }
    done
    printf '%s\0' "$@" --resume auto
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # sourced (a test of first_host): functions only
    mapfile -d '' args < <(with_auto_resume "$@")
    main "${args[@]}"
fi
