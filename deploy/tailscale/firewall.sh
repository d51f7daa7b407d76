#!/usr/bin/env bash
# Only the tailnet may reach Ray's and torch's ports on this node.
#
#   deploy/tailscale/firewall.sh            # print the rules it would load; changes nothing
#   sudo deploy/tailscale/firewall.sh apply # load them (again: replaces, never duplicates)
#   sudo deploy/tailscale/firewall.sh remove
#   deploy/tailscale/firewall.sh status     # what is loaded now
#
# Why: Ray binds most of its servers to all interfaces and Ray 2.60 has no option to change
# that (GCS, raylet, core workers, the dashboard agent's gRPC and three Prometheus /metrics
# endpoints, the last without any token); during training rank 0's torch TCPStore listens
# on *:MASTER_PORT without authentication. Their ports are random, so the rule covers the
# whole unprivileged range: a new TCP connection to a port in RAY_MESH_FW_PORTS is refused
# (TCP reset) unless it arrives on lo, or on the tailnet interface from a tailnet address.
# Ports below 1024 (ssh) and connections this node opens itself are not touched.
#
# Environment:
#   RAY_MESH_FW_IFACE    the tailnet interface (tailscale0)
#   RAY_MESH_FW_PORTS    protected TCP port range (1024-65535)
#   RAY_MESH_FW_OPEN     ports that stay open to everyone, space-separated (e.g. "8888")
#   RAY_MESH_FW_V4       tailnet IPv4 range (100.64.0.0/10)
#   RAY_MESH_FW_V6       tailnet IPv6 range (fd7a:115c:a1e0::/48)
#   RAY_MESH_FW_BACKEND  nft, iptables or auto (nft if installed, else iptables)
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TABLE=ray_mesh  # nftables: table inet ray_mesh; iptables: chain RAY_MESH
CHAIN=RAY_MESH

iface="${RAY_MESH_FW_IFACE:-tailscale0}"
ports="${RAY_MESH_FW_PORTS:-1024-65535}"
open_ports="${RAY_MESH_FW_OPEN:-}"
v4="${RAY_MESH_FW_V4:-100.64.0.0/10}"
v6="${RAY_MESH_FW_V6:-fd7a:115c:a1e0::/48}"

check_inputs() {
    [[ "$iface" =~ ^[A-Za-z0-9_.-]{1,15}$ ]] \
        || die "RAY_MESH_FW_IFACE='$iface' is not an interface name (e.g. tailscale0)."
    [[ "$ports" =~ ^([0-9]+)-([0-9]+)$ ]] \
        || die "RAY_MESH_FW_PORTS='$ports' is not a range LOW-HIGH (e.g. 1024-65535)."
    local lo="${BASH_REMATCH[1]}" hi="${BASH_REMATCH[2]}"
    ((lo >= 1 && lo <= hi && hi <= 65535)) \
        || die "RAY_MESH_FW_PORTS='$ports': need 1 <= LOW <= HIGH <= 65535."
    local p
    for p in $open_ports; do
        if ! [[ "$p" =~ ^[0-9]+$ ]] || ((p < 1 || p > 65535)); then
            die "RAY_MESH_FW_OPEN='$open_ports': '$p' is not a port number (space-separated, e.g. \"8888 9090\")."
        fi
    done
    [[ "$v4" =~ ^[0-9.]+/[0-9]+$ ]] || die "RAY_MESH_FW_V4='$v4' is not an IPv4 CIDR (e.g. 100.64.0.0/10)."
    [[ "$v6" =~ ^[0-9A-Fa-f:]+/[0-9]+$ ]] || die "RAY_MESH_FW_V6='$v6' is not an IPv6 CIDR (e.g. fd7a:115c:a1e0::/48)."
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

# The whole table, loaded atomically by `nft -f`: the leading add+delete makes a second
# `apply` replace the first instead of adding to it.
nft_rules() {
    local open=""
    [[ -n "$open_ports" ]] && open="    tcp dport { ${open_ports// /, } } accept"
    cat <<EOF
add table inet $TABLE
delete table inet $TABLE
table inet $TABLE {
  chain input {
    type filter hook input priority filter - 1; policy accept;
    iifname "lo" accept
    iifname "$iface" ip saddr $v4 accept
    iifname "$iface" ip6 saddr $v6 accept
$open
    tcp dport $ports tcp flags & (fin | syn | rst | ack) == syn counter reject with tcp reset
  }
}
EOF
}

# One iptables/ip6tables command per line (printed, or run by `apply`).
iptables_rules() {
    local cmd src multi=""
    [[ -n "$open_ports" ]] && multi="${open_ports// /,}"
    for cmd in iptables ip6tables; do
        src="$v4"
        [[ "$cmd" == ip6tables ]] && src="$v6"
        echo "$cmd -w -N $CHAIN 2>/dev/null || true"
        echo "$cmd -w -F $CHAIN"
        echo "$cmd -w -A $CHAIN -i lo -j RETURN"
        echo "$cmd -w -A $CHAIN -i $iface -s $src -j RETURN"
        [[ -n "$multi" ]] && echo "$cmd -w -A $CHAIN -p tcp -m multiport --dports $multi -j RETURN"
        echo "$cmd -w -A $CHAIN -p tcp --syn --dport ${ports/-/:} -j REJECT --reject-with tcp-reset"
        echo "$cmd -w -C INPUT -j $CHAIN 2>/dev/null || $cmd -w -I INPUT 1 -j $CHAIN"
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

need_root() {
    [[ "$(id -u)" == 0 ]] || die "'$1' changes the firewall: run it as root (sudo $0 $1)."
}

main() {
    local action="${1:-print}" b
    check_inputs
    case "$action" in
        print)
            b="$(backend)"
            echo "# ray-mesh firewall ($b): only $iface from $v4 / $v6 (and lo) may open TCP ports $ports" >&2
            if [[ "$b" == nft ]]; then nft_rules; else iptables_rules; fi
            ;;
        apply)
            need_root apply
            b="$(backend)"
            if [[ "$b" == nft ]]; then
                nft_rules | nft -f -
            else
                iptables_rules | bash -euo pipefail
            fi
            echo "ray-mesh firewall: applied ($b): TCP $ports only from $iface ($v4, $v6) and lo." >&2
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
        -h | --help | help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' ;;
        *) die "unknown action '$action': use print (default), apply, remove or status." ;;
    esac
}

main "$@"
