"""Every torch/Ray internal that ray_mesh uses, checked against the installed versions.

One test per wrapper in ``ray_mesh.private_apis``, no mocks: after an upgrade, the failing
test names the wrapper and what changed, instead of a run failing somewhere later. Torch
checks that need a process group run in a subprocess with torch's fake backend (no real
communicator, nothing left in this process).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ray_mesh import private_apis as pa

UPGRADE = (f"ray_mesh.private_apis was checked on torch {pa.CHECKED_TORCH} and Ray "
           f"{pa.CHECKED_RAY}; fix the wrapper for the installed version")


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout, or a failure with its stderr."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, f"{UPGRADE}:\n{proc.stderr[-3000:]}"
    return proc.stdout


# A fake-backend world of 4 (rank 0 of it) and a 2x2x1 mesh, for the DeviceMesh internals.
FAKE_WORLD = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from ray_mesh import private_apis as pa
assert pa.register_fake_pg_backend()
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("a", "b", "c"))
"""


def test_private_apis_import_neither_torch_nor_ray():
    """Only function-level imports of torch/Ray: Ray-free modules may import private_apis."""
    tree = ast.parse(Path(pa.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("torch", "ray")], names
    run_python("""
        import sys
        import ray_mesh.private_apis
        assert "ray" not in sys.modules, "importing ray_mesh.private_apis imported ray"
    """)


def test_every_wrapper_has_a_test_and_a_documented_replacement():
    tests = {n for n in globals() if n.startswith("test_")}
    for name in pa.WRAPPERS:
        obj = getattr(pa, name)
        if not callable(obj) or name == "can_set_mesh_group":  # tested with set_mesh_group
            continue
        assert f"test_{name}" in tests, f"private_apis.{name} has no test here"
        doc = " ".join((inspect.getdoc(obj) or "").split())
        assert "Internal" in doc and "Public replacement" in doc, name
        assert pa.CHECKED_TORCH in doc or pa.CHECKED_RAY in doc, name


# ----------------------------------------------------------------------------- torch
def test_register_fake_pg_backend():
    out = run_python("""
        import torch.distributed as dist
        from ray_mesh import private_apis as pa
        assert pa.register_fake_pg_backend(), "torch.testing._internal...fake_pg is gone"
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
        g = dist.new_group([0, 1], backend="fake")
        print(dist.get_backend(), dist.get_backend(g))
    """)
    assert out.split() == ["fake", "fake"], out


def test_dcp_set_element():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    nested = {"optim": {"param_groups": [{"lr": 0.1, "params": [0]}]}}
    flat, mappings = flatten_state_dict(nested)
    key = next(k for k in flat if k.endswith("lr"))
    pa.dcp_set_element(nested, mappings[key], 0.5)
    assert nested["optim"]["param_groups"][0]["lr"] == 0.5, UPGRADE


def test_flatten_mesh():
    out = run_python(FAKE_WORLD + """
flat = pa.flatten_mesh(mesh[("b", "c")], "bc")
assert flat.mesh_dim_names == ("bc",), flat.mesh_dim_names
# Registered on the root: found by name, with the groups of b (c has size 1).
assert mesh["bc"].size() == 2
assert dist.get_process_group_ranks(mesh.get_group("bc")) == \\
    dist.get_process_group_ranks(mesh.get_group("b"))
pa.flatten_mesh(mesh[("a", "c")], "ac", "fake")  # with a backend override
print(dist.get_backend(mesh.get_group("ac")))
""")
    assert out.strip() == "fake", out


def test_concatenate_meshes():
    out = run_python(FAKE_WORLD + """
flat = pa.flatten_mesh(mesh[("b", "c")], "bc")
both = pa.concatenate_meshes([mesh["a"], flat])
assert both.mesh_dim_names == ("a", "bc"), both.mesh_dim_names
assert tuple(both.mesh.shape) == (mesh["a"].size(), 2), both.mesh.shape
print("ok")
""")
    assert out.strip() == "ok", out


def test_group_sequence_number():
    out = run_python(FAKE_WORLD + """
g = mesh.get_group("b")
print(pa.group_sequence_number(g) is not None or dist.get_backend(g) == "fake")
""")
    assert out.strip() == "True", out


def test_set_mesh_group():
    out = run_python(FAKE_WORLD + """
assert pa.can_set_mesh_group(mesh), "DeviceMesh has no _dim_group_names any more"
flat = pa.flatten_mesh(mesh[("a", "c")], "ac", "fake")
pa.set_mesh_group(flat, mesh.get_group("a"))
# The root mesh and the flattened mesh now answer with a's real group.
assert mesh.get_group("ac") is mesh.get_group("a"), "get_group ignores _dim_group_names"
assert mesh["ac"].get_group() is mesh.get_group("a")
print("ok")
""")
    assert out.strip() == "ok", out


def test_root_mesh():
    out = run_python(FAKE_WORLD + """
flat = pa.flatten_mesh(mesh[("b", "c")], "bc")
assert pa.root_mesh(mesh) is mesh
assert pa.root_mesh(mesh["a"]) is mesh, "a slice no longer answers its root"
assert pa.root_mesh(mesh[("a", "b")]) is mesh
assert pa.root_mesh(flat) is mesh, "a flattened dim no longer answers its root"
print("ok")
""")
    assert out.strip() == "ok", out


def test_release_mesh_groups():
    out = run_python(FAKE_WORLD + """
import gc, weakref
pa.flatten_mesh(mesh[("a", "b")], "ab")
names = {mesh.get_group(d).group_name for d in ("a", "b", "c", "ab")}
groups = pa.release_mesh_groups(mesh["a"])  # a submesh: its root's registry is emptied
assert names <= {g.group_name for g in groups}, "DeviceMesh._pg_registry misses a group"
assert pa.release_mesh_groups(mesh) == [], "the registry still holds groups"
refs = [weakref.ref(g) for g in groups]
del groups
dist.destroy_process_group()
gc.collect()
# The mesh is still referenced here, but no longer keeps any group alive.
print(sum(r() is not None for r in refs))
""")
    assert out.strip() == "0", out


def test_has_batch_p2p_wait_fix():
    from torch.distributed.pipelining import schedules

    assert pa.has_batch_p2p_wait_fix(), (
        f"{UPGRADE}: torch.distributed.pipelining.schedules._wait_batch_p2p is gone, so "
        f"known_hang() would refuse every schedule but GPipe on gloo. Find the new way to "
        f"tell that batched p2p waits on all its works.")
    assert callable(schedules._wait_batch_p2p)


# ----------------------------------------------------------------------------- Ray
def test_v2_worker_group_type():
    cls = pa.v2_worker_group_type()
    assert cls is not None, f"{UPGRADE}: Ray Train V2's WorkerGroup moved"
    assert cls.__name__ == "WorkerGroup"
    assert list(inspect.signature(cls.shutdown).parameters) == ["self"], \
        f"{UPGRADE}: WorkerGroup.shutdown() changed its signature"


def test_startup_timeout_error_type():
    from ray.train import ControllerError

    from ray_mesh.raytrain.elastic import explain_startup_failure

    cls = pa.startup_timeout_error_type()
    assert issubclass(cls, Exception)
    err = cls(num_workers=4)
    assert "startup timed out" in str(err).lower(), (
        f"{UPGRADE}: the message changed ({err}); explain_startup_failure matches it")
    assert explain_startup_failure(ControllerError(err), 4) is not None


def test_enable_token_auth():
    setup = importlib.import_module("ray._private.authentication.authentication_token_setup")
    fn = setup.maybe_enable_token_auth_if_token_available
    assert "warn_if_disabled" in inspect.signature(fn).parameters, \
        f"{UPGRADE}: maybe_enable_token_auth_if_token_available lost warn_if_disabled"
    # The call changes Ray's process-wide auth state: make it in a child process.
    out = run_python("""
        from ray_mesh import private_apis as pa
        print(type(pa.enable_token_auth()).__name__)
    """)
    assert out.strip() == "bool", out


def test_quiet_default_auth_notice():
    """Ray's logger still logs the notice as the wrapper expects it, and inside the block
    only that record is dropped."""
    import logging

    setup = importlib.import_module("ray._private.authentication.authentication_token_setup")

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    logger, keep = logging.getLogger(setup.__name__), Keep()
    logger.addHandler(keep)  # Ray's loggers need not reach the root's handlers
    try:
        with pa.quiet_default_auth_notice():
            setup._warn_token_auth_enabled()
            logger.warning("Token authentication is disabled for this Ray cluster. ...")
        setup._warn_token_auth_enabled()
    finally:
        logger.removeHandler(keep)
    said = [r.getMessage() for r in keep.records]
    assert len(said) == 2 and said[0].startswith("Token authentication is disabled"), said
    assert said[1].startswith(pa.DEFAULT_AUTH_NOTICE), f"{UPGRADE}: Ray's notice is {said}"
    assert not logger.filters


def test_auth_headers():
    http = importlib.import_module("ray._private.authentication.http_token_authentication")
    assert len(inspect.signature(http.get_auth_headers_if_auth_enabled).parameters) == 1
    headers = pa.auth_headers()
    assert isinstance(headers, dict)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())


def test_dashboard_url_from_gcs():
    utils = importlib.import_module("ray.dashboard.utils")
    fn = getattr(utils, "ray_address_to_api_server_url", None)
    assert fn is not None, f"{UPGRADE}: ray.dashboard.utils.ray_address_to_api_server_url gone"
    assert list(inspect.signature(fn).parameters) == ["address"], inspect.signature(fn)


def test_gcs_ping():
    grpc = pytest.importorskip("grpc")
    from ray.core.generated import gcs_service_pb2

    service, method = pa.GCS_CLUSTER_ID_METHOD.strip("/").split("/")
    svc = gcs_service_pb2.DESCRIPTOR.services_by_name.get(service.rsplit(".", 1)[1])
    assert svc is not None and svc.full_name == service, f"{UPGRADE}: no {service}"
    rpc = svc.methods_by_name.get(method)
    assert rpc is not None, f"{UPGRADE}: {service} has no {method}"
    # The wrapper sends an empty request: valid only while the request has no fields set.
    request = getattr(gcs_service_pb2, rpc.input_type.name)()
    assert request.SerializeToString() == b""
    # And it is a real, bounded gRPC call: nothing listens on a fresh port.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
            pytest.raises(grpc.RpcError) as err:
        pa.gcs_ping(channel, 2.0)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_data_config_settings():
    from ray.data import ExecutionOptions
    from ray.train import DataConfig

    options = ExecutionOptions(preserve_order=True)
    split, opts, locality = pa.data_config_settings(
        DataConfig(datasets_to_split=["train"], execution_options=options,
                   enable_shard_locality=False))
    assert split == ["train"] and opts is options and locality is False, (
        f"{UPGRADE}: DataConfig stores its arguments elsewhere")


def test_replace_run_data_config():
    """The attributes it reaches are where Ray 2.60 keeps them. The swap itself, on a live
    trainer, is tests/ray/test_mesh_data_ray.py."""
    from ray.train import DataConfig
    from ray.train.v2._internal.callbacks.datasets import (
        DatasetsCallback,
        RayDatasetShardProvider,
    )
    from ray.train.v2._internal.data_integration.dataset_manager import DatasetManager

    for cls, attrs in ((DatasetsCallback, ("_datasets", "_data_config",
                                           "_dataset_shard_provider")),
                       (RayDatasetShardProvider, ("_dataset_manager",)),
                       (DatasetManager, ("_data_config", "_dataset_iterators"))):
        source = inspect.getsource(cls.__init__)
        for attr in attrs:
            assert f"self.{attr} =" in source or f"self.{attr}:" in source, (
                f"{UPGRADE}: {cls.__name__}.{attr} is gone")

    class Group:  # a worker group with no datasets callback: nothing to replace
        _callbacks = ()

    assert pa.replace_run_data_config(Group(), lambda cfg: DataConfig()) == "none"


def test_is_head_node():
    constants = importlib.import_module("ray._common.constants")
    assert constants.HEAD_NODE_RESOURCE_NAME == pa.HEAD_NODE_RESOURCE, (
        f"{UPGRADE}: Ray's head-node resource is now {constants.HEAD_NODE_RESOURCE_NAME!r}")
    assert pa.is_head_node({"CPU": 2.0, pa.HEAD_NODE_RESOURCE: 1.0})
    assert not pa.is_head_node({"CPU": 2.0, "node:10.0.0.2": 1.0})


def test_start_autoscaling_coordinator():
    """What it relies on in Ray 2.60: the coordinator is made on first use, named, detached
    and got-if-exists on its creator's node, and Ray Train's controller asks it with a 5 s
    get (the wait the warm-up spares a busy machine). Without a Ray it gives None. The
    warm-up on a live Ray is tests/ray/test_console_examples.py's console under load."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client

    source = inspect.getsource(dac.get_or_create_autoscaling_coordinator)
    for part in ("get_if_exists=True", 'lifetime="detached"', "get_node_id()"):
        assert part in source, f"{UPGRADE}: get_or_create_autoscaling_coordinator lost {part}"
    assert autoscaling_coordinator_client.AUTOSCALING_REQUESTS_GET_TIMEOUT_S == 5
    assert pa.start_autoscaling_coordinator() is None  # no Ray here: nothing to warm


def test_worker_output_printed():
    """Ray's ray.init registers its printing handler under the name the wrapper looks for
    only with log_to_driver on; without it the wrapper says no line will be printed."""
    from ray._private import worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    assert '"ray_print_logs"' in inspect.getsource(worker.connect), \
        f"{UPGRADE}: ray.init no longer registers its printing handler as ray_print_logs"
    assert not pa.worker_output_printed()  # no Ray here
    dispatcher.add_handler("ray_print_logs", lambda data: None)
    try:
        assert pa.worker_output_printed()
    finally:
        dispatcher.remove_handler("ray_print_logs")
    assert not pa.worker_output_printed()


def test_watch_worker_output():
    """The driver's printing thread hands each batch of worker output to the dispatcher
    the wrapper registers with; a batch reaches the handler, a handler that raises does
    not stop the next handler, and the returned function unregisters it."""
    from ray._private import worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    assert worker.global_worker_stdstream_dispatcher is dispatcher, UPGRADE
    assert "global_worker_stdstream_dispatcher.emit(data)" in inspect.getsource(
        worker.Worker.print_logs), f"{UPGRADE}: the printing thread no longer emits batches"
    got: list[dict] = []

    def boom(data: dict) -> None:
        raise RuntimeError("a broken watcher")

    stop_boom = pa.watch_worker_output(boom)
    stop = pa.watch_worker_output(got.append)
    batch = {"lines": ["run: step 3/3 loss 1.0"], "pid": 7, "ip": "10.0.0.1", "is_err": False}
    try:
        dispatcher.emit(batch)
    finally:
        stop_boom()
        stop()
    dispatcher.emit(batch)
    assert got == [batch]
