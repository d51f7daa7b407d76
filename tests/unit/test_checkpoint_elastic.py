"""Elastic runs and checkpoint job keys, on the driver (no Ray cluster needed).

The restart itself (a node stopped, the group restarting smaller) needs the namespace
cluster; these are the driver-side rules that decide whether a run may shrink.
"""

from __future__ import annotations

import pytest
from ray.train import ControllerError

from ray_mesh.cli.job import Job, JobError
from ray_mesh.cli.runner import check_resources, scaling_for
from ray_mesh.core.spec import MeshSpec, MeshSpecError
from ray_mesh.private_apis import startup_timeout_error_type
from ray_mesh.raytrain.elastic import check_elastic_mesh, explain_startup_failure, failure_config

TRAIN = "harness/ckpt_train.py:train_loop"


def test_only_dp_replicate_may_follow_the_nodes():
    check_elastic_mesh(MeshSpec.hsdp(tp=2), 4, 8)  # dp_replicate='nodes'
    check_elastic_mesh(MeshSpec(dp_replicate=-1, dp_shard=2, tp=2), 4, 12)
    with pytest.raises(MeshSpecError, match="dp_replicate='nodes'.*MeshSpec.hsdp"):
        check_elastic_mesh(MeshSpec(dp_replicate=2, dp_shard=-1), 2, 4)
    with pytest.raises(MeshSpecError, match=r"\[6\] workers is not a multiple of .* = 4"):
        check_elastic_mesh(MeshSpec(dp_replicate=-1, dp_shard=2, tp=2), 4, 6)
    with pytest.raises(MeshSpecError, match="min_workers <= max_workers"):
        check_elastic_mesh(MeshSpec.hsdp(), 4, 2)


def test_job_min_workers_makes_scaling_elastic():
    job = Job.from_dict({"train": TRAIN, "mesh": "hsdp", "scaling": {"num_workers": 4},
                         "run": {"min_workers": 2, "max_failures": 3, "num_to_keep": 2}})
    scaling = scaling_for(job, {"CPU": 8})
    assert scaling.elasticity_enabled and (scaling.min_workers, scaling.max_workers) == (2, 4)
    check_resources(scaling, {"CPU": 2})  # the minimum fits: accepted
    with pytest.raises(JobError, match="CPU: 2 .*cluster has CPU: 1"):
        check_resources(scaling, {"CPU": 1})
    fixed = Job.from_dict({"train": TRAIN, "scaling": {"num_workers": 4}})
    assert scaling_for(fixed, {"CPU": 8}).num_workers == 4


@pytest.mark.parametrize("run,match", [
    ({"min_workers": 8}, "min_workers=8 is above scaling.num_workers=4"),
    ({"min_workers": 0}, "run.min_workers must be an int >= 1"),
    ({"num_to_keep": 0}, "run.num_to_keep must be an int >= 1"),
    ({"max_failures": "many"}, "run.max_failures must be an int >= -1"),
    ({"storage_path": 3}, "run.storage_path must be a non-empty string"),
    ({"num_to_kep": 3}, "Did you mean 'num_to_keep'"),
])
def test_bad_run_keys(run, match):
    with pytest.raises(JobError, match=match):
        Job.from_dict({"train": TRAIN, "scaling": {"num_workers": 4}, "run": run})


def test_startup_failure_is_bounded_and_explained():
    cfg = failure_config(2, startup_retries=3)
    assert (cfg.max_failures, cfg.controller_failure_limit) == (2, 3)
    err = ControllerError(startup_timeout_error_type()(num_workers=4))
    fixed = explain_startup_failure(err, 4)
    assert "fixed 4 workers" in fixed and "not elastic" in fixed and "min_workers" in fixed
    elastic = explain_startup_failure(err, (2, 4))
    assert "fewer than min_workers=2" in elastic
    assert explain_startup_failure(RuntimeError("loss is nan"), 4) is None
