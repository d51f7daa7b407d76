"""The architecture's boundaries, checked on the source itself.

* Ray-free means Ray-free: importing any module outside the Ray glue leaves ``ray`` out of
  ``sys.modules`` (checked in a fresh interpreter, so nothing imported earlier hides it).
  The glue that may import Ray: ``ray_mesh.raytrain``, ``ray_mesh.cli`` and the Ray Train
  checkpointer (``checkpointing.train``, ``.storage``, ``.guards``). Every other module,
  present or future, is held to it.
* Short modules: none over 400 lines, no exemptions.
* No import cycles between modules, and the layers point one way: ``core`` imports no other
  ray_mesh package, and no Ray-free package imports the Ray glue, not even lazily.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ray_mesh"
MAX_LINES = 400
RAY_PACKAGES = ("ray_mesh.raytrain", "ray_mesh.cli")
RAY_MODULES = ("ray_mesh.checkpointing.train", "ray_mesh.checkpointing.storage",
               "ray_mesh.checkpointing.guards")
RAY_GLUE = ("raytrain", "cli")
# package -> ray_mesh packages it must never import (module level or inside a function)
FORBIDDEN = {
    "core": {"network", "planning", "observability", "raytrain", "cli", "parallel",
             "checkpointing"},
    "network": set(RAY_GLUE),
    "planning": set(RAY_GLUE),
    "parallel": set(RAY_GLUE),
    "observability": set(RAY_GLUE),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ``__main__`` modules run a program when imported: they are entry points, not library code.
MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if p.stem != "__main__"}


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
    driver answer at once. Every public name still resolves, on first use."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain: a.py:f\nmesh: {dp_shard: 2}\nbogus: 1\n")
    code = ("import json, sys\nimport ray_mesh, ray_mesh.checkpointing\n"
            "from ray_mesh.cli.main import build_parser, main\nbuild_parser()\n"
            "rc = main(['run', sys.argv[1]])\n"
            "print(json.dumps([rc, sorted(m for m in ('torch', 'ray') if m in sys.modules)]))\n"
            "[getattr(ray_mesh, n) for n in ray_mesh.__all__]\n"
            "[getattr(ray_mesh.checkpointing, n) for n in ray_mesh.checkpointing.__all__]\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], cwd=ROOT, capture_output=True,
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


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


# ----------------------------------------------------------------------------- imports
def _imports(path: Path, *, module_level: bool) -> set[str]:
    """ray_mesh modules ``path`` imports: at import time only, or anywhere in the file."""
    tree = ast.parse(path.read_text())
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not module_level:
                    visit(node.body)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []) or [])

    visit(tree.body)
    return {m for m in out if m in MODULES and m != this}


def test_no_import_cycles():
    graph = {m: _imports(p, module_level=True) for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := dfs(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = dfs(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_point_one_way():
    bad = []
    for name, path in MODULES.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue
        for imported in _imports(path, module_level=False):
            target = imported.split(".")[1] if imported.count(".") else ""
            if target in FORBIDDEN[parts[1]]:
                bad.append(f"{name} imports {imported}")
    assert not bad, "layer violations:\n  " + "\n  ".join(sorted(bad))
