"""Public names on their way out: still returned, with a ``DeprecationWarning``, until removed.

Each public package (``ray_mesh``, ``ray_mesh.parallel``, ``ray_mesh.checkpointing``,
``ray_mesh.replicas``) keeps a ``DEPRECATED`` mapping, name -> :class:`Deprecated`, and its
module ``__getattr__`` ends with :func:`resolve`. A deprecated name is in no ``__all__`` (so
``from package import *`` and ``dir()`` do not touch it): the warning is raised only where a
program names it, ``package.name`` or ``from package import name``, and the value is the same
object as before. ``tests/unit/test_public_api.py`` holds every public name; one may leave a
package's ``__all__`` only through this mapping (and is marked ``deprecated`` in
``tests/unit/public_api.txt``), and leaves the mapping in the release its advice names.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deprecated:
    """Where a deprecated public name's value lives, and what to do instead.

    Attributes:
        target: ``"module:attribute"``, the value's home (imported on first use).
        advice: what to use instead and when the name goes, e.g. ``"import it from
            ray_mesh.parallel.fsdp; removed in 0.2.0"``.
    """

    target: str
    advice: str

    def value(self) -> Any:
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


def moved(target: str, why: str, package: str, release: str = "0.2.0") -> Deprecated:
    """A name that leaves ``package`` in ``release`` but lives on at ``target`` (internal):
    the advice says ``why``, where to import it from and when it goes."""
    module = target.partition(":")[0]
    return Deprecated(target, f"{why}; import it from {module} (it leaves {package} in "
                              f"{release})")


def resolve(package: str, name: str, deprecated: Mapping[str, Deprecated]) -> Any:
    """The value of ``package.name`` from ``deprecated``, after a ``DeprecationWarning``;
    ``AttributeError`` for a name that is not there (a package's ``__getattr__`` ends with
    ``return resolve(__name__, name, DEPRECATED)``)."""
    entry = deprecated.get(name)
    if entry is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    # stacklevel 3: past this function and the package's __getattr__, to the caller's line
    warnings.warn(f"{package}.{name} is deprecated: {entry.advice}", DeprecationWarning,
                  stacklevel=3)
    return entry.value()
