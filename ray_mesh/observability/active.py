"""The one pointer to this process's running :class:`~ray_mesh.observability.owner.Observability`.

The report recorder, the hang watch and the wait sampler belong to one owner object with a
start and a stop (``owner.py``); this module only says which owner is running, so that the
helpers a train loop calls (``hang.watched``, ``hang.all_reduce``) and the train-thread
context find it. ``Observability.start`` installs it (stopping one left running) and
``stop`` clears it: nothing outlives a run. It imports nothing, so every module of the layer
may ask it without an import cycle (the owner imports them all).
"""

from __future__ import annotations

from typing import Any

_running: Any = None


def current() -> Any:
    """The running owner, or None (no run, or under torchrun without ``watch_mesh``)."""
    return _running


def install(owner: Any) -> None:
    """Make ``owner`` the running one (called by ``Observability.start``)."""
    global _running
    _running = owner


def clear(owner: Any) -> None:
    """Forget ``owner`` if it is the running one (called by ``Observability.stop``)."""
    global _running
    if _running is owner:
        _running = None


def watch() -> Any:
    """The running owner's hang watch, or None."""
    return getattr(_running, "watch", None)
