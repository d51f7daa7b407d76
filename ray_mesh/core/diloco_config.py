"""DiLoCo's settings (YAML ``replicate: {mode: diloco, ...}``), checked where they are made.

The settings are the driver's (a job's ``replicate:`` section is checked here, before any
process group) and part of a :class:`~ray_mesh.core.layout.Layout` (its replicate mode), so
they live in the Ray-free, torch-free core; the outer loop that runs them on the workers is
:mod:`ray_mesh.parallel.diloco.outer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ray_mesh.errors import ParallelError

COMPRESS_MODES = ("none", "bf16", "int8")
"""How a DiLoCo sync sends its pseudo-gradients, and replica groups without DiLoCo their
gradients (:mod:`ray_mesh.parallel.compress`)."""


def check_group_compress(compress: str, diloco: bool) -> None:
    """Replica groups' ``compress`` (what crosses between groups at each step): one of the
    modes, and only without DiLoCo, whose config has its own."""
    if compress not in COMPRESS_MODES:
        raise ParallelError(f"compress={compress!r}: use one of {', '.join(COMPRESS_MODES)} "
                            "(how the gradients cross between replica groups at each step)")
    if diloco and compress != "none":
        raise ParallelError(f"compress={compress!r} with DiLoCo: its pseudo-gradients are sent "
                            "as its config's compress says; give DiLoCoConfig(compress="
                            f"{compress!r}) instead")


def check_group_diloco(config: DiLoCoConfig) -> None:
    """Replica groups take DiLoCo's outer step at their commit, in the quorum that decides
    who is in: one sync of every parameter, landed before the next round. ``streaming``
    (fragments on a schedule) and ``overlap`` (a sync landing steps later) belong to one
    mesh's ``DiLoCo.step()``, which groups do not call, so a group given either would run
    without it and say nothing: refused by name instead."""
    for name, default in (("streaming", 1), ("overlap", 0)):
        if getattr(config, name) != default:
            raise ParallelError(
                f"DiLoCoConfig({name}={getattr(config, name)!r}) with replica groups: their "
                f"outer step syncs every parameter at the commit, landed before the next "
                f"round, and {name} is a setting of one mesh's DiLoCo only. Leave {name} "
                f"out (the default, {default}) for replica groups, or run one mesh with "
                f"replicate: {{mode: diloco, {name}: ...}}.")


@dataclass(frozen=True)
class DiLoCoConfig:
    """The replicate dim's DiLoCo settings (YAML: ``replicate: {mode: diloco, ...}``).

    Stability: experimental
    """

    every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compress: str = "none"
    error_feedback: bool = True
    streaming: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ParallelError:
            return ParallelError(f"replicate.{key}={getattr(self, key)!r}: {why}")

        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise bad("every", "give the inner steps between syncs, an integer >= 1 "
                               "(tens to hundreds at this scale; the paper used 500)")
        if (isinstance(self.outer_lr, bool) or not isinstance(self.outer_lr, int | float)
                or not 0 < self.outer_lr <= 10 or math.isnan(self.outer_lr)):
            raise bad("outer_lr", "give a number in (0, 10]; 0.7 is the paper's")
        if (isinstance(self.outer_momentum, bool)
                or not isinstance(self.outer_momentum, int | float)
                or not 0 <= self.outer_momentum < 1):
            raise bad("outer_momentum", "give a number in [0, 1); 0.9 is the paper's")
        if not isinstance(self.nesterov, bool) or not isinstance(self.error_feedback, bool):
            raise ParallelError("replicate.nesterov and replicate.error_feedback must be "
                                "true or false")
        if self.compress not in COMPRESS_MODES:
            raise bad("compress", f"use one of {', '.join(COMPRESS_MODES)}")
        if (isinstance(self.streaming, bool) or not isinstance(self.streaming, int)
                or not 1 <= self.streaming <= self.every):
            raise bad("streaming", f"give the number of fragments, an integer in "
                                   f"[1, every={self.every}]")
        if (isinstance(self.overlap, bool) or not isinstance(self.overlap, int)
                or not 0 <= self.overlap < self.every):
            raise bad("overlap", f"give the inner steps a sync runs behind training, an "
                                 f"integer in [0, every={self.every}) (0: the sync blocks)")

    @classmethod
    def from_dict(cls, data: Any) -> DiLoCoConfig:
        if not isinstance(data, dict):
            raise ParallelError(f"replicate: {data!r} must be a mapping like "
                                "{mode: diloco, every: 50}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known - {"mode"})
        if unknown:
            raise ParallelError(f"replicate: unknown key(s) {unknown}; known: mode, "
                                f"{', '.join(sorted(known))}")
        return cls(**{k: v for k, v in data.items() if k != "mode"})


def too_few_replicas(config: DiLoCoConfig | None, dp_replicate: Any) -> str | None:
    """Why ``config`` cannot run over ``dp_replicate`` (DiLoCo averages replicas: it needs
    2 or more, ``nodes`` or ``-1`` before they are sized), or None when it can. The rule
    of :class:`~ray_mesh.core.layout.Layout`, which every layout is checked against."""
    if config is None or not isinstance(dp_replicate, int) or not 0 <= dp_replicate < 2:
        return None
    return (f"replicate.mode=diloco syncs replicas over dp_replicate, but the mesh has "
            f"dp_replicate={dp_replicate}: set mesh.dp_replicate: nodes (one replica per node) "
            f"or a size >= 2, or use replicate.mode: sync")


__all__ = ["DiLoCoConfig"]
