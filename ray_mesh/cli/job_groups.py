"""The job file's ``replica_groups:`` section: a run of replica groups (Ray-free checks).

::

    replica_groups:
      groups: [{dp_shard: 2}, {dp_shard: 1}]   # one per entry; or auto (one per node);
                                               # or a number, with workers_per_group
      steps: 100             # boundaries (steps) of the whole run
      segment_samples: 32    # samples per group per step (by speed: the mean)
      shares: speed          # equal (default) | speed
      checkpoint_every: 0    # the fallback checkpoint, every N steps (0: none)
      checkpoint_dir: null   # default: <run.storage_path>/<name>-fallback (a bucket is fine)
      max_group_failures: 20 # restarts of one group (-1: no limit); or run.max_failures
      data_from: files       # files (each node reads data.paths) | ray_data (the driver
                             # reads them once into Ray's object store)
      compress: none         # the gradients between groups at each step: none (float32) |
                             # bf16 | int8 (with error feedback: a quarter of the bytes)

Each group is a Ray Train run of the job's train function, which builds its group with
``ray_mesh.replica_group(model, optimizer, config)`` (see docs/replica_groups.md). The
job's ``mesh:``, ``layout:``, ``replicate:`` and ``plan:`` do not apply (each group's layout
is here), and are refused with the reason. A ``data:`` section is checked as for one mesh,
with one group's step (``segment_samples``) as its batch, which every listed group's
data-parallel size must divide; its samples are read by index
(:func:`ray_mesh.data.group_samples`), since the run's quorum hands out index ranges.
``scaling.num_workers``/``placement_strategy`` (a group is packed on one node) and
``run.min_workers``/``startup_retries`` (a group whose node is gone waits for it) are refused
too. ``run.storage_path``/``storage_endpoint`` hold the groups' runs and the fallback
checkpoints, ``run.num_to_keep`` bounds those, and ``run.max_failures`` is each group's
restart budget (or ``max_group_failures``: one of the two).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ray_mesh.cli.job_checks import JobError
from ray_mesh.core.diloco_config import COMPRESS_MODES
from ray_mesh.core.values import read_int, read_str
from ray_mesh.replicas.layouts import GroupLayoutError, group_specs
from ray_mesh.replicas.shares import SHARES

DATA_FROM = ("files", "ray_data")

NOT_WITH_GROUPS = {
    "mesh": "each group's layout is replica_groups.groups",
    "layout": "each group's layout is replica_groups.groups",
    "replicate": "the groups average at every step; DiLoCo is the train function's "
                 "replica_group(..., diloco=...)",
    "plan": "plan unequal nodes with `ray-mesh plan JOB.yaml --per-node 2,2,1`",
}


@dataclass(frozen=True)
class ReplicaGroupsSection:
    """``replica_groups:`` (see the module docstring)."""

    groups: Any = "auto"
    workers_per_group: int | None = None
    steps: int = 0
    segment_samples: int = 0
    shares: str = "equal"
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    max_group_failures: int = 20
    data_from: str = "files"
    compress: str = "none"

    def __post_init__(self) -> None:
        read_int("replica_groups.steps", self.steps, 1, error=JobError)
        read_int("replica_groups.segment_samples", self.segment_samples, 1, error=JobError)
        read_int("replica_groups.checkpoint_every", self.checkpoint_every, 0, error=JobError)
        read_int("replica_groups.max_group_failures", self.max_group_failures, -1,
                 error=JobError)
        read_str("replica_groups.checkpoint_dir", self.checkpoint_dir, none_ok=True,
                 error=JobError, hint=" (a bucket URI or a directory every node reaches; "
                 "leave it out for the run's storage)")
        read_str("replica_groups.data_from", self.data_from, choices=DATA_FROM,
                 error=JobError)
        read_str("replica_groups.compress", self.compress, choices=COMPRESS_MODES,
                 error=JobError, hint=" (int8: a quarter of float32's bytes between groups)")
        if self.shares not in SHARES:
            raise JobError(f"replica_groups.shares: {self.shares!r}; use one of "
                           f"{', '.join(SHARES)} (speed sizes each group's batch to its "
                           "measured speed)")
        if self.groups != "auto":
            try:
                group_specs(self.groups, self.workers_per_group)
            except GroupLayoutError as exc:
                raise JobError(f"replica_groups.groups: {exc}") from None

    def fit_kwargs(self) -> dict[str, Any]:
        """The section as ``fit_replica_groups`` keyword arguments."""
        return {"groups": self.groups, "workers_per_group": self.workers_per_group,
                "total_steps": self.steps, "segment_samples": self.segment_samples,
                "shares": self.shares, "checkpoint_every": self.checkpoint_every,
                "checkpoint_dir": self.checkpoint_dir,
                "max_group_failures": self.max_group_failures, "compress": self.compress}

    def dp_sizes(self) -> list[int] | None:
        """Each listed group's data-parallel size (``dp_shard``: its ``cp`` and ``tp`` peers
        read the same samples); None for ``auto``."""
        if self.groups == "auto":
            return None
        return [s.mesh.get("dp_shard", 1)
                for s in group_specs(self.groups, self.workers_per_group)]

    def workers(self) -> int | None:
        """Workers of all groups together (None for ``auto``: what the cluster has)."""
        if self.groups == "auto":
            return None
        return sum(s.workers for s in group_specs(self.groups, self.workers_per_group))


KEYS = tuple(f.name for f in fields(ReplicaGroupsSection))


def check_alongside(top: dict[str, Any]) -> None:
    """Refuse the sections that do not apply to a run of replica groups, naming why."""
    for key, why in NOT_WITH_GROUPS.items():
        if top.get(key) is not None:
            raise JobError(f"{key}: does not go with replica_groups: ({why}). Remove it.")
    scaling = top.get("scaling") or {}
    if isinstance(scaling, dict) and scaling.get("num_workers") is not None:
        raise JobError("scaling.num_workers does not go with replica_groups: each group's "
                       "size is its layout (replica_groups.groups). Remove it.")
    if isinstance(scaling, dict) and scaling.get("placement_strategy") not in (
            None, "STRICT_PACK"):
        raise JobError("scaling.placement_strategy does not go with replica_groups: each "
                       "group is packed on one node (STRICT_PACK). Remove it.")
    run = top.get("run") or {}
    if isinstance(run, dict) and run.get("min_workers") is not None:
        raise JobError("run.min_workers does not go with replica_groups: groups leave and "
                       "rejoin on their own. Remove it.")
    if isinstance(run, dict) and run.get("startup_retries") is not None:
        raise JobError("run.startup_retries does not go with replica_groups: a group whose "
                       "node is gone waits for it while the others train on, and the run "
                       "ends it after the last step. Remove it.")
    section = top.get("replica_groups")
    if isinstance(run, dict) and "max_failures" in run and isinstance(section, dict) \
            and "max_group_failures" in section:
        raise JobError("run.max_failures and replica_groups.max_group_failures both set each "
                       "group's restart budget: keep one of them.")


BATCH_KEYS = ("batch_size", "batch_tokens")


def parse_group_data(section: Any, groups: ReplicaGroupsSection, base_dir: Path,
                     config: Mapping[str, Any]) -> Any:
    """The job's ``data:`` for a run of replica groups, checked as for one mesh (files,
    split, ``seq_len`` against the model) with one group's step as the batch: returns the
    ``DataSpec`` (its ``batch_size`` is ``segment_samples``), or None without a section."""
    from ray_mesh.data.spec import DataSpecError, parse_job_data

    if section is None:
        return None
    given = [k for k in BATCH_KEYS if isinstance(section, Mapping) and k in section]
    if given:
        raise JobError(f"data.{given[0]} does not go with replica_groups: a group's batch is "
                       f"replica_groups.segment_samples (sequences per group per step). "
                       f"Remove it.")
    for i, dp in enumerate(groups.dp_sizes() or []):
        if groups.segment_samples % dp:
            good = dp * max(1, groups.segment_samples // dp)
            raise JobError(f"replica_groups.segment_samples={groups.segment_samples} does not "
                           f"split over group {i}'s {dp} data-parallel ranks (dp_shard={dp}): "
                           f"use a multiple of {dp}, e.g. {good}.")
    if isinstance(section, Mapping):
        section = {**section, "batch_size": groups.segment_samples}
    try:
        spec = parse_job_data(section, base_dir, config=config)
    except DataSpecError as exc:
        raise JobError(str(exc).replace("one global batch", "one group's step")) from exc
    need = (spec.seq_len + 1) * groups.segment_samples
    if spec.max_tokens is not None and spec.max_tokens < need:
        raise JobError(f"data.max_tokens={spec.max_tokens} holds no group's step of "
                       f"{groups.segment_samples} rows of {spec.seq_len + 1} tokens: raise it "
                       f"to at least {need}, or lower seq_len or replica_groups."
                       f"segment_samples.")
    return spec
