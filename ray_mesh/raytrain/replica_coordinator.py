"""The coordinator actor of a run of replica groups: its quorum and its cross-group store.

One per run, on the driver's node (:func:`ray_mesh.raytrain.replica_groups.fit_replica_groups`
starts it before any group and ends it after the last): it outlives every group, so the
run's membership, sample books and fallback checkpoint survive any group's failure. Every
method is a thin call into :class:`~ray_mesh.replicas.quorum.Quorum` (Ray-free, tested
alone); a ``GroupDropped`` travels back as a plain value, raised in the caller's process.
:class:`~ray_mesh.raytrain.attempt_watch.AttemptWatch` tells it, from each group's Ray Train
controller, that an attempt ended. The actor's process imports neither torch nor Ray Train
(~2.5 s of CPU it would spend before the first group could arrive).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from ray_mesh.errors import GroupDropped
from ray_mesh.replicas.quorum import Decision, Quorum, Range

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=256)
class Coordinator:
    """The quorum and the cross-group store of one run (see the module docstring)."""

    def __init__(self, segment_samples: int, total_steps: int, dead_after_s: float,
                 arrive_timeout_s: float, expected_groups: int, run: str,
                 shares: str = "equal", niceness: int | None = 0) -> None:
        from ray.util.metrics import Gauge

        from ray_mesh.core.priority import current_niceness, set_niceness
        from ray_mesh.replicas.link_store import serve_store

        # Every group waits on this actor at each step and sends it heartbeats: at Ray's
        # worker niceness (15) beside busy processes it answers late and the quorum drops
        # live groups as silent. It runs at the training workers' niceness (MeshConfig's
        # worker_niceness), where it is allowed to (root or CAP_SYS_NICE; the workers'
        # bring-up already warns when it is not).
        if niceness is not None and current_niceness() > niceness:
            set_niceness(niceness)

        self.quorum = Quorum(segment_samples=segment_samples, total_steps=total_steps,
                             dead_after_s=dead_after_s, arrive_timeout_s=arrive_timeout_s,
                             expected_groups=expected_groups, shares=shares)
        # On this node's address only, with the key the groups sign their rendezvous with.
        self.store, self.address = serve_store(ray.util.get_node_ip_address())
        # Exported by Ray's metrics agent as ray_ray_mesh_replica_groups_live{run=...}.
        self.run = run
        self.live = Gauge("ray_mesh_replica_groups_live", description="replica groups alive "
                          "and taking part in the run", tag_keys=("run",))
        self.layouts: dict[int, str] = {}

    def store_address(self) -> tuple[str, int, str]:
        return self.address

    def register(self, gid: int, incarnation: str, ranks: int, layout: str = "") -> None:
        self.layouts[gid] = layout
        self.quorum.register(gid, incarnation, ranks)

    def beat(self, gid: int, incarnation: str, rank: int) -> int | None:
        return self.quorum.beat(gid, incarnation, rank)

    def arrive(self, gid: int, incarnation: str, step: int, holding: list[Range],
               fresh_link: bool, busy_s: float | None = None, fixed_s: float | None = None,
               wait_s: float | None = None) -> Decision | str | None:
        try:
            return self.quorum.arrive(gid, incarnation, step, holding, fresh_link,
                                      busy_s=busy_s, fixed_s=fixed_s, wait_s=wait_s)
        except GroupDropped as exc:  # a plain value: the caller raises it in its own process
            return str(exc)

    def await_decision(self, gid: int, incarnation: str, wait_s: float) -> Decision | str | None:
        try:
            return self.quorum.await_decision(gid, incarnation, wait_s)
        except GroupDropped as exc:
            return str(exc)

    def checkpoint_started(self, step: int) -> None:
        self.quorum.checkpoint_started(step)

    def checkpointed(self, step: int, path: str) -> None:
        self.quorum.checkpointed(step, path)

    def checkpoint_failed(self, gid: int, step: int, error: str) -> None:
        self.quorum.checkpoint_failed(gid, step, error)

    def failed(self, gid: int, error: str, rank: int = 0, incarnation: str | None = None
               ) -> None:
        self.quorum.failed(gid, error, rank, incarnation)

    def attempt_ended(self, gid: int, why: str) -> None:
        self.quorum.attempt_ended(gid, why)

    def status(self) -> dict[str, Any]:
        status = self.quorum.status()
        status["layouts"] = dict(self.layouts)
        self.live.set(len(status["live"]), tags={"run": self.run})
        return status
