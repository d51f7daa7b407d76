#!/usr/bin/env bash
# Start the Ray head on this node's Tailscale address.
#
#   deploy/tailscale/ray-head.sh [extra `ray start` args]
#
# Environment: RAY_PORT (6379), RAY_DASHBOARD_PORT (8265), RAY_BLOCK (1: stay in the
# foreground, as systemd wants; 0: return once started), RAY_MESH_ENV_FILE (NCCL settings,
# default /etc/ray-mesh/nccl.env, else nccl.env next to this script), RAY_MESH_NODE_IP
# (skip `tailscale ip -4`).
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

node_ip="$(tailnet_ip)"
port="${RAY_PORT:-6379}"
load_env_file

use_token_auth
training_niceness
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
    if have_token; then
        secure_token
    else
        # First start: create the cluster's token (0600); copy it to every worker's
        # ~/.ray/auth_token (scp keeps it private: mode 0600 there too).
        generate_token
    fi
fi

args=(
    start --head
    --node-ip-address="$node_ip"
    --port="$port"
    # The dashboard accepts jobs: bind it to the tailnet address, not 0.0.0.0. The Ray
    # Client server and the agents' HTTP servers follow --node-ip-address by themselves;
    # GCS, raylet, workers and the /metrics endpoints have no bind option in Ray 2.60 and
    # listen on all interfaces: firewall.sh (README "What is exposed") closes them.
    --dashboard-host="$node_ip"
    --dashboard-port="${RAY_DASHBOARD_PORT:-8265}"
    --disable-usage-stats
)
if [[ "${RAY_BLOCK:-1}" == "1" ]]; then
    args+=(--block)
fi

echo "ray-mesh deploy: head on ${node_ip}:${port}; join workers with:" >&2
echo "  RAY_HEAD_ADDRESS=${node_ip}:${port} deploy/tailscale/ray-worker.sh" >&2
exec ray "${args[@]}" "$@"
