"""Run names that stay inside storage_path (Ray-free: the job parser checks them too)."""

from __future__ import annotations

from ray_mesh.errors import StorageError


def run_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a run name, or None.

    The run directory is ``<storage_path>/<name>`` and ray_mesh writes (and on a restart,
    deletes unfinished checkpoints) inside it, so the name must be one plain path component:
    ``../x``, ``a/b``, ``/abs`` or ``~x`` would put all of that outside storage_path.
    """
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    if not name.strip():
        return "it is empty"
    if name in (".", "..") or name.startswith("~"):
        return "it names a directory outside the run directory"
    if any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it contains a path separator or a control character"
    if name != name.strip():
        return "it begins or ends with whitespace"
    if len(name.encode()) > 200:
        return "it is longer than 200 bytes"
    return None


def check_run_name(name: object) -> str:
    """``name`` if it is a safe run name (one path component), else :class:`StorageError`."""
    why = run_name_problem(name)
    if why:
        raise StorageError(
            f"Run name {name!r} is not allowed: {why}. The run directory is "
            f"<storage_path>/<name>, so the name must be a single path component: letters, "
            f"digits, '-', '_', '.' (e.g. 'hsdp_run1'). To write elsewhere, change "
            f"storage_path instead."
        )
    return str(name)
