"""``Checkpointer`` refuses bad arguments and a call outside Ray Train at construction."""

from __future__ import annotations

import pytest
import torch.nn as nn

from ray_mesh.checkpointing import Checkpointer, CheckpointError


@pytest.mark.parametrize("kwargs, error, match", [
    ({"every": "2"}, ValueError, r"every=.*int >= 0.*'2'"),
    ({"every": -1}, ValueError, r"every=.*int >= 0"),
    ({"every": 2.0}, ValueError, r"every=.*int >= 0"),
    ({"every": True}, ValueError, r"every=.*int >= 0"),
    ({"async_save": "yes"}, TypeError, r"async_save=.*True or False"),
    ({"upload": "s3"}, TypeError, r"upload=.*None"),
    ({"timeout_s": 0}, ValueError, r"timeout_s=.*> 0"),
    ({"timeout_s": "60"}, ValueError, r"timeout_s=.*> 0"),
    ({"data_seed": "7"}, TypeError, r"data_seed=.*int or None"),
    ({"check_finite": None}, TypeError, r"check_finite=.*True or False"),
    ({"resume_from": 3}, TypeError, r"resume_from=.*path"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Checkpointer(nn.Linear(2, 2), **kwargs)


def test_model_and_optimizer_types():
    with pytest.raises(TypeError, match=r"model=.*torch.nn.Module"):
        Checkpointer("model")
    with pytest.raises(TypeError, match=r"optimizers=.*got str"):
        Checkpointer(nn.Linear(2, 2), "adam")
    with pytest.raises(TypeError, match=r"optimizers=.*got int"):
        Checkpointer(nn.Linear(2, 2), 3)


def test_outside_ray_train_is_a_clear_error():
    with pytest.raises(CheckpointError, match="inside a Ray Train train function") as err:
        Checkpointer(nn.Linear(2, 2), every=2)
    assert "ray_mesh.checkpointing.save(...) and load(...)" in str(err.value)


def test_report_arguments():
    from ray_mesh.checkpointing.guards import check_report

    check_report(3, {"epoch": 1, "offset": [1, 2]})
    with pytest.raises(TypeError, match=r"step=.*int >= 0"):
        check_report("3", None)
    with pytest.raises(TypeError, match=r"data_position=.*must be a dict"):
        check_report(3, [1])
    with pytest.raises(TypeError, match=r"data_position=.*JSON values only"):
        check_report(3, {"sampler": object()})
