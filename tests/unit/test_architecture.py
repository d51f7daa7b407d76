"""The architecture, checked on the source itself: one model of the layers, one circle finder,
one size limit, and the Ray-free boundary.

**Layers.** Every ``import`` statement counts, at module level or inside a function (a lazy
import is still a dependency: it only moves the failure from import time to call time). The
layers, lowest first, are the folders of ``ray_mesh`` as the data flows (README, "Layout"):

* ``private_apis``: every torch and Ray internal the package touches, with its version; it
  imports nothing of ours. ``errors`` and ``upstream`` (the register of upstream
  workarounds) sit beside it.
* ``core``: the Ray-free mesh spec and bootstrap every other part builds on.
* ``network``: interfaces, links and the pre-flight's facts, used from bring-up up.
* ``observability``: what a person sees (tables, layout, progress, metrics, hang and slow
  reports); it reads the spec and the network facts and nothing above, and every layer
  above reports through it.
* ``parallel``: TP, FSDP, PP, CP, DiLoCo on a mesh.
* ``models`` and ``data``: a model and a data pipeline built on ``parallel`` (siblings: they
  do not import each other).
* ``checkpointing``: saves and loads what ``parallel`` built (DiLoCo's replicas included).
* ``replicas``: replica groups, a ``dp_replicate`` dim that survives one group's failure.
* ``planning`` and ``status``: the driver's choice of nodes and mesh, priced with the layers
  below; and its ``ray-mesh status``, which reads what the layers below wrote (siblings).
* ``raytrain``: the Ray Train glue that drives all of the above on a cluster.
* ``cli``: the ``ray-mesh`` program, on top: it parses job files and flags and runs them
  through ``raytrain``.

``ray_mesh/__init__.py`` is the facade above all of them (lazy exports), so it is exempt.
Outside the package: ``harness/`` (the virtual multi-node cluster and the train functions
that tests and benchmarks share) imports only ``ray_mesh``; ``benchmarks/`` imports
``ray_mesh`` and ``harness`` and never reaches into ``tests/``; the package imports none of
them.

**No circle** in the whole tree: the package, ``harness/``, ``benchmarks/`` and the tests'
own helpers (``tests/helpers``, imported by their file names).

**Size.** A soft limit of :data:`MAX_LINES` lines per module: past it a module holds more than
one job. Modules are split by feature, not at a line count.

**Ray-free means Ray-free**: importing any module outside the Ray glue leaves ``ray`` out of
``sys.modules`` (checked in a fresh interpreter, so nothing imported earlier hides it). The
glue that may import Ray: ``ray_mesh.raytrain``, ``ray_mesh.cli`` and the Ray Train
checkpointer (``checkpointing.train``, ``.storage``, ``.guards``). Every other module,
present or future, is held to it.

Run this file as a script for the whole report (cycles, back-arrows, sizes).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ray_mesh"
MAX_LINES = 800

LAYERS: tuple[tuple[str, ...], ...] = (
    ("private_apis", "errors", "upstream"),
    ("core",),
    ("network",),
    ("observability",),
    ("parallel",),
    ("models", "data"),
    ("checkpointing",),
    ("replicas",),
    ("planning", "status"),
    ("raytrain",),
    ("cli",),
)
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
FACADE = "ray_mesh"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(pkg: Path = PKG) -> dict[str, Path]:
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path], root: Path = ROOT
               ) -> list[tuple[str, int]]:
    """``(module, line)`` for every import of a module in ``modules``, anywhere in the file.

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of
    ``a.b``; an import of an unknown name counts for its closest known parent.
    """
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.append((name, node.lineno))
    return sorted(set(found))


def graph(modules: dict[str, Path] | None = None) -> dict[str, list[tuple[str, int]]]:
    modules = modules if modules is not None else package_modules()
    return {m: imports_of(p, modules) for m, p in modules.items()}


def layer_of(module: str) -> str:
    """``ray_mesh.network.probe`` -> ``network``; ``ray_mesh.private_apis`` -> itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def cycles(g: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """One closed path per strongly connected group of modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted({t for t, _ in g[start]})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for t in targets:
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(sorted({u for u, _ in g[t]}))))
                    break
                if t in on_stack:
                    low[node] = min(low[node], index[t])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        group.append(m)
                        if m == node:
                            break
                    if len(group) > 1:
                        groups.append(_closed_path(g, set(group)))
    return groups


def _closed_path(g: dict[str, list[tuple[str, int]]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first inside the group)."""
    first = min(group)
    paths = {first: [first]}
    queue = [first]
    while queue:
        m = queue.pop(0)
        for t, _ in g[m]:
            if t == first:
                return [*paths[m], first]
            if t in group and t not in paths:
                paths[t] = [*paths[m], t]
                queue.append(t)
    return sorted(group)


def back_arrows(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports that point from a layer to a higher one (or to a sibling of its layer)."""
    bad = []
    for m, targets in sorted(g.items()):
        src = layer_of(m)
        if src == FACADE:
            continue
        assert src in RANK, f"{m}: folder {src!r} has no layer; add it to LAYERS"
        for t, line in targets:
            dst = layer_of(t)
            if dst == src:
                continue
            if dst == FACADE or RANK[dst] >= RANK[src]:
                how = "up to" if dst == FACADE or RANK[dst] > RANK[src] else "across to sibling"
                bad.append(f"{m}:{line} imports {t} ({src} -> {how} {dst})")
    return bad


def whole_tree() -> dict[str, Path]:
    """Every module of ours by import name: the package, harness/, benchmarks/, and the tests'
    helpers by their file names (tests/conftest.py puts tests/helpers on the path)."""
    helpers = {p.stem: p for p in sorted((ROOT / "tests" / "helpers").glob("*.py"))}
    return {**package_modules(), **package_modules(ROOT / "harness"),
            **package_modules(ROOT / "benchmarks"), **helpers}


def long_modules(modules: dict[str, Path] | None = None) -> dict[str, int]:
    modules = modules if modules is not None else package_modules()
    return {m: n for m, p in modules.items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}


# ------------------------------------------------------------------------------ the tests
def test_every_folder_has_a_layer():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    files = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    missing = (folders | files) - set(RANK)
    assert not missing, (f"ray_mesh/{', '.join(sorted(missing))} has no layer: add it to "
                         f"LAYERS in {Path(__file__).name}, below everything that imports it")


def test_no_import_cycle():
    """None in the whole tree: the package, harness/, benchmarks/ and the tests' helpers
    (the virtual cluster once had two: its node starter and the cluster, its namespaces and
    the WireGuard tunnel)."""
    modules = whole_tree()
    found = cycles(graph(modules))
    assert not found, (
        "import cycles (function-level imports count):\n  "
        + "\n  ".join(" -> ".join(c) for c in found)
        + "\nMove the piece both need into the lower module (or a new one below both); an "
          "import moved inside a function is still a cycle.")


def test_no_arrow_from_a_lower_layer_up():
    bad = back_arrows(graph())
    assert not bad, (
        "imports against the layers (lowest first: "
        + " < ".join("/".join(layer) for layer in LAYERS) + "):\n  " + "\n  ".join(bad)
        + "\nMove the imported code down to the importer's layer or lower, or the importing "
          "code up to where it is used.")


def test_no_module_over_the_size_limit():
    long = long_modules()
    assert not long, (f"modules over {MAX_LINES} lines: {long}. Split each by feature (a "
                      f"package with one module per job), not at the line.")


def test_the_checker_sees_lazy_imports_cycles_and_back_arrows(tmp_path):
    """The checker itself, on a made-up package: a function-level import closes a cycle and
    points up a layer; both are reported with the module and line."""
    pkg = tmp_path / "ray_mesh"
    for sub in ("core", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ray_mesh.cli import b\n")
    (pkg / "cli" / "b.py").write_text("from ray_mesh.core import a\n")
    (pkg / "cli" / "c.py").write_text("from . import b\n" + "x = 1\n" * MAX_LINES)
    modules = package_modules(pkg)
    g = {m: imports_of(p, modules, tmp_path) for m, p in modules.items()}
    assert cycles(g) == [["ray_mesh.cli.b", "ray_mesh.core.a", "ray_mesh.cli.b"]]
    assert back_arrows(g) == ["ray_mesh.core.a:2 imports ray_mesh.cli.b (core -> up to cli)"]
    assert ("ray_mesh.cli.b", 1) in g["ray_mesh.cli.c"]
    assert long_modules(modules) == {"ray_mesh.cli.c": MAX_LINES + 1}


# ------------------------------------------------------- the package, harness, benchmarks
TOP = {"ray_mesh", "harness", "benchmarks", "tests", "examples"}
MAY_IMPORT = {"ray_mesh": set(), "harness": {"ray_mesh"},
              "benchmarks": {"ray_mesh", "harness", "examples"}}


def _top_level_imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module.split(".")[0], node.lineno))
    return out


def _tests_paths(path: Path) -> list[int]:
    """Lines where code (not a docstring) builds a path into ``tests/``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and (n.value == "tests" or n.value.startswith(("tests/", "tests\\")))]


def test_package_harness_and_benchmarks_point_one_way():
    bad = []
    for top, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            where = path.relative_to(ROOT)
            for name, line in _top_level_imports(path):
                if name in TOP and name != top and name not in allowed:
                    bad.append(f"{where}:{line} imports {name}")
            if top != "ray_mesh":
                bad += [f"{where}:{line} builds a path into tests/" for line in _tests_paths(path)]
    assert not bad, (
        "imports between the package, harness/ and benchmarks/ (allowed: benchmarks -> "
        "harness -> ray_mesh):\n  " + "\n  ".join(bad)
        + "\nWhat benchmarks and tests share lives in harness/; the package imports neither.")


def test_the_laboratory_is_outside_the_package():
    """Calibration, the GPipe event simulation and the measurement helpers are benchmarks'
    tools (``benchmarks/planning_lab/``): the package ships what users call."""
    for name in ("calibrate", "gpipe", "measure"):
        assert not (PKG / "planning" / f"{name}.py").exists(), (
            f"ray_mesh/planning/{name}.py is laboratory code: it belongs in "
            f"benchmarks/planning_lab/")
        assert (ROOT / "benchmarks" / "planning_lab" / f"{name}.py").exists(), name


def report() -> str:
    """The whole picture, for a design note: sizes, cycles, back-arrows, long modules."""
    def lines(top: str) -> int:
        return sum(len(p.read_text().splitlines()) for p in (ROOT / top).rglob("*.py"))

    g = graph()
    out = [f"lines: ray_mesh {lines('ray_mesh')}, benchmarks {lines('benchmarks')}, "
           f"tests {lines('tests')}" + (f", harness {lines('harness')}"
                                        if (ROOT / 'harness').exists() else ""),
           f"modules: {len(g)}, imports between them: {sum(len(t) for t in g.values())}"]
    out += ["cycle: " + " -> ".join(c) for c in cycles(g)] or ["cycles: none"]
    out += ["back-arrow: " + b for b in back_arrows(g)] or ["back-arrows: none"]
    out += [f"over {MAX_LINES} lines: {m} ({n})" for m, n in long_modules().items()]
    return "\n".join(out)


# --------------------------------------------------------------- the Ray-free boundary
RAY_PACKAGES = ("ray_mesh.raytrain", "ray_mesh.cli")
RAY_MODULES = ("ray_mesh.checkpointing.train", "ray_mesh.checkpointing.storage",
               "ray_mesh.checkpointing.guards")
# ``__main__`` modules run a program when imported: they are entry points, not library code.
MODULES = {m: p for m, p in package_modules().items() if p.stem != "__main__"}


def _may_import_ray(name: str) -> bool:
    return name in RAY_MODULES or any(name == p or name.startswith(p + ".")
                                      for p in RAY_PACKAGES)


RAY_FREE = [m for m in MODULES if not _may_import_ray(m)]
RAY_ALLOWED = [m for m in MODULES if _may_import_ray(m)]

_IMPORT_EACH = """
import importlib, json, sys
found = None
for name in json.loads(sys.argv[1]):
    before = set(sys.modules)
    importlib.import_module(name)
    if "ray" in sys.modules:
        new = sorted(m for m in set(sys.modules) - before if m.startswith("ray_mesh"))
        found = {"module": name, "loaded_with_it": new}
        break
print(json.dumps(found))
"""


def _run(code: str, modules: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, json.dumps(modules)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_boundary_lists_cover_the_named_packages():
    # The packages the architecture names as Ray-free are all in the checked list.
    for name in ("ray_mesh", "ray_mesh.parallel", "ray_mesh.checkpointing",
                 "ray_mesh.checkpointing.sharded", "ray_mesh.core.spec",
                 "ray_mesh.network.probe", "ray_mesh.planning.cluster",
                 "ray_mesh.core.table"):
        assert name in RAY_FREE, name
    assert "ray_mesh.raytrain.preflight" in RAY_ALLOWED


def test_ray_free_modules_do_not_import_ray():
    """One fresh interpreter imports them one by one; the first that brings Ray is named."""
    proc = _run(_IMPORT_EACH, RAY_FREE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found is None, (
        f"importing {found['module']} imports Ray (ray_mesh modules loaded with it: "
        f"{found['loaded_with_it']}). Import Ray inside the function that needs it, or move "
        f"the Ray part to ray_mesh.raytrain.")


def test_the_backend_does_not_load_the_parallel_helpers():
    """The Ray Train backend is imported by the driver, the Train controller and every
    worker; DTensor and the pipelining schedules (~1.2 s of imports per process on a 2-core
    machine) load only in a train function that uses them (``ray_mesh.parallel`` is lazy)."""
    code = ("import importlib, json, sys\n[importlib.import_module(m) for m in "
            "json.loads(sys.argv[1])]\nimport ray_mesh.parallel as p\n"
            "print(json.dumps(sorted(m for m in ('torch.distributed.tensor', "
            "'torch.distributed.pipelining', 'ray_mesh.parallel.compose', "
            "'ray_mesh.parallel.diloco') if m in sys.modules)))\n"
            "p.parallelize, p.Pipeline, p.wrap_replicate\n"
            "print('torch.distributed.pipelining' in sys.modules)")
    proc = _run(code, ["ray_mesh.raytrain.backend", "ray_mesh.raytrain"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, later = proc.stdout.strip().splitlines()[-2:]
    assert json.loads(loaded) == [], f"the backend's import loads {loaded}"
    assert later == "True"  # the names still resolve, on first use


def test_the_lazy_parallel_names_are_the_public_ones_and_resolve():
    """``ray_mesh.parallel``'s name table and ``__all__`` list the same names (the table is
    written beside the type checkers' imports, and must not drift from either)."""
    import ray_mesh.parallel as parallel

    assert {*parallel._EXPORTS, "ParallelError"} == set(parallel.__all__)
    for name in parallel.__all__:
        assert getattr(parallel, name) is not None, name


def test_the_cli_starts_and_refuses_a_bad_job_without_torch_or_ray(tmp_path):
    """``import ray_mesh``, its checkpointing package and the CLI load neither torch nor Ray
    (~3 s of CPU on a 2-core machine, paid by every ``ray-mesh`` command and by every Ray
    worker that only needs a spec): ``--help``, ``status``'s parser and a job refused on the
    driver answer at once; a good job with a ``data:`` section and DiLoCo reads without
    them too (its checks are rules of the job's values; ``ray_mesh.data`` loads its
    torch-using modules on first use). Every public name still resolves, on first use."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain: a.py:f\nmesh: {dp_shard: 2}\nbogus: 1\n")
    good = tmp_path / "good.yaml"
    good.write_text("name: good\ntrain: t.py:f\nmesh: {dp_replicate: 2, dp_shard: -1}\n"
                    "replicate: {mode: diloco, every: 4}\n"
                    "config: {model: {preset: tiny, max_seq_len: 64}}\n"
                    "data: {paths: [stdlib], seq_len: 32, batch_size: 8, max_tokens: 60000}\n")
    code = ("import json, sys\nimport ray_mesh, ray_mesh.checkpointing\n"
            "from ray_mesh.cli.main import build_parser, main\nbuild_parser()\n"
            "rc = main(['run', sys.argv[1]])\n"
            "from ray_mesh.cli.job import Job\n"
            "job = Job.from_yaml(sys.argv[2])\nassert job.data and job.replicate, job\n"
            "print(json.dumps([rc, sorted(m for m in ('torch', 'ray', 'numpy')"
            " if m in sys.modules)]))\n"
            "[getattr(ray_mesh, n) for n in ray_mesh.__all__]\n"
            "[getattr(ray_mesh.checkpointing, n) for n in ray_mesh.checkpointing.__all__]\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(bad), str(good)], cwd=ROOT,
                          capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.strip().splitlines()[-2:]
    assert json.loads(before) == [2, []], (before, proc.stderr[-2000:])
    assert "Unknown key 'bogus'" in proc.stderr, proc.stderr[-2000:]
    assert after == "True"  # the lazy names resolve


def test_ray_glue_modules_import():
    code = "import importlib, json, sys\n[importlib.import_module(m) for m in " \
           "json.loads(sys.argv[1])]\nprint('ray' in sys.modules)"
    proc = _run(code, RAY_ALLOWED)
    assert proc.returncode == 0, proc.stderr[-3000:]


if __name__ == "__main__":
    print(report())


def _process_state(path: Path) -> set[str]:
    """A module's process-wide state: the module-level names a function rebinds with
    ``global``, and the private ones that start as an empty container (a registry)."""
    tree = ast.parse(path.read_text())
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global)
               for name in node.names}
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names, value = [t.id for t in node.targets if isinstance(t, ast.Name)], node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names, value = [node.target.id], node.value
        else:
            continue
        empty = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, (ast.List, ast.Set)) and not value.elts) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set") and not value.args)
        found |= {n for n in names if n in rebound or (empty and n.startswith("_"))}
    return found


def test_process_wide_state_is_only_what_the_docs_list():
    """No module global but what a process can only have one of, each named with its reason
    in docs/development.md ("Process-wide state"): the rest is passed."""
    found = {f"{p.relative_to(PKG).as_posix()} {name}" for p in sorted(PKG.rglob("*.py"))
             for name in _process_state(p)}
    page = (ROOT / "docs" / "development.md").read_text()
    table = page.split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    listed = {f"{m} {n}" for m, n in re.findall(r"^\| `([\w/]+\.py)` `(\w+)` \|", table,
                                                 flags=re.M)}
    assert found == listed, (f"undocumented: {sorted(found - listed)}; "
                             f"listed but gone: {sorted(listed - found)}")
    assert len(listed) >= 6  # the parser still reads the table

