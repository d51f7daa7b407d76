#!/usr/bin/env bash
# Only the cluster's own nodes may reach Ray's and torch's ports on this node.
#
#   deploy/tailscale/firewall.sh              # print the rules it would load; changes nothing
#   sudo deploy/tailscale/firewall.sh apply   # load them, atomically (again: replaces)
#   sudo deploy/tailscale/firewall.sh remove
#   deploy/tailscale/firewall.sh status       # what is loaded now
#   deploy/tailscale/firewall.sh peers [ADDR] # the Ray nodes' addresses, one a line
#
# Why: Ray binds most of its servers to all interfaces and Ray 2.60 has no option to change
# that (GCS, raylet, core workers, the dashboard agent's gRPC and three Prometheus /metrics
# endpoints, the last without any token); torch's rendezvous store (rank 0's MASTER_PORT)
# has no authentication. Their ports are random, so the rule covers the whole unprivileged
# range: a new TCP connection to a port in RAY_MESH_FW_PORTS is refused (TCP reset) unless
# it arrives on lo, or on the tailnet interface from one of the cluster's peers. Ports
# below 1024 (ssh) and connections this node opens itself are not touched.
#
# The peers: RAY_MESH_FW_PEERS, else the file RAY_MESH_FW_PEERS_FILE (default
# /etc/ray-mesh/peers, one address or CIDR a line, # comments), e.g. made on the head with
#   deploy/tailscale/firewall.sh peers | sudo tee /etc/ray-mesh/peers
# With neither, every tailnet address (RAY_MESH_FW_V4 / RAY_MESH_FW_V6) is admitted, with
# a warning: any member of the tailnet can then reach the cluster.
#
# Environment:
#   RAY_MESH_FW_PEERS       the cluster's tailnet addresses or CIDRs (space- or comma-separated)
#   RAY_MESH_FW_PEERS_FILE  a file of them (/etc/ray-mesh/peers)
#   RAY_MESH_FW_IFACE       the tailnet interface (tailscale0)
#   RAY_MESH_FW_PORTS       protected TCP port range (1024-65535)
#   RAY_MESH_FW_OPEN        ports that stay open to everyone, space-separated (e.g. "8888")
#   RAY_MESH_FW_V4          tailnet IPv4 range, without peers (100.64.0.0/10)
#   RAY_MESH_FW_V6          tailnet IPv6 range, without peers (fd7a:115c:a1e0::/48)
#   RAY_MESH_FW_BACKEND     nft, iptables or auto (nft if installed, else iptables)
#   RAY_MESH_PYTHON         the Python that has ray, for `peers` (python3)
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TABLE=ray_mesh # nftables: table inet ray_mesh; iptables: chain RAY_MESH
CHAIN=RAY_MESH
MAX_PEERS=1024
MAX_OPEN=64

iface="${RAY_MESH_FW_IFACE:-tailscale0}"
ports="${RAY_MESH_FW_PORTS:-1024-65535}"
open_ports="${RAY_MESH_FW_OPEN:-}"
v4="${RAY_MESH_FW_V4:-100.64.0.0/10}"
v6="${RAY_MESH_FW_V6:-fd7a:115c:a1e0::/48}"
peers_file="${RAY_MESH_FW_PEERS_FILE:-/etc/ray-mesh/peers}"
# Filled by check_inputs: the admitted sources per family, the open ports (deduplicated).
src4=()
src6=()
open=()
peers_from=""

is_port() {
    [[ "$1" =~ ^[1-9][0-9]{0,4}$ ]] && (($1 <= 65535))
}

# An IPv4 address or CIDR, each octet 0-255, prefix 0-32 (no leading zeros: they mean octal
# to some tools).
is_v4() {
    local addr="${1%/*}" len="" octet
    [[ "$1" == */* ]] && len="${1#*/}"
    [[ -z "$len" && "$1" == */* ]] && return 1
    if [[ -n "$len" ]]; then
        [[ "$len" =~ ^(0|[1-9][0-9]?)$ ]] && ((len <= 32)) || return 1
    fi
    [[ "$addr" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
    for octet in "${BASH_REMATCH[@]:1}"; do
        [[ "$octet" =~ ^(0|[1-9][0-9]*)$ ]] && ((octet <= 255)) || return 1
    done
}

# An IPv6 address or CIDR: hex groups and colons (at least two), prefix 0-128.
is_v6() {
    local addr="${1%/*}" len=""
    [[ "$1" == */* ]] && len="${1#*/}"
    [[ -z "$len" && "$1" == */* ]] && return 1
    if [[ -n "$len" ]]; then
        [[ "$len" =~ ^(0|[1-9][0-9]{0,2})$ ]] && ((len <= 128)) || return 1
    fi
    [[ "$addr" =~ ^[0-9A-Fa-f:]{2,39}$ && "$addr" == *:*:* && "$addr" != *:::* ]]
}

# The peer list, from RAY_MESH_FW_PEERS or the peers file; each entry checked.
read_peers() {
    local raw="" line p n=0
    local -a words
    if [[ -n "${RAY_MESH_FW_PEERS:-}" ]]; then
        raw="${RAY_MESH_FW_PEERS//,/ }"
        peers_from="RAY_MESH_FW_PEERS"
    elif [[ -f "$peers_file" ]]; then
        [[ -r "$peers_file" ]] || die "RAY_MESH_FW_PEERS_FILE=$peers_file cannot be read."
        while IFS= read -r line || [[ -n "$line" ]]; do
            line="${line%%#*}"
            raw+=" $line"
        done <"$peers_file"
        peers_from="$peers_file"
    fi
    read -r -a words <<<"$raw"
    for p in "${words[@]}"; do
        n=$((n + 1))
        ((n <= MAX_PEERS)) || die "${peers_from}: more than $MAX_PEERS peers; list the cluster's nodes, or use CIDRs."
        if is_v4 "$p"; then
            src4+=("$p")
        elif is_v6 "$p"; then
            src6+=("$p")
        else
            die "${peers_from}: '$p' is not an IPv4 or IPv6 address or CIDR (e.g. 100.101.102.103 or fd7a:115c:a1e0::1)."
        fi
    done
    if [[ -n "$peers_from" && $n -eq 0 ]]; then
        die "${peers_from} lists no peer: it would shut every node out. List the cluster's tailnet addresses ('firewall.sh peers'), or remove it to admit the whole tailnet."
    fi
}

check_inputs() {
    [[ "$iface" =~ ^[A-Za-z0-9_.-]{1,15}$ ]] \
        || die "RAY_MESH_FW_IFACE='$iface' is not an interface name (e.g. tailscale0)."
    local lo="${ports%%-*}" hi="${ports#*-}"
    if ! { [[ "$ports" == *-* ]] && is_port "$lo" && is_port "$hi"; }; then
        die "RAY_MESH_FW_PORTS='$ports' is not a range LOW-HIGH of ports 1-65535 (e.g. 1024-65535)."
    fi
    ((lo <= hi)) || die "RAY_MESH_FW_PORTS='$ports': LOW must not be above HIGH."
    local p seen=" "
    local -a words
    read -r -a words <<<"${open_ports//,/ }"
    for p in "${words[@]}"; do
        is_port "$p" \
            || die "RAY_MESH_FW_OPEN='$open_ports': '$p' is not a port number 1-65535 (space-separated, e.g. \"8888 9090\")."
        [[ "$seen" == *" $p "* ]] && continue
        seen+="$p "
        open+=("$p")
    done
    ((${#open[@]} <= MAX_OPEN)) || die "RAY_MESH_FW_OPEN: more than $MAX_OPEN ports."
    is_v4 "$v4" || die "RAY_MESH_FW_V4='$v4' is not an IPv4 CIDR (e.g. 100.64.0.0/10)."
    is_v6 "$v6" || die "RAY_MESH_FW_V6='$v6' is not an IPv6 CIDR (e.g. fd7a:115c:a1e0::/48)."
    read_peers
    if [[ -z "$peers_from" ]]; then
        src4=("$v4")
        src6=("$v6")
    fi
}

backend() {
    local b="${RAY_MESH_FW_BACKEND:-auto}"
    case "$b" in
        nft | iptables) ;;
        auto)
            if command -v nft >/dev/null 2>&1; then
                b=nft
            elif command -v iptables >/dev/null 2>&1; then
                b=iptables
            else
                die "neither 'nft' nor 'iptables' is installed: apt-get install -y nftables (or iptables)."
            fi
            ;;
        *) die "RAY_MESH_FW_BACKEND='$b': use nft, iptables or auto." ;;
    esac
    command -v "$b" >/dev/null 2>&1 || die "'$b' is not installed (apt-get install -y ${b/nft/nftables})."
    printf '%s\n' "$b"
}

join_by() {
    local sep="$1" out="" x
    shift
    for x in "$@"; do out+="${out:+$sep}$x"; done
    printf '%s' "$out"
}

# The whole table, loaded atomically by `nft -f`: the leading add+delete makes a second
# `apply` replace the first instead of adding to it, in the same transaction.
nft_rules() {
    cat <<EOF
add table inet $TABLE
delete table inet $TABLE
table inet $TABLE {
  chain input {
    type filter hook input priority filter - 1; policy accept;
    iifname "lo" accept
EOF
    ((${#src4[@]})) && echo "    iifname \"$iface\" ip saddr { $(join_by ', ' "${src4[@]}") } accept"
    ((${#src6[@]})) && echo "    iifname \"$iface\" ip6 saddr { $(join_by ', ' "${src6[@]}") } accept"
    ((${#open[@]})) && echo "    tcp dport { $(join_by ', ' "${open[@]}") } accept"
    cat <<EOF
    tcp dport $ports tcp flags & (fin | syn | rst | ack) == syn counter reject with tcp reset
  }
}
EOF
}

# One iptables-restore input per family (4 or 6), committed atomically with --noflush:
# declaring the chain empties it, the rules and the INPUT jump land in one commit, and a
# failing line leaves the rules already loaded untouched.
iptables_rules() {
    local family="$1" jump="$2" s i
    local -a srcs=("${src4[@]}")
    [[ "$family" == 6 ]] && srcs=("${src6[@]}")
    echo "*filter"
    echo ":$CHAIN - [0:0]"
    echo "-A $CHAIN -i lo -j RETURN"
    for s in "${srcs[@]}"; do
        echo "-A $CHAIN -i $iface -s $s -j RETURN"
    done
    for ((i = 0; i < ${#open[@]}; i += 15)); do # multiport takes 15 ports at most
        echo "-A $CHAIN -p tcp -m multiport --dports $(join_by , "${open[@]:i:15}") -j RETURN"
    done
    echo "-A $CHAIN -p tcp --syn --dport ${ports/-/:} -j REJECT --reject-with tcp-reset"
    [[ "$jump" == 1 ]] && echo "-I INPUT 1 -j $CHAIN"
    echo "COMMIT"
}

iptables_apply() {
    local family cmd jump
    if ! command -v iptables-restore >/dev/null 2>&1 || ! command -v ip6tables-restore >/dev/null 2>&1; then
        die "'iptables-restore' / 'ip6tables-restore' are not installed (apt-get install -y iptables)."
    fi
    for family in 4 6; do
        cmd=iptables
        [[ "$family" == 6 ]] && cmd=ip6tables
        jump=1
        "$cmd" -w -C INPUT -j "$CHAIN" 2>/dev/null && jump=0
        iptables_rules "$family" "$jump" | "$cmd-restore" -w 10 --noflush \
            || die "$cmd-restore refused the rules (nothing changed for IPv$family); see the error above."
    done
}

iptables_remove() {
    local cmd
    for cmd in iptables ip6tables; do
        while "$cmd" -w -D INPUT -j "$CHAIN" 2>/dev/null; do :; done
        "$cmd" -w -F "$CHAIN" 2>/dev/null || true
        "$cmd" -w -X "$CHAIN" 2>/dev/null || true
    done
}

# The addresses of the Ray cluster's live nodes (run where `ray` and the token are).
ray_peers() {
    local py="${RAY_MESH_PYTHON:-python3}" out addr
    command -v "$py" >/dev/null 2>&1 || die "'$py' not found: set RAY_MESH_PYTHON to the Python that has ray."
    use_token_auth
    # Bounded: ray.init keeps retrying an address where no GCS answers.
    out="$(timeout "${RAY_MESH_FW_PEERS_TIMEOUT:-90}" "$py" - "${1:-${RAY_ADDRESS:-auto}}" <<'EOF'
import socket
import sys

address = sys.argv[1]
if address != "auto":
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        sys.exit(f"nothing answers at {address} ({exc})")
import ray  # noqa: E402

ray.init(address=address, logging_level="ERROR", log_to_driver=False)
for node in ray.nodes():
    if node.get("Alive"):
        print(node["NodeManagerAddress"])
EOF
)" || die "could not list the Ray nodes (is the cluster up, and the token here?); pass the head's address: firewall.sh peers 100.x.y.z:6379"
    local -a addrs
    mapfile -t addrs <<<"$out"
    for addr in "${addrs[@]}"; do
        is_v4 "$addr" || is_v6 "$addr" || die "Ray reported a node address '$addr' that is not an IP address."
    done
    printf '%s\n' "$out" | sort -u
}

need_root() {
    [[ "$(id -u)" == 0 ]] || die "'$1' changes the firewall: run it as root (sudo $0 $1)."
}

describe() {
    local who
    if [[ -n "$peers_from" ]]; then
        who="the peers in $peers_from ($(join_by ' ' "${src4[@]}" "${src6[@]}"))"
    else
        who="every tailnet address ($v4, $v6)"
        echo "ray-mesh firewall: warning: no peer list (RAY_MESH_FW_PEERS or $peers_file): any member of the tailnet may connect. List the cluster's nodes: firewall.sh peers | sudo tee $peers_file" >&2
    fi
    printf 'TCP %s only from lo and, on %s, %s' "$ports" "$iface" "$who"
}

main() {
    local action="${1:-print}" b what
    if [[ "$action" == peers ]]; then
        ray_peers "${2:-}"
        return 0
    fi
    check_inputs
    case "$action" in
        print)
            b="$(backend)"
            what="$(describe)"
            echo "# ray-mesh firewall ($b): $what" >&2
            if [[ "$b" == nft ]]; then
                nft_rules
            else
                echo "# iptables-restore --noflush"
                iptables_rules 4 1
                echo "# ip6tables-restore --noflush"
                iptables_rules 6 1
            fi
            ;;
        apply)
            need_root apply
            b="$(backend)"
            what="$(describe)"
            if [[ "$b" == nft ]]; then
                nft_rules | nft -f - || die "nft refused the rules (nothing changed); see the error above."
            else
                iptables_apply
            fi
            echo "ray-mesh firewall: applied ($b): $what." >&2
            ;;
        remove)
            need_root remove
            b="$(backend)"
            if [[ "$b" == nft ]]; then
                nft delete table inet "$TABLE" 2>/dev/null || true
            else
                iptables_remove
            fi
            echo "ray-mesh firewall: removed ($b)." >&2
            ;;
        status)
            b="$(backend)"
            if [[ "$b" == nft ]]; then
                nft list table inet "$TABLE" 2>/dev/null || echo "ray-mesh firewall: not loaded." >&2
            else
                iptables -w -S "$CHAIN" 2>/dev/null || echo "ray-mesh firewall: not loaded." >&2
            fi
            ;;
        -h | --help | help) sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//' ;;
        *) die "unknown action '$action': use print (default), apply, remove, status or peers." ;;
    esac
}

main "$@"
