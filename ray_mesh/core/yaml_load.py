"""YAML job and mesh files, loaded strictly and within bounds (Ray-free).

A job file is small and written by a person, but it is still input: PyYAML's safe loader
runs no code, yet three things in a file of a few hundred bytes cost far more than the file:

* **aliases** (``*a``) reuse a value, so nine lines of ten aliases each ("billion laughs")
  load as a list that *refers to* 10**9 items; the first message that prints it, or
  anything that walks it, takes gigabytes and minutes (measured: 3.8 GB and no answer
  after 90 s from ``ray-mesh plan``);
* **nesting** 20,000 levels deep exhausts Python's recursion limit in the loader
  (``RecursionError`` traceback);
* **integers** past 4300 digits make ``int()`` (or a later ``str()``) raise ``ValueError``
  (a traceback).

So :class:`_StrictLoader` counts, while it composes the document, how many values the file
expands to (an alias counts as everything it stands for; a long string counts once per 80
characters), and refuses more than :data:`MAX_VALUES` or nesting deeper than
:data:`MAX_DEPTH`, each as a YAML error naming the line; a file over :data:`MAX_BYTES` is
not read at all. It also refuses a key given twice in one mapping (plain PyYAML keeps the
last one without a word, so a job with ``name:`` twice runs under the second).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ray_mesh.core.values import brief
from ray_mesh.errors import MeshSpecError

MAX_BYTES = 1 << 20
"""A job or mesh file larger than 1 MiB is not one a person wrote."""
MAX_VALUES = 100_000
"""Values a file may expand to, its aliases followed (a large job file has a few hundred)."""
MAX_DEPTH = 64
"""Levels of nesting a file may have (a job file has four or five)."""
MAX_INT_CHARS = 1000
"""An integer written with more characters is not a setting (Python's ``int()`` and
``str()`` stop at 4300 decimal digits; hex, octal and base-60 forms grow faster)."""


LIMIT = "ray_mesh_limit"  # set on a YAML error that is a bound passed, not a syntax error


def _limit_error(problem: str, mark: Any) -> yaml.composer.ComposerError:
    """A bound of :class:`_StrictLoader` was passed: reported as YAML reports a problem."""
    exc = yaml.composer.ComposerError(None, None, problem, mark)
    setattr(exc, LIMIT, True)
    return exc


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds on expansion, depth and integers, and no key twice."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values = 0  # values composed so far, aliases expanded
        self._depth = 0
        self._weight: dict[int, int] = {}  # id(node) -> values it stands for

    def compose_node(self, parent: Any, index: Any) -> Any:  # PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            self._count(self._weight.get(id(node), 1), mark)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _limit_error(f"the file nests deeper than {MAX_DEPTH} levels: a job file "
                               f"needs a handful; flatten it", self.peek_event().start_mark)
        before = self._values
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        own = 1 + len(node.value) // 80 if isinstance(node, yaml.ScalarNode) else 1
        self._count(own, node.start_mark)
        self._weight[id(node)] = self._values - before
        return node

    def _count(self, values: int, mark: Any) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            raise _limit_error(
                f"the file expands to more than {MAX_VALUES:,} values (its aliases *name "
                f"followed, as a billion-laughs file does): write the values out, or use "
                f"fewer aliases", mark)

    def construct_yaml_int(self, node: Any) -> int:
        if len(node.value) > MAX_INT_CHARS:
            raise _limit_error(f"an integer of {len(node.value)} characters (at most "
                               f"{MAX_INT_CHARS}): quote it to keep it as text",
                               node.start_mark)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor`: later keys override merged ones on purpose
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base loader reports it
                seen.setdefault(key, key_node.start_mark.line)
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {brief(key)} appears twice in one mapping (also on "
                        f"line {first + 1}): keep one of them", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _read_text(path: Path, error: type[Exception]) -> str:
    """A YAML file's text; a directory, a device, a missing, oversized or non-UTF-8 file
    says so."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.y*ml"))[:5]
        hint = f" (YAML files there: {', '.join(inside)})" if inside else ""
        raise error(f"{str(path)!r} is a directory, not a YAML file: give the path of the "
                    f"file itself{hint}.")
    if not path.exists():
        raise error(f"YAML file {str(path)!r} does not exist.")
    if not path.is_file():
        raise error(f"{str(path)!r} is not a regular file (a device, pipe or socket): give "
                    f"the path of a YAML file.")
    with path.open("rb") as f:  # bounded: the size stat() reports may not be what is read
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise error(f"{str(path)!r} is larger than {MAX_BYTES >> 20} MiB: a job or mesh file "
                    f"is a few KB; put data in files the job names (data.paths).")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise error(f"{str(path)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line "
                    f"{line}): save it as UTF-8.") from None


def load_yaml(source: str | Path, *, error: type[Exception] = MeshSpecError) -> Any:
    """Load YAML from a path or text; a parse error names the file, line and column.

    ``error`` is the exception raised for a missing file or bad YAML: ``MeshSpecError`` for
    mesh files, the caller's own for other files (job files pass ``JobError``). The bounds
    of :class:`_StrictLoader` apply, and a key given twice in one mapping is an error.
    """
    where = "<text>"
    text = source
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                    and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        where, text = str(path), _read_text(path, error)
    if len(text) > MAX_BYTES:
        raise error(f"{where} is larger than {MAX_BYTES >> 20} MiB: not a job or mesh file.")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if getattr(exc, LIMIT, False):
            raise error(f"{where} is refused{at}: {problem}.") from exc
        raise error(f"{where} is not valid YAML{at}: {problem}. Fix that line.") from exc
