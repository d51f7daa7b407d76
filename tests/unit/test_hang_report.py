"""The hang report's reasoning on hand-made snapshots (no processes), and the config checks."""

from __future__ import annotations

import pytest

from ray_mesh.observability.hang_report import find_stalls, format_report, guess_op

SLEEP = [{"file": "/job/train.py", "line": 9, "func": "train", "code": "time.sleep(60)"}]
C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"
IN_ALLREDUCE = [{"file": "/job/train.py", "line": 7, "func": "train", "code": "all_reduce(t)"},
                {"file": "/x/site-packages/torch/distributed/c10d_logger.py", "line": 83,
                 "func": "wrapper", "code": ""},
                {"file": C10D, "line": 3252, "func": "all_reduce", "code": "work.wait()"},
                {"file": C10D, "line": 10, "func": "_inner", "code": ""}]


def snap(rank, seq, groups, frames, stalled=None, pending=None):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "seq": seq, "groups": groups,
            "stalled_s": stalled or {d: 30.0 for d in seq}, "pending": pending,
            "threads": [{"name": "MainThread", "frames": frames}]}


def test_rank_behind_is_named_and_a_dead_rank_reads_no_answer():
    groups = {"dp": [0, 1, 2]}
    snaps = {0: snap(0, {"dp": 5}, groups, IN_ALLREDUCE),
             1: snap(1, {"dp": 4}, groups, SLEEP)}
    beats = {2: {"seq": {"dp": 4}}}  # rank 2 published once, then went silent
    stalls = find_stalls(snaps, beats)
    assert len(stalls) == 1
    s = stalls[0]
    assert (s.dim, s.seq, s.op, s.waiting, s.missing) == ("dp", 5, "all_reduce", (0,),
                                                          {1: 4, 2: 4})
    text = format_report(snaps, beats, 3, 60, 75)
    assert "all_reduce #5 on mesh dim 'dp' (group ranks [0, 1, 2]): waiting rank 0" in text
    assert "rank 2: NO ANSWER" in text
    assert "rank 1 (h pid 101): NOT in any collective" in text
    assert 'File "/job/train.py", line 9, in train' in text
    assert text.splitlines()[-1].startswith("Hang summary: all_reduce #5 on mesh dim 'dp'")


def test_cause_listed_before_knock_on_and_pending_op_wins():
    g = {"tp": [0, 1], "dp": [1, 3]}
    snaps = {0: snap(0, {"tp": 5, "dp": 4}, {"tp": [0, 1]}, IN_ALLREDUCE,
                     stalled={"tp": 40.0, "dp": 40.0}),
             1: snap(1, {"tp": 4, "dp": 4}, g, IN_ALLREDUCE, stalled={"tp": 30.0, "dp": 20.0},
                     pending={"dim": "dp", "op": "reduce_scatter", "since": 0}),
             3: snap(3, {"tp": 4, "dp": 3}, {"dp": [1, 3]}, SLEEP)}
    stalls = find_stalls(snaps, {})
    # tp(0,1) waited longer but rank 1 waits on dp itself: dp(1,3) is the cause.
    assert [(s.dim, s.group) for s in stalls] == [("dp", (1, 3)), ("tp", (0, 1))]
    assert stalls[0].op == "reduce_scatter"
    assert "a knock-on: rank 1 itself waits" in format_report(snaps, {}, 4, 60, 75)


def test_no_rank_behind_says_so():
    groups = {"dp": [0, 1]}
    snaps = {r: snap(r, {"dp": 3}, groups, IN_ALLREDUCE) for r in (0, 1)}
    assert find_stalls(snaps, {}) == []
    assert "no rank is behind" in format_report(snaps, {}, 2, 60, 75)


def test_guess_op_takes_the_public_c10d_call():
    assert guess_op(IN_ALLREDUCE) == "all_reduce"
    assert guess_op(SLEEP) is None


@pytest.mark.parametrize("bad", [0, -1, "60", True])
def test_meshconfig_refuses_a_bad_hang_timeout(bad):
    import ray_mesh

    with pytest.raises(ValueError, match="hang_timeout_s must be"):
        ray_mesh.MeshConfig(hang_timeout_s=bad)
    assert ray_mesh.MeshConfig(hang_timeout_s=None).hang_timeout_s is None


def test_job_network_hang_timeout_key():
    from ray_mesh.cli.job import Job, JobError

    job = Job.from_dict({"train": "m:f", "network": {"hang_timeout_s": 30}})
    assert job.network.options.hang_timeout_s == 30
    assert job.network.mesh_config_kwargs()["options"].hang_timeout_s == 30
    off = Job.from_dict({"train": "m:f", "network": {"hang_timeout_s": None}})
    assert off.network.options.hang_timeout_s is None
    with pytest.raises(JobError, match="hang_timeout_s"):
        Job.from_dict({"train": "m:f", "network": {"hang_timeout_s": -1}})


def test_pp_counts_differ_by_design_unless_a_watched_collective_waits():
    groups = {"pp": [0, 1]}
    snaps = {0: snap(0, {"pp": 8}, groups, IN_ALLREDUCE), 1: snap(1, {"pp": 4}, groups, SLEEP)}
    assert find_stalls(snaps, {}) == []
    snaps[0]["pending"] = {"dim": "pp", "op": "all_reduce", "since": 0}
    assert [s.dim for s in find_stalls(snaps, {})] == ["pp"]
