"""Replica groups on the virtual cluster: 3 nodes x 2 workers, one replica group per node.

HSDP (a boundary every step), ``fit_replica_groups`` driven from the head namespace
(``benchmarks/replica_groups.py``'s driver). Worker rank 1 of group 1 SIGKILLs itself (the
train function's ``kill`` hook) at step 8: the other two groups keep training (no long wait,
no step taken twice), Ray Train restarts group 1 alone, it heals from a live group over the
network and ends with the same model (the same held-out loss); no sample is used twice or
skipped. ~120 s on a quiet 2-core machine (cluster ~16 s; most of the rest is the three
groups' Ray Train bring-up).
"""

from __future__ import annotations

import pytest

from harness.netns_cluster import NetnsCluster, netns_unavailable_reason

pytestmark = pytest.mark.netns

KILLED, KILL_AT = 1, 8


@pytest.fixture(scope="module")
def cluster():
    if reason := netns_unavailable_reason(tunnel="veth"):
        pytest.skip(f"virtual cluster unavailable: {reason}")
    # Bare veth, no WireGuard: the point is the groups' failure handling, not the tunnel
    # (benchmarks/replica_groups.py kills a whole node over WireGuard), and userspace
    # WireGuard costs CPU on a 2-core machine.
    with NetnsCluster([{"slot": 2}] * 3, tunnel="veth", start_attempts=4,
                      ray_start_timeout_s=180) as c:
        yield c


@pytest.mark.timeout(400)
def test_lost_group_rejoins_while_the_others_train(cluster):
    from benchmarks.replica_groups import driver_args, run_on_cluster, summarize
    from harness import replica_check as rc

    work = cluster.root / "rg"
    marker = work / "killed"
    kill = {"group": KILLED, "rank": 1, "at_step": KILL_AT, "marker": str(marker)}
    # 60 steps of >= 0.4 s: the killed group is back (~15-25 s) with steps to spare.
    args = driver_args("hsdp", work / "logs", cluster.root / "runs", steps=60, kill=kill,
                       env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})
    raw = run_on_cluster(cluster, args, work, timeout_s=300)
    t_kill = rc.kill_time(marker, KILLED)
    got = summarize(work / "logs", KILLED, t_kill)
    print({k: v for k, v in got.items() if k != "loss_curve"}, f"wall {raw['wall_s']:.1f} s")

    assert got["survivor_max_step_gap_s"] < 10, got
    assert got["survivor_steps_lost"] == 0, got
    assert got["samples_twice"] == 0 and got["samples_skipped"] == 0, got
    events = [(e["kind"], e["group"]) for e in raw["events"]]
    assert ("left", KILLED) in events, events
    assert ("healed", KILLED) in events or events.count(("joined", KILLED)) >= 2, events
    assert got["rejoin_s"] is not None, got
    assert got["killed_group_attempts"] == 2, got
    # every group ran to the end, and the healed one holds the same model
    assert set(got["final_step"].values()) == {60}, got
    losses = got["final_eval_loss"]
    assert len(losses) == 3, losses
    assert max(losses.values()) - min(losses.values()) < 1e-6, losses
