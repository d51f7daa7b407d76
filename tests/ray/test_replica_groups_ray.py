"""Replica groups on a real local Ray: the fallback when every group dies at once, a train
function that always fails, and the shipped example (groups of unequal size, from the job
file through ``ray-mesh run``).

Fallback: two DiLoCo replica groups (one worker each, an outer step every 3 inner steps,
outer momentum 0.5: at 0.9 this tiny problem diverges over so few inner steps), a checkpoint
of the group state every 4 outer steps into the run's storage, an S3 bucket (a moto server,
no ``checkpoint_dir``), uploaded in the background, and both groups' workers SIGKILLed at
step 11. With no live group left to heal from, the restart waits for both groups; the first
restores the newest checkpoint from the bucket (outer state included), the second heals from
it over the network, and the run finishes. The kill-and-rejoin of
one group while the others train on, on unequal nodes, is tests/netns/test_lab_job.py
(the LM job of docs/lab_job.md, a box's every process killed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import replica_check as rc

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray


@pytest.mark.timeout(300)
def test_every_group_gone_restores_from_the_bucket_of_the_runs_storage(ray_local, tmp_path):
    """No shared filesystem: storage_path is a bucket at an endpoint, the fallback goes to
    ``<storage_path>/<name>-fallback`` there (written locally, uploaded in the background,
    recorded once whole), and the restart after every group died restores it from there:
    the first group back restores checkpoint 8, the other heals from it over the network,
    steps lost with every group are taken again and no sample is skipped. (A local
    ``checkpoint_dir`` takes the same path through ``replicas.fallback``, with a local
    filesystem: tests/dist/test_replica_layouts.py restores one without Ray.)"""
    from moto_s3 import S3Server

    from ray_mesh.checkpointing.upload import complete
    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import describe, fit_replica_groups

    s3 = S3Server(bucket="rg-fallback-bucket", credentials={
        k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    try:
        logs_dir = tmp_path / "logs"
        logs_dir.mkdir()
        config = {"log_dir": str(logs_dir), "step_s": 0.3,
                  "diloco": {"every": 3, "outer_momentum": 0.5},
                  "kill": {"group": "all", "rank": 0, "at_step": 11,
                           "marker": str(tmp_path / "killed")}}
        lines: list[str] = []
        result = fit_replica_groups(
            load_function("harness/replica_train.py:train_loop"), groups=2,
            workers_per_group=1, total_steps=16, segment_samples=12, config=config,
            storage_path=s3.uri("runs"), storage_endpoint=s3.endpoint,
            resources_per_worker={"CPU": 1}, checkpoint_every=4, num_to_keep=1,
            name="rg-bucket", on_event=lambda e: lines.append(describe(e)))
        print("\n".join(lines))
        kinds = [(e["kind"], e["group"]) for e in result.events]
        assert ("left", 0) in kinds and ("left", 1) in kinds, lines
        restore = [e for e in result.events if e["kind"] == "restore"]
        assert len(restore) == 1 and restore[0]["step"] == 8, lines
        assert s3.uri("runs/rg-bucket-fallback/checkpoint_00000008_") in restore[0]["detail"]
        healed = [e for e in result.events if e["kind"] == "healed"]
        assert healed and {e["step"] for e in healed} == {8}, lines
        assert kinds.count(("joined", 0)) == 2 and kinds.count(("joined", 1)) == 2, lines
        assert not [e for e in result.events if e["kind"] == "unsaved"], lines
        assert result.status["step"] == 16 and result.status["finished"], result.status

        logs = rc.read(logs_dir)
        # steps 9 to 11 were taken, lost with every group, and taken again after the restore
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
        # num_to_keep=1: only the newest complete fallback is left in the bucket
        kept = complete(s3.uri("runs/rg-bucket-fallback"), s3.endpoint)
        assert len(kept) == 1 and kept[0][0] >= 12, kept
    finally:
        s3.stop()


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


@pytest.mark.timeout(600)
def test_the_replica_groups_example_runs_groups_of_unequal_size_with_a_clean_console(
        ray_local, tmp_path):
    """``ray-mesh run examples/replica_groups.yaml`` as its header says (joining the session's
    Ray with --address): a group of 2 workers (``dp_shard=2``) and one of 1, so every
    exchange is of full tensors, shares by speed; the job's ``replica_groups:`` section and
    the CLI's summary. (A slowed group getting the smaller share, on a real CPU quota:
    tests/netns/test_lab_job.py.)"""
    import yaml
    from console import lines, problems

    job = yaml.safe_load((ROOT / "examples" / "replica_groups.yaml").read_text())
    job["train"] = f"{ROOT / 'examples' / 'replica_groups.py'}:train_loop"
    job["run"] = {"storage_path": str(tmp_path / "results")}
    path = tmp_path / "replica_groups.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli.main", "run", "--address",
                           ray_local.get_runtime_context().gcs_address, str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert not problems(out), "unexpected console lines:\n" + "\n".join(problems(out)[:40])
    shown = lines(out)
    # Ray Train's controller INFO lines (state transitions, worker group starts), hidden
    # without --verbose as for one mesh: each group's RunConfig is ray_mesh's to set
    chatter = [x for x in out.splitlines() if "(TrainController" in x
               or "[State Transition]" in x]
    assert not chatter, chatter
    steps = job["replica_groups"]["steps"]
    assert "ray-mesh: run 'replica_groups' finished: 20 steps of 2 replica group(s)" in out, \
        out[-3000:]
    for gid, layout in ((0, "dp_shard=2"), (1, "dp_shard=1")):
        assert any(x.startswith(f"  group {gid} ({layout}): ") and "loss=" in x
                   for x in shown), shown[-20:]
        assert any(x.startswith(f"replica_groups-g{gid}: step {steps}/{steps} loss ")
                   for x in shown), shown[-40:]
    assert any("replica group 1 joined at step 0" in x for x in shown), shown[-40:]
    groups_file = tmp_path / "results" / "replica_groups-g0" / "ray_mesh_replica_groups.json"
    assert '"layout": "dp_shard=1"' in groups_file.read_text()
