"""ray_mesh's own bring-up options, Ray-free: one home for their defaults and their checks.

:class:`~ray_mesh.raytrain.backend.MeshConfig` is ``MeshOptions`` plus Ray's ``TorchConfig``
(backend, init_method, timeout_s); the job file's ``network:`` section
(:mod:`ray_mesh.cli.job`) reads its defaults from these fields. Keeping them here, away from
Ray, lets the job parser use them without importing Ray, and the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ray_mesh.core import priority
from ray_mesh.core.spec import MeshSpec
from ray_mesh.core.values import describe, read_bool, read_int, read_seconds

MeshLike = MeshSpec | Mapping[str, Any] | str | None
"""What ``mesh=`` accepts: a MeshSpec, a dict of dim sizes, 'hsdp'/'fsdp'/'ddp', or None."""


@dataclass
class MeshOptions:
    """The options ``MeshConfig`` adds to ``TorchConfig`` (see its docstring for each).

    ``MeshConfig(layout=..., options=MeshOptions(...))`` gives a run's settings as two
    objects: the layout says how the ranks are laid out, these say how the mesh is brought
    up and watched. A job file's ``network:`` section is one of these (its ``mesh`` stays
    None there: the mesh is the layout's).

    Stability: experimental
    """

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

    def option_values(self) -> dict[str, Any]:
        """Every option but the mesh, by name (``OPTION_NAMES``)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def check_options(self) -> None:
        """Raise ``ValueError`` naming the option and the fix for a bad value (mesh aside)."""
        check_option_values(self.option_values())

    def worker_options(self) -> MeshOptions:
        """These options as a plain ``MeshOptions`` for the workers (``mesh`` left None: a
        worker is given the resolved mesh in its layout). One generic copy, so a new option
        reaches the workers without a new field anywhere."""
        return MeshOptions(**self.option_values())

    def options_dict(self) -> dict[str, Any]:
        """Every option by name, the mesh as a dict (for ``MeshConfig.to_dict``)."""
        out = {f.name: getattr(self, f.name) for f in fields(MeshOptions)}
        out["mesh"] = self.mesh if self.mesh == "auto" else MeshSpec.from_dict(self.mesh).to_dict()
        return out


OPTION_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(MeshOptions)}
"""Option name -> default, read from the dataclass (job sections use this)."""

OPTION_NAMES: tuple[str, ...] = tuple(name for name in OPTION_DEFAULTS if name != "mesh")
"""The options proper: every field but ``mesh``, which a :class:`~ray_mesh.core.layout.Layout`
carries (resolved) from the driver on. Checks, the workers' copy and the job's keys read it."""


def check_option_values(values: Mapping[str, Any]) -> None:
    """Check the options present in ``values``; raise ``ValueError`` with the fix.

    The same strict readers as the job file and the CLI (:mod:`ray_mesh.core.values`):
    ``"false"`` is not a bool, ``0`` is not ``False``, ``.nan`` is not a number of seconds.
    """
    if "interface" in values:
        iface = values["interface"]
        if not isinstance(iface, str) or not iface.strip():
            raise ValueError(f"interface must be 'auto' or an interface name (e.g. "
                             f"tailscale0); got {describe(iface)}.")
    for name in ("bringup_timeout_s", "preflight_timeout_s"):
        if name in values:
            read_seconds(name, values[name])
    if "hang_timeout_s" in values:
        read_seconds("hang_timeout_s", values["hang_timeout_s"], none_ok=True,
                     none_means="None/null turns the hang watch off")
    if "wait_sample_s" in values:
        read_seconds("wait_sample_s", values["wait_sample_s"], high=1, none_ok=True,
                     none_means="None/null turns the wait sampler off")
    if "link_probe_s" in values:
        read_seconds("link_probe_s", values["link_probe_s"], high=30)
    for name in ("allow_cross_node_inner", "preflight", "verbose"):
        if name in values:
            read_bool(name, values[name])
    for name in ("measure_links", "nccl_vpn_defaults"):
        if name in values:
            read_bool(name, values[name], also=("auto",))
    if "worker_niceness" in values:
        lo, hi = priority.NICENESS_RANGE[0], priority.NICENESS_RANGE[-1]
        read_int("worker_niceness", values["worker_niceness"], lo, hi, none_ok=True)
