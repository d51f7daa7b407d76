# shellcheck shell=bash
# Shared by ray-head.sh and ray-worker.sh: find this node's tailnet address and load the
# NCCL settings. Sourced, not run.

die() {
    printf 'ray-mesh deploy: error: %s\n' "$*" >&2
    exit 2
}

# The node's Tailscale IPv4 address: Ray, NCCL and gloo all use it, so they agree on one
# interface (tailscale0) instead of picking eth0/docker0 on their own.
tailnet_ip() {
    local ip
    if [[ -n "${RAY_MESH_NODE_IP:-}" ]]; then
        printf '%s\n' "$RAY_MESH_NODE_IP"
        return 0
    fi
    command -v tailscale >/dev/null 2>&1 \
        || die "the 'tailscale' command is not on PATH. Install Tailscale and run 'tailscale up', or set RAY_MESH_NODE_IP to this node's address."
    ip="$(tailscale ip -4 2>/dev/null | head -n 1)"
    [[ -n "$ip" ]] \
        || die "'tailscale ip -4' printed no address. Run 'tailscale up' (and check 'tailscale status'), then start again."
    printf '%s\n' "$ip"
}

# NCCL/gloo settings shared by every Ray worker on this node (see nccl.env). A value set in
# the environment before this script runs wins over the file; RAY_MESH_ENV_FILE=none
# skips the file.
#
# The file may set only these keys (every Ray worker inherits them, so a key that loads
# code, LD_PRELOAD and friends, would run it in every training process):
#   NCCL_*, GLOO_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_DEBUG, TORCH_CPP_LOG_LEVEL,
#   OMP_NUM_THREADS, CUDA_DEVICE_ORDER
# except NCCL's plugin keys (*_PLUGIN*: NCCL loads the library they name) and NCCL_CONF_FILE
# (a second file of settings). Set those in the systemd unit if you need them. The file
# must belong to root or to the user running the script, and be writable by no one else.
ENV_FILE_KEYS='^(NCCL_[A-Z0-9_]+|GLOO_[A-Z0-9_]+|TORCH_NCCL_[A-Z0-9_]+|TORCH_DISTRIBUTED_DEBUG|TORCH_CPP_LOG_LEVEL|OMP_NUM_THREADS|CUDA_DEVICE_ORDER)$'
ENV_FILE_DENIED='(_PLUGIN|^NCCL_CONF_FILE$)'

file_owner() {
    stat -L -c '%u' "$1" 2>/dev/null || stat -L -f '%u' "$1"
}

# Refuse an env file that someone other than root or this user could have written.
check_env_file_owner() {
    local file="$1" owner mode
    owner="$(file_owner "$file")"
    mode="$(stat -L -c '%a' "$file" 2>/dev/null || stat -L -f '%Lp' "$file")"
    [[ "$owner" == 0 || "$owner" == "$(id -u)" ]] \
        || die "$file belongs to uid $owner, not root or $(id -un): every Ray worker would run with the settings someone else wrote. Make root own it: sudo chown root: $file"
    if ((8#$mode & 8#022)); then
        die "$file has mode $mode: others can write it, and every Ray worker would run with their settings. Fix: sudo chmod 644 $file"
    fi
}

load_env_file() {
    local file="${RAY_MESH_ENV_FILE:-}"
    [[ "$file" == "none" ]] && return 0
    if [[ -z "$file" ]]; then
        for candidate in /etc/ray-mesh/nccl.env "$(dirname "${BASH_SOURCE[0]}")/nccl.env"; do
            if [[ -r "$candidate" ]]; then
                file="$candidate"
                break
            fi
        done
    fi
    [[ -z "$file" ]] && return 0
    [[ -r "$file" ]] || die "RAY_MESH_ENV_FILE=$file cannot be read."
    check_env_file_owner "$file"
    local line key n=0
    while IFS= read -r line || [[ -n "$line" ]]; do
        n=$((n + 1))
        [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
        key="${line%%=*}"
        [[ "$line" == *=* && "$key" =~ ^[A-Z_][A-Z0-9_]*$ ]] || die "$file line $n: not a KEY=value line: $line"
        if ! [[ "$key" =~ $ENV_FILE_KEYS ]] || [[ "$key" =~ $ENV_FILE_DENIED ]]; then
            die "$file line $n: $key may not be set from this file (it takes NCCL_*, GLOO_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_DEBUG, TORCH_CPP_LOG_LEVEL, OMP_NUM_THREADS, CUDA_DEVICE_ORDER; no *_PLUGIN or NCCL_CONF_FILE). Set other variables in the systemd unit (Environment=) or the shell that starts Ray."
        fi
        if [[ -z "${!key+x}" ]]; then
            export "$key=${line#*=}"
        fi
    done <"$file"
}

# Ray 2.60 turns token authentication on by default; keep it on. The token lives in
# ~/.ray/auth_token (or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH) and must be the same on
# every node.
# Turn token mode on explicitly: `ray start --address` on a worker does not switch it on by
# itself when a token file exists (the head does), and then fails with InvalidAuthToken.
use_token_auth() {
    if [[ "${RAY_AUTH_MODE:-}" == "disabled" ]]; then
        echo "ray-mesh deploy: warning: RAY_AUTH_MODE=disabled: anyone on the tailnet can run code on this cluster." >&2
        return 0
    fi
    export RAY_AUTH_MODE=token
}

# Ray starts worker processes at niceness 15; training ranks should compete for the CPU like
# torchrun's do (ray_mesh.core.priority). Workers inherit this from `ray start`, so no privilege
# is needed, unlike lowering it later from inside the worker. An exported value wins.
training_niceness() {
    export RAY_worker_niceness="${RAY_worker_niceness:-0}"
}

have_token() {
    [[ -n "${RAY_AUTH_TOKEN:-}" ]] && return 0
    [[ -n "${RAY_AUTH_TOKEN_PATH:-}" && -r "${RAY_AUTH_TOKEN_PATH}" ]] && return 0
    [[ -r "${HOME:-/root}/.ray/auth_token" ]]
}

# The token file as Ray reads it: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token.
token_file() {
    printf '%s\n' "${RAY_AUTH_TOKEN_PATH:-${HOME:-/root}/.ray/auth_token}"
}

file_mode() {
    stat -c '%a' "$1" 2>/dev/null || stat -f '%Lp' "$1"
}

# The token lets anyone who reads it run code on the cluster: keep it 0600 in a 0700
# directory. An existing token others can read is tightened, with a warning.
secure_token() {
    local file dir mode
    file="$(token_file)"
    dir="$(dirname "$file")"
    if [[ -f "$file" ]]; then
        mode="$(file_mode "$file")"
        if [[ "$mode" != "600" && "$mode" != "400" ]]; then
            echo "ray-mesh deploy: warning: $file had mode $mode (readable by other local users); setting it to 600." >&2
            chmod 600 "$file"
        fi
    fi
    # Only the default directory is ours to tighten; one named by RAY_AUTH_TOKEN_PATH is not.
    if [[ -z "${RAY_AUTH_TOKEN_PATH:-}" && -d "$dir" ]]; then
        mode="$(file_mode "$dir")"
        if [[ "$mode" != "700" ]]; then
            echo "ray-mesh deploy: warning: $dir had mode $mode; setting it to 700." >&2
            chmod 700 "$dir"
        fi
    fi
}

# First start of a head: a new token, created private (umask 077 in a subshell, so nothing
# else this script creates changes mode).
generate_token() {
    (
        umask 077
        mkdir -p "${HOME:-/root}/.ray"
        ray get-auth-token --generate >/dev/null
    )
    secure_token
}

# Before Ray starts again on a worker node (after a crash, a kill, a closed lid): the node
# joins the head's session, so it writes into the same session folder as before, and Ray's
# log monitor reads every worker log there from the start: the driver's console would show
# what the dead workers printed a second time. Ray moves a dead worker's logs to logs/old/
# itself, but only when it runs short of open files; this does it at start. Only the logs
# of processes that are gone move (their names end in the worker's pid).
retire_dead_worker_logs() {
    local root="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray" f pid prev=""
    for f in "$@"; do  # `ray start --temp-dir=DIR` or `--temp-dir DIR` among the arguments
        [[ "$f" == --temp-dir=* ]] && root="${f#--temp-dir=}"
        [[ "$prev" == --temp-dir ]] && root="$f"
        prev="$f"
    done
    shopt -s nullglob
    for f in "$root"/session_*/logs/worker-*.out "$root"/session_*/logs/worker-*.err; do
        pid="${f##*-}"
        pid="${pid%.*}"
        [[ "$pid" =~ ^[0-9]+$ ]] || continue
        { [[ -d "/proc/$pid" ]] || kill -0 "$pid" 2>/dev/null; } && continue
        if mkdir -p "$(dirname "$f")/old"; then mv -f "$f" "$(dirname "$f")/old/" || true; fi
    done
    shopt -u nullglob
}
