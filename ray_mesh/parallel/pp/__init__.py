"""Pipeline parallel along ``mesh["pp"]``: the plan (:mod:`.plan`: how the layers are cut into
stages and which pp rank runs each, pure arithmetic checked on the driver or on every rank
alike) and the pipeline that runs it (:mod:`.pipeline`: this rank's stages, TP and data
parallel on each, a ``torch.distributed.pipelining`` schedule).

:class:`Pipeline` is public as ``ray_mesh.parallel.Pipeline``; the plan is internal.
"""

from ray_mesh.parallel.pp.pipeline import Pipeline as Pipeline
from ray_mesh.parallel.pp.plan import PipelinePlan as PipelinePlan
