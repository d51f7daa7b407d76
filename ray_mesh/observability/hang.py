"""Hangs explained: a per-rank watchdog that names the dim, the collective, the ranks that did
not arrive and their Python stacks, within ``hang_timeout_s`` (Ray-free, torch only).

Why this shape:

* **Arrival without hooks.** torch counts the collectives issued on every process group
  (its per-group sequence number, also what NCCL's flight recorder labels entries with), so
  the watchdog sees every collective on a mesh dim's group, FSDP's and tensor parallel's
  included, without wrapping anything. The training path pays nothing; the watchdog thread
  reads the counters once per ``poll_s``.
* **A shared record on the rendezvous store.** Each watchdog publishes a small heartbeat
  (its counter per dim) to a client of the job's own TCPStore (``MASTER_ADDR:MASTER_PORT``,
  public ``torch.distributed.TCPStore``); every value read back is bounded and parsed
  strictly (:mod:`ray_mesh.observability.hang_store`: the store has no authentication, so a
  malformed value is refused and warned about, never adopted). When a rank's count on a
  dim has not moved for ``hang_timeout_s`` while a peer in that group is behind, the peer
  has not arrived: the first rank to notice asks every rank for a snapshot (counters and
  Python stacks from ``sys._current_frames``, taken by each rank's watchdog thread), waits
  a bounded time, then writes one report (:mod:`ray_mesh.observability.hang_report`) and prints it.
* **Ending the run with torch's own tool.** A blocked gloo call cannot be interrupted
  (``ProcessGroup.abort`` does not wake it; upstream: torch-gloo-abort-no-wake), so the
  watched groups' process-group timeout is set to ``hang_timeout_s + END_GRACE_S``: the
  waiting ranks' collectives then raise (gloo) or are aborted by NCCL's watchdog, and the
  exception is replaced by :class:`CollectiveHangError` carrying the report
  (:meth:`HangWatch.explain`, called by MeshConfig's train-thread context and by
  ``owner.watch_mesh``). With ``FailureConfig(max_failures=k)`` Ray Train retries the run as
  for any worker error. On NCCL also set ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (flight recorder)
  and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` for torch's own per-collective dump.

Collectives issued through :func:`watched` / :func:`all_reduce` also carry their op name and
start time; for the rest the op is read from the blocked thread's stack. Limits: the pp dim
is judged only by :func:`watched` collectives (pipeline stages issue different numbers of
point-to-point ops by design); on gloo a rank counts as waiting only while one of its
threads is inside ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import ray_mesh.private_apis as private_apis
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
from ray_mesh.errors import CollectiveHangError
from ray_mesh.observability import active
from ray_mesh.observability.hang_report import P2P_DIM, format_report
from ray_mesh.observability.hang_store import HangStore, connect_reader, connect_store

logger = logging.getLogger(__name__)

END_GRACE_S = 15.0  # process-group timeout = hang_timeout_s + this: time to gather the report
SNAPSHOT_WAIT_S = 5.0  # how long the reporter waits for the other ranks' snapshots


def _group_seq(group: dist.ProcessGroup) -> int | None:
    """torch's count of collectives issued on ``group`` (``private_apis``), or None."""
    return private_apis.group_sequence_number(group)


def mesh_groups(mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
    """{label: group} for every real group of the mesh, and the world group as 'world'.

    Dims that share one group (twins, or a dim spanning the world) get one label, the first
    name in DIM_NAMES + FLATTENED_DIMS order, with the others after an '='.
    """
    by_name: dict[str, list[Any]] = {}
    for dim in (*DIM_NAMES, *FLATTENED_DIMS):
        try:
            group = mesh.get_group(dim)
        except Exception:  # noqa: BLE001 - a flattened dim this mesh lacks
            continue
        if dist.get_world_size(group) < 2 or _group_seq(group) is None:
            continue
        by_name.setdefault(group.group_name, [[], group])[0].append(dim)
    world = dist.group.WORLD
    if world is not None and dist.get_world_size() > 1:
        by_name.setdefault(world.group_name, [[], world])[0].append("world")
    return {"=".join(dims): group for dims, group in by_name.values()}


def _frames(frame: Any) -> list[dict[str, Any]]:
    return [{"file": f.filename, "line": f.lineno, "func": f.name, "code": f.line or ""}
            for f in traceback.extract_stack(frame)]


class _Watched:
    """``with watch.watched(dim, op):`` -- a class, not a generator: a few hundred ns."""

    __slots__ = ("watch", "dim", "op")

    def __init__(self, watch: HangWatch, dim: str, op: str) -> None:
        self.watch, self.dim, self.op = watch, dim, op

    def __enter__(self) -> None:
        self.watch._pending = {"dim": self.dim, "op": self.op, "since": time.time()}

    def __exit__(self, *exc: object) -> bool:
        self.watch._pending = None
        return False


class HangWatch:
    """The watchdog of one rank; see the module docstring."""

    def __init__(self, groups: dict[str, dist.ProcessGroup], store: dist.Store, *, rank: int,
                 world_size: int, timeout_s: float, poll_s: float | None = None,
                 reader: Any = None, end_s: float | None = None) -> None:
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0 (or None to turn the watch off), "
                             f"got {timeout_s!r}.")
        self.groups = groups
        self.members = {d: dist.get_process_group_ranks(g) for d, g in groups.items()}
        self._backend = {d: str(dist.get_backend(g)) for d, g in groups.items()}
        # dim name -> (label, group), so the training path does no lookups of its own.
        self.by_dim = {name: (label, g) for label, g in groups.items()
                       for name in label.split("=")}
        self.store = store
        self.wire = HangStore(store, rank, world_size, reader)  # reader: length first
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.poll_s = poll_s or min(1.0, self.timeout_s / 10)
        # the watched groups' process-group timeout, as the report states it
        self.end_s = end_s or self.timeout_s + END_GRACE_S
        self.report: str | None = None
        self.report_ready = threading.Event()
        self.hang_seen = threading.Event()
        self._pending: dict[str, Any] | None = None
        self._seq: dict[str, int] = {}
        self._changed: dict[str, float] = {}
        self._last_peer_check = 0.0
        self._snapshot_sent = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray_mesh-hang-watch",
                                        daemon=True)

    # ------------------------------------------------------------------ training side
    def watched(self, dim: str, op: str) -> _Watched:
        """Mark a collective the caller issues on ``dim`` (names the op in a report)."""
        return _Watched(self, self.label_of(dim), op)

    def label_of(self, dim: str) -> str:
        hit = self.by_dim.get(dim)
        return hit[0] if hit else dim

    def explain(self, exc: BaseException | None, wait_s: float = END_GRACE_S
                ) -> CollectiveHangError | None:
        """The hang error to raise instead of ``exc`` when this rank saw a hang."""
        if exc is None or isinstance(exc, CollectiveHangError):
            return None
        if not self.report_ready.is_set() and not self.hang_seen.is_set():
            return None
        if self.report_ready.wait(wait_s) and self.report:
            return CollectiveHangError(self.report)
        return None

    # ------------------------------------------------------------------ watchdog side
    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5 * self.poll_s + 1)
        if self.wire.reader is not None:
            self.wire.reader.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the watch must never break training
                if self._stop.is_set() or not dist.is_initialized():
                    return
                logger.warning("ray_mesh hang watch on rank %d stopped: %s: %s", self.rank,
                               type(exc).__name__, exc)
                return

    def _tick(self) -> None:
        now = time.monotonic()
        for label, group in self.groups.items():
            seq = _group_seq(group) or 0
            if self._seq.get(label) != seq:
                self._seq[label], self._changed[label] = seq, now
        self.wire.publish_beat(self._seq)
        if self.report_ready.is_set():
            return
        report = self.wire.report()  # None if absent or malformed (warned once)
        if report is not None:
            self._take_report(report)
            return
        if self.wire.request() is not None:
            self.hang_seen.set()
            if not self._snapshot_sent:
                self.wire.send_snapshot(self.snapshot())
                self._snapshot_sent = True
            return
        stalled = self._stalled_dim(now)
        if stalled:
            self.hang_seen.set()
            if self.wire.claim():
                self._write_report(stalled)

    def _stalled_dim(self, now: float) -> str | None:
        pending = self._pending
        if pending and time.time() - pending["since"] > self.timeout_s:
            return pending["dim"]
        old = [d for d in self.groups if self._seq.get(d) and P2P_DIM not in d.split("=")
               and now - self._changed[d] > self.timeout_s]
        if not old or now - self._last_peer_check < 5 * self.poll_s:
            return None
        self._last_peer_check = now
        for dim in old:
            peers = [r for r in self.members[dim] if r != self.rank]
            beats = self.wire.beats(peers).values()
            if any(b is None or b["seq"].get(dim, 0) < self._seq[dim] for b in beats) and (
                    self._backend[dim] != "gloo" or self._blocked_in_torch()):
                return dim
        return None

    def _blocked_in_torch(self) -> bool:
        """A thread of this process is inside torch.distributed (gloo blocks the caller).

        Guards against counts that differ by design (a point-to-point op on the world group
        between two ranks only) while nothing waits. NCCL returns before the collective
        runs, so there the counts alone decide.
        """
        mine = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident != mine and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
                return True
        return False

    def snapshot(self) -> dict[str, Any]:
        """This rank's counters, groups, pending collective and Python stacks."""
        now = time.monotonic()
        names = {t.ident: t.name for t in threading.enumerate()}
        threads = [{"name": names.get(ident, str(ident)), "frames": _frames(frame)}
                   for ident, frame in sys._current_frames().items()
                   if ident != threading.get_ident()]
        stalled = {d: now - t for d, t in self._changed.items()}
        pending = self._pending
        if pending:  # exact start time, not the poll that saw the counter move
            stalled[pending["dim"]] = time.time() - pending["since"]
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "seq": dict(self._seq), "groups": self.members, "stalled_s": stalled,
                "pending": pending, "threads": threads}

    def _write_report(self, dim: str) -> None:
        self.wire.send_request(dim)
        self.wire.send_snapshot(self.snapshot())
        self._snapshot_sent = True
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        keys = [f"snap/{r}" for r in range(self.world_size)]
        while time.monotonic() < deadline and not all(self.store.check([k]) for k in keys):
            time.sleep(0.1)
        ranks = range(self.world_size)
        snaps, malformed = self.wire.snapshots(ranks)
        beats = {r: b for r, b in self.wire.beats(ranks).items() if b is not None}
        report = format_report(snaps, beats, self.world_size, self.timeout_s, self.end_s,
                               malformed=malformed)
        self.wire.send_report(dim, report)
        print(report, file=sys.stderr, flush=True)
        self._take_report(report)

    def _take_report(self, report: str) -> None:
        self.report = report
        self.hang_seen.set()
        self.report_ready.set()


# ----------------------------------------------------------------------------- starting one
def start_watch(mesh: DeviceMesh, timeout_s: float, *, pg_timeout_s: float | None = None,
                poll_s: float | None = None, store: dist.Store | None = None) -> HangWatch:
    """Start a watchdog on ``mesh``'s groups and bound their collectives; the caller stops it.

    Every watched group's process-group timeout becomes ``timeout_s + END_GRACE_S`` (or
    ``pg_timeout_s`` if smaller), so that a hung collective ends after the report. Its owner
    in a run is :class:`ray_mesh.observability.owner.Observability` (which
    :func:`watched` and :func:`all_reduce` find through ``observability.active``); under
    torchrun, ``owner.watch_mesh``.
    """
    groups = mesh_groups(mesh)
    end = timeout_s + END_GRACE_S
    if pg_timeout_s:
        end = min(end, pg_timeout_s)
    for group in groups.values():
        group.set_timeout(timedelta(seconds=end))
    reader = None
    if store is None:  # the job's own store: its values are read length first
        store, reader = connect_store(), connect_reader()
    return HangWatch(groups, store, rank=dist.get_rank(), world_size=dist.get_world_size(),
                     timeout_s=timeout_s, poll_s=poll_s, reader=reader, end_s=end).start()


def current() -> HangWatch | None:
    """The running owner's watch (see ``observability.active``), or None."""
    return active.watch()


def watched(dim: str, op: str) -> contextlib.AbstractContextManager:
    """Name a collective you issue on ``dim`` for the hang report (no-op without a watch)."""
    watch = active.watch()
    return watch.watched(dim, op) if watch is not None else contextlib.nullcontext()


def all_reduce(tensor: torch.Tensor, dim: str, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """``dist.all_reduce`` on the mesh dim ``dim``, named in a hang report."""
    watch = active.watch()
    hit = watch.by_dim.get(dim) if watch is not None else None
    if hit is None:  # no watch, or a dim of size 1
        from ray_mesh.core.bootstrap import get_mesh

        dist.all_reduce(tensor, op=op, group=get_mesh().get_group(dim))
        return tensor
    with _Watched(watch, hit[0], "all_reduce"):
        dist.all_reduce(tensor, op=op, group=hit[1])
    return tensor
