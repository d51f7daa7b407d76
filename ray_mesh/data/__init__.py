"""Data for real jobs: the ``data:`` job section (:mod:`.spec`) and byte-level text (:mod:`.text`).

Ray-free; :func:`ray_mesh.data.text.ray_dataset` imports Ray Data when called.
"""

from ray_mesh.data.spec import DataSpec, DataSpecError
from ray_mesh.data.text import load_split, pack, ray_dataset, unigram_entropy

__all__ = ["DataSpec", "DataSpecError", "load_split", "pack", "ray_dataset",
           "unigram_entropy"]
