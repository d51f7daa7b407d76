"""Bounded pre-flight before the first process group: fail in seconds, not hang.

The driver/controller side of the check. It fans the worker-side steps of
``ray_mesh.network.probe`` out to one process per node, one function per step:

1. :func:`listen_step`: every node chooses its interface, listens on it, reports facts;
2. :func:`admit_step`: every node's listeners learn the other nodes' chosen addresses,
   the only sources they serve (a connection from any other address is closed at once);
3. :func:`connect_step`: every node connects to its peers' listeners and to rank 0's
   rendezvous port: every other node up to ``FULL_MESH_NODES`` (16) nodes, past that a
   bounded set, about log2(n) + 3 per node (``ray_mesh.network.pairs``: the head both
   ways, the ring both ways, log2(n) partners, the layout's neighbours);
4. :func:`close_step`: every node stops its listeners (torch's TCPStore binds the
   rendezvous port right after) and reports what they turned away.

The whole thing runs under one deadline (default 20 s). A node that does not answer by
then (its link is down, say) is reported by name like any other failure, and everything
that failed ends up in one ``PreflightError`` (``ray_mesh.network.report``).

The steps call the nodes through an *executor*: any ``submit(node_index, fn, *args) ->
handle`` plus ``wait(handles, timeout_s) -> [Outcome]``. :class:`RayRefExecutor` adapts Ray
object refs, whether from a Ray Train worker group (:func:`check_worker_group`) or from
``ray-mesh doctor``'s node agents (``ray_mesh.raytrain.cluster``); tests use threads.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.core.topology import MeshPlan
from ray_mesh.network.gate import new_nonce
from ray_mesh.network.interfaces import Choice
from ray_mesh.network.pairs import Pair, check_pairs, layout_pairs
from ray_mesh.network.probe import (
    RENDEZVOUS,
    Target,
    admit_peers,
    close_listeners,
    open_listeners,
    probe_peers,
)
from ray_mesh.network.report import (
    DEFAULT_TIMEOUT_S,
    NodeTarget,
    PreflightReport,
    find_problems,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What one remote call gave back: a value, an error, or nothing before the deadline."""

    status: str  # "ok", "error" or "timeout"
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Executor(Protocol):
    """Runs a worker-side function on node ``node`` and waits, bounded, for the results."""

    def submit(self, node: int, fn: Callable[..., Any], *args: Any) -> Any: ...

    def wait(self, handles: Sequence[Any], timeout_s: float) -> list[Outcome]: ...


class RayRefExecutor:
    """Runs the pre-flight through anything that turns (node, fn, args) into a Ray ref."""

    def __init__(self, call: Callable[..., ray.ObjectRef]) -> None:
        self._call = call

    def submit(self, node: int, fn: Callable[..., Any], *args: Any) -> ray.ObjectRef:
        return self._call(node, fn, *args)

    def wait(self, handles: Sequence[ray.ObjectRef], timeout_s: float) -> list[Outcome]:
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


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def listen_step(executor: Executor, report: PreflightReport, deadline: float,
                nonce: str) -> list[int]:
    """Step 1: choose + listen + facts on every node; returns the nodes that did not answer.

    The listeners answer only clients that send ``nonce`` (the run's secret).
    """
    rdv = report.rendezvous_port
    handles = [executor.submit(i, open_listeners, i, node.node_ip, node.interface,
                               rdv if i == 0 else None, report.timeout_s + 5.0, nonce)
               for i, node in enumerate(report.nodes)]
    silent: list[int] = []
    for i, outcome in enumerate(executor.wait(handles, _left(deadline) * 0.6)):
        if outcome.ok:
            report.facts[i] = outcome.value
        elif outcome.status == "timeout":
            silent.append(i)
        else:
            report.problems.append(f"{report.nodes[i].label(i)}: the pre-flight call failed: "
                                   f"{outcome.value}")
    return silent


def admit_step(executor: Executor, report: PreflightReport, deadline: float,
               silent: list[int]) -> None:
    """Step 2: every listening node serves the nodes' chosen addresses, and only those.

    A node that does not answer in time is added to ``silent`` (its listeners serve only
    its own address, so the others' probes to it would fail anyway).
    """
    addresses = sorted({f.choice.address for f in report.facts
                        if f is not None and f.choice is not None})
    calls = [(i, executor.submit(i, admit_peers, f.token, addresses))
             for i, f in enumerate(report.facts) if f is not None and f.choice is not None]
    outcomes = executor.wait([h for _, h in calls], _left(deadline) * 0.3)
    for (i, _), outcome in zip(calls, outcomes, strict=True):
        if outcome.status == "timeout" and i not in silent:
            silent.append(i)
        elif outcome.status == "error":
            report.problems.append(f"{report.nodes[i].label(i)}: the pre-flight call failed: "
                                   f"{outcome.value}")


def _targets(report: PreflightReport, i: int, peers: Sequence[int]) -> list[Target]:
    """Where node ``i`` connects: its ``peers``' listeners (those listening), and rank 0's
    rendezvous port."""
    targets = []
    for j in peers:
        f = report.facts[j]
        if j != i and f is not None and f.choice is not None and f.port:
            targets.append(Target(j, f.choice.address, f.port))
    f0 = report.facts[0] if report.facts else None
    if report.rendezvous_port and f0 is not None and f0.choice is not None \
            and not f0.rendezvous_error:
        targets.append(Target(RENDEZVOUS, f0.choice.address, report.rendezvous_port))
    return targets


def connect_step(executor: Executor, report: PreflightReport, deadline: float,
                 silent: list[int], nonce: str) -> None:
    """Step 3: the pairs of ``report.pairs``, from every node that chose an interface to
    its peers' listeners, and every node to rank 0's rendezvous port.

    A node that does not answer is added to ``silent``.
    """
    connect_timeout = max(0.5, min(3.0, _left(deadline) / 2 - 0.5))
    peers: dict[int, list[int]] = {}
    for i, j in report.pairs:
        peers.setdefault(i, []).append(j)
    probes: list[tuple[int, Any]] = []
    for i in range(len(report.nodes)):
        choice = report.choice(i)
        targets = _targets(report, i, peers.get(i, [])) if choice else []
        if choice and targets:
            probes.append((i, executor.submit(i, probe_peers, choice.address, targets,
                                              connect_timeout, nonce)))
    outcomes = executor.wait([h for _, h in probes], _left(deadline))
    for (i, _), outcome in zip(probes, outcomes, strict=True):
        if outcome.ok:
            for j, res in outcome.value.items():
                if j == RENDEZVOUS:
                    report.rendezvous[i] = res
                else:
                    report.matrix[(i, j)] = res
        elif outcome.status == "timeout" and i not in silent:
            silent.append(i)
        elif outcome.status == "error":
            report.problems.append(f"{report.nodes[i].label(i)}: the connectivity probe "
                                   f"failed: {outcome.value}")


def close_step(executor: Executor, report: PreflightReport, deadline: float) -> None:
    """Step 4: close every node's listeners, and wait for it (a few seconds at most);
    what each node's listeners turned away goes to ``report.gates``.

    Listeners on a node that does not answer end at their own deadline.
    """
    closing = [(i, executor.submit(i, close_listeners, f.token))
               for i, f in enumerate(report.facts) if f is not None]
    outcomes = executor.wait([h for _, h in closing], min(max(_left(deadline), 0.0) + 1.0,
                                                          3.0))
    for (i, _), outcome in zip(closing, outcomes, strict=True):
        if outcome.ok and outcome.value is not None:
            report.gates[i] = outcome.value


def run_preflight(
    executor: Executor,
    nodes: Sequence[NodeTarget],
    *,
    rendezvous_port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pairs: Sequence[Pair] | None = None,
    layout: Sequence[Pair] = (),
) -> PreflightReport:
    """Run the checks on one process per node (node 0 = rank 0's node); never raises.

    Everything finishes within ``timeout_s`` plus a second of bookkeeping: each step waits
    only for the time left, and each connect gets a slice of it. ``pairs``: the ordered node
    pairs to connect (default :func:`~ray_mesh.network.pairs.check_pairs`: all of them up to
    16 nodes, a bounded set past that, with the ``layout`` pairs and this run's partners).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    if pairs is None:
        pairs = check_pairs(len(nodes), seed=secrets.randbits(32), layout=layout)
    report = PreflightReport(list(nodes), [None] * len(nodes), rendezvous_port=rendezvous_port,
                             timeout_s=timeout_s, pairs=list(pairs))
    # One secret per run, sent to the nodes through the executor (Ray's authenticated
    # calls): the listeners answer only this run's probes.
    nonce = new_nonce()
    silent = listen_step(executor, report, deadline, nonce)
    admit_step(executor, report, deadline, silent)
    connect_step(executor, report, deadline, silent, nonce)
    close_step(executor, report, deadline)
    report.elapsed_s = time.monotonic() - start
    report.problems += find_problems(report, sorted(silent))
    return report


def plan_pairs(plan: MeshPlan) -> set[Pair]:
    """The node pairs next to each other in a mesh dim's group of ``plan`` (checked past 16
    nodes too: :func:`ray_mesh.network.pairs.layout_pairs`)."""
    dims = [d for d in DIM_NAMES if getattr(plan.spec, d) > 1]
    index = {node: k for k, node in enumerate(plan.node_ids)}
    coords = [plan.spec.coordinate(w.rank) for w in plan.workers]
    return layout_pairs([index[w.node_id] for w in plan.workers],
                        [{d: c[d] for d in DIM_NAMES} for c in coords], dims)


class AsyncWorkerGroup(Protocol):
    """The part of Ray Train's worker group the pre-flight uses (V1 and V2 both have it)."""

    def execute_single_async(self, rank: int, fn: Callable[..., Any],
                             *args: Any) -> ray.ObjectRef: ...


def check_worker_group(worker_group: AsyncWorkerGroup, plan: MeshPlan,
                       choices: Sequence[Choice], rendezvous_port: int,
                       timeout_s: float) -> PreflightReport:
    """The pre-flight on a Ray Train worker group (one worker per node); raises on failure.

    ``choices`` are the per-rank interfaces the driver chose, passed by name so every node
    re-checks exactly that interface; each node's first rank runs its steps.
    """
    first_rank: dict[int, int] = {}
    for w in plan.workers:
        first_rank.setdefault(plan.node_rank(w.rank), w.rank)
    ranks = [first_rank[k] for k in sorted(first_rank)]
    nodes = [NodeTarget(plan.workers[r].node_ip, choices[r].interface,
                        plan.workers[r].hostname) for r in ranks]
    executor = RayRefExecutor(lambda i, fn, *args: worker_group.execute_single_async(
        ranks[i], fn, *args))
    report = run_preflight(executor, nodes, rendezvous_port=rendezvous_port,
                           timeout_s=timeout_s, layout=plan_pairs(plan))
    logger.info("ray_mesh pre-flight:\n%s", report.format())
    report.raise_if_failed()
    return report
