"""The public API changes only on purpose: ``tests/unit/public_api.txt`` lists it.

The public modules are the top-level ``ray_mesh``, ``ray_mesh.parallel``,
``ray_mesh.checkpointing`` (with its submodule ``remote``, checkpoints in object storage) and
``ray_mesh.replicas``; their public names are their ``__all__``, and every one is in the list
with its stability. A name added to an ``__all__`` and not to the list fails here, so does a
listed name that left its ``__all__`` without a deprecation (its package's ``DEPRECATED``,
``ray_mesh/core/deprecation.py``), one that no longer resolves, and one whose docstring does
not say ``Stability: stable`` or ``Stability: experimental`` as the list does. Every other
module is internal: its ``__all__``, where it has one, names only public objects defined in
it (the home of a name a public module exports), never a re-export or an internal name.

The checks that import (torch, Ray's modules, every module of the package) run in one fresh
interpreter with warnings as errors, so that a public name that warns fails, and nothing it
loads stays in this process.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("public_api.txt")
PUBLIC_MODULES = ("ray_mesh", "ray_mesh.parallel", "ray_mesh.checkpointing",
                  "ray_mesh.checkpointing.remote", "ray_mesh.replicas")
STABILITIES = ("stable", "experimental", "deprecated")


def read_list(text: str) -> dict[str, str]:
    """``{"ray_mesh.parallel.parallelize": "stable", ...}`` from the list's text."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        assert len(parts) == 2 and parts[1] in STABILITIES, (
            f"public_api.txt:{number}: {line!r} is not 'NAME STABILITY' with STABILITY one of "
            f"{STABILITIES}")
        assert parts[0] not in out, f"public_api.txt:{number}: {parts[0]} is listed twice"
        module_of(parts[0])  # an unknown module fails here
        out[parts[0]] = parts[1]
    return out


def module_of(name: str) -> tuple[str, str]:
    """``("ray_mesh.checkpointing.remote", "load")`` for its full name: the longest public
    module the name is in."""
    found = [m for m in PUBLIC_MODULES if name.startswith(m + ".")]
    assert found, f"{name} is in none of the public modules {PUBLIC_MODULES}"
    module = max(found, key=len)
    return module, name[len(module) + 1:]


def source_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _assigned(module: str, target: str) -> ast.expr | None:
    for node in ast.parse(source_of(module).read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == target for t in node.targets):
            return node.value
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == target):
            return node.value
    return None


def all_of(module: str) -> list[str]:
    """A public module's ``__all__``, read from its source (importing would load torch)."""
    value = _assigned(module, "__all__")
    assert value is not None, f"{module} has no __all__: a public module lists its names"
    return list(ast.literal_eval(value))


def deprecated_of(module: str) -> set[str]:
    """The keys of a public module's ``DEPRECATED`` mapping (none when it has none)."""
    value = _assigned(module, "DEPRECATED")
    if value is None:
        return set()
    assert isinstance(value, ast.Dict), f"{module}.DEPRECATED is not a dict display"
    return {ast.literal_eval(k) for k in value.keys}


LISTED = read_list(LIST.read_text())


def test_the_list_names_each_public_module_once_at_least():
    modules = {module_of(n)[0] for n in LISTED}
    assert modules == set(PUBLIC_MODULES), modules


def test_a_name_added_to_a_public_all_is_in_the_list():
    unlisted = [f"{m}.{n}" for m in PUBLIC_MODULES for n in all_of(m)
                if LISTED.get(f"{m}.{n}") in (None, "deprecated")]
    assert not unlisted, (
        f"in a public __all__ but not in tests/unit/public_api.txt as stable or experimental: "
        f"{unlisted}. Adding a public name is a decision: add a line 'NAME stable' or "
        f"'NAME experimental' there (and 'Stability: ...' to its docstring), or keep it out "
        f"of __all__")


def test_a_public_name_leaves_only_through_a_deprecation():
    problems = []
    for name, stability in LISTED.items():
        module, short = module_of(name)
        exported, deprecated = short in all_of(module), short in deprecated_of(module)
        if stability != "deprecated" and not exported:
            problems.append(
                f"{name} ({stability}) is not in {module}.__all__: restore it, or deprecate "
                f"it: an entry in {module}.DEPRECATED (ray_mesh.core.deprecation.Deprecated: "
                f"where it lives, what to use, the release it goes) and 'deprecated' for its "
                f"line in public_api.txt" if deprecated is False else
                f"{name} is in {module}.DEPRECATED: mark it 'deprecated' in public_api.txt")
        if stability == "deprecated" and (exported or not deprecated):
            problems.append(f"{name} is listed as deprecated: it belongs in {module}.DEPRECATED "
                            f"and in no __all__")
    for module in PUBLIC_MODULES:
        problems += [f"{module}.{n} is in {module}.DEPRECATED but not in public_api.txt as "
                     f"deprecated" for n in sorted(deprecated_of(module))
                     if LISTED.get(f"{module}.{n}") != "deprecated"]
    assert not problems, "\n".join(problems)


def test_a_deprecated_name_warns_where_it_is_used_and_is_the_same_object(monkeypatch):
    """The mechanism itself, on a name planted in the top-level package (Ray- and torch-free):
    the warning points at the line that named it, and the value is the target."""
    import ray_mesh
    from ray_mesh.core.deprecation import Deprecated
    from ray_mesh.core.spec import MeshSpec

    monkeypatch.setitem(ray_mesh.DEPRECATED, "OldSpec", Deprecated(
        "ray_mesh.core.spec:MeshSpec", "use ray_mesh.MeshSpec; removed in 0.2.0"))
    with pytest.warns(DeprecationWarning, match=r"^ray_mesh\.OldSpec is deprecated: use "
                      r"ray_mesh\.MeshSpec; removed in 0\.2\.0$") as caught:
        value = ray_mesh.OldSpec
    assert value is MeshSpec
    assert [Path(w.filename) for w in caught] == [Path(__file__)]
    with pytest.warns(DeprecationWarning):
        from ray_mesh import OldSpec
    assert OldSpec is MeshSpec
    assert "OldSpec" not in ray_mesh.__all__ and "OldSpec" not in dir(ray_mesh)
    with warnings.catch_warnings():  # an unknown name is an AttributeError, and silent
        warnings.simplefilter("error")
        assert not hasattr(ray_mesh, "NoSuchName")
        with pytest.raises(AttributeError, match="module 'ray_mesh' has no attribute 'Gone'"):
            ray_mesh.Gone  # noqa: B018


_PROBE = r'''
import ast, importlib, inspect, json, pkgutil, re, sys, warnings
warnings.simplefilter("error")
listed, public_modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"heavy_after_import": None, "unresolved": {}, "markers": {}, "deprecated": {},
       "internal_all": []}
for m in public_modules:
    importlib.import_module(m.rpartition(".")[0] if m.endswith(".remote") else m)
out["heavy_after_import"] = sorted(m for m in ("torch", "ray") if m in sys.modules)
MARK = re.compile(r"^\s*Stability: (\w+)\s*$", re.M)

def attribute_doc(name, obj):
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("ray_mesh") or getattr(mod, name, None) is not obj:
            continue
        try:
            body = ast.parse(inspect.getsource(mod)).body
        except (OSError, TypeError):
            continue
        for a, b in zip(body, body[1:]):
            targets = a.targets if isinstance(a, ast.Assign) else [getattr(a, "target", None)]
            if (isinstance(a, (ast.Assign, ast.AnnAssign))
                    and any(isinstance(t, ast.Name) and t.id == name for t in targets)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                return b.value.value
    return None

def assigned(mod):
    names = set()
    for a in ast.parse(inspect.getsource(mod)).body:
        if isinstance(a, (ast.Assign, ast.AnnAssign)):
            targets = a.targets if isinstance(a, ast.Assign) else [a.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names

def own_doc(name, obj):
    if isinstance(obj, type):
        return vars(obj).get("__doc__")
    if inspect.ismodule(obj) or callable(obj):
        return obj.__doc__
    return attribute_doc(name, obj)

def split(full):
    module = max((m for m in public_modules if full.startswith(m + ".")), key=len)
    return module, full[len(module) + 1:]

public_objects = []
for full, stability in listed.items():
    module, short = split(full)
    mod = importlib.import_module(module)
    if stability == "deprecated":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(mod, short)
        entry = mod.DEPRECATED[short]
        out["deprecated"][full] = [[w.category.__name__, str(w.message)] for w in caught] + [
            value is entry.value()]
        continue
    try:
        obj = getattr(mod, short)
        exec(f"from {module} import {short}", {})
    except Exception as e:
        out["unresolved"][full] = f"{type(e).__name__}: {e}"
        continue
    public_objects.append(obj)
    out["markers"][full] = MARK.findall(own_doc(short, obj) or "")

import ray_mesh
root = ray_mesh.__path__[0]
for info in pkgutil.walk_packages([root], "ray_mesh."):
    if info.name in public_modules or info.name.endswith(".__main__"):
        continue
    mod = importlib.import_module(info.name)
    for n in getattr(mod, "__all__", ()):
        value = getattr(mod, n, None)
        if isinstance(value, type) or callable(value):
            home = getattr(inspect.unwrap(value), "__module__", None)
        else:  # a constant's home is the module that assigns it
            home = info.name if n in assigned(mod) else None
        if home != info.name or not any(value is o for o in public_objects):
            out["internal_all"].append(f"{info.name}.{n}")
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(LISTED), json.dumps(PUBLIC_MODULES)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_public_modules_load_neither_torch_nor_ray(probe):
    """``import ray_mesh`` and the public packages stay light: the names that need torch or
    Ray load on first use (``ray-mesh`` commands and torchrun users pay for neither)."""
    assert probe["heavy_after_import"] == []


def test_every_public_name_resolves_without_a_warning(probe):
    assert not probe["unresolved"], probe["unresolved"]


def test_every_public_name_says_its_stability_as_the_list_does(probe):
    wrong = {name: found for name, found in probe["markers"].items()
             if found != [LISTED[name]]}
    assert not wrong, (
        f"docstrings whose 'Stability: ...' line is missing, doubled or not what "
        f"public_api.txt says (name: found): {wrong}. One line 'Stability: stable' or "
        f"'Stability: experimental' per public name (docs/api/index.md)")


def test_every_deprecated_name_warns_once_and_is_its_target(probe):
    for name, (*caught, same) in probe["deprecated"].items():
        assert [c[0] for c in caught] == ["DeprecationWarning"], (name, caught)
        assert caught[0][1].startswith(f"{name} is deprecated: "), (name, caught)
        assert same, f"{name} is not the object its DEPRECATED target names"


def test_internal_modules_export_only_what_a_public_module_exports(probe):
    assert not probe["internal_all"], (
        f"__all__ entries of internal modules that are not a public name defined there: "
        f"{probe['internal_all']}. Internal names and re-exports stay out of __all__; a name "
        f"meant for users goes into a public module (and tests/unit/public_api.txt)")


def test_the_stability_convention_is_the_documented_one():
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    assert "Stability: stable" in index and "Stability: experimental" in index
    assert re.search(r"tests/unit/public_api\.txt", index)
