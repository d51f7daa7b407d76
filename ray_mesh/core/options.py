"""ray_mesh's own bring-up options, Ray-free: one home for their defaults and their checks.

:class:`~ray_mesh.raytrain.backend.MeshConfig` is ``MeshOptions`` plus Ray's ``TorchConfig``
(backend, init_method, timeout_s); the job file's ``network:`` section
(:mod:`ray_mesh.cli.job`) reads its defaults from these fields. Keeping them here, away from
Ray, lets the job parser use them without importing Ray, and the two can no longer drift.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ray_mesh.core import priority
from ray_mesh.core.spec import MeshSpec

MeshLike = MeshSpec | Mapping[str, Any] | str | None
"""What ``mesh=`` accepts: a MeshSpec, a dict of dim sizes, 'hsdp'/'fsdp'/'ddp', or None."""


@dataclass
class MeshOptions:
    """The options ``MeshConfig`` adds to ``TorchConfig`` (see its docstring for each)."""

    mesh: MeshLike = None
    interface: str = "auto"
    allow_cross_node_inner: bool = False
    bringup_timeout_s: float = 120.0
    preflight: bool = True
    preflight_timeout_s: float = 20.0
    nccl_vpn_defaults: bool | str = "auto"
    worker_niceness: int | None = 0
    measure_links: bool | str = "auto"
    link_probe_s: float = 1.0
    hang_timeout_s: float | None = 60.0
    wait_sample_s: float | None = 0.02
    verbose: bool = False

    def check_options(self) -> None:
        """Raise ``ValueError`` naming the option and the fix for a bad value (mesh aside)."""
        check_option_values({f.name: getattr(self, f.name) for f in fields(MeshOptions)
                             if f.name != "mesh"})

    def options_dict(self) -> dict[str, Any]:
        """Every option by name, the mesh as a dict (for ``MeshConfig.to_dict``)."""
        out = {f.name: getattr(self, f.name) for f in fields(MeshOptions)}
        out["mesh"] = self.mesh if self.mesh == "auto" else MeshSpec.from_dict(self.mesh).to_dict()
        return out


OPTION_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(MeshOptions)}
"""Option name -> default, read from the dataclass (job sections use this)."""


def _positive(name: str, value: Any, high: float = math.inf) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not 0 < value <= high):
        bound = "" if high == math.inf else f" and <= {high:g}"
        raise ValueError(f"{name} must be a finite number of seconds > 0{bound}, got {value!r}.")


def check_option_values(values: Mapping[str, Any]) -> None:
    """Check the options present in ``values``; raise ``ValueError`` with the fix."""
    if "interface" in values:
        interface = values["interface"]
        if not isinstance(interface, str) or not interface:
            raise ValueError(f"interface must be 'auto' or an interface name, got "
                             f"{interface!r}.")
    for name in ("bringup_timeout_s", "preflight_timeout_s"):
        if name in values:
            _positive(name, values[name])
    hang_s = values.get("hang_timeout_s")
    if hang_s is not None:
        try:
            _positive("hang_timeout_s", hang_s)
        except ValueError:
            raise ValueError(f"hang_timeout_s must be a finite number of seconds > 0, or None "
                             f"(null in YAML) to turn the hang watch off; got {hang_s!r}.") \
                from None
    wait_s = values.get("wait_sample_s")
    if wait_s is not None:
        try:
            _positive("wait_sample_s", wait_s, high=1)
        except ValueError:
            raise ValueError(f"wait_sample_s must be a number of seconds in (0, 1], or None "
                             f"(null in YAML) to turn the wait sampler off; got {wait_s!r}.") \
                from None
    if "link_probe_s" in values:
        _positive("link_probe_s", values["link_probe_s"], high=30)
    if "measure_links" in values and values["measure_links"] not in (True, False, "auto"):
        raise ValueError(f"measure_links must be True, False or 'auto', got "
                         f"{values['measure_links']!r}.")
    for name in ("allow_cross_node_inner", "preflight", "verbose"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"{name} must be true or false, got {values[name]!r}.")
    if "nccl_vpn_defaults" in values and values["nccl_vpn_defaults"] not in (True, False, "auto"):
        raise ValueError(f"nccl_vpn_defaults must be True, False or 'auto', got "
                         f"{values['nccl_vpn_defaults']!r}.")
    if "worker_niceness" in values:
        nice = values["worker_niceness"]
        if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int)
                                 or nice not in priority.NICENESS_RANGE):
            raise ValueError(f"worker_niceness must be an int from -20 to 19 or None (keep "
                             f"Ray's), got {nice!r}.")


__all__ = ["OPTION_DEFAULTS", "MeshLike", "MeshOptions", "check_option_values"]
