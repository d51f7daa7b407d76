"""The end of a replica group's attempt, told to the run's coordinator from its Ray Train
controller (a ``ray.train.UserCallback``), apart from the coordinator actor so that its
process does not import Ray Train."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.train import UserCallback

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


__all__ = ["AttemptWatch"]
