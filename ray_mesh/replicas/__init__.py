"""Replica groups: a ``dp_replicate`` dim that survives a group's failure (Ray-free core).

Each ``dp_replicate`` index is a *replica group*: its own inner mesh (``dp_shard`` x ``cp``
x ``tp`` on its node), its own ``torch.distributed`` world, its own Ray Train run. When a
group loses a worker, only that group stops and is replaced; the others go on, averaging
over the groups present, and the returning group receives the current state from a live
one over the network.

What a program uses: on the driver, :func:`ray_mesh.fit_replica_groups` starts the groups
(one :class:`GroupSpec` each where their layouts differ); in the train function,
:func:`ray_mesh.replica_group` builds this group's :class:`ReplicaGroup`. Those two are the
Ray glue (``ray_mesh.raytrain.replica_groups``), so they live in the top-level package; this
package is the Ray-free core behind them: the quorum that decides who takes part at each
boundary and which samples each group trains on next, the gloo links across groups, a rank's
state as one list of tensors, and :class:`ReplicaGroup`, what a train function calls.

Stability: experimental
"""

import importlib
from typing import TYPE_CHECKING

from ray_mesh.core import deprecation as _deprecation

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.replicas.group import ReplicaGroup
    from ray_mesh.replicas.layouts import GroupSpec

__all__ = ["GroupSpec", "ReplicaGroup"]

# name -> (module, attribute), imported on first use (PEP 562). ReplicaGroup imports torch
# and DCP (~1.5 s of CPU): the coordinator actor, which needs only the quorum, starts
# without them.
_LAZY: dict[str, tuple[str, str]] = {
    "GroupSpec": ("ray_mesh.replicas.layouts", "GroupSpec"),
    "ReplicaGroup": ("ray_mesh.replicas.group", "ReplicaGroup"),
}


def _moved(target: str) -> _deprecation.Deprecated:
    return _deprecation.moved(target, "the quorum's parts are internal", __name__)


DEPRECATED: dict[str, _deprecation.Deprecated] = {
    "Decision": _moved("ray_mesh.replicas.quorum:Decision"),
    "GroupDropped": _moved("ray_mesh.errors:GroupDropped"),
    "Quorum": _moved("ray_mesh.replicas.quorum:Quorum"),
}
"""Deprecated public names of this package (``ray_mesh.core.deprecation``)."""


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        return _deprecation.resolve(__name__, name, DEPRECATED)
    return getattr(importlib.import_module(where[0]), where[1])
