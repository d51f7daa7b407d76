"""A replica group's worker's view of the run's coordinator actor
(:class:`ray_mesh.raytrain.replica_groups.Coordinator`): the ``Coordinator`` protocol of
:mod:`ray_mesh.replicas.coordinator` over Ray actor calls, each one bounded."""

from __future__ import annotations

from typing import Any

import ray

from ray_mesh.errors import GroupDropped
from ray_mesh.replicas.coordinator import Decision, Range


class CoordinatorClient:
    """A worker's view of the coordinator actor (the ``Coordinator`` protocol of
    :mod:`ray_mesh.replicas.coordinator`); every call is bounded."""

    def __init__(self, handle: Any, timeout_s: float, arrive_s: float) -> None:
        # arrive_s: the quorum ends its own wait first (a TimeoutError after
        # arrive_timeout_s + dead_after_s + 30 s); this bound is for a coordinator that
        # stopped answering at all.
        self.handle, self.timeout_s, self.arrive_s = handle, timeout_s, arrive_s

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        return ray.get(ref, timeout=timeout_s or self.timeout_s)

    def register(self, gid: int, incarnation: str, ranks: int, layout: str = "") -> None:
        self._get(self.handle.register.remote(gid, incarnation, ranks, layout))

    def beat(self, gid: int, incarnation: str, rank: int) -> int | None:
        return self._get(self.handle.beat.remote(gid, incarnation, rank))

    def arrive(self, gid: int, incarnation: str, step: int, holding: list[Range],
               fresh_link: bool, busy_s: float | None = None, fixed_s: float | None = None,
               wait_s: float | None = None) -> Decision | None:
        return _dropped_or(self._get(self.handle.arrive.remote(
            gid, incarnation, step, holding, fresh_link, busy_s, fixed_s, wait_s),
            self.arrive_s if wait_s is None else wait_s + self.timeout_s))

    def await_decision(self, gid: int, incarnation: str, wait_s: float) -> Decision | None:
        return _dropped_or(self._get(self.handle.await_decision.remote(gid, incarnation, wait_s),
                                     wait_s + self.timeout_s))

    def checkpoint_started(self, step: int) -> None:
        self._get(self.handle.checkpoint_started.remote(step))

    def checkpointed(self, step: int, path: str) -> None:
        self._get(self.handle.checkpointed.remote(step, path))

    def checkpoint_failed(self, gid: int, step: int, error: str) -> None:
        self._get(self.handle.checkpoint_failed.remote(gid, step, error))

    def store_address(self) -> tuple[str, int, str]:
        return tuple(self._get(self.handle.store_address.remote()))


def _dropped_or(answer: Any) -> Any:
    if isinstance(answer, str):  # the coordinator's GroupDropped, as a plain value
        raise GroupDropped(answer)
    return answer
