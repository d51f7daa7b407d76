"""Heavy tests one at a time, and a record that proves it.

The heavy kinds (``dist``, ``netns``, ``ray``) start Ray clusters, virtual clusters and
torchrun jobs that each take the whole 2-core machine; two at once time out in gloo and
dashboards. The suite runs them in one process, in order (``tests/helpers/streams.py``), and
this module holds that from outside any plugin:

* every heavy test holds one machine-wide lock (``fcntl.flock`` on :data:`LOCK_PATH`) from its
  setup to its teardown (a session fixture's start and stop included: pytest runs them in the
  first and last test's setup and teardown), so a second process (``-n 2``, a second suite
  started by hand) waits instead of overlapping; the wait is bounded (:data:`WAIT_S`), after
  which the test runs anyway and the overlap is recorded;
* each heavy test appends its start and end to a journal (:data:`JOURNAL_ENV` names it for
  every process of the run), and :func:`overlaps` finds any two that overlapped: the run fails
  naming them (``tests/conftest.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# RAY_MESH_HEAVY_LOCK / RAY_MESH_HEAVY_WAIT_S: another lock file and bound, for the test of
# this machinery (tests/unit/test_suite_streams.py) only.
LOCK_PATH = Path(os.environ.get("RAY_MESH_HEAVY_LOCK")
                 or Path(tempfile.gettempdir()) / "ray_mesh_heavy_tests.lock")
JOURNAL_ENV = "RAY_MESH_HEAVY_JOURNAL"
# longer than any one heavy test (the suite's per-test timeout is 600 s)
WAIT_S = float(os.environ.get("RAY_MESH_HEAVY_WAIT_S", "900"))
POLL_S = 0.5


def holder(lock: Path = LOCK_PATH) -> str:
    """Who holds the lock now, as its holder wrote it (for the waiting message)."""
    try:
        return lock.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextmanager
def alone(nodeid: str, journal: Path | None, wait_s: float = WAIT_S, say=print,
          lock: Path = LOCK_PATH) -> Iterator[None]:
    """Hold the heavy-test lock around one test and journal its start and end."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    waited_since = time.monotonic()
    told = False
    locked = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                waited = time.monotonic() - waited_since
                if waited >= wait_s:
                    say(f"\n{nodeid}: the heavy-test lock {lock} is still held after "
                        f"{waited:.0f} s by {holder(lock)}; running anyway, and the run will fail "
                        "naming the overlap. Stop the other test session, or run one at a time.")
                    break
                if not told and waited >= 5:
                    say(f"\n{nodeid}: waiting for {holder(lock)} to finish (heavy tests run one at "
                        f"a time; lock {lock}, at most {wait_s:.0f} s)")
                    told = True
                time.sleep(POLL_S)
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {nodeid}".encode(), 0)
        start = time.time()
        try:
            yield
        finally:
            if journal is not None:
                record(journal, nodeid, start, time.time())
    finally:
        if locked:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def record(journal: Path, nodeid: str, start: float, end: float) -> None:
    """One line per heavy test; O_APPEND keeps lines of several processes whole."""
    line = json.dumps({"pid": os.getpid(), "nodeid": nodeid, "start": start, "end": end})
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read(journal: Path) -> list[dict]:
    """The journal's entries (a missing journal: none)."""
    try:
        text = journal.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def overlaps(entries: list[dict]) -> list[tuple[dict, dict]]:
    """Every pair of entries whose [start, end] intervals overlap, earliest start first."""
    found = []
    ordered = sorted(entries, key=lambda e: e["start"])
    for i, first in enumerate(ordered):
        for second in ordered[i + 1:]:
            if second["start"] >= first["end"]:
                break
            found.append((first, second))
    return found


def describe(pairs: list[tuple[dict, dict]]) -> str:
    """The overlapping pairs, one line each, for the failure message."""
    return "\n".join(
        f"  {a['nodeid']} (pid {a['pid']}, {a['start']:.1f}-{a['end']:.1f}) and "
        f"{b['nodeid']} (pid {b['pid']}, {b['start']:.1f}-{b['end']:.1f})"
        for a, b in pairs)
