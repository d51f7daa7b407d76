"""A replica group beats from its registration on: what its start does after registering (a
bucket's client for the fallback checkpoint, the cross-group store's address) can take
seconds on a starved box, and a group silent that long counted as gone before it took a
step (seen beside two CPU hogs: the laptop's group dropped at step 0).

One group on a local quorum in this process (no Ray, no process group; a real TCP store),
whose coordinator answers ``store_address`` only after twice the quorum's bound, while
another group's beats drive the quorum's sweeps for the dead, as they do in a run.
"""

from __future__ import annotations

import threading
import time

import torch

from harness.local_coordinator import LocalCoordinator
from ray_mesh.replicas import ReplicaGroup
from ray_mesh.replicas.link_store import serve_store
from ray_mesh.replicas.quorum import Quorum

DEAD_AFTER_S = 1.0


class SlowStart(LocalCoordinator):
    def store_address(self):
        time.sleep(2 * DEAD_AFTER_S)  # a starved box, seconds into its start
        return super().store_address()


def test_a_group_slow_to_start_is_not_dropped_before_its_first_step():
    store, address = serve_store("127.0.0.1")
    quorum = Quorum(segment_samples=2, total_steps=2, dead_after_s=DEAD_AFTER_S,
                    expected_groups=1)
    quorum.register(1, "other", 1)  # another group, beating all along
    stop = threading.Event()

    def other_beats() -> None:
        while not stop.wait(0.05):
            quorum.beat(1, "other", 0)

    beats = threading.Thread(target=other_beats, daemon=True)
    beats.start()
    model = torch.nn.Linear(2, 2)
    try:
        rg = ReplicaGroup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          client=SlowStart(quorum, address), group_id=0, total_steps=2,
                          segment_samples=2, beat_s=0.1, layout="dp_shard=1")
        registered = quorum.status()["registered"]
        stop.set()
        quorum.failed(1, "the other group ends here", 0, "other")  # group 0 goes on alone
        try:
            assert registered == [0, 1], quorum.events
            rg.commit()  # joins: not GroupDropped ("it stopped beating in time")
            assert rg.ranges and rg.running, (rg.ranges, rg.step)
            assert [e for e in quorum.events if e["group"] == 0 and e["kind"] == "left"] \
                == [], quorum.events
        finally:
            rg.finish()
    finally:
        stop.set()
        del store
