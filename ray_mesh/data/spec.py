"""The ``data:`` section of a job file, checked on the driver before any worker starts.

::

    data:
      paths: [stdlib]        # files, directories, globs (** recurses); 'stdlib' = Python's
                             # own standard library sources (*.py), on every machine
      format: text           # text | jsonl | parquet (jsonl/parquet: the text_key column)
      seq_len: 128           # tokens per training row (rows hold seq_len + 1: inputs + target)
      batch_size: 16         # global batch in sequences (or batch_tokens: 2048)
      validation: 0.05       # fraction of files held out, or a list of globs to hold out
      shuffle_seed: 0
      max_tokens: null       # read at most this many training tokens (bytes)
      val_tokens: 65536      # validation tokens kept in memory on every worker

Ray-free. The files are resolved and split here, so a typo, an empty dataset, a batch the
dp size does not divide or a sequence the model cannot take fails with the key and the fix
instead of on the workers minutes later.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ray_mesh.core.values import read_str
from ray_mesh.errors import DataSpecError

FORMATS: dict[str, tuple[str, ...]] = {
    "text": (),  # any file
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
}
STDLIB = "stdlib"
"""The ``paths`` entry naming Python's standard library sources (no site-packages)."""
GLOB_CHARS = set("*?[")


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files (~1,800 on CPython 3.11), sorted.

    Walked with ``site-packages`` and ``dist-packages`` pruned, not globbed and filtered:
    they sit inside the standard library's folder and hold every installed package (torch,
    Ray: ~40,000 files here), which a glob walked on every node and every worker at each
    start and evaluation (1.1 s a walk on a 2-core box; 0.05 s pruned)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(found)


def _entry_files(entry: str, fmt: str, base_dir: Path) -> list[Path]:
    if entry == STDLIB:
        return stdlib_files()
    exts = FORMATS[fmt]
    expanded = os.path.expanduser(entry)
    candidates = [Path(expanded)] if os.path.isabs(expanded) else [base_dir / expanded,
                                                                   Path.cwd() / expanded]
    for cand in candidates:
        if GLOB_CHARS & set(str(cand)):
            found = [Path(p) for p in glob.glob(str(cand), recursive=True)]
            found = [p for p in found if p.is_file()]
            if found:
                return sorted(found)
        elif cand.is_dir():
            return sorted(p for p in cand.rglob("*") if p.is_file()
                          and not p.name.startswith(".") and (not exts or p.suffix in exts))
        elif cand.is_file():
            return [cand]
    return []


def _split_key(path: Path, seed: int) -> str:
    # The last three components: the same split on nodes where the root differs.
    tail = "/".join(path.parts[-3:])
    return hashlib.sha1(f"{seed}:{tail}".encode()).hexdigest()


@dataclass(frozen=True)
class DataSpec:
    """A validated ``data:`` section (see the module doc). ``base_dir``: where relative paths
    resolve first (the job file's folder), then the working directory."""

    paths: tuple[str, ...] = (STDLIB,)
    format: str = "text"
    text_key: str = "text"
    seq_len: int = 128
    batch_size: int | None = None
    batch_tokens: int | None = None
    validation: float | tuple[str, ...] = 0.05
    shuffle_seed: int = 0
    max_tokens: int | None = None
    val_tokens: int | None = 65536
    base_dir: str = field(default_factory=os.getcwd)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, base_dir: str | Path | None = None,
                  ) -> DataSpec:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise DataSpecError(f"'data' must be a mapping (paths, format, seq_len, ...), got "
                                f"{type(data).__name__}: {data!r}.")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                import difflib

                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise DataSpecError(f"Unknown key {key!r} in 'data'.{hint} Allowed: "
                                    f"{tuple(known)}.")
        values = dict(data)
        paths = values.get("paths", [STDLIB])
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, Sequence) or not paths or \
                not all(isinstance(p, str) and p for p in paths):
            raise DataSpecError(f"data.paths must be a path, glob, or list of them (or "
                                f"'{STDLIB}'), got {paths!r}.")
        values["paths"] = tuple(paths)
        val = values.get("validation", 0.05)
        if isinstance(val, str):
            val = [val]
        if isinstance(val, list | tuple):
            values["validation"] = tuple(val)
        if base_dir is not None or "base_dir" not in values:
            values["base_dir"] = str(base_dir or os.getcwd())
        if values.get("batch_size") is None and values.get("batch_tokens") is None:
            values["batch_size"] = 16
        spec = cls(**values)
        spec.check_values()
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists for tuples) for a train_loop_config; ``from_dict`` reads it."""
        out = asdict(self)
        out["paths"] = list(self.paths)
        if isinstance(self.validation, tuple):
            out["validation"] = list(self.validation)
        return out

    def check_values(self) -> None:
        """Types and ranges of every key (no file access)."""
        read_str("data.format", self.format, choices=tuple(FORMATS), error=DataSpecError)
        read_str("data.text_key", self.text_key, error=DataSpecError,
                 hint=" (the column holding the text in jsonl/parquet rows)")
        for key in ("seq_len", "batch_size", "batch_tokens", "max_tokens", "val_tokens"):
            value = getattr(self, key)
            if value is None and key != "seq_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataSpecError(f"data.{key} must be a positive int, got {value!r}.")
        if self.batch_size is not None and self.batch_tokens is not None:
            raise DataSpecError("data: give batch_size (sequences) or batch_tokens (tokens), "
                                "not both.")
        if self.batch_tokens is not None and self.batch_tokens % self.seq_len:
            raise DataSpecError(
                f"data.batch_tokens={self.batch_tokens} is not a whole number of sequences of "
                f"seq_len={self.seq_len}. Use a multiple of {self.seq_len}, e.g. "
                f"{self.seq_len * max(1, self.batch_tokens // self.seq_len)}.")
        if isinstance(self.validation, tuple):
            if not all(isinstance(g, str) and g for g in self.validation):
                raise DataSpecError(f"data.validation as a list holds globs of files to hold "
                                    f"out, got {list(self.validation)!r}.")
        elif isinstance(self.validation, bool) or not isinstance(self.validation, int | float) \
                or not 0 < self.validation < 1:
            raise DataSpecError(f"data.validation must be a fraction of files in (0, 1) or a "
                                f"list of globs to hold out, got {self.validation!r}.")
        if isinstance(self.shuffle_seed, bool) or not isinstance(self.shuffle_seed, int):
            raise DataSpecError(f"data.shuffle_seed must be an int, got {self.shuffle_seed!r}.")

    # ------------------------------------------------------------------ files
    @property
    def global_batch(self) -> int:
        """The global batch in sequences."""
        if self.batch_tokens is not None:
            return self.batch_tokens // self.seq_len
        return int(self.batch_size or 16)

    def files(self) -> list[Path]:
        """Every file the paths name (deduplicated, sorted); a path matching none raises."""
        seen: dict[str, Path] = {}
        for i, entry in enumerate(self.paths):
            found = _entry_files(entry, self.format, Path(self.base_dir))
            if not found:
                exts = FORMATS[self.format]
                kind = f" with {'/'.join(exts)} files" if exts else ""
                raise DataSpecError(
                    f"data.paths[{i}] = {entry!r} matches no file{kind} (looked in "
                    f"{self.base_dir} and {os.getcwd()}). Fix the path or glob ('**' "
                    f"recurses), or use '{STDLIB}' for Python's own sources.")
            for p in found:
                real = p.resolve()
                seen.setdefault(str(real), real)
        return sorted(seen.values())

    def split(self, files: list[Path] | None = None) -> tuple[list[Path], list[Path]]:
        """(train, validation) files: held out by glob, or a seeded fraction of the files."""
        files = self.files() if files is None else files
        if isinstance(self.validation, tuple):
            val = [p for p in files if any(fnmatch(p.as_posix(), g) or fnmatch(p.name, g)
                                           for g in self.validation)]
        else:
            if len(files) < 2:
                raise DataSpecError(
                    f"data.validation={self.validation} holds out a fraction of the files, but "
                    f"the paths give only {len(files)} file. Add files, or hold out a glob.")
            k = min(len(files) - 1, max(1, round(self.validation * len(files))))
            val = sorted(sorted(files, key=lambda p: _split_key(p, self.shuffle_seed))[:k])
        held = set(val)
        return [p for p in files if p not in held], val

    # ------------------------------------------------------------------ checks
    def check(self, *, dp_size: int | None = None, max_seq_len: int | None = None,
              ) -> tuple[list[Path], list[Path]]:
        """Everything that can be known before training: returns the (train, val) files."""
        self.check_values()
        if max_seq_len is not None and self.seq_len > max_seq_len:
            raise DataSpecError(
                f"data.seq_len={self.seq_len} is longer than the model's max_seq_len="
                f"{max_seq_len}. Lower data.seq_len, or raise config.model.max_seq_len to "
                f"at least {self.seq_len}.")
        if dp_size is not None and self.global_batch % dp_size:
            what = (f"batch_tokens={self.batch_tokens} ({self.global_batch} sequences)"
                    if self.batch_tokens is not None else f"batch_size={self.global_batch}")
            good = dp_size * max(1, self.global_batch // dp_size)
            raise DataSpecError(
                f"data.{what} does not split over the mesh's {dp_size} data-parallel ranks "
                f"(dp_replicate x dp_shard). Use a global batch that is a multiple of "
                f"{dp_size}, e.g. batch_size: {good}.")
        train, val = self.split()
        row = self.seq_len + 1
        for name, part, need in (("training", train, row * self.global_batch),
                                 ("validation", val, row * (dp_size or 1))):
            size = sum(p.stat().st_size for p in part)
            if not part or size < need:
                fix = ("hold out fewer files (data.validation)" if name == "training"
                       else "hold out more files (data.validation)")
                raise DataSpecError(
                    f"data: the {name} split is empty or too small: {len(part)} files, {size} "
                    f"bytes, but one {'global batch' if name == 'training' else 'row per dp rank'}"
                    f" needs {need} bytes ({row} bytes a row). Add data to data.paths, lower "
                    f"seq_len or the batch, or {fix}.")
        return train, val


def parse_job_data(section: Any, base_dir: str | Path, *, mesh: Any = None,
                   num_workers: int | None = None, config: Mapping[str, Any] | None = None,
                   ) -> DataSpec | None:
    """The job file's ``data:`` section, checked (None when the job has none).

    The global batch is checked against the dp size the mesh (a ``MeshSpec``) resolves to on
    ``num_workers`` (skipped when it cannot resolve yet, e.g. ``nodes`` dims), and
    ``seq_len`` against ``config.model.max_seq_len`` when the job's config sets it.
    """
    if section is None:
        return None
    spec = DataSpec.from_dict(section, base_dir=base_dir)
    dp = None
    if mesh is not None and num_workers:
        try:
            resolved = mesh.resolve(num_workers)
            dp = resolved.size("dp_replicate") * resolved.size("dp_shard")
        except ValueError:  # MeshSpecError: reported by the mesh's own check
            dp = None
    model = (config or {}).get("model")
    max_seq = model.get("max_seq_len") if isinstance(model, Mapping) else None
    spec.check(dp_size=dp, max_seq_len=max_seq if isinstance(max_seq, int) else None)
    return spec
