"""The pieces behind the bad-input checks, without a Ray instance: the strict readers, the
YAML loader, the interface-variable rules, the embedded-size bound, and finding our error
inside Ray Train's wrappers (Ray's own exception classes, pickled as between processes)."""

from __future__ import annotations

import math
import pickle

import pytest

from ray_mesh.cli.job import Job, JobError
from ray_mesh.cli.preray import embedded_capacity_problem, user_error_inside
from ray_mesh.core.spec import MeshSpecError, load_yaml
from ray_mesh.core.topology import WorkerReport
from ray_mesh.core.values import read_bool, read_int, read_seconds
from ray_mesh.network.interfaces import NetworkError, check_user_ifnames, user_ifname_problems
from ray_mesh.network.report import PreflightError

IFACES = {"eth0": ["10.0.0.2"], "tailscale0": ["100.64.0.2"], "lo": ["127.0.0.1"]}


@pytest.mark.parametrize("value", ["false", 0, 1, "yes", None, "auto"])
def test_read_bool_takes_only_yaml_booleans(value):
    with pytest.raises(ValueError, match="must be true or false"):
        read_bool("network.preflight", value)


def test_read_bool_extras():
    assert read_bool("x", "auto", also=("auto",)) == "auto"
    assert read_bool("x", False) is False


@pytest.mark.parametrize("value", [2.0, "2", True, None, -1, 0])
def test_read_int_refuses_what_it_would_have_to_convert(value):
    with pytest.raises(ValueError, match="scaling.num_workers must be an int"):
        read_int("scaling.num_workers", value, 1)


@pytest.mark.parametrize("value", [0, -5, math.nan, math.inf, "10", True, 1e12])
def test_read_seconds(value):
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        read_seconds("network.bringup_timeout_s", value)
    assert read_seconds("x", 0.5) == 0.5


def test_duplicate_keys_are_refused_at_any_depth_but_merges_are_not():
    with pytest.raises(MeshSpecError, match=r"line 2.*'x' appears twice"):
        load_yaml("a: 1\nb: {x: 1, x: 2}\n")
    assert load_yaml("base: &b {x: 1}\nc:\n  <<: *b\n  x: 2\n")["c"] == {"x": 2}


def test_num_workers_override_is_checked_like_the_file(tmp_path):
    (tmp_path / "job.yaml").write_text("train: a:b\nscaling: {num_workers: 4}\n"
                                       "mesh: {dp_shard: -1, dp_replicate: 2}\n")
    job = Job.from_yaml(tmp_path / "job.yaml")
    assert job.with_num_workers(8).scaling.num_workers == 8
    with pytest.raises(JobError, match="num_workers must be an int"):
        job.with_num_workers(-2)
    with pytest.raises(JobError, match="5 workers do not divide"):  # the mesh, before Ray
        job.with_num_workers(5)


@pytest.mark.parametrize("mesh, workers, says", [
    ("{dp_shard: 3}", 4, "= 3 ranks, but the run has 4 workers"),
    ("{dp_replicate: 2, dp_shard: -1, tp: 3}", 4, "4 workers do not divide"),
    ("{dp_replicate: 2, dp_shard: 2}\nrun: {min_workers: 2}", 4, "elastic run"),
])
def test_the_mesh_is_checked_against_the_workers_before_ray(mesh, workers, says):
    """Before, ``dp_shard: 3`` over 4 workers parsed, and failed only after Ray started."""
    text = f"train: a:b\nscaling: {{num_workers: {workers}}}\nmesh: {mesh}\n"
    with pytest.raises(JobError, match=says) as err:
        Job.from_dict(load_yaml(text, error=JobError))
    assert "scaling.num_workers" in str(err.value)


@pytest.mark.parametrize("env, nccl, bad", [
    ({"GLOO_SOCKET_IFNAME": "nosuch0"}, False, "GLOO_SOCKET_IFNAME"),
    ({"GLOO_SOCKET_IFNAME": "eth0,nosuch0"}, False, "GLOO_SOCKET_IFNAME"),
    ({"NCCL_SOCKET_IFNAME": "=eth"}, True, "NCCL_SOCKET_IFNAME"),  # exact: no "eth"
    ({"NCCL_SOCKET_IFNAME": "ib"}, True, "NCCL_SOCKET_IFNAME"),
])
def test_user_interface_variables_that_name_nothing(env, nccl, bad):
    problems = user_ifname_problems(env, IFACES, nccl=nccl)
    assert len(problems) == 1 and problems[0].startswith(bad), problems
    assert f"Unset {bad}" in problems[0]


@pytest.mark.parametrize("env, nccl", [
    ({"GLOO_SOCKET_IFNAME": "tailscale0"}, False),
    ({"GLOO_SOCKET_IFNAME": "eth0,lo"}, False),
    ({"NCCL_SOCKET_IFNAME": "eth"}, True),  # a prefix
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, True),  # an exclusion list
    ({"NCCL_SOCKET_IFNAME": "ib"}, False),  # not read by gloo
    ({}, True),
])
def test_user_interface_variables_that_fit(env, nccl):
    assert user_ifname_problems(env, IFACES, nccl=nccl) == []


def test_check_user_ifnames_names_the_node():
    reports = [WorkerReport(rank=0, node_id="a", node_ip="10.0.0.2", hostname="alpha",
                            interfaces=IFACES),
               WorkerReport(rank=1, node_id="b", node_ip="10.0.0.3", hostname="beta",
                            interfaces={"eth1": ["10.0.0.3"]})]
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    with pytest.raises(NetworkError, match=r"node 10\.0\.0\.3 \(beta\).*Unset") as info:
        check_user_ifnames(reports, [env, env], nccl=False)
    assert "alpha" not in str(info.value)


def test_embedded_capacity():
    gb = 2**30
    assert embedded_capacity_problem(4, 8 * gb) is None
    why = embedded_capacity_problem(5000, 8 * gb)
    assert why.startswith("scaling.num_workers") and "at most 16" in why


def test_our_error_is_found_inside_ray_trains_wrappers():
    """As `ray-mesh run` sees a failed pre-flight: ControllerError(PreflightError), pickled
    by the controller actor."""
    from ray.train import ControllerError, WorkerGroupError

    ours = PreflightError("ray_mesh pre-flight failed: node 1 cannot reach node 0")
    wrapped = pickle.loads(pickle.dumps(ControllerError(ours)))
    found = user_error_inside(wrapped, (NetworkError,))
    assert isinstance(found, PreflightError) and str(found) == str(ours)
    group = pickle.loads(pickle.dumps(WorkerGroupError("x", {1: JobError("bad")})))
    assert isinstance(user_error_inside(group, (JobError,)), JobError)
    assert user_error_inside(ControllerError(RuntimeError("other")), (NetworkError,)) is None


def test_a_train_function_that_raised_is_one_line_naming_the_ranks():
    """`ray-mesh run`'s closing line when the user's train function raised (Ray Train's
    WorkerGroupError, pickled as the controller sends it): the ranks and the error, ranks
    that raised the same named together; each rank's traceback is on the console above."""
    from ray.train import ControllerError, WorkerGroupError

    from ray_mesh.cli.preray import train_function_failure

    wrapped_text = RuntimeError("Traceback (most recent call last):\n  File \"t.py\", line 11, "
                                "in train_loop\n    raise ValueError(\"bad batch\")\n"
                                "ValueError: bad batch at step 3\n")
    group = pickle.loads(pickle.dumps(WorkerGroupError("x", {
        1: ValueError("bad batch at step 3"), 0: wrapped_text, 3: KeyError("shard")})))
    assert train_function_failure(group) == ("ranks 0, 1: ValueError: bad batch at step 3; "
                                             "rank 3: KeyError: 'shard'")
    # a rank that failed because another did is named after the cause, whatever its rank
    torn = pickle.loads(pickle.dumps(WorkerGroupError("x", {
        0: ValueError("Could not resolve the process group registered under the name 0"),
        1: RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
        2: ValueError("bad batch at step 3")})))
    assert train_function_failure(torn) == (
        "rank 2: ValueError: bad batch at step 3; rank 0: ValueError: Could not resolve the "
        "process group registered under the name 0; rank 1: RuntimeError: [../gloo/transport/"
        "tcp/pair.cc:534] Connection closed by peer")
    assert train_function_failure(ControllerError(RuntimeError("other"))) is None
    assert train_function_failure(RuntimeError("not Ray's")) is None
