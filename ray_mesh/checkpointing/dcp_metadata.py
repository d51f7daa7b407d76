"""Reading DCP's ``.metadata`` (a pickle) so that nothing in it runs or changes the process.

DCP keeps a checkpoint's metadata as a pickle; unpickling a crafted one with plain
``pickle`` runs code, and DCP's own reader does just that
(upstream: torch-dcp-load-unpickles). :func:`read_metadata` uses an unpickler that admits
DCP's metadata classes, torch dtypes/sizes/layouts and plain containers only, builds
(``BUILD``) nothing but the metadata dataclass instances the file itself created (an enum
member or a function built by a crafted file would stay changed after the refused load, and
break every later save of the process), and reads no file above a size cap (checked before
the read; the read is bounded too).

Split from :mod:`ray_mesh.checkpointing.integrity`, which re-exports these names. Ray-free;
torch is imported inside the functions (for the metadata classes).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from pathlib import Path
from typing import Any

METADATA = ".metadata"
METADATA_MAX_BYTES = 1 << 30
"""The largest ``.metadata`` read: about 7 million shards at ~143 bytes each (a 70B-parameter
model with Adam on 2,048 ranks is ~5 million). A larger one is refused before it is read;
``RAY_MESH_METADATA_MAX_BYTES`` raises the cap for a genuine checkpoint larger still."""
METADATA_MAX_ENV = "RAY_MESH_METADATA_MAX_BYTES"


def metadata_max_bytes() -> int:
    """:data:`METADATA_MAX_BYTES`, or the cap set in :data:`METADATA_MAX_ENV` (read at each
    call: every rank reads it where it loads)."""
    raw = os.environ.get(METADATA_MAX_ENV)
    if raw is None:
        return METADATA_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{METADATA_MAX_ENV}={raw!r} is not a number of bytes > 0: unset it "
                         f"(cap {METADATA_MAX_BYTES}) or set e.g. {2 * METADATA_MAX_BYTES}")
    return value


def metadata_size_problem(size: int) -> str | None:
    """Why a ``.metadata`` of ``size`` bytes is not read (over the cap, or the cap set
    wrongly), or None. Never raises: a scan reports the reason and goes on."""
    try:
        cap = metadata_max_bytes()
    except ValueError as exc:
        return str(exc)
    if size <= cap:
        return None
    return (f"{METADATA} is {size} bytes, over the {cap}-byte cap, so it was not read "
            f"(unpickling it could exhaust memory); a checkpoint of ray_mesh's stays far below "
            f"unless it has millions of shards: if this one is genuine, set {METADATA_MAX_ENV} "
            f"above {size} on every node, else resume from another checkpoint")


_ALTERED = ("ray_mesh never writes such a file, so the checkpoint was altered (or is not "
            "one of ray_mesh's): resume from another checkpoint, and find out who can write "
            "to this storage")
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_EXTRA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


@functools.cache
def _build_types() -> frozenset[type]:
    """The exact types a ``.metadata`` may ``BUILD``: DCP's metadata dataclasses.

    Every other object the unpickler can reach is shared by the whole process (a class, the
    enum members of ``_MEM_FORMAT_ENCODING``, dtypes, layouts, the function ``_get_layout``):
    setting its attributes would outlive the refused load and poison every later save.
    """
    import dataclasses

    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return frozenset({_StorageInfo} | {
        t for t in vars(dcp_metadata).values() if isinstance(t, type)
        and t.__module__ == dcp_metadata.__name__ and dataclasses.is_dataclass(t)})


class _MetadataUnpickler(pickle._Unpickler):
    """Admits DCP's metadata classes, torch dtypes/sizes/layouts and plain containers only.

    The pure-Python unpickler (``pickle._Unpickler``, stable across CPython 3.x) because its
    opcodes can be overridden: ``BUILD`` sets attributes of an existing object, and the only
    objects that may have theirs set are the metadata dataclass instances this very file
    created (exact type, :func:`_build_types`), from a plain dict (or, for a type with its own
    ``__setstate__`` such as ``TensorProperties``, the state it defines). ``BUILD`` on anything
    else (a class, an enum member, a function) would change the loading process for good, so
    it is refused. ``.metadata`` is small: the speed does not matter.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        kind = type(inst)
        if kind not in _build_types():
            what = f"the class {inst.__name__}" if isinstance(inst, type) else (
                f"{inst!r:.80} (a {kind.__module__}.{kind.__qualname__}; only DCP's metadata "
                f"dataclasses may be built)")
            raise pickle.UnpicklingError(f"it applies BUILD to {what}, which would change "
                                         f"it in the loading process")
        if "__setstate__" not in vars(kind) and not (isinstance(state, dict) and all(
                isinstance(k, str) and not k.startswith("__") for k in state)):
            raise pickle.UnpicklingError(f"it applies BUILD to a {kind.__name__} with a state "
                                         f"that is not a dict of its fields")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        import torch

        obj = super().find_class(module, name) if (
            module in _METADATA_MODULES or (module, name) in _EXTRA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ) else None
        if obj is None or (module in _METADATA_MODULES and not (
                isinstance(obj, type) and obj.__module__ == module)):  # defined there only
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata "
                                         f"never holds")
        return obj


def read_metadata(path: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of checkpoint ``path``, unpickled with the restricted unpickler.

    Raises ``ValueError`` naming what was unexpected (a file over the size cap, a class
    outside DCP's metadata, a ``BUILD`` on a shared object, or an object that is not a
    ``Metadata``); nothing from the file runs, and the process is left as it was.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(Path(path) / METADATA, "rb") as f:  # size first; read no more than the cap
        cap = metadata_max_bytes()
        data = f.read(cap + 1) if os.fstat(f.fileno()).st_size <= cap else None
        size = os.fstat(f.fileno()).st_size
    if data is None or len(data) > cap:  # over the cap, or grown past it since the stat
        raise ValueError(metadata_size_problem(max(size, cap + 1)))
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: not DCP metadata
        raise ValueError(f"{METADATA} is not DCP metadata: {type(exc).__name__}: {exc}; "
                         f"{_ALTERED}") from exc
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise ValueError(f"{METADATA} unpickles to a {type(meta).__name__}, not DCP Metadata; "
                         f"{_ALTERED}")
    return meta
