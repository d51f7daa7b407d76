"""Private local staging directories for upload-mode checkpoints and downloads.

Upload mode writes each rank's shards to local disk before Ray uploads them, and a remote
checkpoint is downloaded before it is loaded. A fixed path such as
``/tmp/ray_mesh_staging/<run>/rank<r>`` lets another local user create it first (a
directory they own, or a symlink to somewhere else) and read the shards or have them
written -- and later ``rmtree``'d -- where they chose. So every Checkpointer gets its own
directory from :func:`tempfile.mkdtemp` (mode 0700, an unpredictable name, created
atomically), and only this object, which knows the path, ever removes it: on
:meth:`StagingDir.cleanup`, when it is garbage collected, or at interpreter exit.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from pathlib import Path

PREFIX = "ray_mesh_staging_"


def _safe(text: str) -> str:
    """``text`` reduced to a short file-name-safe piece (run names are user input)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:40] or "run"


class StagingDir:
    """One private temp directory, created on first use and removed by its owner only.

    Args:
        run_name: the run's name (only part of the prefix, for a human reading ``/tmp``).
        rank: the worker's world rank (likewise).
        base: the parent directory; ``None``: :func:`tempfile.gettempdir` (honours TMPDIR).
    """

    def __init__(self, run_name: str, rank: int, base: str | None = None) -> None:
        self.prefix = f"{PREFIX}{_safe(run_name)}_rank{int(rank)}_"
        self.base = base
        self._path: Path | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def path(self) -> Path:
        """The directory (0700, created now if it does not exist yet)."""
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix=self.prefix, dir=self.base))
            # Removed when this object goes away or the process exits normally: a run that
            # never calls cleanup() (an exception in the train function) leaves nothing.
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._path), True)
        return self._path

    @property
    def created(self) -> bool:
        return self._path is not None

    def cleanup(self) -> None:
        """Remove the directory and everything in it (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._path = None
        self._finalizer = None
