"""The one error type of ``ray_mesh.parallel``.

A ``ValueError`` so that callers who validate configs catch it with the other input errors
(``MeshSpecError`` is one too); the message always names the layer, dim or option at fault
and the fix.
"""

from __future__ import annotations


class ParallelError(ValueError):
    """A model, plan or schedule that cannot be put on the mesh as asked."""
