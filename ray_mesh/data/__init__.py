"""Data for real jobs, a documented part of the package: the ``data:`` job section and its
byte-level corpus.

* :class:`DataSpec` (:mod:`.spec`): the job file's ``data:`` section (files, directories,
  globs or ``stdlib``; ``text`` / ``jsonl`` / ``parquet``; sequence length, global batch,
  validation split), checked on the driver against the mesh and the model before Ray starts.
* :func:`ray_datasets`: the section's Ray Data datasets (``{"train": ...}``, streamed and
  split by dp rank under ``MeshConfig``), which ``ray-mesh run`` passes to ``TorchTrainer``
  for any job with a ``data:`` section; :func:`load_split` the same rows in memory (torchrun,
  validation).
* :class:`TokenSamples` (:mod:`.indexed`): the training rows as a map-style dataset, sample
  ``i`` the same on every node, indices past the end wrapping to the next epoch, for replica
  groups (``rg.sample_ids``); :func:`group_samples` in their train function;
  :func:`from_ray_dataset` (:mod:`.indexed_ray`) materializes a Ray Data dataset for it.

Why in the package and not in ``examples/``: the ``data:`` section is part of the job file
format (``ray-mesh run`` checks it and wires it for every train function, not for one
example), and the byte-level corpus with the Llama-style model (:mod:`ray_mesh.models`) is the
package's reference workload for benchmarks and tests of the parallel layouts on real text.

Ray-free; :func:`ray_dataset` imports Ray Data when called. Each name is imported on first
use (PEP 562), not with the package: reading a job file (``ray_mesh.cli.job`` checks the
``data:`` section with :mod:`.spec`) must not pull in torch and numpy, ~1.5 s of every
``ray-mesh`` command on a 2-core machine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {  # name -> the module of this package that defines it
    "TokenSamples": "indexed",
    "group_samples": "indexed",
    "from_ray_dataset": "indexed_ray",
    "DataSpec": "spec",
    "DataSpecError": "spec",
    "load_split": "text",
    "pack": "text",
    "ray_dataset": "text",
    "ray_datasets": "text",
    "unigram_entropy": "text",
}

if TYPE_CHECKING:  # what type checkers and editors see (``X as X``: a re-export)
    from ray_mesh.data.indexed import TokenSamples as TokenSamples
    from ray_mesh.data.indexed import group_samples as group_samples
    from ray_mesh.data.indexed_ray import from_ray_dataset as from_ray_dataset
    from ray_mesh.data.spec import DataSpec as DataSpec
    from ray_mesh.data.spec import DataSpecError as DataSpecError
    from ray_mesh.data.text import load_split as load_split
    from ray_mesh.data.text import pack as pack
    from ray_mesh.data.text import ray_dataset as ray_dataset
    from ray_mesh.data.text import ray_datasets as ray_datasets
    from ray_mesh.data.text import unigram_entropy as unigram_entropy


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
