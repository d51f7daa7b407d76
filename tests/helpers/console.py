"""What a person reads: a console checker (tests/ray/test_console_examples.py).

A line is a problem when it carries a warning (``Warning``, ``WARNING``, torch's ``W1125 ...``
and ``[W1125 ...]`` log lines, Ray's C++ ``E``/``W`` log lines), a traceback, an ``Error``, a
metrics address on port -1, the wait sampler's "ProcessGroup name not set", ray_mesh's own
shutdown warning of groups "still referenced" or Ray Train's "Failed to query" (a Ray worker
prints a library's WARNING record without its level), unless an entry of :data:`EXPECTED`
(each with its reason) says it is expected. Ray's "[repeated 3x across cluster]" counts as 3
lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^\(\w+ pid=\d+(?:, ip=[^)]*)?\)\s?")
REPEATED = re.compile(r"\[repeated (\d+)x across cluster\]")
# torch's C++ log lines (``W1125 ...``, ``[W1125 ...] [c10d] ...``, with a rank prefix or
# not) and Ray's C++ ones at error or warning level (``[2026-11-27 13:33:28,424 E 15740
# 15781] core_worker.cc:...``): a person reads them as something gone wrong.
PROBLEM = re.compile(r"Warning|WARNING|^\[rank\d+\]:W\d{4} |^W\d{4} |^\[[WE]\d{4} |"
                     r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [EWF] \d+ \d+\]|Traceback|Error|"
                     r":-1/|port -1|ProcessGroup name not set|are still referenced|"
                     r"Failed to query")


@dataclass(frozen=True)
class Expected:
    pattern: str
    why: str


EXPECTED: tuple[Expected, ...] = (
    Expected(r"WARNING authentication_token_setup\.py:\d+ -- Token authentication is enabled",
             "Ray 2.60 says so at every start of a Ray whose RAY_AUTH_MODE is unset, token "
             "auth on by default, which ray_mesh keeps on by design (docs/security.md): a "
             "script's own ray.init() (python examples/driver.py). ray-mesh run's embedded "
             "start drops that one record (private_apis.quiet_default_auth_notice; "
             "tests/ray/test_main_job.py holds it)"),
    Expected(r"\(raylet\) WARNING: \d+ PYTHON worker processes have been started on node",
             "Ray's raylet notes that more Python workers start at once than the machine has "
             "cores (on 2 cores: 4 training workers plus Ray Data's read tasks); the size of "
             "the machine, not a fault of the job"),
    Expected(r"\(gcs_server\) gcs_actor_scheduler\.cc:\d+: Failed to kill actor [0-9a-f]+, "
             r"return status: Invalid: KillActor RPC failed for actor [0-9a-f]+: RpcError: "
             r"RPC error: Socket closed",
             "Ray 2.60's GCS, at the end of a run on a busy machine: it asks a worker to kill "
             "one of Ray Train's actors whose process has already exited (the socket is "
             "closed), and logs the failed request; the actor is gone either way. Seen once "
             "in a fresh-clone run of the suite (the diloco example, 2026-11-26)"),
)


def lines(out: str) -> list[str]:
    """The console's lines without colour and without Ray's per-process prefix."""
    return [PREFIX.sub("", ANSI.sub("", line)).rstrip() for line in out.splitlines()]


def count(line: str) -> int:
    m = REPEATED.search(line)
    return int(m.group(1)) if m else 1


def problems(out: str, expected: tuple[Expected, ...] = EXPECTED) -> list[str]:
    """Every problem line of ``out`` (see the module docstring), repeats spelled out."""
    found = []
    for line in lines(out):
        if not PROBLEM.search(line) or any(re.search(e.pattern, line) for e in expected):
            continue
        found += [line] * count(line)
    return found


def warnings_count(out: str) -> int:
    """Warning lines (expected ones included), Ray's repeats counted: the before/after figure."""
    return sum(count(line) for line in lines(out)
               if re.search(r"Warning|WARNING|^\[rank\d+\]:W\d{4} |^W\d{4} ", line))


__all__ = ["ANSI", "EXPECTED", "Expected", "lines", "problems", "warnings_count"]
