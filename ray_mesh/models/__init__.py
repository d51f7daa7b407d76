"""Models for real jobs (Ray-free, torch only): a Llama-style decoder and its parallel plan."""

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
