"""A run's ``Quorum`` served to replica groups without Ray, for tests under torchrun.

Each group is its own torchrun world (a helper script); this process serves the quorum
through a ``multiprocessing`` manager (the ``Coordinator`` protocol of
``ray_mesh.replicas.coordinator``, as the Ray coordinator actor serves it) and the TCP
store the cross-group links meet on. ``tests/dist/test_lm_groups.py`` uses it;
``tests/dist/test_replica_layouts.py`` uses its :class:`LocalCoordinator`
(``harness/local_coordinator.py``, which the lab job's reference run uses too).
"""

from __future__ import annotations

import threading
from multiprocessing.managers import BaseManager
from typing import Any

from harness.local_coordinator import LocalCoordinator
from ray_mesh.replicas.quorum import Quorum

AUTHKEY = b"local-quorum"


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
