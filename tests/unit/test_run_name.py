"""Run names are one path component: a name never puts the run directory outside storage_path.

Checked in the YAML job (``name:``), in ``check_storage(name=...)`` and where the launch layer
puts a run together (``run_parts``); nothing is created outside the storage path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_mesh.checkpointing.storage import StorageError, check_run_name, check_storage
from ray_mesh.cli.job import Job, JobError
from ray_mesh.raytrain.launch import run_parts

TRAIN = str(Path(__file__).resolve().parents[2] / "harness" / "ckpt_train.py") + ":train_loop"
BAD = ["../escaped_run", "..", ".", "a/b", "/abs/run", "a\\b", "~root", "x\0y", "tab\there",
       " padded ", "", "   ", "n" * 300]
GOOD = ["hsdp", "run-1.2_x", "TorchTrainer_2026-11-23_10-00-00", "my run", "2024"]


@pytest.mark.parametrize("name", BAD)
def test_bad_names_are_refused_everywhere(tmp_path, name):
    storage = tmp_path / "storage"
    with pytest.raises(StorageError, match="single path component"):
        check_run_name(name)
    with pytest.raises(StorageError, match="not allowed"):
        check_storage(storage, name=name)
    if name.strip():  # an empty name means "the train file's name" in a job file
        with pytest.raises(JobError, match=r"cannot be a run name.*one plain path component"):
            Job.from_dict({"name": name, "train": TRAIN})
    job = Job(name=name, train=TRAIN)  # built in Python, past the YAML checks
    with pytest.raises(StorageError, match="not allowed"):  # where a run is put together
        run_parts(job, str(storage), connected=False, cluster={"CPU": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created anywhere


@pytest.mark.parametrize("name", GOOD)
def test_good_names_pass(tmp_path, name):
    assert check_run_name(name) == name
    assert Job.from_dict({"name": name, "train": TRAIN}).name == name
    assert Path(check_storage(tmp_path, name=name)) == tmp_path


def test_yaml_int_name_and_default_name():
    assert Job.from_dict({"name": 2024, "train": TRAIN}).name == "2024"
    assert Job.from_dict({"train": TRAIN}).name == "ckpt_train"
    with pytest.raises(JobError, match="not a string"):
        Job.from_dict({"name": ["a"], "train": TRAIN})
