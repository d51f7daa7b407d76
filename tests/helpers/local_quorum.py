"""A run's ``Quorum`` served to replica groups without Ray, for tests under torchrun.

Each group is its own torchrun world (a helper script); this process serves the quorum
through a ``multiprocessing`` manager (the ``Coordinator`` protocol of
``ray_mesh.replicas.coordinator``, as the Ray coordinator actor serves it) and the TCP
store the cross-group links meet on. ``tests/dist/test_lm_groups.py`` uses it;
``tests/dist/test_replica_layouts.py`` uses its :class:`LocalCoordinator`.
"""

from __future__ import annotations

import threading
from multiprocessing.managers import BaseManager
from typing import Any

from ray_mesh.replicas.quorum import Quorum

AUTHKEY = b"local-quorum"


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


class LocalQuorum:
    """A :class:`Quorum` and a TCP store for the groups, served until this process ends
    (``port``: where the groups' managers connect, with :data:`AUTHKEY`)."""

    def __init__(self, *, steps: int, expected_groups: int, segment_samples: int = 8,
                 dead_after_s: float = 10.0, **quorum_kwargs: Any) -> None:
        from ray_mesh.replicas.link_store import serve_store

        self.store, address = serve_store("127.0.0.1")  # as the Ray coordinator serves it
        self.quorum = Quorum(segment_samples=segment_samples, total_steps=steps,
                             dead_after_s=dead_after_s, arrive_timeout_s=60.0,
                             expected_groups=expected_groups, start_timeout_s=60.0,
                             **quorum_kwargs)
        self.coordinator = LocalCoordinator(self.quorum, address)

        class Manager(BaseManager):
            pass

        Manager.register("coordinator", callable=lambda: self.coordinator)
        self.server = Manager(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()
        self.port = self.server.address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def connect(port: int) -> Any:
    """In a group's process: the served coordinator (a manager proxy)."""

    class Manager(BaseManager):
        pass

    Manager.register("coordinator")
    manager = Manager(address=("127.0.0.1", port), authkey=AUTHKEY)
    manager.connect()
    return manager.coordinator()


__all__ = ["AUTHKEY", "LocalCoordinator", "LocalQuorum", "connect"]
