"""Where a run of replica groups keeps what outlives its groups, checked before any starts.

Two things outlive a group: its Ray Train run's directory (``<storage_path>/<name>-g<i>``,
Ray Train's own) and the run's fallback checkpoints, which the quorum restores when every
group is gone at once. A home lab's tailnet has no directory every node reaches, so the
fallback goes to the run's storage by default (``<storage_path>/<name>-fallback``, a bucket
at ``storage_endpoint`` or a shared directory); ``checkpoint_dir`` names another place.

Checked on the driver before the coordinator or any group starts, each failure one line
naming the fix: the settings themselves, and the storage, through the one-mesh path's own
check (:func:`ray_mesh.checkpointing.storage.check_storage`): the driver writes a probe,
and with Ray up every alive node repeats it with its own credentials and route, so a
bucket that is missing, or unreachable from one node, is refused naming that node. A
local directory that only some nodes see is refused the same way when the fallback goes
there.
"""

from __future__ import annotations

from typing import Any

from ray_mesh.checkpointing.upload import join
from ray_mesh.core.object_store import is_uri, run_storage, same_location
from ray_mesh.errors import ConfigurationError

FALLBACK_SUFFIX = "-fallback"


def fallback_location(storage_path: str | None, name: str, checkpoint_dir: str | None
                      ) -> str:
    """Where the fallback checkpoints go: ``checkpoint_dir`` when given, else
    ``<storage_path>/<name>-fallback`` (Ray Train's default storage when none is given)."""
    if checkpoint_dir:
        return checkpoint_dir
    if storage_path is None:
        from ray_mesh.checkpointing.storage import default_storage_path

        storage_path = default_storage_path()
    return join(storage_path, name + FALLBACK_SUFFIX)


def _endpoint_for(location: str, endpoint: str | None) -> str | None:
    """``storage_endpoint`` applies to the run's ``s3://`` locations only."""
    return endpoint if is_uri(location) and location.startswith("s3://") else None


def check_settings(*, checkpoint_every: int, num_to_keep: int | None,
                   max_group_failures: int, upload_timeout_s: float) -> None:
    """The numbers, before anything is contacted: one line each, naming the fix."""
    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(checkpoint_every) or checkpoint_every < 0:
        raise ConfigurationError(f"checkpoint_every={checkpoint_every!r}: give a whole number "
                                 "of steps >= 0 (0: no fallback checkpoint)")
    if num_to_keep is not None and (not whole(num_to_keep) or num_to_keep < 1):
        raise ConfigurationError(f"num_to_keep={num_to_keep!r}: give how many fallback "
                                 "checkpoints to keep in storage (>= 1), or None for all")
    if not whole(max_group_failures) or max_group_failures < -1:
        raise ConfigurationError(f"max_group_failures={max_group_failures!r}: give the "
                                 "restarts one group may take (>= 0, or -1 for no limit)")
    if not isinstance(upload_timeout_s, int | float) or not upload_timeout_s > 0:
        raise ConfigurationError(f"upload_timeout_s={upload_timeout_s!r}: give the seconds "
                                 "one fallback checkpoint's upload may take (> 0)")


def check_groups_storage(*, storage_path: str | None, storage_endpoint: str | None, name: str,
                         checkpoint_every: int, checkpoint_dir: str | None,
                         where: str, timeout_s: float = 60.0
                         ) -> tuple[str | None, str | None]:
    """Probe the run's storage (and the fallback's, when elsewhere) from the driver or
    every alive node; ``(fallback location, its endpoint)``, or ``(None, None)`` without
    fallback checkpoints. Raises what
    :func:`~ray_mesh.checkpointing.storage.check_storage` raises (``StorageURIError``,
    ``ObjectStoreError``, ``StorageError``), naming the node that failed.

    ``where``: ``"driver"`` (the driver only, before anything asks Ray: a run's storage
    when it is a URI, as Ray Train's runs write there), ``"here"`` (the driver only, before
    Ray starts: the run's storage whatever its kind, as for one mesh) or ``"nodes"`` (the
    nodes only: the driver probed already). A run probes each place once: the driver, then
    the nodes."""
    from ray_mesh.checkpointing.storage import (
        absolute_storage_path,
        check_run_name,
        check_storage,
        check_storage_nodes,
    )

    check_run_name(name)
    run_storage(storage_path, storage_endpoint)  # the text: an endpoint needs an s3:// path

    def probe(location: str | None, endpoint: str | None) -> str:
        if where == "nodes":
            location = absolute_storage_path(location)
            check_storage_nodes(location, endpoint=endpoint, timeout_s=timeout_s)
            return location
        return check_storage(location, endpoint=endpoint, timeout_s=timeout_s, nodes=False)

    checked = []
    if where == "here" or (storage_path is not None and is_uri(storage_path)):
        # Ray Train's runs write there; a local one is each group's node's own business
        checked.append(probe(storage_path, storage_endpoint))
    if not checkpoint_every:
        return None, None
    location = fallback_location(storage_path, name, checkpoint_dir)
    endpoint = _endpoint_for(location, storage_endpoint)
    if checkpoint_dir or not any(same_location(location, c) or location.startswith(
            c.split("?", 1)[0].rstrip("/") + "/") for c in checked if is_uri(c)):
        location = probe(location, endpoint)
    return location, endpoint
