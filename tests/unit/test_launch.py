"""The launch layer (``ray_mesh.raytrain.launch``): one way from a checked job to a run.

* A job file is parsed once, ``ray-mesh run``'s flags included (it was three times:
  ``from_yaml``, ``with_num_workers``, ``with_storage``), and putting the run together
  parses nothing again.
* The driver probes the storage once per place before Ray starts (it was twice on each
  path: ``check_before_ray``, then ``check_cluster(check_store=True)`` or
  ``fit_replica_groups``' own check); with Ray up, only the nodes probe it (counted with
  Ray in ``tests/ray/test_launch_ray.py``).
* Every job key, at the top level and in ``scaling:``, ``run:`` and ``network:``, either
  reaches the parts of both shapes (one mesh, replica groups) or is refused by name for
  the shape that cannot take it; a key added later without a decision here fails.

Ray-free in this process: the parts are built with ``connected=False`` (Ray Data's
datasets, which start a Ray, are built in the Ray tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from moto_s3 import S3Server

import ray_mesh.checkpointing.storage as storage_mod
from ray_mesh.cli.job import NETWORK_KEYS, RUN_KEYS, SCALING_KEYS, TOP_KEYS, Job, JobError
from ray_mesh.cli.job_groups import KEYS as GROUP_KEYS
from ray_mesh.data.indexed import INDEX_KEY
from ray_mesh.raytrain.launch import probe_storage, run_parts

ROOT = Path(__file__).resolve().parents[2]
GROUPS = {"groups": [{"dp_shard": 2}, {"dp_shard": 1}], "steps": 3, "segment_samples": 4}


@pytest.fixture
def train(tmp_path) -> str:
    (tmp_path / "t.py").write_text("def f(config):\n    pass\n\n\ndef g(config):\n    pass\n")
    return f"{tmp_path / 't.py'}:f"


@pytest.fixture
def parses(monkeypatch) -> list[int]:
    """Counts calls of the job parser (``Job.from_dict``, what every path goes through)."""
    calls: list[int] = []
    real = Job.from_dict.__func__

    def counted(cls, data, base_dir=None):
        calls.append(1)
        return real(cls, data, base_dir)

    monkeypatch.setattr(Job, "from_dict", classmethod(counted))
    return calls


def _parts(job: Job, storage: str | None = None):
    return run_parts(job, storage, connected=False, cluster={"CPU": 8})


# ----------------------------------------------------------------------------- parsed once
def test_a_job_file_and_the_run_flags_are_parsed_once(tmp_path, train, parses):
    path = tmp_path / "job.yaml"
    path.write_text(f"train: {train}\nmesh: hsdp\nscaling: {{num_workers: 4}}\n")
    Job.from_yaml(path)
    assert len(parses) == 1
    before = Job.from_yaml(path).with_num_workers(2).with_storage(str(tmp_path / "r"), None)
    assert len(parses) == 1 + 3  # the way ray-mesh run went before: three parses
    parses.clear()
    job = Job.from_yaml(path, num_workers=2, storage_path=str(tmp_path / "r"))
    assert len(parses) == 1 and job == before  # now: one, and the same job
    parts = _parts(job, probe_storage(job))
    assert len(parses) == 1  # the launch layer reads the job, never parses it again
    assert parts.scaling.num_workers == 2 and parts.run_config.storage_path == str(
        tmp_path / "r")


def test_a_flag_the_checks_refuse_is_named_and_a_bad_file_is_the_files(tmp_path, train):
    path = tmp_path / "job.yaml"
    path.write_text(f"train: {train}\nmesh: hsdp\nrun: {{min_workers: 2}}\n")
    with pytest.raises(JobError, match=r"^--num-workers 1: run.min_workers=2 is above"):
        Job.from_yaml(path, num_workers=1)
    path.write_text(f"train: {train}\nmesh: {{dp_shard: 3}}\n")  # the file is wrong anyway
    with pytest.raises(JobError, match=r"^mesh: .*dp_shard=3"):
        Job.from_yaml(path, num_workers=2)
    with pytest.raises(JobError, match="^run.storage_endpoint is set"):  # no --num-workers
        Job.from_yaml(path, num_workers=3, storage_endpoint="http://10.0.0.5:9000")
    assert Job.from_yaml(path, num_workers=3).scaling.num_workers == 3  # the flag fixes it


# ----------------------------------------------------------------------------- probed once
@pytest.fixture(scope="module")
def s3():
    server = S3Server(bucket="launch-bucket")
    yield server
    server.stop()


@pytest.fixture
def probes(s3, monkeypatch) -> list[str]:
    """The driver's bucket probes, by location (the real probe runs: a write to moto)."""
    for k, v in s3.credentials.items():
        monkeypatch.setenv(k, v)
    seen: list[str] = []
    real = storage_mod.check_object_storage

    def counted(path, endpoint=None, **kw):
        seen.append(path)
        return real(path, endpoint, **kw)

    monkeypatch.setattr(storage_mod, "check_object_storage", counted)
    return seen


@pytest.mark.parametrize("shape", ["one mesh", "groups", "groups, fallback elsewhere"])
def test_the_driver_probes_the_storage_once_per_place(s3, probes, train, shape):
    top = {"train": train, "run": {"storage_path": s3.uri("runs"),
                                   "storage_endpoint": s3.endpoint}}
    if shape != "one mesh":
        top["replica_groups"] = {**GROUPS, "checkpoint_every": 2}
    if shape.endswith("elsewhere"):
        top["replica_groups"]["checkpoint_dir"] = s3.uri("fallback")
    job = Job.from_dict(top)
    checked = probe_storage(job)
    parts = _parts(job, checked)
    places = [s3.uri("runs")] + ([s3.uri("fallback")] if shape.endswith("elsewhere") else [])
    assert probes == places  # was: the run's storage twice (before Ray, then with it)
    assert (parts.storage_path, parts.storage_endpoint) == (s3.uri("runs"), s3.endpoint)
    if parts.groups is not None:  # fit_replica_groups: the nodes only
        assert parts.groups_kwargs()["storage_probed"] is True


# ----------------------------------------------------------------------------- every key
PLAN = {"model": f"{ROOT / 'examples' / 'fsdp_tp_transformer.py'}:make_model",
        "tokens_per_step": 64, "compute_s": 0.5}
DATA = {"paths": ["stdlib"], "seq_len": 32, "max_tokens": 20000}

# key -> (its value, what else the job needs, what the one-mesh run's parts show, what
# the groups' parts show, or the words of the refusal when a run of groups cannot take it)
TOP = {
    "name": ("kw-name", {}, lambda p, j: p.run_config.name == "kw-name",
             lambda p, j: p.groups_kwargs()["name"] == "kw-name"),
    "train": (None, {}, lambda p, j: p.train_fn.__name__ == "g",
              lambda p, j: p.train_fn.__name__ == "g"),
    "config": ({"lr": 0.25}, {}, lambda p, j: p.config["lr"] == 0.25,
               lambda p, j: p.groups_kwargs()["config"]["lr"] == 0.25),
    "mesh": ("hsdp", {}, lambda p, j: p.mesh_config.layout.mesh == j.mesh,
             "mesh: does not go with replica_groups"),
    "scaling": ({"use_gpu": False, "resources_per_worker": {"CPU": 0.5}}, {},
                lambda p, j: p.scaling.resources_per_worker == {"CPU": 0.5},
                lambda p, j: p.groups_kwargs()["resources_per_worker"] == {"CPU": 0.5}),
    "network": ({"bringup_timeout_s": 33}, {},
                lambda p, j: p.mesh_config.bringup_timeout_s == 33,
                lambda p, j: p.groups_kwargs()["mesh_config"].bringup_timeout_s == 33),
    "run": ({"num_to_keep": 2}, {}, lambda p, j: p.run_config.checkpoint_config.num_to_keep == 2,
            lambda p, j: p.groups_kwargs()["num_to_keep"] == 2),
    "data": (DATA, {}, lambda p, j: p.config["data"] == j.data.to_dict(),
             lambda p, j: p.config["data"] == j.data.to_dict() and "manifest" in p.config[
                 INDEX_KEY]),
    "replicate": ({"mode": "diloco", "every": 5}, {"mesh": "hsdp"},
                  lambda p, j: p.mesh_config.layout.diloco.every == 5,
                  "replicate: does not go with replica_groups"),
    "plan": (PLAN, {"config": {"heads": 4}}, lambda p, j: p.mesh_config.plan is j.plan,
             "plan: does not go with replica_groups"),
    "layout": ("dp_replicate=2,dp_shard=2/bf16/sync", {},
               lambda p, j: p.mesh_config.layout == j.layout,
               "layout: does not go with replica_groups"),
    # the groups' own section: it makes the run one of groups (its keys: below)
    "replica_groups": (GROUPS, {}, None,
                       lambda p, j: p.groups_kwargs()["total_steps"] == GROUPS["steps"]),
}
SCALING = {
    "num_workers": (2, lambda p: p.scaling.num_workers == 2,
                    "scaling.num_workers does not go with replica_groups"),
    "use_gpu": (False, lambda p: p.scaling.use_gpu is False,
                lambda p: p.groups_kwargs()["use_gpu"] is False),
    "resources_per_worker": ({"slot": 1}, lambda p: p.scaling.resources_per_worker["slot"] == 1,
                             lambda p: p.groups_kwargs()["resources_per_worker"] == {"slot": 1}),
    "placement_strategy": ("SPREAD", lambda p: p.scaling.placement_strategy == "SPREAD",
                           "scaling.placement_strategy does not go with replica_groups"),
}
RUN = {
    "storage_path": ("s3://kw-bucket/runs",
                     lambda p: p.run_config.storage_path == "s3://kw-bucket/runs",
                     lambda p: p.groups_kwargs()["storage_path"] == "s3://kw-bucket/runs"),
    "storage_endpoint": ("http://10.0.0.5:9000",
                         lambda p: p.run_config.storage_filesystem.type_name == "s3",
                         lambda p: p.groups_kwargs()["storage_endpoint"] == "http://10.0.0.5:9000"),
    "max_failures": (3, lambda p: p.run_config.failure_config.max_failures == 3,
                     lambda p: p.groups_kwargs()["max_group_failures"] == 3),
    "num_to_keep": (2, lambda p: p.run_config.checkpoint_config.num_to_keep == 2,
                    lambda p: p.groups_kwargs()["num_to_keep"] == 2),
    "min_workers": (2, lambda p: p.scaling.min_workers == 2,
                    "run.min_workers does not go with replica_groups"),
    "startup_retries": (5, lambda p: p.run_config.failure_config.controller_failure_limit == 5,
                        "run.startup_retries does not go with replica_groups"),
}
NETWORK = {"interface": "tailscale0", "bringup_timeout_s": 33.0, "allow_cross_node_inner": True,
           "backend": "gloo", "timeout_s": 99, "preflight": False, "preflight_timeout_s": 7.0,
           "nccl_vpn_defaults": False, "worker_niceness": 3, "hang_timeout_s": 50.0,
           "wait_sample_s": 0.5, "measure_links": False, "link_probe_s": 2.0}
GROUP_SECTION = {"groups": ([{"dp_shard": 1}], "groups"),
                 "workers_per_group": (None, "workers_per_group"),  # with groups: N
                 "steps": (7, "total_steps"), "segment_samples": (6, "segment_samples"),
                 "shares": ("speed", "shares"), "checkpoint_every": (2, "checkpoint_every"),
                 "checkpoint_dir": ("/shared/fallback", "checkpoint_dir"),
                 "max_group_failures": (4, "max_group_failures"), "data_from": (None, None),
                 "compress": ("int8", "compress")}


def test_every_key_has_a_decision_here():
    assert set(TOP) == set(TOP_KEYS)
    assert set(SCALING) == set(SCALING_KEYS) and set(RUN) == set(RUN_KEYS)
    assert set(NETWORK) == set(NETWORK_KEYS) and set(GROUP_SECTION) == set(GROUP_KEYS)


def _both(train: str, top: dict) -> tuple[dict, dict]:
    return {"train": train, **top}, {"train": train, "replica_groups": GROUPS, **top}


@pytest.mark.parametrize("key", sorted(TOP))
def test_each_top_level_key_reaches_both_shapes_or_is_refused_by_name(train, key):
    value, extra, one, groups = TOP[key]
    if key == "train":
        value = train.replace(":f", ":g")
    single, grouped = _both(train, {**extra, key: value})
    if one is not None:
        job = Job.from_dict(single, base_dir=ROOT / "examples")
        assert one(_parts(job), job), key
    grouped.update({"replica_groups": {**GROUPS, **value}} if key == "replica_groups" else {})
    for refused in ("mesh", "plan"):  # what `extra` adds for one mesh, not the groups' key
        if refused != key and refused in extra:
            grouped.pop(refused)
    if isinstance(groups, str):
        with pytest.raises(JobError, match=groups + r".*Remove it"):
            Job.from_dict(grouped, base_dir=ROOT / "examples")
    else:
        job = Job.from_dict(grouped, base_dir=ROOT / "examples")
        assert groups(_parts(job), job), key


@pytest.mark.parametrize("section, key", [("scaling", k) for k in sorted(SCALING)]
                         + [("run", k) for k in sorted(RUN)])
def test_each_scaling_and_run_key_reaches_both_shapes_or_is_refused_by_name(train, section,
                                                                           key):
    value, one, groups = (SCALING if section == "scaling" else RUN)[key]
    given = {key: value}
    if key == "storage_endpoint":
        given["storage_path"] = "s3://kw-bucket/runs"
    single, grouped = _both(train, {section: given})
    single["mesh"] = "hsdp" if key == "min_workers" else "ddp"
    job = Job.from_dict(single)
    assert one(_parts(job, job.run.storage_path)), key
    if isinstance(groups, str):
        with pytest.raises(JobError, match=groups + r".*Remove it"):
            Job.from_dict(grouped)
    else:
        job = Job.from_dict(grouped)
        assert groups(_parts(job, job.run.storage_path)), key


@pytest.mark.parametrize("key", sorted(NETWORK))
def test_each_network_key_reaches_the_mesh_config_of_both_shapes(train, key):
    for top in _both(train, {"network": {key: NETWORK[key]}}):
        parts = _parts(Job.from_dict(top))
        assert getattr(parts.mesh_config, key) == NETWORK[key], (key, top)


@pytest.mark.parametrize("key", sorted(GROUP_SECTION))
def test_each_replica_groups_key_reaches_the_groups(train, key):
    value, kwarg = GROUP_SECTION[key]
    section = {**GROUPS, key: value}
    if key == "workers_per_group":
        section.update(groups=2, workers_per_group=3)
        value = 3
    top = {"train": train, "replica_groups": section}
    if key == "data_from":  # read by the launch layer: the train function's data index
        top["data"] = DATA
        parts = _parts(Job.from_dict({**top, "replica_groups": {**section, key: "files"}}))
        assert "manifest" in parts.config[INDEX_KEY]
        return
    assert _parts(Job.from_dict(top)).groups_kwargs()[kwarg] == value, key
