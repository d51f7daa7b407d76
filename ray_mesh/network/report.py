"""The pre-flight's findings as one report: a table for ``ray-mesh doctor`` and one
:class:`PreflightError` naming node, interface, peer and fix for each failure (no Ray).

A process group over the wrong interface or through a firewall does not fail: NCCL and
gloo wait for their timeout (30 min by default). So the pre-flight (run by
``ray_mesh.raytrain.preflight``, worker side in ``ray_mesh.network.probe``) collects facts
under one deadline, and this module turns them into the lines a person acts on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ray_mesh.core.table import text_table
from ray_mesh.errors import PreflightError
from ray_mesh.network.gate import GateStats
from ray_mesh.network.interfaces import Choice, host_port
from ray_mesh.network.pairs import FULL_MESH_NODES, Pair, isolated
from ray_mesh.network.probe import VERSION_KEYS, ConnectResult, NodeFacts

DEFAULT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class NodeTarget:
    """A node as the pre-flight sees it: rank order, Ray IP, the interface asked for."""

    node_ip: str
    interface: str = "auto"  # "auto" or a name (the backend passes its already-chosen one)
    hostname: str = ""

    def label(self, index: int) -> str:
        host = f", {self.hostname}" if self.hostname else ""
        return f"node {index} ({self.node_ip}{host})"


@dataclass
class PreflightReport:
    """Everything the pre-flight learned; :meth:`format` is what ``ray-mesh doctor`` prints.

    ``facts[i]`` is None for a node that did not answer step 1; ``matrix[(i, j)]`` is the
    connect from node i to node j; ``rendezvous[i]`` node i's connect to rank 0's port;
    ``gates[i]`` what node i's listeners served and turned away; ``pairs`` the ordered pairs
    the connect step tries (``ray_mesh.network.pairs``: every pair up to 16 nodes).
    """

    nodes: list[NodeTarget]
    facts: list[NodeFacts | None]
    matrix: dict[tuple[int, int], ConnectResult] = field(default_factory=dict)
    rendezvous: dict[int, ConnectResult] = field(default_factory=dict)
    gates: dict[int, GateStats] = field(default_factory=dict)
    rendezvous_port: int | None = None
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    timeout_s: float = DEFAULT_TIMEOUT_S
    pairs: list[Pair] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def choice(self, i: int) -> Choice | None:
        f = self.facts[i]
        return None if f is None else f.choice

    def label(self, i: int) -> str:
        f = self.facts[i]
        node = self.nodes[i]
        if not node.hostname and f is not None and f.hostname:
            node = replace(node, hostname=f.hostname)
        return node.label(i)

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PreflightError(self.error_message())

    def error_message(self) -> str:
        lines = [f"ray_mesh pre-flight failed after {self.elapsed_s:.1f} s (bound "
                 f"{self.timeout_s:.0f} s), before any process group was created; "
                 f"{len(self.problems)} problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        lines.append("Run `ray-mesh doctor --address <head>:6379` for the full interface "
                     "and connectivity table.")
        return "\n".join(lines)

    def format(self) -> str:
        """Per node: interfaces, chosen one, address, versions; then the matrix."""
        out = []
        for i, f in enumerate(self.facts):
            out.append(self.label(i))
            if f is None:
                out.append("    did not answer within the pre-flight bound")
                continue
            ifaces = ", ".join(f"{n} {' '.join(a) or '-'}" for n, a in sorted(f.interfaces.items()))
            out.append(f"    interfaces: {ifaces}")
            c = f.choice
            if c:
                port = f" (pre-flight port {f.port})" if f.port else ""
                out.append(f"    chosen:     {c.interface} -> {c.address} [{c.reason}]{port}")
            else:
                out.append(f"    chosen:     NONE: {f.choice_error}")
            out.append("    versions:   " + ", ".join(
                f"{k} {f.versions.get(k) or '-'}" for k in VERSION_KEYS))
            gate = self.gates.get(i)
            if gate is not None and gate.turned_away:
                out.append(f"    listeners:  {gate.describe()}")
        if len(self.nodes) > FULL_MESH_NODES:
            out += ["", f"connectivity: {len(self.matrix)} of {len(self.pairs)} pair(s) "
                        f"tried (a bounded set past {FULL_MESH_NODES} nodes); per node, "
                        f"connects that succeeded of those tried",
                    self._pairs_table()]
        elif self.nodes:
            out += ["", "connectivity (row = from, column = to; ok / FAIL / ? not tried)",
                    self._matrix_table()]
        out.append("")
        out.append(f"pre-flight {'passed' if self.ok else 'FAILED'} in {self.elapsed_s:.1f} s")
        out += [f"  - {p}" for p in self.problems]
        return "\n".join(out)

    def _matrix_table(self) -> str:
        n = len(self.nodes)
        rdv = f"rank0:{self.rendezvous_port}" if self.rendezvous_port else ""
        columns = ["from\\to", *(f"node {j}" for j in range(n)), *([rdv] if rdv else [])]
        rows = []
        for i in range(n):
            row = {"from\\to": f"node {i}"}
            for j in range(n):
                row[f"node {j}"] = "-" if i == j else _cell(self.matrix.get((i, j)))
            if rdv:
                row[rdv] = _cell(self.rendezvous.get(i))
            rows.append(row)
        return text_table(rows, columns)


    def _pairs_table(self) -> str:
        """One row per node: its connects out and in, ok of tried, and to rank 0's port
        (the node x node table has n² cells: 262,144 at 512 nodes)."""
        counts = {i: [0, 0, 0, 0] for i in range(len(self.nodes))}
        for (i, j), res in self.matrix.items():
            counts[i][0] += res.ok
            counts[i][1] += 1
            counts[j][2] += res.ok
            counts[j][3] += 1
        rdv = f"rank0:{self.rendezvous_port}" if self.rendezvous_port else ""
        rows = [{"node": f"node {i}", "out ok": f"{c[0]}/{c[1]}", "in ok": f"{c[2]}/{c[3]}",
                 **({rdv: _cell(self.rendezvous.get(i))} if rdv else {})}
                for i, c in counts.items()]
        return text_table(rows, ["node", "out ok", "in ok", *([rdv] if rdv else [])])


def _cell(result: ConnectResult | None) -> str:
    return "?" if result is None else "ok" if result.ok else "FAIL"


def find_problems(report: PreflightReport, silent: Sequence[int]) -> list[str]:
    """Turn the raw results into one line per failure, each naming node, peer and fix.

    ``silent`` are the nodes that did not answer a step within the bound.
    """
    out: list[str] = []
    for i in silent:
        out.append(
            f"{report.label(i)} did not answer within the {report.timeout_s:.0f} s pre-flight "
            f"bound: its link is probably down (Tailscale disconnected, machine asleep, cable), "
            f"or it is too overloaded to answer. "
            f"Check `tailscale status` and `ray status`; remove the node "
            f"(`ray stop` on it) or bring its link back, then retry."
        )
    for i, f in enumerate(report.facts):
        if f is None:
            continue
        if f.choice_error:
            out.append(f"{report.label(i)}: {f.choice_error}")
        if f.bind_error:
            out.append(f"{report.label(i)}: {f.bind_error}. The chosen address is not "
                       f"usable on this node: fix its interface, or pass interface=<name>.")
        if f.rendezvous_error:
            out.append(f"{report.label(i)}: {f.rendezvous_error}. Another process holds "
                       f"it; retry (a new port is picked each run).")
    out += _matrix_problems(report)
    out += _cut_off(report)
    out += _gate_problems(report)
    out += version_problems([f.versions if f else None for f in report.facts], report.label)
    return out


def _matrix_problems(report: PreflightReport) -> list[str]:
    out: list[str] = []
    for (i, j), res in sorted(report.matrix.items()):
        ci, cj, fj = report.choice(i), report.choice(j), report.facts[j]
        if res.ok or ci is None or cj is None or fj is None or fj.port is None:
            continue
        out.append(
            f"{report.label(i)} cannot open TCP from {ci.interface} ({ci.address}) "
            f"to {report.label(j)} at {host_port(cj.address, fj.port)} "
            f"on {cj.interface}: {res.error}. Fix: allow TCP between the nodes on "
            f"{cj.interface} (firewall/ACLs: NCCL and gloo use random high ports), check "
            f"the link with `ping {cj.address}` from {report.nodes[i].node_ip}, or choose "
            f"another interface with MeshConfig(interface=...)."
        )
    c0 = report.choice(0) if report.facts else None
    for i, res in sorted(report.rendezvous.items()):
        if res.ok or c0 is None or report.rendezvous_port is None:
            continue
        out.append(
            f"{report.label(i)} cannot reach rank 0's rendezvous port "
            f"{host_port(c0.address, report.rendezvous_port)} (MASTER_ADDR:MASTER_PORT "
            f"on {report.label(0)}, {c0.interface}): {res.error}. Fix: open TCP "
            f"ports on {report.label(0)} to the other nodes (at least 1024-65535 on "
            f"{c0.interface}), or choose another interface."
        )
    return out


def _cut_off(report: PreflightReport) -> list[str]:
    """Past :data:`FULL_MESH_NODES` nodes: a node none of whose connects out (or in)
    succeeded, named once (its own side is the likelier fault than that many peers)."""
    if len(report.nodes) <= FULL_MESH_NODES:
        return []
    results = {pair: res.ok for pair, res in report.matrix.items()}
    dead_out, dead_in = isolated(len(report.nodes), results, min_checks=3)
    tried = {i: [j for (a, j) in results if a == i] for i in dead_out}
    asked = {j: [i for (i, b) in results if b == j] for j in dead_in}
    return [f"{report.label(i)} reached none of the {len(tried[i])} nodes it tried: its "
            f"outbound traffic on its chosen interface is blocked (firewall, wrong interface "
            f"or route) rather than {len(tried[i])} separate links" for i in dead_out] + [
            f"{report.label(j)} was reached by none of the {len(asked[j])} nodes that tried: "
            f"its listener's port is blocked on its chosen interface (a firewall on the node)"
            f" rather than {len(asked[j])} separate links" for j in dead_in]


def _gate_problems(report: PreflightReport) -> list[str]:
    """When connects failed, the listeners that turned connections away: a crowd of
    strangers or of slow clients is a likelier cause than the link, and is named as such."""
    if all(r.ok for r in [*report.matrix.values(), *report.rendezvous.values()]):
        return []
    return [
        f"{report.label(i)}: its pre-flight listeners {g.describe()}. Something other "
        f"than this run's probes is connecting to the pre-flight's ports (a port scanner, a "
        f"misconfigured service, or an attack), so failed connects to this node may be its "
        f"doing rather than the link's. Find it with `ss -tnp` on the node or in the "
        f"firewall's log, and let only the nodes reach the node's chosen address; if a "
        f"listed address is one of your nodes, its traffic is rewritten on the way (NAT): "
        f"give the nodes addresses they reach each other on directly."
        for i, g in sorted(report.gates.items()) if g.turned_away]


def version_problems(versions: Sequence[Mapping[str, str] | None],
                     label: Callable[[int], str]) -> list[str]:
    """One line per package whose version differs across nodes (rank 0's node is the ref).

    ``versions[i]`` is node i's :func:`ray_mesh.network.probe.node_versions` (None: unknown).
    """
    out = []
    present = [(i, v) for i, v in enumerate(versions) if v]
    for key in VERSION_KEYS:
        seen: dict[str, list[int]] = {}
        for i, v in present:
            seen.setdefault(str(v.get(key, "")), []).append(i)
        if len(seen) > 1:
            parts = "; ".join(f"{v or 'none'} on {', '.join(label(i) for i in idx)}"
                              for v, idx in seen.items())
            pkg = {"nccl": "torch (NCCL ships with it)", "python": "Python"}.get(key, key)
            out.append(f"{key} versions differ across nodes: {parts}. Install the same {pkg} "
                       f"version on every node (e.g. one container image or a pinned "
                       f"requirements file), then restart Ray there.")
    return out
