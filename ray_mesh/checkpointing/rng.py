"""Random state per rank, saved next to the shards so a resumed run draws what it would have.

Dropout masks, random augmentations and sampling all come from generators whose state is not
part of the model or optimizer. Without it a resumed run diverges from an uninterrupted one at
its first random draw. Each rank writes its own ``rng_rank<r>.json`` (torch CPU generator,
every CUDA generator when CUDA is initialised, Python ``random``, NumPy's global generator
when NumPy is importable). JSON, never pickle: reading it back runs nothing. Written through
:func:`ray_mesh.core.files.write_atomic` (a fresh ``O_EXCL`` temporary name, then a rename):
the checkpoint directory may be writable by others, and a symlink planted at
``rng_rank<r>.json`` must not redirect our write into a file it points to.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import torch

from ray_mesh.core.files import write_atomic

FORMAT = 1


def file_name(rank: int) -> str:
    return f"rng_rank{rank}.json"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's random state, JSON-ready."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"format": FORMAT, "torch": _b64(torch.get_rng_state()),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Set this process's random state from :func:`capture`'s output; returns what was not
    restored (and why), for a warning."""
    skipped: list[str] = []
    torch.set_rng_state(_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([_tensor(s) for s in cuda])
        else:
            skipped.append(f"CUDA generators ({len(cuda)} saved, "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                           f"devices here)")
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                 cached))
        except ImportError:
            skipped.append("NumPy's generator (NumPy is not installed here)")
    return skipped


def save(path: Path, rank: int) -> str:
    """Write this rank's random state into checkpoint ``path``; returns the file name."""
    name = file_name(rank)
    path.mkdir(parents=True, exist_ok=True)  # as DCP would: save() may come before it
    write_atomic(path / name, json.dumps(capture()))
    return name


def load(path: Path, rank: int) -> list[str]:
    """Restore this rank's random state from ``path``; returns warnings (none: all restored).

    A checkpoint from another world size has no file for some ranks: those keep their
    current state, and the warning says a resumed run is then not bitwise reproducible.
    """
    f = path / file_name(rank)
    if not f.is_file():
        return [f"checkpoint {path} has no random state for rank {rank} (written by an older "
                f"ray_mesh, or on fewer ranks): this rank keeps its current random state, so "
                f"random draws (dropout, sampling) differ from an uninterrupted run"]
    try:
        skipped = restore(json.loads(f.read_text()))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, RecursionError) as exc:
        return [f"random state {f} is unusable ({type(exc).__name__}: {exc}); rank {rank} "
                f"keeps its current random state"]
    return [f"rank {rank} did not restore {what}" for what in skipped]
