"""Slow and foreign clients cannot fail a real peer at the gate (issue "Security, round 2", 3).

Real sockets on loopback, no mocks. Distinct source addresses come from 127.0.0.0/8, all of
which is local on Linux: a client bound to 127.0.0.2 is a "stranger" to a listener that
serves only 127.0.0.1. A crowd of clients that trickle a byte every 0.5 s and never send
the nonce holds the gate; the real probe must still be served before the nonce deadline,
and the crowd must be closed by it (an absolute deadline, not one per read).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import pytest

from ray_mesh.network import gate as gate_mod
from ray_mesh.network import probe
from ray_mesh.network.gate import NONCE_TIMEOUT_S, GatedListener, new_nonce, read_line
from ray_mesh.network.probe import (
    MAX_CLIENTS,
    Target,
    close_listeners,
    open_listeners,
    probe_peers,
)
from ray_mesh.network.report import NodeTarget, PreflightReport, find_problems
from ray_mesh.raytrain.preflight import Outcome, run_preflight

ME, STRANGER = "127.0.0.1", "127.0.0.2"
TICK = 0.2  # the gate's loop tick: how late a deadline may be acted on
SLACK = 1.0  # scheduling on a busy 2-core machine


class Crowd:
    """``n`` clients from ``source`` that send one byte every ``every_s`` seconds and never a
    whole line; with ``persistent``, each one closed is replaced on the next beat. Records
    how long each connection lived (connect to seen closed) and whether any got an answer.
    """

    def __init__(self, port: int, n: int, source: str = ME, every_s: float = 0.5,
                 persistent: bool = False) -> None:
        self.port, self.n, self.source, self.every_s = port, n, source, every_s
        self.persistent = persistent
        self.open: dict[socket.socket, float] = {}
        self.lifetimes: list[float] = []
        self.answered = 0
        self.connects = 0
        self._stop = threading.Event()
        for _ in range(n):
            self._connect()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _connect(self) -> None:
        s = socket.socket()
        s.settimeout(1.0)
        t0 = time.monotonic()
        try:
            s.bind((self.source, 0))
            s.connect((ME, self.port))
        except ConnectionResetError:  # turned away before connect() even returned
            self.lifetimes.append(time.monotonic() - t0)
            s.close()
            return
        except OSError:
            s.close()
            return
        s.setblocking(False)
        self.connects += 1
        self.open[s] = time.monotonic()

    def _closed(self, s: socket.socket) -> None:
        t0 = self.open.pop(s, None)
        if t0 is not None:
            self.lifetimes.append(time.monotonic() - t0)
        s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            beat = time.monotonic() + self.every_s
            while self.open and (left := beat - time.monotonic()) > 0:
                readable, _, _ = select.select(list(self.open), [], [], left)
                for s in readable:
                    try:
                        data = s.recv(64)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    self.answered += bool(data)
                    self._closed(s)
            if not self.open:
                time.sleep(max(0.0, beat - time.monotonic()))
            for s in list(self.open):
                try:
                    s.send(b"a")  # one byte of a line that never ends
                except OSError:
                    self._closed(s)
            while self.persistent and len(self.open) < self.n and not self._stop.is_set():
                self._connect()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        for s in list(self.open):
            s.close()


def _closed_within(s: socket.socket, timeout: float) -> float | None:
    """Seconds until the peer closed ``s`` (FIN or reset) with nothing sent; None if not."""
    t0 = time.monotonic()
    s.settimeout(timeout)
    try:
        data = s.recv(64)
    except (ConnectionResetError, BrokenPipeError):
        data = b""
    except TimeoutError:
        return None
    return time.monotonic() - t0 if data == b"" else None


def test_read_line_deadline_is_absolute_not_per_read():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            b.send(b"x")

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            read_line(a, 1000, deadline=start + 0.5)
        # A byte every 0.1 s never trips a per-read timeout; the deadline still ends it.
        assert time.monotonic() - start < 0.5 + SLACK
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()


def test_trickling_crowd_holds_no_slot_and_is_closed_at_the_nonce_deadline():
    """40 clients (> MAX_CLIENTS) from the listener's own, allowed, address trickle bytes:
    the real probe is served before any of them expires, and each is closed by the deadline."""
    nonce = new_nonce()
    facts = open_listeners(0, ME, "lo", None, 20.0, nonce)
    assert facts.port, facts
    crowd = Crowd(facts.port, 40)
    try:
        assert crowd.connects == 40 > MAX_CLIENTS
        time.sleep(1.0)  # the crowd has been trickling: every slot would be held by now
        t0 = time.monotonic()
        res = probe_peers(ME, [Target(1, ME, facts.port)], 3.0, nonce)[1]
        took = time.monotonic() - t0
        assert res.ok, res
        # Served without waiting for any of the crowd to expire (none has yet).
        assert took < NONCE_TIMEOUT_S - 1.0, took
        wait_until = time.monotonic() + NONCE_TIMEOUT_S + SLACK
        while crowd.open and time.monotonic() < wait_until:
            time.sleep(0.1)
        assert len(crowd.lifetimes) == 40 and crowd.answered == 0, crowd.lifetimes
        # An absolute deadline from accept: trickling a byte every 0.5 s does not stretch it.
        assert max(crowd.lifetimes) < NONCE_TIMEOUT_S + TICK + SLACK, crowd.lifetimes
    finally:
        crowd.close()
        stats = close_listeners(facts.token)
    assert stats.served == 1 and stats.expired == 40, stats


def test_strangers_are_closed_at_once_even_with_the_nonce():
    """Connections from an address that is not allowed are closed right after accept, before
    they read a byte, take a slot or a thread, even when they send the right nonce."""
    nonce = new_nonce()
    handled = threading.Event()
    gate = GatedListener(ME, 0, nonce, lambda c: (handled.set(), c.sendall(b"hi")),
                         lifetime_s=30, max_clients=2, allowed_peers=[ME])
    baseline = threading.active_count()
    strangers = []
    try:
        closed: list[float | None] = []
        for _ in range(40):
            s = socket.socket()
            s.bind((STRANGER, 0))
            s.settimeout(2)
            try:
                s.connect((ME, gate.port))
            except ConnectionResetError:  # turned away before connect() even returned
                closed.append(0.0)
                s.close()
                continue
            strangers.append(s)
        for s in strangers:
            with contextlib.suppress(OSError):  # it may be reset already
                s.sendall(nonce.encode() + b"\n")
        closed += [_closed_within(s, NONCE_TIMEOUT_S + 2) for s in strangers]
        assert all(c is not None for c in closed), closed
        # Well under the nonce deadline: they were not read, only accepted and closed.
        assert max(closed) < NONCE_TIMEOUT_S / 4, closed
        assert threading.active_count() <= baseline
        assert not handled.is_set()
        with socket.create_connection((ME, gate.port), timeout=5) as s:
            s.sendall(nonce.encode() + b"\n")
            assert s.recv(8) == b"hi"
    finally:
        for s in strangers:
            s.close()
        gate.close()
    st = gate.stats()
    assert (st.dropped, st.served, st.refused, st.expired) == (40, 1, 0, 0), st
    assert st.sources == [STRANGER]


def test_admit_widens_the_allowed_sources_and_checks_them():
    nonce = new_nonce()
    gate = GatedListener(ME, 0, nonce, lambda c: c.sendall(b"hi"), lifetime_s=30,
                         max_clients=2, allowed_peers=())  # its own address only
    try:
        def ask(source: str) -> bytes:
            with socket.socket() as s:
                s.settimeout(5)
                s.bind((source, 0))
                try:  # a reset may come before connect() even returns
                    s.connect((ME, gate.port))
                    s.sendall(nonce.encode() + b"\n")
                    return s.recv(8)
                except (ConnectionResetError, BrokenPipeError):
                    return b""

        assert ask(ME) == b"hi"
        assert ask(STRANGER) == b""
        gate.admit([f"::ffff:{STRANGER}"])  # IPv4-mapped spelling of the same address
        assert ask(STRANGER) == b"hi" and ask(ME) == b"hi"
        with pytest.raises(ValueError, match="not the single string"):
            gate.admit(STRANGER)
        with pytest.raises(ValueError, match="IP addresses"):
            gate.admit(["node-1.tailnet"])
    finally:
        gate.close()
    assert gate.stats().dropped == 1


def test_pending_cap_evicts_the_oldest_and_the_real_client_still_gets_in():
    nonce = new_nonce()
    gate = GatedListener(ME, 0, nonce, lambda c: c.sendall(b"hi"), lifetime_s=30,
                         max_clients=1, allowed_peers=[ME], max_pending=4)
    crowd = Crowd(gate.port, 12)
    try:
        time.sleep(0.3)
        with socket.create_connection((ME, gate.port), timeout=NONCE_TIMEOUT_S) as s:
            s.sendall(nonce.encode() + b"\n")
            assert s.recv(8) == b"hi"
    finally:
        crowd.close()
        gate.close()
    st = gate.stats()
    assert st.served == 1 and st.evicted >= 12 - 4, st


def test_more_real_peers_at_once_than_pending_slots_are_read_not_evicted():
    """A large cluster's rendezvous port: every node connects at once and sends the nonce at
    once. With more of them than pending slots, the oldest's nonce is already there when the
    next one is accepted: it is read and served, not evicted (the gate evicted it before:
    105 connects failed in a 128-node simulation of the pre-flight)."""
    nonce = new_nonce()
    gate = GatedListener(ME, 0, nonce, lambda c: c.sendall(b"hi"), lifetime_s=30,
                         max_clients=2, allowed_peers=[ME], max_pending=4)
    peers = []
    try:
        # Hold the accept thread at its next tick (it takes this lock every loop), so that
        # all 40 are queued, nonces sent, when it wakes and accepts them in one go.
        with gate._lock:
            time.sleep(3 * gate_mod._TICK_S)
            for _ in range(40):
                s = socket.create_connection((ME, gate.port), timeout=NONCE_TIMEOUT_S + 3)
                s.sendall(nonce.encode() + b"\n")
                peers.append(s)
        answers = [s.recv(8) for s in peers]
    finally:
        for s in peers:
            s.close()
        gate.close()
    assert answers == [b"hi"] * 40
    st = gate.stats()
    assert st.served == 40 and st.evicted == 0 and st.turned_away == 0, st


def test_a_session_is_cut_at_its_deadline_and_frees_its_slot():
    nonce = new_nonce()

    def hog(conn: socket.socket) -> None:  # an authenticated client that never finishes
        conn.settimeout(None)
        if conn.recv(1):
            conn.sendall(b"hi")

    gate = GatedListener(ME, 0, nonce, hog, lifetime_s=30, max_clients=1,
                         allowed_peers=[ME], session_s=0.5)
    try:
        with socket.create_connection((ME, gate.port), timeout=5) as s:
            s.sendall(nonce.encode() + b"\n")
            took = _closed_within(s, 5)
            assert took is not None and took < 0.5 + TICK + SLACK, took
        with socket.create_connection((ME, gate.port), timeout=5) as s:  # the slot is free
            s.sendall(nonce.encode() + b"\nx")
            assert s.recv(8) == b"hi"
    finally:
        gate.close()


class CrowdedExecutor:
    """run_preflight's executor on threads, which points a crowd at every listener as soon
    as it opens: tricklers from the nodes' own address and strangers from another one,
    replaced as they are closed, for the whole pre-flight."""

    def __init__(self) -> None:
        import concurrent.futures as cf

        self.cf = cf
        self.pool = cf.ThreadPoolExecutor(8)
        self.crowds: list[Crowd] = []

    def submit(self, node, fn, *args):
        def run():
            value = fn(*args)
            if fn is open_listeners:
                ports = [value.port] + ([args[3]] if args[3] and not value.rendezvous_error
                                        else [])
                for port in ports:
                    self.crowds.append(Crowd(port, 24, ME, persistent=True))
                    self.crowds.append(Crowd(port, 24, STRANGER, persistent=True))
            return value
        return self.pool.submit(run)

    def wait(self, handles, timeout_s):
        done, _ = self.cf.wait(handles, timeout=max(timeout_s, 0))
        return [Outcome("timeout") if h not in done else
                Outcome("error", repr(h.exception())) if h.exception() else
                Outcome("ok", h.result()) for h in handles]


def test_real_preflight_passes_within_its_bound_through_a_crowd():
    with socket.socket() as s:
        s.bind((ME, 0))
        rdv = s.getsockname()[1]
    executor = CrowdedExecutor()
    nodes = [NodeTarget(ME, "lo"), NodeTarget(ME, "auto")]
    try:
        report = run_preflight(executor, nodes, rendezvous_port=rdv, timeout_s=10)
    finally:
        for crowd in executor.crowds:
            crowd.close()
    assert len(executor.crowds) == 6  # node 0's two listeners, node 1's one; two crowds each
    assert report.ok, report.format()
    assert report.elapsed_s < 10 + 1
    for res in [*report.matrix.values(), *report.rendezvous.values()]:
        assert res.ok and res.ms < (NONCE_TIMEOUT_S - 1.0) * 1000, res  # no wait for a slot
    assert sum(c.answered for c in executor.crowds) == 0
    for i in (0, 1):
        g = report.gates[i]
        assert g.dropped >= 24 and STRANGER in g.sources, g
        assert g.expired + g.evicted >= 24, g
    assert "listeners:  turned away" in report.format()


def test_a_failed_probe_names_the_turned_away_clients_not_the_link():
    nonce = new_nonce()
    facts = open_listeners(0, ME, "lo", None, 10.0, nonce)
    try:
        # A peer whose source address the listener was not told about (NAT, say).
        res = probe_peers(STRANGER, [Target(0, ME, facts.port)], 2.0, nonce)[0]
    finally:
        stats = close_listeners(facts.token)
    assert not res.ok
    assert "turned this client away" in res.error and STRANGER in res.error, res.error
    assert "packets dropped" not in res.error
    assert stats.dropped == probe.CONNECT_TRIES and stats.sources == [STRANGER], stats
    facts.index = 1
    report = PreflightReport([NodeTarget(ME, "lo"), NodeTarget(ME, "lo")],
                             [facts, facts], matrix={(0, 1): res}, gates={1: stats})
    lines = find_problems(report, [])
    assert len(lines) == 2, lines
    assert f"node 1 ({ME}" in lines[1] and "turned away 3 connection(s)" in lines[1]
    assert "rather than the link's" in lines[1] and STRANGER in lines[1]


def test_a_listener_that_accepts_but_never_answers_is_not_called_a_dropped_link():
    with socket.socket() as srv:  # the kernel completes handshakes; nobody ever accepts
        srv.bind((ME, 0))
        srv.listen(8)
        res = probe_peers(ME, [Target(1, ME, srv.getsockname()[1])], 1.0, new_nonce())[1]
    assert not res.ok and "connected, but no greeting" in res.error, res.error
    assert "not a dropped link" in res.error
    assert res.ms < (1.0 + SLACK) * 1000  # the probe's bound is absolute


def test_gate_stats_describe_and_add():
    a = gate_mod.GateStats(served=1, dropped=2, sources=["10.0.0.9"])
    b = gate_mod.GateStats(expired=3, sources=["10.0.0.9", "10.0.0.8"])
    s = a + b
    assert (s.served, s.turned_away, s.sources) == (1, 5, ["10.0.0.9", "10.0.0.8"])
    text = s.describe()
    assert "2 from addresses that are not the run's nodes" in text
    assert f"3 that sent no nonce within {NONCE_TIMEOUT_S:.0f} s" in text
    assert gate_mod.GateStats(served=4).describe() == ""
