"""Driver-side storage checks: a storage_path that cannot hold checkpoints fails at start.

Two ways a run loses its checkpoints late: a path nobody can write (found at the first save,
after the first N steps of work), and a path that is local to each node on a multi-node
cluster (every node writes its own shards into its own disk; the directory Ray records holds
a fraction of a checkpoint, and a restart on another node finds nothing). Both are checked
here before ``fit()``: a probe file is written from the driver and every alive Ray node is
asked whether it sees it.
"""

from __future__ import annotations

import ipaddress
import os
import uuid
from pathlib import Path
from typing import Any

import ray

from ray_mesh.checkpointing.bucket_probe import PROBE_PREFIX, check_object_storage, endpoint_of
from ray_mesh.checkpointing.names import StorageError, check_run_name
from ray_mesh.core.object_store import check_location
from ray_mesh.core.object_store import is_uri as _is_uri


def default_storage_path() -> str:
    """Where Ray Train stores runs when RunConfig(storage_path=None): ``~/ray_results``."""
    from ray.train import RunConfig

    return str(RunConfig().storage_path)


def _sees_probe(path: str, token: str) -> tuple[str, bool]:
    ip = ray.util.get_node_ip_address()
    try:
        return ip, Path(path).read_text() == token
    except OSError:
        return ip, False


def _check_nodes(probe: Path, token: str, timeout_s: float) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    task = ray.remote(num_cpus=0, max_retries=0)(_sees_probe)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(str(probe), token) for n in nodes]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [nodes[refs.index(r)]["NodeManagerAddress"] for r in pending]
        raise StorageError(
            f"Could not check within {timeout_s:.0f} s whether nodes {late} see storage_path "
            f"{probe.parent}: a task on them did not run. Check `ray status` (are those nodes "
            f"alive?), then retry."
        )
    blind = sorted(ip for ip, ok in ray.get(refs) if not ok)
    if blind:
        raise StorageError(
            f"storage_path {str(probe.parent)!r} is local to each node: a file written there "
            f"on the driver's node is not visible on nodes {blind}. Checkpoint shards written "
            f"by those nodes would be lost, and a restart could not find them. Use a shared "
            f"filesystem mounted at the same path on every node (NFS, a cluster filesystem), "
            f"or a cloud URI (s3://bucket/path, gs://bucket/path)."
        )


def _node_probe(path: str, endpoint: str | None, timeout_s: float) -> tuple[str, str | None]:
    """On one node: the bucket probe with that node's own credentials; (ip, why not)."""
    from ray_mesh.errors import RayMeshError

    ip = ray.util.get_node_ip_address()
    try:
        check_object_storage(path, endpoint, timeout_s=timeout_s)
        return ip, None
    except RayMeshError as exc:
        return ip, str(exc)


def refuse_loopback(path: str, endpoint: str | None, nodes: int) -> None:
    """An endpoint on loopback (``ray-mesh storage serve``'s default host) names a different
    server on every machine: the driver's own probe passes, the other nodes find nothing
    there (or another server). Refused by its name, before any node is asked."""
    from ray_mesh.errors import ObjectStoreError

    where = endpoint_of(path, endpoint)
    if where is None or nodes < 2:
        return
    url, host, port = where
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in ("localhost", "localhost.localdomain")
    if loopback:
        raise ObjectStoreError(
            f"storage endpoint {url} is on loopback, which is each machine's own: the "
            f"{nodes - 1} other node(s) of this cluster cannot reach the server there. Serve "
            f"the bucket on an address every node reaches (`ray-mesh storage serve --host "
            f"$(tailscale ip -4) --port {port}` on the head) and name that address in "
            f"storage_endpoint.")


def _check_nodes_uri(path: str, endpoint: str | None, timeout_s: float,
                     nodes: list[dict]) -> None:
    """Every alive node (``nodes``, Ray's records) probes the bucket itself: its workers use
    its own credentials (the AWS environment ``ray start`` ran with) and its own route to
    the endpoint."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_mesh.errors import ObjectStoreError

    task = ray.remote(num_cpus=0, max_retries=0)(_node_probe)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(path, endpoint, timeout_s) for n in nodes]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 30)
    if pending:
        late = [nodes[refs.index(r)]["NodeManagerAddress"] for r in pending]
        raise ObjectStoreError(
            f"Could not check within {timeout_s + 30:.0f} s whether nodes {late} can write "
            f"{path}: a task on them did not run. Check `ray status`, then retry.")
    for ip, why in sorted(ray.get(refs), key=lambda r: r[0]):
        if why:
            raise ObjectStoreError(f"on node {ip}: {why} (each node uses the AWS credentials "
                                   f"its `ray start` ran with)")


def check_storage(storage_path: str | os.PathLike | None, *, timeout_s: float = 60.0,
                  name: str | None = None, endpoint: str | None = None,
                  nodes: bool = True) -> str:
    """The storage_path to give RunConfig, checked; raises :class:`StorageError`.

    * ``name``: the RunConfig name, when given, must be one safe path component
      (:func:`check_run_name`).

    * ``None``: Ray Train's default (``~/ray_results``), checked like any local path.
    * a local path: made absolute, created, written to; on a Ray cluster of several nodes
      (``ray.init`` already called), every alive node must see the probe file, else the
      path is node-local and refused.
    * a URI (``s3://``, ``gs://``, ...; ``endpoint``: the URL of an S3-compatible server):
      the endpoint must answer, the bucket exist, and a probe object with a fresh name is
      written, read back and deleted (:mod:`ray_mesh.checkpointing.bucket_probe`); each
      failure is one :class:`~ray_mesh.errors.ObjectStoreError` line saying what to fix.
      With ``ray.init`` called, every alive node repeats the probe with its own credentials
      and route, and a node that fails is named.

    ``nodes=False``: the driver's probe only, even with Ray up (``ray-mesh run`` probes
    before Ray starts, then asks the nodes once Ray is up: :func:`check_storage_nodes`).

    Stability: stable
    """
    if name is not None:
        check_run_name(name)
    path = str(storage_path) if storage_path is not None else default_storage_path()
    check_location(path, endpoint)
    if _is_uri(path):
        alive = _alive_nodes() if nodes else []
        refuse_loopback(path, endpoint, len(alive))  # before the driver's probe: it passes
        check_object_storage(path, endpoint, timeout_s=timeout_s)
        if alive:
            _check_nodes_uri(path, endpoint, timeout_s, alive)
        return path
    local = Path(absolute_storage_path(path))
    token = uuid.uuid4().hex
    probe = local / f"{PROBE_PREFIX}{token}"
    try:
        local.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    except OSError as exc:
        raise StorageError(
            f"storage_path {str(local)!r} is not writable: {type(exc).__name__}: {exc}. "
            f"Checkpoints would fail at the first save. Pick a directory this user can write "
            f"(on a cluster: a shared filesystem mounted on every node, or a cloud URI)."
        ) from exc
    try:
        if nodes and ray.is_initialized():
            _check_nodes(probe, token, timeout_s)
    finally:
        probe.unlink(missing_ok=True)
    return str(local)


def absolute_storage_path(storage_path: str | os.PathLike | None) -> str:
    """What :func:`check_storage` returns for a path, without probing it: a URI as given,
    a local path (``file://`` or not) absolute, None Ray Train's default."""
    path = str(storage_path) if storage_path is not None else default_storage_path()
    if _is_uri(path):
        return path
    return str(Path(path.removeprefix("file://")).expanduser().absolute())


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")] if ray.is_initialized() else []


def check_storage_nodes(storage_path: str, *, endpoint: str | None = None,
                        timeout_s: float = 60.0) -> None:
    """The nodes' half of :func:`check_storage`, for a path the driver already probed (its
    return value): every alive node probes a bucket itself, and on a cluster of several
    nodes each must see a file the driver writes into a local path. Needs ``ray.init``."""
    if _is_uri(storage_path):
        alive = _alive_nodes()
        refuse_loopback(storage_path, endpoint, len(alive))
        if alive:
            _check_nodes_uri(storage_path, endpoint, timeout_s, alive)
        return
    if len(_alive_nodes()) < 2:  # one node: the driver's probe was on it
        return
    token = uuid.uuid4().hex
    probe = Path(storage_path) / f"{PROBE_PREFIX}{token}"
    try:
        probe.write_text(token)
    except OSError as exc:
        raise StorageError(f"storage_path {storage_path!r} is no longer writable: "
                           f"{type(exc).__name__}: {exc}. Pick a directory this user can "
                           f"write (a shared filesystem on every node, or a cloud URI).") from exc
    try:
        _check_nodes(probe, token, timeout_s)
    finally:
        probe.unlink(missing_ok=True)


def check_seen_by_all_ranks(directory: str | os.PathLike, group: Any = None) -> None:
    """Collective, in the train function: rank 0 writes a probe into ``directory`` and every
    rank must read it back; else :class:`StorageError` naming the ranks and nodes that
    cannot, before any training step.

    Without it a node-local ``storage_path`` used through the Python API (which does not go
    through :func:`check_storage`) fails at the first checkpoint save, after ``every``
    steps of work (the virtual cluster, where each node has its own files, shows it).
    """
    import torch.distributed as dist

    from ray_mesh.checkpointing.sharded import _barrier, _rank, broadcast_from_rank0

    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    token = broadcast_from_rank0(uuid.uuid4().hex, group)
    probe = Path(directory) / f"{PROBE_PREFIX}{token}"
    if _rank(group) == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    _barrier(group)
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (dist.get_rank(), ray.util.get_node_ip_address(), seen),
                           group=group)
    _barrier(group)
    if _rank(group) == 0:
        probe.unlink(missing_ok=True)
    blind = [(rank, ip) for rank, ip, ok in found if not ok]
    if blind:
        raise StorageError(
            f"storage_path directory {str(directory)!r} is local to each node: ranks "
            f"{[r for r, _ in blind]} on nodes {sorted({ip for _, ip in blind})} do not see "
            f"the file rank 0 wrote there, so their checkpoint shards would be written to "
            f"their own disks and lost. Use a shared filesystem mounted at the same path on "
            f"every node (NFS, a cluster filesystem), or a cloud URI (s3://bucket/path).")


__all__ = ["check_storage"]
