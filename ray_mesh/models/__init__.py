"""Models for real jobs (Ray-free, torch only): a Llama-style decoder and its parallel plan.

A documented part of the package, not an example: the reference model for ray_mesh's
layouts on real text (FSDP2 x TP with sequence parallel, GQA, rotary, SwiGLU), used by
``examples/llm.py``, ``mesh: auto``'s trials, the benchmarks and the numerics tests; any job
may import it. Its data comes from the ``data:`` job section (:mod:`ray_mesh.data`), which
``ray-mesh run`` handles for every job, not by a special case of this model.
"""

from ray_mesh.models.llama import PRESETS as PRESETS
from ray_mesh.models.llama import Llama as Llama
from ray_mesh.models.llama import LlamaConfig as LlamaConfig
from ray_mesh.models.llama import ModelConfigError as ModelConfigError
from ray_mesh.models.llama import num_params as num_params
from ray_mesh.models.parallelize import llama_tp_plan as llama_tp_plan
from ray_mesh.models.parallelize import parallelize_llama as parallelize_llama
