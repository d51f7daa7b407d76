"""Whole-or-absent file writes that follow no planted symlink.

The obvious ``path + ".tmp"`` then ``rename`` lets another local user (or a writer of a
shared directory) plant a symlink at that predictable name and have our bytes written where
they point. :func:`write_atomic` writes through :func:`tempfile.mkstemp` instead:
``O_CREAT | O_EXCL`` with an unpredictable name in the target's own directory (so the rename
stays on one filesystem and is atomic), mode 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str | bytes, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` whole or not at all (readers see the old file or the new).

    Args:
        path: the destination; its directory must exist.
        text: str (written as UTF-8) or bytes.
        mode: the new file's permission bits (default: the owner only).
    """
    path = Path(path)
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
