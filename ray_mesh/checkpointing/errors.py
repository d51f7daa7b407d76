"""The error types of ``ray_mesh.checkpointing`` (imports nothing: any module may raise them).

Every message names the checkpoint and the fix. :class:`CheckpointMismatchError` and
:class:`NonFiniteError` are ``ValueError`` too, so that input checks catch them with the
other bad inputs.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message names it and the fix."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint holds another model: the message lists the keys that do not match."""


class NonFiniteError(CheckpointError, ValueError):
    """The model holds NaN or inf: saving it would replace good checkpoints with broken ones."""


__all__ = ["CheckpointError", "CheckpointMismatchError", "NonFiniteError"]
