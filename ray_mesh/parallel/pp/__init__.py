"""Pipeline parallel along ``mesh["pp"]``: the plan (:mod:`.plan`: how the layers are cut into
stages and which pp rank runs each, pure arithmetic checked on the driver or on every rank
alike) and the pipeline that runs it (:mod:`.pipeline`: this rank's stages, TP and data
parallel on each, a ``torch.distributed.pipelining`` schedule).

``from ray_mesh.parallel.pp import Pipeline, PipelinePlan`` is the public path (and
``ray_mesh.parallel`` re-exports both).
"""

from ray_mesh.parallel.pp.pipeline import ParallelizeFn, Pipeline
from ray_mesh.parallel.pp.plan import (
           SCHEDULES,
           PipelinePlan,
           known_hang,
           named_layers,
           schedule_info,
)

__all__ = ["SCHEDULES", "ParallelizeFn", "Pipeline", "PipelinePlan", "known_hang", "named_layers",
           "schedule_info"]
