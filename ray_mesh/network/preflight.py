"""Bounded pre-flight checks before the first process group: fail in seconds, not hang.

A process group over the wrong interface or through a firewall does not fail: NCCL and gloo
wait for their timeout (30 min by default). So before ``init_process_group`` ray_mesh asks
one process per node to:

1. choose its interface (the same rule as the planner) and open a short-lived TCP listener
   on the chosen address (rank 0's node also on the rendezvous port, MASTER_PORT), which
   proves the address is really on that node;
2. connect from its chosen address to every other node's listener and to rank 0's
   rendezvous port (a node x node matrix), each connect with a short timeout, all at once;
3. report its torch, NCCL, Ray and Python versions, compared across nodes.

The whole thing runs under one deadline (default 20 s). A node that does not answer by then
(its link is down, say) is reported by name like any other failure, and everything that
failed ends up in one :class:`PreflightError` naming node, interface, peer and fix.

The worker-side functions are plain Python (no Ray import). The orchestration calls them
through an *executor*: any ``submit(node_index, fn, *args) -> handle`` plus
``wait(handles, timeout_s) -> [Outcome]``; :class:`RayRefExecutor` adapts Ray object refs,
whether they come from a Ray Train worker group or from ``ray-mesh doctor``'s node agents.
"""

from __future__ import annotations

import errno
import logging
import platform
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

from ray_mesh.network.interfaces import (
    Choice,
    NetworkError,
    choose_interface,
    host_port,
    local_interfaces,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 20.0
GREETING = b"ray_mesh-preflight\n"
VERSION_KEYS = ("torch", "nccl", "ray", "python")


class PreflightError(NetworkError):
    """The nodes cannot form a process group; the message lists every failure and its fix."""


# ============================================================================ worker side
def node_versions() -> dict[str, str]:
    """torch, NCCL (GPU builds), Ray and Python versions of this process's environment."""
    out = {"python": platform.python_version()}
    for dist in ("torch", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        import torch

        out["torch"] = torch.__version__
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "")
    except Exception:  # noqa: BLE001 - a broken torch is reported as a version, not a crash
        out.setdefault("nccl", "")
    return out


class _Listener:
    """Accepts connections on one address:port until stopped or its lifetime ends."""

    def __init__(self, address: str, port: int, lifetime_s: float) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        # The rendezvous port is taken over by torch's TCPStore right after the pre-flight.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, port))
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.deadline = time.monotonic() + lifetime_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"ray_mesh-preflight-{self.port}")
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()
        self.sock.close()

    @staticmethod
    def _greet(conn: socket.socket) -> None:
        # Send the greeting, then wait for the client to close first, so TIME_WAIT stays on
        # the client side and the rendezvous port is free to bind again at once.
        with conn:
            conn.settimeout(3.0)
            try:
                conn.sendall(GREETING)
                conn.recv(16)
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped.set()


_listeners: dict[str, list[_Listener]] = {}
_listeners_lock = threading.Lock()


def open_listeners(
    node_ip: str,
    interface: str,
    rendezvous_port: int | None,
    lifetime_s: float,
) -> dict[str, Any]:
    """Step 1 on one node: choose the interface, listen on its address, report facts.

    Returns a dict with ``hostname``, ``interfaces``, ``versions``, ``choice`` (or
    ``choice_error``), ``port`` (or ``bind_error``), ``rendezvous_error`` and a ``token``
    for :func:`close_listeners`. Never raises: every problem is data for the report.
    """
    out: dict[str, Any] = {"hostname": socket.gethostname(), "node_ip": node_ip,
                           "interfaces": local_interfaces(), "versions": node_versions(),
                           "token": uuid.uuid4().hex}
    try:
        choice = choose_interface(node_ip, interface, out["interfaces"])
    except NetworkError as exc:
        out["choice_error"] = str(exc)
        return out
    out["choice"] = {"interface": choice.interface, "address": choice.address,
                     "family": choice.family, "reason": choice.reason}
    opened: list[_Listener] = []
    try:
        main = _Listener(choice.address, 0, lifetime_s)
        opened.append(main)
        out["port"] = main.port
    except OSError as exc:
        out["bind_error"] = f"cannot listen on {choice.address} ({choice.interface}): {exc}"
    if rendezvous_port:
        try:
            opened.append(_Listener(choice.address, rendezvous_port, lifetime_s))
        except OSError as exc:
            out["rendezvous_error"] = (f"cannot listen on the rendezvous port "
                                       f"{host_port(choice.address, rendezvous_port)}: {exc}")
    with _listeners_lock:
        _listeners[out["token"]] = opened
    return out


def close_listeners(token: str) -> None:
    """Step 3: stop this node's listeners (they also stop on their own at their deadline)."""
    with _listeners_lock:
        opened = _listeners.pop(token, [])
    for listener in opened:
        listener.stop()
    for listener in opened:
        listener.thread.join(timeout=1.0)


def _connect_once(source: str, address: str, port: int, timeout_s: float) -> dict[str, Any]:
    start = time.monotonic()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    result: dict[str, Any] = {"ok": False}
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            if source:
                s.bind((source, 0))  # leave from the chosen address, as NCCL will
            s.connect((address, port))
            data = b""
            while not data.endswith(b"\n") and len(data) < 64:
                chunk = s.recv(64)
                if not chunk:
                    break
                data += chunk
            if data != GREETING:
                result["error"] = (f"something else answers on {host_port(address, port)} "
                                   f"(not the pre-flight listener)")
            else:
                result["ok"] = True
    except TimeoutError:
        result["error"] = (f"timed out after {timeout_s:.1f} s (packets dropped: link down, "
                           f"firewall, or the wrong interface)")
    except ConnectionRefusedError:
        result["error"] = "connection refused (a firewall rejects the port, or nothing listens)"
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            result["error"] = f"no route to host ({exc.strerror})"
        elif exc.errno == errno.EADDRNOTAVAIL:
            result["error"] = f"source address {source} is not on this node ({exc.strerror})"
        else:
            result["error"] = f"{type(exc).__name__}: {exc}"
    result["ms"] = round((time.monotonic() - start) * 1000, 1)
    return result


def probe_peers(source: str, targets: Sequence[tuple[str, str, int]],
                timeout_s: float) -> dict[str, dict[str, Any]]:
    """Step 2 on one node: connect to every ``(name, address, port)`` target at once."""
    results: dict[str, dict[str, Any]] = {}
    threads = []
    for name, address, port in targets:
        def run(name=name, address=address, port=port) -> None:
            results[name] = _connect_once(source, address, port, timeout_s)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout_s + 2.0)
    for name, _, _ in targets:
        results.setdefault(name, {"ok": False, "error": "probe thread did not finish"})
    return results


# ============================================================================ orchestration
@dataclass(frozen=True)
class Outcome:
    """What one remote call gave back: a value, an error, or nothing before the deadline."""

    status: str  # "ok", "error" or "timeout"
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Executor(Protocol):
    def submit(self, node: int, fn: Callable[..., Any], *args: Any) -> Any: ...

    def wait(self, handles: Sequence[Any], timeout_s: float) -> list[Outcome]: ...


class RayRefExecutor:
    """Runs the pre-flight through anything that turns (node, fn, args) into a Ray ref."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def submit(self, node: int, fn: Callable[..., Any], *args: Any) -> Any:
        return self._call(node, fn, *args)

    def wait(self, handles: Sequence[Any], timeout_s: float) -> list[Outcome]:
        import ray

        deadline = time.monotonic() + max(timeout_s, 0.0)
        pending = list(handles)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=remaining)
        outcomes = []
        for ref in handles:
            if ref in pending:
                outcomes.append(Outcome("timeout"))
                continue
            try:
                outcomes.append(Outcome("ok", ray.get(ref, timeout=1.0)))
            except Exception as exc:  # noqa: BLE001 - any remote failure is a finding
                outcomes.append(Outcome("error", f"{type(exc).__name__}: {exc}"))
        return outcomes


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
    """Everything the pre-flight learned; :meth:`format` is what ``ray-mesh doctor`` prints."""

    nodes: list[NodeTarget]
    facts: list[dict[str, Any] | None]
    matrix: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    rendezvous: dict[int, dict[str, Any]] = field(default_factory=dict)
    rendezvous_port: int | None = None
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def ok(self) -> bool:
        return not self.problems

    def choice(self, i: int) -> dict[str, Any] | None:
        f = self.facts[i]
        return None if f is None else f.get("choice")

    def label(self, i: int) -> str:
        f = self.facts[i] or {}
        node = self.nodes[i]
        if not node.hostname and f.get("hostname"):
            node = NodeTarget(node.node_ip, node.interface, f["hostname"])
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
        for i in range(len(self.nodes)):
            f = self.facts[i]
            out.append(self.label(i))
            if f is None:
                out.append("    did not answer within the pre-flight bound")
                continue
            ifaces = ", ".join(f"{n} {' '.join(a) or '-'}"
                               for n, a in sorted(f["interfaces"].items()))
            out.append(f"    interfaces: {ifaces}")
            c = f.get("choice")
            if c:
                port = f" (pre-flight port {f['port']})" if f.get("port") else ""
                out.append(f"    chosen:     {c['interface']} -> {c['address']} "
                           f"[{c['reason']}]{port}")
            else:
                out.append(f"    chosen:     NONE: {f.get('choice_error')}")
            out.append("    versions:   " + ", ".join(
                f"{k} {f['versions'].get(k) or '-'}" for k in VERSION_KEYS))
        n = len(self.nodes)
        if n:
            out.append("")
            out.append("connectivity (row = from, column = to; ok / FAIL / ? not tried)")
            head = ["from\\to"] + [f"node {j}" for j in range(n)]
            if self.rendezvous_port:
                head.append(f"rank0:{self.rendezvous_port}")
            rows = [head]
            for i in range(n):
                row = [f"node {i}"]
                for j in range(n):
                    r = self.matrix.get((i, j))
                    row.append("-" if i == j else "?" if r is None else
                               "ok" if r["ok"] else "FAIL")
                if self.rendezvous_port:
                    r = self.rendezvous.get(i)
                    row.append("?" if r is None else "ok" if r["ok"] else "FAIL")
                rows.append(row)
            widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
            out += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))
                    for r in rows]
        out.append("")
        out.append(f"pre-flight {'passed' if self.ok else 'FAILED'} in {self.elapsed_s:.1f} s")
        out += [f"  - {p}" for p in self.problems]
        return "\n".join(out)


def run_preflight(
    executor: Executor,
    nodes: Sequence[NodeTarget],
    *,
    rendezvous_port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PreflightReport:
    """Run the checks on one process per node (node 0 = rank 0's node); never raises.

    Everything finishes within ``timeout_s`` plus a second of bookkeeping: each step waits
    only for the time left, and each connect gets a slice of it.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    n = len(nodes)
    report = PreflightReport(list(nodes), [None] * n, rendezvous_port=rendezvous_port,
                             timeout_s=timeout_s)

    def left() -> float:
        return deadline - time.monotonic()

    # 1. choose + listen + facts
    handles = [executor.submit(i, open_listeners, node.node_ip, node.interface,
                               rendezvous_port if i == 0 else None, timeout_s + 5.0)
               for i, node in enumerate(nodes)]
    first = executor.wait(handles, left() * 0.6)
    silent: list[int] = []
    for i, outcome in enumerate(first):
        if outcome.ok:
            report.facts[i] = outcome.value
        elif outcome.status == "timeout":
            silent.append(i)
        else:
            report.problems.append(f"{nodes[i].label(i)}: the pre-flight call failed: "
                                   f"{outcome.value}")
    # 2. the matrix: every node that listens, from every node that chose an interface
    listening = [i for i in range(n) if report.facts[i] and report.facts[i].get("port")]
    rdv_open = rendezvous_port and report.facts[0] and report.choice(0) and \
        not report.facts[0].get("rendezvous_error")
    connect_timeout = max(0.5, min(3.0, left() / 2 - 0.5))
    probes: list[tuple[int, Any]] = []
    for i in range(n):
        c = report.choice(i)
        if not c:
            continue
        targets = [(f"node{j}", report.choice(j)["address"], report.facts[j]["port"])
                   for j in listening if j != i]
        if rdv_open:
            targets.append(("rendezvous", report.choice(0)["address"], rendezvous_port))
        if targets:
            probes.append((i, executor.submit(i, probe_peers, c["address"], targets,
                                              connect_timeout)))
    second = executor.wait([h for _, h in probes], left())
    for (i, _), outcome in zip(probes, second, strict=True):
        if outcome.ok:
            for name, res in outcome.value.items():
                if name == "rendezvous":
                    report.rendezvous[i] = res
                else:
                    report.matrix[(i, int(name[4:]))] = res
        elif outcome.status == "timeout" and i not in silent:
            silent.append(i)
        elif outcome.status == "error":
            report.problems.append(f"{nodes[i].label(i)}: the connectivity probe failed: "
                                   f"{outcome.value}")
    # 3. close, and wait for it: torch's TCPStore binds the rendezvous port right after.
    # (Listeners on a node that does not answer end at their own deadline.)
    closing = [executor.submit(i, close_listeners, report.facts[i]["token"])
               for i in range(n) if report.facts[i]]
    executor.wait(closing, min(max(left(), 0.0) + 1.0, 3.0))
    report.elapsed_s = time.monotonic() - start
    report.problems += _problems(report, sorted(silent))
    return report


def _problems(report: PreflightReport, silent: list[int]) -> list[str]:
    """Turn the raw results into one line per failure, each naming node, peer and fix."""
    out: list[str] = []
    nodes = report.nodes
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
        if f.get("choice_error"):
            out.append(f"{report.label(i)}: {f['choice_error']}")
        if f.get("bind_error"):
            out.append(f"{report.label(i)}: {f['bind_error']}. The chosen address is not "
                       f"usable on this node: fix its interface, or pass interface=<name>.")
        if f.get("rendezvous_error"):
            out.append(f"{report.label(i)}: {f['rendezvous_error']}. Another process holds "
                       f"it; retry (a new port is picked each run).")
    for (i, j), res in sorted(report.matrix.items()):
        if not res["ok"]:
            ci, cj = report.choice(i), report.choice(j)
            out.append(
                f"{report.label(i)} cannot open TCP from {ci['interface']} ({ci['address']}) "
                f"to {report.label(j)} at {host_port(cj['address'], report.facts[j]['port'])} "
                f"on {cj['interface']}: {res['error']}. Fix: allow TCP between the nodes on "
                f"{cj['interface']} (firewall/ACLs: NCCL and gloo use random high ports), check "
                f"the link with `ping {cj['address']}` from {nodes[i].node_ip}, or choose "
                f"another interface with MeshConfig(interface=...)."
            )
    c0 = report.choice(0)
    for i, res in sorted(report.rendezvous.items()):
        if not res["ok"]:
            out.append(
                f"{report.label(i)} cannot reach rank 0's rendezvous port "
                f"{host_port(c0['address'], report.rendezvous_port)} (MASTER_ADDR:MASTER_PORT "
                f"on {report.label(0)}, {c0['interface']}): {res['error']}. Fix: open TCP "
                f"ports on {report.label(0)} to the other nodes (at least 1024-65535 on "
                f"{c0['interface']}), or choose another interface."
            )
    out += version_problems(report.facts, report.label)
    return out


def version_problems(facts: Sequence[Mapping[str, Any] | None],
                     label: Callable[[int], str]) -> list[str]:
    """One line per package whose version differs across nodes (rank 0's node is the ref)."""
    out = []
    present = [(i, f["versions"]) for i, f in enumerate(facts) if f and f.get("versions")]
    for key in VERSION_KEYS:
        seen: dict[str, list[int]] = {}
        for i, versions in present:
            seen.setdefault(str(versions.get(key, "")), []).append(i)
        if len(seen) > 1:
            parts = "; ".join(f"{v or 'none'} on {', '.join(label(i) for i in idx)}"
                              for v, idx in seen.items())
            pkg = {"nccl": "torch (NCCL ships with it)", "python": "Python"}.get(key, key)
            out.append(f"{key} versions differ across nodes: {parts}. Install the same {pkg} "
                       f"version on every node (e.g. one container image or a pinned "
                       f"requirements file), then restart Ray there.")
    return out


def check_worker_group(worker_group: Any, plan: Any, choices: Sequence[Choice],
                       rendezvous_port: int, timeout_s: float) -> PreflightReport:
    """The pre-flight on a Ray Train worker group (one worker per node); raises on failure.

    ``plan`` is the :class:`ray_mesh.core.topology.MeshPlan`; ``choices`` the per-rank interfaces
    the driver chose, passed by name so every node re-checks exactly that interface.
    """
    first_rank: dict[int, int] = {}
    for w in plan.workers:
        first_rank.setdefault(plan.node_rank(w.rank), w.rank)
    order = sorted(first_rank)
    nodes = [NodeTarget(plan.workers[first_rank[k]].node_ip, choices[first_rank[k]].interface,
                        plan.workers[first_rank[k]].hostname) for k in order]
    executor = RayRefExecutor(lambda i, fn, *args: worker_group.execute_single_async(
        first_rank[order[i]], fn, *args))
    report = run_preflight(executor, nodes, rendezvous_port=rendezvous_port,
                           timeout_s=timeout_s)
    logger.info("ray_mesh pre-flight:\n%s", report.format())
    report.raise_if_failed()
    return report


def choose_all(reports: Sequence[Any], requested: str) -> list[Choice]:
    """Choose every worker's interface on the driver; one error naming every failing node.

    ``reports`` are :class:`ray_mesh.core.topology.WorkerReport` (node_ip, interfaces, rank).
    """
    choices: list[Choice | None] = []
    failures: dict[str, str] = {}
    for r in reports:
        try:
            choices.append(choose_interface(r.node_ip, requested, r.interfaces))
        except NetworkError as exc:
            choices.append(None)
            who = r.hostname or f"rank {r.rank}"
            failures.setdefault(r.node_ip, f"node {r.node_ip} ({who}): {exc}")
    if failures:
        raise NetworkError(
            f"No usable interface on {len(failures)} of "
            f"{len({r.node_ip for r in reports})} node(s):\n  - "
            + "\n  - ".join(failures.values())
        )
    return choices  # type: ignore[return-value]


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "NodeTarget",
    "Outcome",
    "PreflightError",
    "PreflightReport",
    "RayRefExecutor",
    "check_worker_group",
    "choose_all",
    "close_listeners",
    "node_versions",
    "open_listeners",
    "probe_peers",
    "run_preflight",
    "version_problems",
]
