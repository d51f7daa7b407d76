"""The suite's two streams: the unit tests in a child process beside the heavy kinds.

The heavy kinds (``dist``, ``netns``, ``ray``) share state across tests of one process (the
local Ray of ``tests/ray``, the virtual clusters of ``tests/netns/conftest.py``) and must run
one at a time, in order; they use about one core on average, in bursts. The unit tests are
independent CPU work. So a whole-suite run (``python -m pytest``: no paths, ``-k`` or ``-m``)
runs the heavy kinds itself, one after another, and the unit tests in one child
``python -m pytest tests/unit`` started at collection. The child writes each report as it is
made (pytest's public ``pytest_report_to_serializable``); the parent logs them into its own
session between its tests and at the end (``pytest_report_from_serializable``,
``pytest_runtest_logreport``: how pytest-xdist replays its workers), so one console, one
closing line and one exit code count both streams. A unit test the child never reported (it
crashed or hung past :data:`WAIT_S`) fails by name.

This replaces pytest-xdist's ``--dist loadgroup``, which groups nothing under pytest 9.2
(xdist 3.8 marks a group by rewriting ``item._nodeid``; pytest 9.2 reads the node id from
elsewhere), so the heavy kinds ran two at a time. Nothing here depends on a plugin.
``RAY_MESH_UNIT_STREAM=0`` runs everything in the one process (unit tests first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

STREAM_ENV = "RAY_MESH_UNIT_STREAM"  # "0": no child; in the child: the reports file
WAIT_S = 1800.0  # the unit stream's bound after the heavy kinds are done
# The unit tests take the CPU the heavy kinds leave: those wait on bring-ups and timeouts
# between bursts, and their bursts are what must not be slowed.
NICE = 10


class UnitStream:
    """The parent's handle on the child that runs the unit tests."""

    def __init__(self, config: pytest.Config, items: list[pytest.Item], unit_dir: Path,
                 folder: Path):
        self.config = config
        self.items = {item.nodeid: item for item in items}
        folder.mkdir(parents=True, exist_ok=True)
        self.reports = folder / "reports.jsonl"
        self.log = folder / "console.log"
        self.reports.write_text("")
        self._offset = 0
        self._open: set[str] = set()
        self.finished: set[str] = set()
        cmd = [sys.executable, "-m", "pytest", str(unit_dir), "-p", "no:cacheprovider",
               "--basetemp", str(folder / "tmp"), "-q", "--durations=0"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=config.rootpath, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, STREAM_ENV: str(self.reports)},
                preexec_fn=lambda: os.nice(NICE))

    def drain(self) -> None:
        """Log into this session every report the child wrote since the last call."""
        with open(self.reports, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only: the child may be mid-write
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self._log(json.loads(line))

    def _log(self, data: dict) -> None:
        if isinstance(data.get("longrepr"), list):  # a skip's (path, line, reason): JSON
            data["longrepr"] = tuple(data["longrepr"])  # made the tuple a list
        hook = self.config.hook
        report = hook.pytest_report_from_serializable(config=self.config, data=data)
        if report is None or not isinstance(report, pytest.TestReport):
            return
        if report.nodeid not in self._open:
            self._open.add(report.nodeid)
            hook.pytest_runtest_logstart(nodeid=report.nodeid, location=report.location)
        hook.pytest_runtest_logreport(report=report)
        if report.when == "teardown":
            self._open.discard(report.nodeid)
            self.finished.add(report.nodeid)
            hook.pytest_runtest_logfinish(nodeid=report.nodeid, location=report.location)

    def finish(self, say=print) -> None:
        """Wait for the child (bounded), log the rest, and fail what it never reported."""
        if self.proc.poll() is None:
            say(f"\nthe unit stream (pid {self.proc.pid}) is still running; waiting for it "
                f"(at most {WAIT_S:.0f} s; its console: {self.log})")
        deadline = time.monotonic() + WAIT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.5)
        why = None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            why = f"the unit stream was still running after {WAIT_S:.0f} s and was stopped"
        elif self.proc.returncode not in (0, 1):
            why = f"the unit stream ended with exit code {self.proc.returncode}"
        self.drain()
        for nodeid, item in self.items.items():
            if nodeid in self.finished:
                continue
            reason = why or "the unit stream ended without reporting it"
            self._fail(item, f"{nodeid} did not run to its end in the unit stream: {reason}. "
                             f"Its console: {self.log}")

    def stop(self) -> None:
        """End the child now (the parent's run was interrupted)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _fail(self, item: pytest.Item, message: str) -> None:
        log_failure(self.config, item.nodeid, item.location, message,
                    started=item.nodeid in self._open)


def log_failure(config: pytest.Config, nodeid: str, location: tuple, message: str,
                started: bool = False) -> None:
    """Log a failed test this process did not run (a unit test the child never reported,
    the heavy tests' overlap check) into the session, as its own tests are logged."""
    hook = config.hook
    if not started:
        hook.pytest_runtest_logstart(nodeid=nodeid, location=location)
    hook.pytest_runtest_logreport(report=pytest.TestReport(
        nodeid=nodeid, location=location, keywords={}, outcome="failed", longrepr=message,
        when="call"))
    hook.pytest_runtest_logfinish(nodeid=nodeid, location=location)


class ReportWriter:
    """In the child: a plugin that appends each report to the file the parent reads."""

    def __init__(self, config: pytest.Config, path: str):
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")
