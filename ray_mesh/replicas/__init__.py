"""Replica groups: a ``dp_replicate`` dim that survives a group's failure (Ray-free core).

Each ``dp_replicate`` index is a *replica group*: its own inner mesh (``dp_shard`` x ``cp``
x ``tp`` on its node), its own ``torch.distributed`` world, its own Ray Train run. When a
group loses a worker, only that group stops and is replaced; the others go on, averaging
over the groups present, and the returning group receives the current state from a live
one over the network. The parts:

* :mod:`.quorum`: who takes part at each boundary, who heals from whom, which samples each
  group trains on next (nothing skipped or repeated);
* :mod:`.link`: the gloo process groups across groups, one per inner rank, per epoch;
* :mod:`.state`: a rank's state as one ordered list of tensors (transfer and fallback file);
* :mod:`.group`: :class:`ReplicaGroup`, what a train function calls.

The Ray glue (a coordinator actor, one Ray Train run per group) is
:mod:`ray_mesh.raytrain.replica_groups`.
"""

from typing import TYPE_CHECKING

from ray_mesh.replicas.quorum import Decision, GroupDropped, Quorum

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.replicas.group import ReplicaGroup

__all__ = ["Decision", "GroupDropped", "Quorum", "ReplicaGroup"]


def __getattr__(name: str):
    # ReplicaGroup imports torch and DCP (~1.5 s of CPU): loaded on first use, so that the
    # coordinator actor, which needs only the quorum, starts without them.
    if name == "ReplicaGroup":
        from ray_mesh.replicas.group import ReplicaGroup

        return ReplicaGroup
    raise AttributeError(f"module 'ray_mesh.replicas' has no attribute {name!r}")
