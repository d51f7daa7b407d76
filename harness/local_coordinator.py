"""A run's ``Quorum`` behind the ``Coordinator`` protocol in the caller's own process, without
Ray (``ray_mesh.replicas.coordinator``; the Ray coordinator actor serves the same calls).

Used where replica groups run without Ray: the torchrun tests serve it to their groups
(``tests/helpers/local_quorum.py``), and the lab job's reference run
(:mod:`harness.lab_reference`) trains one group on it in one process.
"""

from __future__ import annotations

from ray_mesh.replicas.quorum import Quorum


class LocalCoordinator:
    """The ``Coordinator`` protocol over a local :class:`Quorum`."""

    def __init__(self, quorum: Quorum, store_address: tuple[str, int, str]) -> None:
        self.quorum, self.address = quorum, store_address
        self.layouts: dict[int, str] = {}

    def register(self, gid, incarnation, ranks, layout=""):
        self.layouts[gid] = layout
        self.quorum.register(gid, incarnation, ranks)

    def beat(self, gid, incarnation, rank):
        return self.quorum.beat(gid, incarnation, rank)

    def arrive(self, gid, incarnation, step, holding, fresh_link, busy_s=None, fixed_s=None,
               wait_s=None):
        return self.quorum.arrive(gid, incarnation, step, holding, fresh_link, busy_s=busy_s,
                                  fixed_s=fixed_s, wait_s=wait_s)

    def await_decision(self, gid, incarnation, wait_s):
        return self.quorum.await_decision(gid, incarnation, wait_s)

    def checkpoint_started(self, step):
        self.quorum.checkpoint_started(step)

    def checkpointed(self, step, path):
        self.quorum.checkpointed(step, path)

    def checkpoint_failed(self, gid, step, error):
        self.quorum.checkpoint_failed(gid, step, error)

    def failed(self, gid, error, rank=0, incarnation=None):
        self.quorum.failed(gid, error, rank, incarnation)

    def store_address(self):
        return self.address


__all__ = ["LocalCoordinator"]
