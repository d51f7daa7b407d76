"""Every use of a torch or Ray internal, each in one small wrapper, checked on one version.

ray_mesh uses public APIs where they exist. Where none does, the internal use lives here
and nowhere else, so that an upgrade breaks one place and ``tests/unit/test_private_apis.py``
says which: it runs each wrapper against the installed torch and Ray, without mocks. Each
docstring names the version it was checked on and the public API that would replace it.
Internals live here; workarounds for upstream *behaviour* are registered in
:mod:`ray_mesh.upstream`.

Checked on torch 2.13.0 and Ray 2.60.0 (Train V2). Everything imports lazily inside the
wrappers: this module imports neither torch nor Ray, so Ray-free modules can use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

CHECKED_TORCH = "2.13.0"
CHECKED_RAY = "2.60.0"


# ----------------------------------------------------------------------------- torch
def register_fake_pg_backend() -> bool:
    """Make torch's ``"fake"`` process-group backend creatable; False if this torch lacks it.

    Internal: ``torch.testing._internal.distributed.fake_pg`` registers the backend's creator
    on import (torch 2.13.0 lists ``"fake"`` in ``Backend.backend_list`` without it, but
    ``new_group(backend="fake")`` then fails with "Unknown c10d backend type FAKE").
    ``torch.distributed.fsdp`` and ``init_process_group(backend="fake")`` import it
    themselves; importing it here makes ray_mesh independent of what the user imported.
    Public replacement: none in torch 2.13 (a public fake backend for disabled mesh dims).
    """
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError:
        return False
    return True


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (a flattened key's mapping) of a nested state dict.

    Internal: ``torch.distributed.checkpoint._nested_dict.set_element``, the helper DCP's
    ``DefaultLoadPlanner.load_bytes`` writes an unflattened bytes entry back with (torch
    2.13.0). ray_mesh's load planner (``checkpointing/safe_load.py``) replaces only the
    unpickling of that method and must write the entry back the same way. Public
    replacement: none in torch 2.13 (a planner hook that receives the loaded object).
    """
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)


def flatten_mesh(mesh: Any, name: str, backend_override: Any = None) -> Any:
    """``mesh._flatten(mesh_dim_name=name, backend_override=...)``: a named flattened dim.

    Internal: ``DeviceMesh._flatten`` (torch 2.13.0; ``backend_override`` since 2.8). It
    registers the flattened dim on the root mesh so that ``mesh[name]`` and
    ``mesh.get_group(name)`` find it. Public replacement: a public ``DeviceMesh.flatten`` /
    ``_unflatten`` pair is planned upstream; none in torch 2.13.
    """
    return mesh._flatten(mesh_dim_name=name, backend_override=backend_override)


def concatenate_meshes(parts: list[Any]) -> Any:
    """One DeviceMesh whose dims are the 1-D meshes ``parts`` (of one root), in order.

    Internal: ``DeviceMesh._concatenate`` (torch 2.13.0), what slicing several dims does
    inside torch; it reuses the parts' process groups. ray_mesh needs it to join a kept
    flattened mesh with a named dim without slicing the flattened dim from the root mesh
    (deprecated since torch 2.11). Public replacement: none in torch 2.13.
    """
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(parts)


def group_sequence_number(group: Any) -> int | None:
    """torch's count of collectives issued on ``group`` (None where a backend keeps none).

    Internal: ``ProcessGroup._get_sequence_number_for_group`` (torch 2.13.0, gloo and NCCL):
    the hang watch compares it across ranks to name who did not arrive. Public replacement:
    the flight recorder's dumps (NCCL) hold the same counters; none for gloo in torch 2.13.
    """
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - fake groups and backends without a counter
        return None


def can_set_mesh_group(mesh: Any) -> bool:
    """True when this torch's DeviceMesh finds its groups by ``_dim_group_names``."""
    return hasattr(mesh, "_dim_group_names")


def set_mesh_group(mesh: Any, group: Any) -> None:
    """Point a 1-D mesh (e.g. a flattened dim) at an existing process group.

    Internal: ``DeviceMesh._dim_group_names`` (torch 2.13.0), the list of group names that
    ``get_group`` resolves; ``DeviceMesh.from_group`` sets it the same way. Public
    replacement: none in torch 2.13 for registering an existing group as a flattened dim
    (``DeviceMesh.from_group`` builds a new, separate mesh).
    """
    mesh._dim_group_names = [group.group_name]


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced or flattened from (``mesh`` itself for a root mesh).

    Internal: ``DeviceMesh._get_root_mesh`` (torch 2.13.0; a slice ``mesh["tp"]`` and a
    flattened dim both answer the mesh they came from). Public replacement: none in torch
    2.13 (a slice keeps no public link to its parent).
    """
    return mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh


def release_mesh_groups(mesh: Any) -> list[Any]:
    """Empty the process-group registry of ``mesh``, of its root and of the root's flattened
    meshes; returns the groups they held, each once.

    Internal: ``DeviceMesh._pg_registry`` and ``DeviceMesh._flatten_mapping`` (torch 2.13.0).
    The root mesh keeps a strong reference to the group of every dim and flattened dim (a
    registry for torch.compile, cf. pytorch#172272) that ``destroy_process_group`` does not
    drop: a mesh still referenced keeps every communicator, and its threads, alive until
    interpreter exit. Call it after ``destroy_process_group``, when the names no longer
    resolve anyway. Public replacement: none in torch 2.13 (no DeviceMesh teardown, and
    ``destroy_process_group`` leaves the registry alone).
    """
    root = root_mesh(mesh)
    groups: dict[int, Any] = {}
    for m in (mesh, root, *getattr(root, "_flatten_mapping", {}).values()):
        registry = getattr(m, "_pg_registry", None)
        if registry:
            for group in registry.values():
                groups.setdefault(id(group), group)
            registry.clear()
    return list(groups.values())


def has_batch_p2p_wait_fix() -> bool:
    """True when torch pipelining waits on every ``Work`` of a batched send/recv.

    Internal: the presence of ``torch.distributed.pipelining.schedules._wait_batch_p2p``
    (added by pytorch#152938, torch 2.8; present in 2.13.0) is the feature test for the fix
    of the gloo deadlock in pytorch#132644. Public replacement: a torch version check
    (``torch >= 2.8``), which would misjudge backports and nightlies.
    """
    from torch.distributed.pipelining import schedules

    return hasattr(schedules, "_wait_batch_p2p")


# ----------------------------------------------------------------------------- Ray
def v2_worker_group_type() -> type | None:
    """Ray Train V2's ``WorkerGroup`` class, or None under Ray Train V1.

    Internal: ``ray.train.v2._internal.execution.worker_group.worker_group.WorkerGroup``
    (Ray 2.60.0), to shut down a group whose backend hook raised (Ray leaks it otherwise;
    see ``ray_mesh.raytrain.backend``). Public replacement: none; the leak itself is the
    upstream bug to fix, after which this goes.
    """
    try:
        from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    except ImportError:
        return None
    return WorkerGroup


def start_autoscaling_coordinator() -> Any:
    """Start Ray's autoscaling coordinator actor now, on this node; returns the reference its
    ``__ray_ready__`` answers on (the caller waits, bounded), or None where this Ray has none
    or no Ray is connected.

    Why: Ray Train 2.60's controller, on the driver's node, creates that actor on its first
    resource request and gives the request a 5 s ``ray.get``. On a busy machine starting a
    new actor process takes longer, and the controller logs a WARNING with the whole
    ``GetTimeoutError`` traceback into the user's console (then retries 20 s later). The
    actor is named, detached and pinned to its creator's node, so one made here from the
    driver is the one the controller finds.

    Internal: ``ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator.
    get_or_create_autoscaling_coordinator`` (Ray 2.60.0). Public replacement: none.
    """
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:
        return None
    import ray

    if not ray.is_initialized():  # its remote() would start a Ray of its own
        return None
    try:
        return get_or_create_autoscaling_coordinator().__ray_ready__.remote()
    except Exception:  # noqa: BLE001 - a warm-up: Ray Train makes the actor itself anyway
        return None


def startup_timeout_error_type() -> type:
    """Ray Train V2's ``WorkerGroupStartupTimeoutError`` (a group that could not start).

    Internal: ``ray.train.v2._internal.exceptions`` (Ray 2.60.0). ray_mesh matches the error
    by its name and message (``raytrain.elastic.explain_startup_failure``); tests build one.
    Public replacement: ``ray.train.ControllerError`` wraps it; no public subclass.
    """
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return WorkerGroupStartupTimeoutError


_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"
_TOKEN_HTTP = "ray._private.authentication.http_token_authentication"


def enable_token_auth() -> bool:
    """Load this machine's Ray cluster token, if any, for the calls that follow; quietly.

    Internal: ``ray._private.authentication.authentication_token_setup.
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)`` (Ray 2.60.0). Its
    logger's note on the auth default is dropped (:func:`quiet_default_auth_notice`).
    Public replacement: ``ray.init`` does it for a driver; there is none for a process that
    only talks HTTP to the dashboard.
    False when this Ray has no token auth.
    """
    import importlib

    try:
        setup = importlib.import_module(_TOKEN_SETUP)
    except ImportError:
        return False
    with quiet_default_auth_notice():
        return bool(setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


DEFAULT_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."
"""How Ray 2.60.0's WARNING begins when a new local Ray turns token auth on by default."""


@contextmanager
def quiet_default_auth_notice() -> Iterator[None]:
    """Inside the block, drop Ray's WARNING that a new local Ray turned token
    authentication on by default (:data:`DEFAULT_AUTH_NOTICE`), and only that record.

    Internal: the logger of ``ray._private.authentication.authentication_token_setup``
    (Ray 2.60.0), which logs it at every ``ray.init()`` that starts a Ray with
    ``RAY_AUTH_MODE`` unset. Setting the variable instead does not do: the driver's cached
    Ray config, read at ``import ray``, then sends no token and the start fails
    (upstream: ray-auth-default-warning). Public replacement: none (a quieter level for
    Ray's notice of its own default).
    """

    class _DropDefaultNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(DEFAULT_AUTH_NOTICE)

    quiet = _DropDefaultNotice()
    logger = logging.getLogger(_TOKEN_SETUP)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def auth_headers() -> dict[str, str]:
    """The HTTP headers that carry the cluster token (empty when auth is off).

    Internal: ``ray._private.authentication.http_token_authentication.
    get_auth_headers_if_auth_enabled({})`` (Ray 2.60.0). Public replacement: none; the
    dashboard's REST API has no public client that adds them.
    """
    import importlib

    try:
        http = importlib.import_module(_TOKEN_HTTP)
    except ImportError:
        return {}
    return dict(http.get_auth_headers_if_auth_enabled({}))


def dashboard_url_from_gcs(address: str) -> str:
    """The dashboard URL the GCS at ``address`` advertises (``http://host:port``).

    Internal module: ``ray.dashboard.utils.ray_address_to_api_server_url`` (Ray 2.60.0;
    needs ``ray[default]``). It blocks on the GCS: call it in a bounded thread. Public
    replacement: ``ray.init(address).dashboard_url``, which joins the cluster as a driver.
    """
    from ray.dashboard.utils import ray_address_to_api_server_url

    return str(ray_address_to_api_server_url(address))


TRAIN_ERROR_LOGGERS = ("ray.train.v2._internal.execution.callback_manager",
                      "ray.train.v2._internal.execution.controller.controller")
"""Ray Train V2's loggers that log a callback's error with its traceback (2.60.0)."""


def quiet_callback_traceback(types: tuple[type[BaseException], ...]) -> None:
    """In the controller: log an error of ``types`` from a callback (our backend's on_start)
    as its message only. Ray Train logs it with ``logger.exception`` before wrapping it in a
    ``ControllerError``; the driver then shows our message once, as one line."""
    import logging

    class _Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            exc = record.exc_info[1] if record.exc_info else None
            if isinstance(exc, types):
                text = record.getMessage()
                record.exc_info, record.exc_text, record.args = None, None, None
                record.msg = text if str(exc) in text else f"{text} {exc}"
            return True

    for name in TRAIN_ERROR_LOGGERS:
        logger = logging.getLogger(name)
        if not any(type(f).__name__ == "_Quiet" for f in logger.filters):
            logger.addFilter(_Quiet())


TRAIN_FAILURE_LOGGER = "ray.train.v2._internal.execution.failure_handling.default"
"""Ray Train V2's failure policy's logger: each decision with the error's whole text (2.60.0)."""

GCS_CLUSTER_ID_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""Raw gRPC method name of the GCS call that every Ray client makes first (Ray 2.60.0)."""


def gcs_ping(channel: Any, timeout_s: float) -> None:
    """One bounded gRPC call to a Ray GCS over ``channel``; raises ``grpc.RpcError``.

    Internal: the GCS's gRPC method ``NodeInfoGcsService/GetClusterId`` with an empty
    request (Ray 2.60.0), whose answer, even UNAUTHENTICATED, proves a GCS listens. Public
    replacement: ``ray.init(address)``, which can block for minutes on a wrong address.
    """
    channel.unary_unary(GCS_CLUSTER_ID_METHOD)(b"", timeout=timeout_s)


def data_config_settings(config: Any) -> tuple[Any, Any, bool]:
    """A ``ray.train.DataConfig``'s constructor arguments back (datasets_to_split,
    execution options, shard locality), to rebuild it as a mesh-aware one.

    Internal: the private attributes ``DataConfig.__init__`` stores them in (Ray 2.60.0,
    ``ray/train/_internal/data_config.py``). Public replacement: none (no getters).
    """
    return (config._datasets_to_split, config._user_execution_options,
            config._enable_shard_locality)


def _set_manager_config(manager: Any, config: Any) -> bool:
    """Runs inside Ray Train's DatasetManager actor: use ``config`` for its first split."""
    if manager._dataset_iterators:
        return False
    manager._data_config = config
    return True


def replace_run_data_config(worker_group: Any, decide: Any, timeout_s: float = 60) -> str:
    """Replace the ``DataConfig`` of the running trainer by ``decide(current)``.

    Returns ``"none"`` when the group has no datasets to split, ``"kept"`` when ``decide``
    returned the current config, ``"replaced"`` when it was swapped in time, ``"late"`` when
    the datasets were already split (too late to change).

    Internal (Ray 2.60.0, Train V2): the controller's ``DatasetsCallback`` (found in the
    worker group's ``_callbacks``) keeps the trainer's ``DataConfig`` in ``_data_config`` and,
    before the backend's ``on_start``, has already started a ``DatasetManager`` actor
    (``_dataset_shard_provider._dataset_manager``) holding a copy; that actor calls
    ``configure`` lazily, at the first ``get_dataset_shard``, i.e. after ``on_start``. Both
    are updated: the actor through ``__ray_call__`` (the current group), the callback for
    the groups of later restarts. Public replacement: a mesh-aware ``DataConfig`` in Ray
    itself (Ray PR #60439, ``DeviceMeshConfig``), or a backend hook that sees the datasets;
    until then ``dataset_config=ray_mesh.MeshDataConfig(mesh=...)`` needs none of this.
    """
    import ray

    callbacks = [cb for cb in getattr(worker_group, "_callbacks", ())
                 if type(cb).__name__ == "DatasetsCallback"]
    if not callbacks or not getattr(callbacks[0], "_datasets", None):
        return "none"
    callback = callbacks[0]
    new = decide(callback._data_config)
    if new is callback._data_config:
        return "kept"
    callback._data_config = new
    provider = callback._dataset_shard_provider
    if provider is not None:
        manager = provider._dataset_manager
        if not ray.get(manager.__ray_call__.remote(_set_manager_config, new),
                       timeout=timeout_s):
            return "late"
    return "replaced"


HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The resource Ray puts on the head node only (``ray._common.constants``, Ray 2.60.0)."""


def is_head_node(resources: Mapping[str, Any]) -> bool:
    """True for the head node's entry of ``ray.nodes()`` (by its ``Resources`` mapping).

    Internal: the ``node:__internal_head__`` resource name (Ray 2.60.0,
    ``ray._common.constants.HEAD_NODE_RESOURCE_NAME``). Public replacement:
    ``ray.util.state.list_nodes()``'s ``is_head_node`` (needs the dashboard).
    """
    return HEAD_NODE_RESOURCE in resources


def watch_worker_output(handler: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call ``handler`` with every batch of worker output this driver receives, after Ray
    has printed it (a dict with ``lines``, ``pid``, ``ip``, ...); returns the function that
    stops it. ``handler`` runs in Ray's printing thread: it must be quick and must not raise
    (an exception there would end the printing of every later line), so it is wrapped.

    Internal: ``ray._private.ray_logging.global_worker_stdstream_dispatcher``'s
    ``add_handler`` / ``remove_handler`` (Ray 2.60.0; Ray's own printing thread and its
    client server register there). Public replacement: none; ``ray.init(log_to_driver=)``
    only turns the printing on or off.
    """
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    name = f"ray_mesh_watch_{id(handler):x}"

    def safe(data: dict[str, Any]) -> None:
        try:
            handler(data)
        except Exception:  # noqa: BLE001 - never break Ray's printing of the next lines
            logging.getLogger(__name__).debug("ray_mesh: output watcher failed", exc_info=True)

    dispatcher.add_handler(name, safe)
    return lambda: dispatcher.remove_handler(name)


def worker_output_printed() -> bool:
    """Whether Ray prints the workers' output on this driver: ``ray.init(log_to_driver=)``
    True (the default; False in a driver that keeps its console to itself, as
    ``benchmarks/run.py`` does). Without it no worker line ever reaches this console, so
    nothing should wait for one.

    Internal: the handler Ray's ``ray.init`` registers in
    ``ray._private.ray_logging.global_worker_stdstream_dispatcher`` under the name
    ``"ray_print_logs"`` when ``log_to_driver`` is on (Ray 2.60.0). Public replacement: none
    (the setting is not kept anywhere public).
    """
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    return any(name == "ray_print_logs" for name, _ in list(dispatcher.handlers))


WRAPPERS = (
    # The register of wrappers and their constants: tests/unit/test_private_apis.py holds
    # every callable here to a test of its own and to its docstring's "Internal" and "Public
    # replacement".
    "CHECKED_RAY",
    "CHECKED_TORCH",
    "GCS_CLUSTER_ID_METHOD",
    "HEAD_NODE_RESOURCE",
    "auth_headers",
    "can_set_mesh_group",
    "dashboard_url_from_gcs",
    "dcp_set_element",
    "data_config_settings",
    "enable_token_auth",
    "DEFAULT_AUTH_NOTICE",
    "quiet_default_auth_notice",
    "flatten_mesh",
    "gcs_ping",
    "has_batch_p2p_wait_fix",
    "is_head_node",
    "register_fake_pg_backend",
    "release_mesh_groups",
    "replace_run_data_config",
    "set_mesh_group",
    "startup_timeout_error_type",
    "v2_worker_group_type",
    "watch_worker_output",
    "worker_output_printed",
    "start_autoscaling_coordinator",
)
