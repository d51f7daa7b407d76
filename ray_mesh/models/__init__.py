"""Models for real jobs (Ray-free, torch only): a Llama-style decoder and its parallel plan.

A documented part of the package, not an example: the reference model for ray_mesh's
layouts on real text (FSDP2 x TP with sequence parallel, GQA, rotary, SwiGLU), used by
``examples/llm.py``, ``mesh: auto``'s trials, the benchmarks and the numerics tests; any job
may import it. Its data comes from the ``data:`` job section (:mod:`ray_mesh.data`), which
``ray-mesh run`` handles for every job, not by a special case of this model.
"""

from ray_mesh.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    ModelConfigError,
    num_params,
)
from ray_mesh.models.parallelize import llama_tp_plan, parallelize_llama

__all__ = ["PRESETS", "Llama", "LlamaConfig", "ModelConfigError", "llama_tp_plan",
           "num_params", "parallelize_llama"]
