"""Job files: every bad input fails on the driver with a message naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_mesh.cli.job import Job, JobError, load_function
from ray_mesh.raytrain.runner import check_resources, scaling_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_job_parses():
    job = Job.from_yaml(EXAMPLES / "hsdp.yaml")
    assert job.name == "hsdp" and job.scaling["num_workers"] == 4
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
    ({"num_workers": 0}, "positive int"),
    ({"num_workers": "four"}, "positive int"),
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
