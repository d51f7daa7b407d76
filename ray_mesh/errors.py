"""Every error ray_mesh raises, in one hierarchy under :class:`RayMeshError`.

Four branches, by who has to act:

* :class:`UserInputError` -- a value the user wrote (a mesh spec, a job file key, a CLI flag, a
  model or data setting, a run name) cannot work. Fix the input.
* :class:`ConfigurationError` -- values that are each fine but do not fit together or do not
  fit the cluster (a mesh the workers' placement cannot host, a plan, a data split, a
  storage path the nodes do not share). Change the configuration or the cluster.
* :class:`ClusterError` -- the cluster or its network failed at run time (interfaces,
  pre-flight, bring-up, a collective that hangs, a cluster that does not answer).
* :class:`CheckpointError` -- a checkpoint cannot be written or used.

Every message names the problem and the fix. The branches have builtin bases (``ValueError``
for input and configuration, ``RuntimeError`` for the cluster and checkpoints), so
``except ValueError`` catches input and configuration errors. The
``ray-mesh`` CLI decides by class alone: a :class:`RayMeshError` is one line and exit code 2,
anything else a bug with its traceback. Each subclass is also
importable from the module that raises it. This module imports nothing.
"""

from __future__ import annotations


class RayMeshError(Exception):
    """Any error ray_mesh raises on purpose; the message names the problem and the fix.

    Stability: stable
    """


# ----------------------------------------------------------------------------- branches
class UserInputError(RayMeshError, ValueError):
    """A value the user wrote cannot work; the message names the key or flag and the fix.

    Stability: stable
    """


class ConfigurationError(RayMeshError, ValueError):
    """Settings that do not fit each other or the cluster; the message says what to change.

    Stability: stable
    """


class ClusterError(RayMeshError, RuntimeError):
    """The cluster or its network failed; the message names the node, rank or link.

    Stability: stable
    """


class CheckpointError(RayMeshError, RuntimeError):
    """A checkpoint that cannot be written or used; the message names it and the fix.

    Stability: stable
    """


class GroupDropped(ClusterError):  # noqa: N818 - a state the caller reacts to, not a bug
    """This attempt of a replica group is no longer a member of the run (it stopped beating,
    or a newer attempt of the same group registered): its ranks stop, and Ray Train starts
    the group again (ray_mesh.replicas)."""


class LinkAbandoned(ClusterError):  # noqa: N818 - a state the caller reacts to, not a bug
    """A wait on the cross-group link ended because the quorum dropped a member of its epoch
    (ray_mesh.replicas.link): the step is retried with the groups that remain."""


class TrainFunctionError(ClusterError):
    """The job's train function raised on some ranks (Ray Train's ``WorkerGroupError``):
    ``ray-mesh run`` says which ranks and what, in one line; each rank's traceback is on the
    console above it (ray_mesh.cli.runner)."""


class GroupsFailed(ClusterError):
    """A replica group failed several times in a row (twice with the same error) without
    rejoining in between: the train function or the group's setup, not a node coming and
    going (ray_mesh.raytrain.replica_groups)."""


# ----------------------------------------------------------------------------- user input
class MeshSpecError(UserInputError):
    """A mesh spec that cannot describe a mesh; the message says how to fix it.

    Stability: stable
    """


class GroupLayoutError(UserInputError):
    """A replica group's layout that cannot run (ray_mesh.replicas.layouts): an unknown dim,
    a size that is not a whole number, a node that is not in the cluster, a group that fits
    no node; the message names the group and the fix."""


class LayoutError(UserInputError):
    """A layout string, mapping or family that cannot be read (ray_mesh.core.layout)."""


class JobError(UserInputError):
    """A job file that cannot run; the message names the key and the fix."""


class DataSpecError(UserInputError):
    """A ``data:`` section that cannot feed the job; the message names the key and the fix."""


class ModelConfigError(UserInputError):
    """A model config that cannot build or run; the message names the key and the fix."""


class StorageURIError(UserInputError):
    """A storage_path or storage_endpoint that is not a valid location (a malformed URI, a
    bucket name S3 refuses, an endpoint that is not a server URL); the message shows the form."""


# ----------------------------------------------------------------------------- configuration
class TopologyError(ConfigurationError):
    """The workers' placement cannot host the mesh; the message says how to fix it."""


class PlanError(ConfigurationError):
    """The cost model's inputs cannot give a plan; the message names the input and the fix."""


class TrialError(PlanError):
    """The job's step failed on a candidate mesh; the message names the layout and rank."""


class ParallelError(ConfigurationError):
    """A model, plan or schedule that cannot be put on the mesh as asked.

    Stability: stable
    """


class DataSplitError(ConfigurationError):
    """The datasets cannot be split by dp rank as configured; the message says the fix."""


class StorageError(ConfigurationError):
    """A storage_path that cannot hold this run's checkpoints; the message says what to use.

    Stability: stable
    """


class RequestRefused(StorageError):
    """A request ``ray-mesh storage serve`` answers with an S3 error instead of passing it
    to its server (``status``, ``code``: the HTTP status line and S3 error code)."""

    def __init__(self, status: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ObjectStoreError(StorageError):
    """An object store (an S3 endpoint and bucket) that cannot hold this run's checkpoints:
    the endpoint does not answer, the bucket is missing, the credentials are refused, or it
    refuses writes. One line, naming the endpoint and bucket and what to fix (never a key)."""


# ----------------------------------------------------------------------------- cluster
class NetworkError(ClusterError):
    """An interface or address problem; the message names the node, interface and fix."""


class PreflightError(NetworkError):
    """The nodes cannot form a process group; the message lists every failure and its fix.

    Stability: stable
    """


class LinkError(ClusterError):
    """A link could not be measured; the message names the pair and what to check."""


class BootstrapError(ClusterError):
    """The process group or mesh could not be built; the message says why and what to do."""


class BringUpError(ClusterError):
    """The mesh could not be brought up on the workers; the message names ranks and nodes."""


class CollectiveHangError(ClusterError):
    """A collective did not complete within hang_timeout_s; the message is the full report.

    Stability: stable
    """


class StatusError(ClusterError):
    """The cluster could not be asked; the message says what to check."""


class SourceError(ClusterError):
    """One source ``ray-mesh status`` reads (an HTTP answer, a storage file) could not be read
    within its bounds; the message names it and why."""


class SourceTimeout(SourceError):
    """A source did not answer within its time: slow (a busy head), not known to be wrong, so
    one more ask with more time may get it."""


class Malformed(ClusterError, ValueError):
    """A record from the cluster that is not what ray_mesh writes; the message says why."""


class Oversize(Malformed):  # noqa: N818 - a size, not an error of the program
    """A store value larger than its limit; ``size`` is its length in bytes (left unread)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


# ----------------------------------------------------------------------------- checkpoints
class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint holds another model: the message lists the keys that do not match.

    Stability: stable
    """


class NonFiniteError(CheckpointError, ValueError):
    """The model holds NaN or inf: saving it would replace good checkpoints with broken ones.

    Stability: stable
    """


EXIT_CODE = 2
"""``ray-mesh``'s exit code for any :class:`RayMeshError`: one ``ray-mesh: error:`` line, no
traceback (``-v`` adds it). Anything else is a bug in ray_mesh and keeps its traceback."""


def exit_code(exc: BaseException) -> int | None:
    """The CLI's exit code for ``exc``, or None when it is not one of ours (a bug)."""
    return EXIT_CODE if isinstance(exc, RayMeshError) else None


__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ClusterError",
    "CollectiveHangError",
    "ConfigurationError",
    "MeshSpecError",
    "NonFiniteError",
    "ParallelError",
    "PreflightError",
    "RayMeshError",
    "StorageError",
    "UserInputError",
]
