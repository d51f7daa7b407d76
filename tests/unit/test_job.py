"""Job files: every bad input fails on the driver with a message naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_mesh.cli.job import Job, JobError, load_function
from ray_mesh.cli.runner import check_resources, scaling_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_job_parses():
    job = Job.from_yaml(EXAMPLES / "hsdp.yaml")
    assert job.name == "hsdp" and job.scaling.num_workers == 4
    assert job.mesh.resolve(4).to_dict()["dp_shard"] == 2
    assert callable(job.load_train_fn())


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "name: x\ntrain: a.py:f\nmesh: {dp_shard: 2\nscaling: {}\n")
    with pytest.raises(JobError, match=r"job.yaml is not valid YAML at line \d+"):
        Job.from_yaml(path)


def test_unknown_keys_are_named_with_a_suggestion(tmp_path):
    with pytest.raises(JobError, match=r"Unknown key 'scalling' in 'job'.*'scaling'"):
        Job.from_dict({"train": "a:b", "scalling": {}})
    with pytest.raises(JobError, match=r"Unknown key 'num_worker' in 'scaling'.*'num_workers'"):
        Job.from_dict({"train": "a:b", "scaling": {"num_worker": 2}})
    with pytest.raises(JobError, match=r"mesh: Unknown mesh dim 'tensor'"):
        Job.from_dict({"train": "a:b", "mesh": {"tensor": 2}})


def test_mesh_errors_surface_as_job_errors():
    with pytest.raises(JobError, match="Only one dim may be -1"):
        Job.from_dict({"train": "a:b", "mesh": {"dp_replicate": -1, "dp_shard": -1}})


@pytest.mark.parametrize("scaling, match", [
    ({"num_workers": 0}, "num_workers must be an int from 1"),
    ({"num_workers": "four"}, "num_workers must be an int from 1"),
    ({"use_gpu": "yes"}, "true, false or auto"),
])
def test_bad_scaling_values(scaling, match):
    with pytest.raises(JobError, match=match):
        Job.from_dict({"train": "a:b", "scaling": scaling})


def test_missing_train_key():
    with pytest.raises(JobError, match="no 'train' key"):
        Job.from_dict({"name": "x"})


def test_train_function_that_cannot_be_imported(tmp_path):
    with pytest.raises(JobError, match="':function' part is missing"):
        load_function("examples/hsdp.py")
    with pytest.raises(JobError, match="file 'nope.py' not found"):
        load_function("nope.py:f", tmp_path)
    with pytest.raises(JobError, match="cannot import module 'no_such_pkg.mod'"):
        load_function("no_such_pkg.mod:f")
    with pytest.raises(JobError, match=r"has no function 'train_lop'.*'train_loop'"):
        load_function("hsdp.py:train_lop", EXAMPLES)
    broken = write(tmp_path, "import no_such_module_here\n", "broken.py")
    with pytest.raises(JobError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_function(f"{broken}:f")


def test_train_path_resolves_against_the_job_folder(tmp_path):
    write(tmp_path, "def f(config):\n    return 42\n", "mytrain.py")
    job = Job.from_yaml(write(tmp_path, "train: mytrain.py:f\n"))
    assert job.name == "mytrain" and job.load_train_fn()({}) == 42


def test_gpu_auto_and_resource_check():
    job = Job.from_dict({"train": "a:b", "scaling": {"num_workers": 4}})
    cpu = scaling_for(job, {"CPU": 8.0})
    assert not cpu.use_gpu and cpu.resources_per_worker == {"CPU": 1}
    assert scaling_for(job, {"CPU": 8.0, "GPU": 4.0}).use_gpu
    check_resources(cpu, {"CPU": 8.0})

    gpu_job = Job.from_dict({"train": "a:b", "scaling": {"num_workers": 4, "use_gpu": True}})
    with pytest.raises(JobError) as err:
        check_resources(scaling_for(gpu_job, {"CPU": 8.0}), {"CPU": 8.0})
    assert "asks for GPU: 4" in str(err.value) and "has GPU: 0" in str(err.value)
    assert "use_gpu: false" in str(err.value)
    with pytest.raises(JobError, match="asks for CPU: 16"):
        check_resources(scaling_for(Job.from_dict(
            {"train": "a:b", "scaling": {"num_workers": 16}}), {"CPU": 8.0}), {"CPU": 8.0})


def test_sections_are_typed_and_take_meshconfig_defaults():
    """The network section's defaults are MeshConfig's own (one source, no drift)."""
    import dataclasses

    import ray_mesh
    from ray_mesh.cli.job import NetworkSection, RunSection, ScalingSection
    from ray_mesh.raytrain.elastic import STARTUP_RETRIES, failure_config

    job = Job.from_dict({"train": "a:b"})
    assert isinstance(job.scaling, ScalingSection) and isinstance(job.run, RunSection)
    config = ray_mesh.MeshConfig()
    assert isinstance(job.network, NetworkSection)
    for f in dataclasses.fields(job.network.options):  # one type, MeshConfig's base
        if f.name != "mesh":
            assert getattr(job.network.options, f.name) == getattr(config, f.name), f.name
    # Unset backend/timeout_s leave TorchConfig's defaults in force.
    built = ray_mesh.MeshConfig(mesh=job.mesh, **job.network.mesh_config_kwargs())
    assert (built.backend, built.timeout_s) == (config.backend, config.timeout_s)
    # One startup-retry bound for the job, the runner and failure_config.
    assert STARTUP_RETRIES == 3 == job.run.startup_retries
    assert failure_config(0).controller_failure_limit == STARTUP_RETRIES


def test_worker_niceness_from_yaml(tmp_path):
    import ray_mesh

    job = Job.from_yaml(write(tmp_path, "train: a:b\nnetwork: {worker_niceness: 5}\n"))
    config = ray_mesh.MeshConfig(mesh=job.mesh, **job.network.mesh_config_kwargs())
    assert config.worker_niceness == 5
    keep = Job.from_yaml(write(tmp_path, "train: a:b\nnetwork: {worker_niceness: null}\n"))
    assert keep.network.options.worker_niceness is None
    with pytest.raises(JobError, match="network.worker_niceness must be an int from -20 to 19"):
        Job.from_yaml(write(tmp_path, "train: a:b\nnetwork: {worker_niceness: 40}\n"))


@pytest.mark.parametrize("network, match", [
    ({"bringup_timeout_s": 0}, "network.bringup_timeout_s must be a finite number of seconds > 0"),
    ({"preflight": "no thanks"}, "network.preflight must be true or false"),
    ({"nccl_vpn_defaults": "sometimes"}, "network.nccl_vpn_defaults must be true, false or auto"),
    ({"timeout_s": -1}, "network.timeout_s must be an int from 1"),
    ({"interface": ""}, "network.interface must be 'auto' or an interface name"),
])
def test_bad_network_values_fail_at_parse(network, match):
    with pytest.raises(JobError, match=match):
        Job.from_dict({"train": "a:b", "network": network})


def test_job_is_not_edited_in_place():
    import dataclasses

    job = Job.from_dict({"train": "a:b", "mesh": "hsdp", "scaling": {"num_workers": 4},
                         "run": {"min_workers": 2}})  # elastic: dp_replicate follows nodes
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.run = None  # type: ignore[misc]
    bigger = job.with_num_workers(8)
    assert (bigger.scaling.num_workers, job.scaling.num_workers) == (8, 4)
    with pytest.raises(JobError, match="min_workers=2 is above scaling.num_workers=1"):
        job.with_num_workers(1)


def test_missing_job_file_is_a_job_error(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        Job.from_yaml(tmp_path / "nope.yaml")


def test_job_parsing_needs_no_ray():
    import subprocess
    import sys

    code = ("import sys; from ray_mesh.cli.job import Job; "
            "Job.from_dict({'train': 'a:b', 'mesh': 'hsdp'}); "
            "assert 'ray' not in sys.modules, 'cli.job imported ray'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_cli_sets_rays_controller_poll_low_unless_the_user_set_it(monkeypatch):
    """docs/monitoring.md says `ray-mesh run` sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S low (a
    report waits for the controller's poll): the CLI's defaults carry it, only for the run,
    and a value the user exported wins."""
    import os

    from ray_mesh.cli.runner import env_defaults
    from ray_mesh.raytrain.driver import CLI_ENV

    key = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    assert float(CLI_ENV[key]) <= 0.5
    monkeypatch.delenv(key, raising=False)
    with env_defaults(CLI_ENV):
        assert os.environ[key] == CLI_ENV[key]
    assert key not in os.environ
    monkeypatch.setenv(key, "3")
    with env_defaults(CLI_ENV):
        assert os.environ[key] == "3"
    assert os.environ[key] == "3"
