"""The end of a replica group's attempt, told to the run's coordinator from its Ray Train
controller (a ``ray.train.UserCallback``), apart from the coordinator actor so that its
process does not import Ray Train; and the controller's own account of it in one line."""

from __future__ import annotations

import logging
import re
from typing import Any

import ray
from ray.train import UserCallback

from ray_mesh.private_apis import TRAIN_FAILURE_LOGGER

logger = logging.getLogger(__name__)
TELL_TIMEOUT_S = 5.0  # the controller's wait for the coordinator to take the news


class AttemptWatch(UserCallback):
    """In group ``gid``'s Ray Train controller: when a poll of its workers finds errors (a
    worker raised, or its process or node died and its health check failed), the group's
    attempt is over, whatever Ray Train does next (a restart or the end of the run). The
    coordinator hears it at once: a killed process stops beating silently, and the other
    groups would otherwise wait at the boundary for ``dead_after_s`` or more before going
    on without it (a box that is switched off or cut off still takes that long)."""

    def __init__(self, coordinator: Any, gid: int) -> None:
        self.coordinator, self.gid = coordinator, gid

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]
                        ) -> None:
        _one_line_failures()  # before the failure policy logs this attempt's end
        rank, exc = min(worker_exceptions.items(), key=lambda kv: kv[0])
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [type(exc).__name__]
        why = lines[0] + "".join(f" {x}" for x in lines[1:] if "died because" in x)
        try:
            ray.get(self.coordinator.attempt_ended.remote(
                self.gid, f"its attempt ended (rank {rank}: {why[:240]})"),
                timeout=TELL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - its heartbeats stopping still says it
            logger.debug("ray_mesh: replica group %d: the coordinator did not take the end "
                         "of its attempt: %r", self.gid, err)


class _OneLine(logging.Filter):
    """The failure policy's record of a group's ended attempt as one line: its decision,
    the count and the error's first line (``[FailurePolicy] RETRY (worker group, failure 1
    of at most 20): A worker health check failed.``). The driver's console has the quorum's
    event line for the same end, with its step and reason; Ray Train's own record, the
    error's whole text twice and a traceback, is ~60 lines per closed laptop lid
    (upstream: ray-train-failure-policy-record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        lines = [x.strip() for x in record.getMessage().splitlines() if x.strip()]
        if len(lines) < 2 or not lines[0].startswith("[FailurePolicy]"):
            return True
        fields = dict(x.split(": ", 1) for x in lines[1:3] if ": " in x)
        count = re.match(r"(\d+) \(max allowed: (-?\d+)\)", fields.get("Error count", ""))
        snippet = [x for x in lines if not re.match(r"Error:|\[Rank \d+ Error Snippet\]:|"
                                                     r"Source:|Error count:|\[FailurePolicy\]",
                                                     x)]
        where = fields.get("Source", "?") + (f", failure {count[1]} of at most {count[2]}"
                                             if count else "")
        record.msg = f"{lines[0]} ({where}): {snippet[0] if snippet else '?'}"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _one_line_failures() -> None:
    """In this group's controller, once: the failure policy's records as one line each."""
    log = logging.getLogger(TRAIN_FAILURE_LOGGER)
    if not any(isinstance(f, _OneLine) for f in log.filters):
        log.addFilter(_OneLine())
