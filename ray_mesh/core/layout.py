"""Layout: how one run is laid out, in one typed value with one spelling.

A layout is the mesh dims (``pp, dp_replicate, dp_shard, cp, tp``), the dtype gradients
are reduced in, the pipeline schedule and its microbatches, and the replicate mode (sync,
or DiLoCo with its settings). The CLI, job files, the planner's proposals, ``mesh: auto``'s
trials and pick, the benchmarks' results and the status page all read and write this one
type, so a layout printed by one is understood by the others.

The canonical string (:meth:`Layout.__str__`, parsed by :func:`parse_layout`; the two
round-trip, ``parse_layout(str(x)) == x``)::

    dp_replicate=2,dp_shard=4/bf16/sync
    pp=2,tp=4/fp32/schedule=1f1b,microbatches=8/sync
    dp_replicate=nodes,dp_shard=-1/fp32/diloco:every=50,compress=int8

Segments are separated by ``/``: the dims (``name=size``; a dim left out is 1; ``-1`` and
``nodes`` as in :class:`~ray_mesh.core.spec.MeshSpec`), the reduce dtype (``fp32`` or
``bf16``), the pipeline (only when set), and the replicate mode (``sync``, or ``diloco``
with the settings that differ from :class:`DiLoCoConfig`'s defaults, ``every`` always).
The mapping form (a job file's ``layout:`` section, or :meth:`Layout.to_dict`) has the
keys ``mesh``, ``reduce``, ``pipeline`` ({schedule, microbatches}) and ``replicate``.

A *family* (``ddp``, ``fsdp``, ``hsdp``, ``tp_hsdp``, ``pp``, ``tp_pp``, ``pp_tp_hsdp``) is
a shape relative to the cluster, not a layout: :func:`family_mesh` turns one into dims for
N nodes x G workers, and :attr:`Layout.family` names the family of given dims (read off the
dims, never guessed from a name).

Ray-free and torch-free: the driver, the CLI and the status page build layouts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ray_mesh.core.diloco_config import DiLoCoConfig, too_few_replicas
from ray_mesh.core.families import FAMILIES, OLD_FAMILY_SPELLINGS
from ray_mesh.core.families import check_family as check_family
from ray_mesh.core.families import family_mesh as family_mesh
from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.errors import LayoutError, MeshSpecError, ParallelError

REDUCE_DTYPES = ("fp32", "bf16")
"""What gradients are reduced in: fp32, or bf16 (half the bytes of every reduction)."""

SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("GPipe", "single"),
    "1f1b": ("1F1B", "single"),
    "interleaved1f1b": ("Interleaved1F1B", "loop"),
    "loopedbfs": ("LoopedBFS", "loop"),
    "interleavedzerobubble": ("InterleavedZeroBubble", "loop"),
    "zbvzerobubble": ("ZBVZeroBubble", "v"),
    "dualpipev": ("DualPipeV", "v"),
}
"""Canonical pipeline schedule name -> (torch schedule name, stage placement style)."""

_SCHEDULE_ALIASES = {"interleaved": "interleaved1f1b", "zbv": "zbvzerobubble",
                     "interleavedzb": "interleavedzerobubble"}

_EXAMPLE = "dp_replicate=2,dp_shard=4/bf16/sync"


def schedule_name(name: Any) -> str:
    """The canonical name of a pipeline schedule given in any common spelling
    (``Interleaved1F1B``, ``interleaved_1f1b``, ``ScheduleGPipe``...)."""
    key = str(name).strip().lower().replace("_", "").replace("-", "").replace(" ", "")
    key = _SCHEDULE_ALIASES.get(key.removeprefix("schedule"), key.removeprefix("schedule"))
    if key not in SCHEDULES:
        raise LayoutError(
            f"Unknown pipeline schedule {name!r}: use one of gpipe, 1f1b, interleaved_1f1b, "
            f"looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, dualpipev.")
    return key


@dataclass(frozen=True)
class Layout:
    """One run's layout: mesh dims, reduce dtype, pipeline, replicate mode (see module doc).

    ``diloco`` None is sync replication (HSDP's all-reduce every step); a
    :class:`DiLoCoConfig` is DiLoCo with those settings. ``schedule`` None: no pipeline
    schedule chosen (the train function's own, or no pipeline).

    Stability: experimental
    """

    mesh: MeshSpec = MeshSpec(dp_shard=1)
    reduce: str = "fp32"
    schedule: str | None = None
    microbatches: int = 1
    diloco: DiLoCoConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, MeshSpec):
            raise LayoutError(f"Layout.mesh must be a MeshSpec, not {self.mesh!r}; build "
                              f"layouts with parse_layout({_EXAMPLE!r}) or Layout.of(...)")
        if self.reduce not in REDUCE_DTYPES:
            raise LayoutError(f"reduce dtype {self.reduce!r}: use fp32 or bf16 (gradients "
                              f"reduced in bf16: half the bytes), e.g. {_EXAMPLE}")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", schedule_name(self.schedule))
        mb = self.microbatches
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= 100_000:
            raise LayoutError(f"microbatches={mb!r}: give an integer >= 1 (pipeline "
                              f"microbatches per step), e.g. schedule=1f1b,microbatches=4")
        if self.diloco is not None and not isinstance(self.diloco, DiLoCoConfig):
            raise LayoutError(f"Layout.diloco must be a DiLoCoConfig or None (sync), not "
                              f"{self.diloco!r}")
        if why := too_few_replicas(self.diloco, self.mesh.dp_replicate):
            raise LayoutError(why)  # a layout that could not run is never built

    # ------------------------------------------------------------------ building
    @classmethod
    def of(cls, mesh: Any = None, *, reduce: str = "fp32", schedule: str | None = None,
           microbatches: int = 1, diloco: DiLoCoConfig | None = None) -> Layout:
        """A layout from mesh dims given as a :class:`MeshSpec` or a mapping (dims left out
        are 1), e.g. ``Layout.of({"dp_replicate": 2, "dp_shard": 2}, reduce="bf16")``."""
        return cls(_mesh(mesh), reduce, schedule, microbatches, diloco)

    def resolved(self, world_size: int, num_nodes: int | None = None) -> Layout:
        """This layout with its ``-1``/``nodes`` dims sized for the cluster."""
        return replace(self, mesh=self.mesh.resolve(world_size, num_nodes))

    # ------------------------------------------------------------------ reading
    @property
    def dims(self) -> dict[str, int | str]:
        """The dims that are not 1, outer to inner (what the string shows)."""
        return {d: v for d, v in self.mesh.to_dict().items() if v != 1}

    @property
    def dims_text(self) -> str:
        """The dims segment of the string (``dp_replicate=nodes,dp_shard=-1``)."""
        return ",".join(f"{d}={v}" for d, v in self.dims.items()) or "dp_shard=1"

    @property
    def replicate(self) -> str:
        """``sync`` or ``diloco``."""
        return "sync" if self.diloco is None else "diloco"

    @property
    def precision(self) -> str | None:
        """The ``mixed_precision`` name FSDP reduces in for this layout (None: fp32)."""
        return "bf16_grads" if self.reduce == "bf16" else None

    @property
    def family(self) -> str:
        """The family these dims belong to (an open dim, -1 or nodes, counts as > 1)."""
        big = {d: v != 1 for d, v in self.mesh.to_dict().items()}
        rep, shard = big["dp_replicate"], big["dp_shard"] or big["cp"]
        if big["pp"]:
            if not big["tp"]:
                return "pp"
            return "tp_pp" if not (rep or shard) else "pp_tp_hsdp"
        if big["tp"]:
            return "tp_hsdp"
        if rep and shard:
            return "hsdp"
        return "ddp" if rep else "fsdp"

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        parts = [self.dims_text, self.reduce]
        if self.schedule is not None or self.microbatches != 1:
            pipe = [f"schedule={self.schedule}"] if self.schedule else []
            pipe += [f"microbatches={self.microbatches}"] if self.microbatches != 1 else []
            parts.append(",".join(pipe))
        if self.diloco is None:
            parts.append("sync")
        else:
            default = DiLoCoConfig()
            settings = [f"{f.name}={_word(getattr(self.diloco, f.name))}"
                        for f in fields(DiLoCoConfig)
                        if f.name == "every"
                        or getattr(self.diloco, f.name) != getattr(default, f.name)]
            parts.append("diloco:" + ",".join(settings))
        return "/".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The mapping form (JSON, job files); :func:`parse_layout` reads it back."""
        return {"mesh": self.mesh.to_dict(), "reduce": self.reduce,
                "pipeline": {"schedule": self.schedule, "microbatches": self.microbatches},
                "replicate": ({"mode": "sync"} if self.diloco is None
                              else {"mode": "diloco", **asdict(self.diloco)})}


def _word(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _mesh(value: Any) -> MeshSpec:
    """Mesh dims from a MeshSpec, a mapping (dims left out are 1) or a mesh shorthand."""
    if isinstance(value, MeshSpec):
        return value
    if value is None:
        return MeshSpec(dp_shard=1)
    try:
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(DIM_NAMES))
            if unknown:
                return MeshSpec.from_dict(dict(value))  # its error names the dims
            return MeshSpec(**{d: value.get(d, 1) for d in DIM_NAMES})
        return MeshSpec.from_dict(value)  # 'hsdp' / 'fsdp' / 'ddp'
    except MeshSpecError as exc:
        raise LayoutError(f"layout mesh: {exc}") from None


# ---------------------------------------------------------------------------- parsing
_DIM = re.compile(r"^([a-z_]+)=(-1|\d+|nodes)$")


def parse_layout(value: Any) -> Layout:
    """The one parser: a :class:`Layout` from its canonical string, its mapping form, or a
    Layout. Raises :class:`~ray_mesh.errors.LayoutError` naming the fix.

    Stability: experimental
    """
    if isinstance(value, Layout):
        return value
    if isinstance(value, str):
        return _from_string(value)
    if isinstance(value, Mapping):
        return _from_mapping(value)
    raise LayoutError(f"a layout is a string like {_EXAMPLE!r} or a mapping {{mesh, reduce, "
                      f"pipeline, replicate}}, not {type(value).__name__}: {value!r}")


def _from_string(text: str) -> Layout:
    raw = text.strip()
    segments = raw.split("/")
    if not raw or "=" not in segments[0]:
        raise LayoutError(_not_a_layout(raw))
    dims: dict[str, Any] = {}
    for item in segments[0].split(","):
        m = _DIM.match(item.strip())
        if not m or m.group(1) not in DIM_NAMES:
            raise LayoutError(f"layout {raw!r}: {item.strip()!r} is not a dim; write "
                              f"name=size with a name from {', '.join(DIM_NAMES)} and a "
                              f"size, -1 or nodes, e.g. {_EXAMPLE}")
        if m.group(1) in dims:
            raise LayoutError(f"layout {raw!r}: dim {m.group(1)} given twice")
        size = m.group(2)
        dims[m.group(1)] = size if size == "nodes" else int(size)
    seen: dict[str, Any] = {}
    for seg in (s.strip() for s in segments[1:]):
        kind = ("reduce" if seg in REDUCE_DTYPES else
                "replicate" if seg == "sync" or seg.startswith("diloco") else
                "pipeline" if seg.startswith(("schedule=", "microbatches=")) else None)
        if kind is None:
            raise LayoutError(f"layout {raw!r}: segment {seg!r} is none of: a reduce dtype "
                              f"(fp32, bf16), a pipeline (schedule=1f1b,microbatches=4), a "
                              f"replicate mode (sync, diloco:every=50); e.g. {_EXAMPLE}")
        if kind in seen:
            raise LayoutError(f"layout {raw!r}: two {kind} segments ({seen[kind]!r}, {seg!r})")
        seen[kind] = seg
    pipe = _settings(seen.get("pipeline", ""), raw)
    unknown = sorted(set(pipe) - {"schedule", "microbatches"})
    if unknown:
        raise LayoutError(f"layout {raw!r}: pipeline key(s) {unknown}; use schedule and "
                          "microbatches")
    diloco = None
    rep = seen.get("replicate", "sync")
    if rep != "sync":
        if rep != "diloco" and not rep.startswith("diloco:"):
            raise LayoutError(f"layout {raw!r}: replicate {rep!r}; write sync, diloco or "
                              "diloco:every=50,compress=int8")
        diloco = _diloco(_settings(rep.removeprefix("diloco").removeprefix(":"), raw))
    return Layout.of(dims, reduce=seen.get("reduce", "fp32"),
                     schedule=pipe.get("schedule"),
                     microbatches=_int(pipe.get("microbatches", 1), "microbatches", raw),
                     diloco=diloco)


def _settings(text: str, raw: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key or not val:
            raise LayoutError(f"layout {raw!r}: {item!r} is not key=value")
        out[key] = val
    return out


def _int(value: Any, key: str, raw: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LayoutError(f"layout {raw!r}: {key}={value!r} is not an integer") from None


def _diloco(settings: Mapping[str, Any]) -> DiLoCoConfig:
    """DiLoCo settings from strings (the canonical string) or typed values (a mapping)."""
    kinds = {f.name: f.type for f in fields(DiLoCoConfig)}
    typed: dict[str, Any] = {}
    for key, val in settings.items():
        if key == "mode":
            continue
        kind = kinds.get(key)
        if isinstance(val, str) and kind in ("int", "float", "bool"):
            try:
                val = ({"true": True, "false": False}[val.lower()] if kind == "bool"
                       else int(val) if kind == "int" else float(val))
            except (KeyError, ValueError):
                raise LayoutError(f"replicate {key}={val!r}: not a valid {kind}") from None
        typed[key] = val
    try:
        return DiLoCoConfig.from_dict(typed)
    except ParallelError as exc:
        raise LayoutError(str(exc)) from None


def parse_replicate(data: Any) -> DiLoCoConfig | None:
    """A replicate mode (a job's ``replicate:`` section): None (sync) or DiLoCo settings.

    Accepts None, ``'sync'``, ``'diloco'`` (its defaults), a mapping (``mode`` defaults to
    ``sync``), or a :class:`DiLoCoConfig`.
    """
    if data is None or isinstance(data, DiLoCoConfig):
        return data
    if isinstance(data, str):
        data = {"mode": data}
    if not isinstance(data, Mapping):
        raise LayoutError(f"replicate: {data!r} must be a mapping like "
                          "{mode: diloco, every: 50} (or mode: sync, the default)")
    mode = data.get("mode", "sync")
    if mode not in ("sync", "diloco"):
        raise LayoutError(f"replicate.mode={mode!r}: use 'sync' (HSDP, all-reduce every "
                          "step) or 'diloco' (sync every `every` steps)")
    if mode == "sync":
        extra = sorted(set(data) - {"mode"})
        if extra:
            raise LayoutError(f"replicate: {extra} only apply to mode: diloco; add "
                              "mode: diloco or remove them")
        return None
    return _diloco(data)


def _from_mapping(data: Mapping[str, Any]) -> Layout:
    unknown = sorted(set(data) - {"mesh", "reduce", "pipeline", "replicate"})
    if unknown:
        raise LayoutError(f"layout: unknown key(s) {unknown}; a layout mapping has mesh, "
                          "reduce, pipeline and replicate (or write the string form, "
                          f"{_EXAMPLE!r})")
    pipe = data.get("pipeline") or {}
    if not isinstance(pipe, Mapping) or set(pipe) - {"schedule", "microbatches"}:
        raise LayoutError(f"layout.pipeline: {pipe!r}; give {{schedule: 1f1b, "
                          "microbatches: 4}}")
    return Layout.of(data.get("mesh"), reduce=data.get("reduce", "fp32"),
                     schedule=pipe.get("schedule"), microbatches=pipe.get("microbatches", 1),
                     diloco=parse_replicate(data.get("replicate")))


def _not_a_layout(raw: str) -> str:
    """What to write instead of ``raw``, which has no dims (an old spelling, or a family)."""
    key = raw.lower()
    base = re.split(r"[+/@]", key)[0]
    family = OLD_FAMILY_SPELLINGS.get(base, base)
    if re.fullmatch(r"tp\d+_hsdp", family):
        family = "tp_hsdp"
    if family in FAMILIES:
        return (f"{raw!r} names a layout family ({family}), not a layout: a layout spells its "
                f"dims, e.g. {_EXAMPLE} or pp=2,tp=4/fp32/sync. Families go in plan.layouts "
                f"and `ray-mesh plan --layout {family}`; family_mesh() gives a family's dims "
                f"on a cluster.")
    return (f"{raw!r} is not a layout: write dims/reduce/replicate, e.g. {_EXAMPLE} "
            f"(dims: {', '.join(DIM_NAMES)}; reduce: fp32, bf16; replicate: sync, "
            f"diloco:every=50).")


__all__ = ["Layout", "parse_layout"]
