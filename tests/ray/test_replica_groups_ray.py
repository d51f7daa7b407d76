"""Replica groups on a real local Ray: the fallback when every group dies at once.

Two DiLoCo replica groups (one worker each, an outer step every 3 inner steps, outer momentum
0.5: at 0.9 this tiny problem diverges over so few inner steps), a checkpoint
of the group state every 4 outer steps, and both groups' workers SIGKILLed at step 10. With no
live group left to heal from, the restart waits for both groups; the first restores the newest
checkpoint from storage (outer state included), the second heals from it over the network,
and the run finishes. The
kill-and-rejoin of one group while the others train on is tests/netns/test_replica_groups_netns.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import replica_check as rc

pytestmark = pytest.mark.ray


@pytest.mark.timeout(300)
def test_every_group_gone_restores_from_storage_and_the_run_finishes(ray_local, tmp_path):
    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import describe, fit_replica_groups

    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    config = {"log_dir": str(logs_dir), "step_s": 0.2,
              "diloco": {"every": 3, "outer_momentum": 0.5},
              "kill": {"group": "all", "rank": 0, "at_step": 10,
                       "marker": str(tmp_path / "killed")}}
    lines: list[str] = []
    result = fit_replica_groups(
        load_function("harness/replica_train.py:train_loop"), groups=2, workers_per_group=1,
        total_steps=16, segment_samples=12, config=config, storage_path=str(tmp_path / "runs"),
        resources_per_worker={"CPU": 1}, checkpoint_every=4,
        checkpoint_dir=str(tmp_path / "ckpt"), name="rg-fallback",
        on_event=lambda e: lines.append(describe(e)))
    print("\n".join(lines))
    kinds = [(e["kind"], e["group"]) for e in result.events]
    assert ("left", 0) in kinds and ("left", 1) in kinds, lines
    restore = [e for e in result.events if e["kind"] == "restore"]
    assert len(restore) == 1 and restore[0]["step"] == 8, lines
    assert "step_00000008" in restore[0]["detail"], restore
    healed = [e for e in result.events if e["kind"] == "healed"]
    assert healed and {e["step"] for e in healed} == {8}, lines
    assert kinds.count(("joined", 0)) == 2 and kinds.count(("joined", 1)) == 2, lines
    assert result.status["step"] == 16 and result.status["finished"], result.status

    logs = rc.read(logs_dir)
    # steps 9 and 10 were taken, lost with every group, and taken again after the restore
    for gid, rows in logs.items():
        steps = [r["step"] for r in rows]
        assert steps[-1] == 16 or gid != restore[0]["group"], (gid, steps)
    twice, skipped = rc.sample_use(logs)
    assert skipped == [], skipped
    redone = {i for rows in logs.values() for r in rows if r["step"] > 8
              for s, n in r["ranges"] for i in range(s, s + n)}
    assert set(twice) <= redone, (twice, sorted(redone))
    # both groups end with the same model (the second one healed from the restored one)
    finals = rc.finals(logs_dir)
    last = [rows[-1] for rows in finals.values()]
    assert len(last) == 2 and all(r["step"] == 16 for r in last), finals
    assert abs(last[0]["eval_loss"] - last[1]["eval_loss"]) < 1e-6, last
    assert last[0]["eval_loss"] < 0.5, last  # it trained (0.65 untrained)


@pytest.mark.timeout(300)
def test_a_train_function_that_always_fails_stops_the_run_with_its_error(ray_local, tmp_path):
    """A bug in the train function is not a node coming and going: after two failures in a
    row with the same error and no rejoin between, the driver stops every group and raises
    the error itself (before, the console showed only "left ... stopped beating" until the
    restart budget ran out)."""
    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import GroupsFailed, describe, fit_replica_groups

    lines: list[str] = []
    with pytest.raises(GroupsFailed, match=r"replica group 0 failed 2 times in a row .*"
                       r"FileNotFoundError: no/such/shard.*fix it"):
        fit_replica_groups(
            load_function("harness/replica_train.py:train_loop"), groups=1,
            workers_per_group=1, total_steps=4, segment_samples=4,
            config={"fail": "no/such/shard"}, storage_path=str(tmp_path / "runs"),
            resources_per_worker={"CPU": 1}, name="rg-fails",
            on_event=lambda e: lines.append(describe(e)))
    assert any("failed" in line and "no/such/shard" in line for line in lines), lines


@pytest.mark.timeout(300)
def test_a_slowed_group_gets_the_smaller_share_and_no_sample_is_lost(ray_local, tmp_path):
    """Unequal boxes: two groups, each pinned to its own core, and another process spinning
    on group 1's core (it gets about half of it). With ``shares="speed"`` the quorum sizes
    each group's segment to its measured speed: the faster group ends up with the larger
    share, every boundary still hands out the same total, and no sample is used twice or
    skipped."""
    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import fit_replica_groups

    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs 2 cores: one per group")
    cores = sorted(os.sched_getaffinity(0))[:2]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                           preexec_fn=lambda: os.sched_setaffinity(0, {cores[1]}))
    try:
        logs_dir = tmp_path / "logs"
        result = fit_replica_groups(
            load_function("harness/replica_train.py:train_loop"), groups=2,
            workers_per_group=1, total_steps=24, segment_samples=16, shares="speed",
            config={"log_dir": str(logs_dir), "work": 20,
                    "pin_cpu": {"0": cores[0], "1": cores[1]}},
            storage_path=str(tmp_path / "runs"), resources_per_worker={"CPU": 1},
            name="rg-shares")
    finally:
        hog.kill()
        hog.wait()
    assert result.status["finished"], result.status
    logs = rc.read(logs_dir)
    share = {gid: {r["step"]: sum(n for _, n in r["ranges"]) for r in rows}
             for gid, rows in logs.items()}
    steps = sorted(set(share[0]) & set(share[1]))
    assert all(share[0][s] + share[1][s] == 32 for s in steps), share  # the total is kept
    late = steps[-8:]
    fast, slow = sum(share[0][s] for s in late), sum(share[1][s] for s in late)
    assert fast >= 1.3 * slow, (fast, slow, share)
    shares = result.status["shares"]
    assert shares[0]["samples_per_s"] > shares[1]["samples_per_s"], shares
    # What `ray-mesh status --storage` prints from the file the driver wrote.
    from ray_mesh.observability import replica_groups as groups_file

    doc = groups_file.parse((tmp_path / "runs" / "rg-shares-g0" / groups_file.GROUPS_JSON)
                            .read_bytes(), "status file")
    shown = "\n".join(groups_file.lines(doc))
    assert "group 0: 1 rank(s), " in shown and "group 1: 1 rank(s), " in shown, shown
    assert shown.count(" samples/s") == 2, shown
    twice, skipped = rc.sample_use(logs)
    assert twice == [] and skipped == [], (twice, skipped)
