#!/usr/bin/env bash
# Join this node to a Ray head over Tailscale.
#
#   deploy/tailscale/ray-worker.sh HEAD_ADDRESS[:PORT] [extra `ray start` args]
#   RAY_HEAD_ADDRESS=100.101.102.103:6379 deploy/tailscale/ray-worker.sh
#
# Environment: as ray-head.sh, plus RAY_HEAD_ADDRESS. The head's auth token must be in
# ~/.ray/auth_token here (or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH).
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

head="${RAY_HEAD_ADDRESS:-}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    head="$1"
    shift
fi
[[ -n "$head" ]] || die "no head address: pass HEAD_IP[:PORT] or set RAY_HEAD_ADDRESS (the head's 'tailscale ip -4')."
[[ "$head" == *:* ]] || head="${head}:${RAY_PORT:-6379}"

node_ip="$(tailnet_ip)"
load_env_file

use_token_auth
training_niceness
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
    have_token || die "no Ray auth token on this node. Copy the head's ~/.ray/auth_token to ~/.ray/auth_token here, mode 0600 (or set RAY_AUTH_TOKEN_PATH)."
    secure_token
fi

retire_dead_worker_logs "$@"

args=(start --address="$head" --node-ip-address="$node_ip" --disable-usage-stats)
if [[ "${RAY_BLOCK:-1}" == "1" ]]; then
    args+=(--block)
fi
exec ray "${args[@]}" "$@"
