"""The register of upstream workarounds (``ray_mesh/upstream.py``) and the code, held together.

* every entry's ``where`` modules exist and name the entry (``upstream: <key>``), and every
  ``upstream: <key>`` in the package names an entry that lists that module;
* keys are unique slugs;
* the versions the entries were checked on are ``private_apis.CHECKED_RAY`` /
  ``CHECKED_TORCH``: an upgrade that bumps those fails here until the register is read;
* a comment or docstring naming the checked Ray or torch version ("Ray 2.60", "Ray Train
  2.60", "torch 2.13") outside ``private_apis.py`` and ``upstream.py`` has an
  ``upstream: <key>`` within :data:`WINDOW` lines: a new undocumented workaround fails.

Every check is a function of a package folder and a register, run once on the real ones and
once on a broken copy in ``tmp_path`` (so each check is shown to fail).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from ray_mesh import private_apis
from ray_mesh.upstream import WORKAROUNDS, Workaround

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ray_mesh"
REGISTERS = ("private_apis.py", "upstream.py")  # where versions are named by design
WINDOW = 6  # lines either side of a version note in which its ``upstream:`` must stand
REF = re.compile(r"upstream: ([a-z0-9]+(?:-[a-z0-9]+)*)")
SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)+")
VERSION = re.compile(r"\b(Ray|torch) (\d+\.\d+(?:\.\d+)?)")
ADD_ENTRY = ("add an entry to ray_mesh/upstream.py (WORKAROUNDS) for the upstream behaviour "
             "it works around, and name it beside the note as `upstream: <key>`")


def modules(pkg: Path) -> list[Path]:
    return sorted(pkg.rglob("*.py"))


def rel(path: Path, pkg: Path) -> str:
    """``ray_mesh/raytrain/driver.py``: the path as ``where`` spells it."""
    return path.relative_to(pkg.parent).as_posix()


def refs(text: str) -> set[str]:
    return set(REF.findall(text))


def version_note(ray: str, torch: str) -> re.Pattern[str]:
    """Matches a mention of the checked versions by major.minor: "Ray 2.60", "Ray Train
    2.60", "torch 2.13" (and their patch versions)."""
    ray_mm, torch_mm = (".".join(v.split(".")[:2]) for v in (ray, torch))
    return re.compile(rf"\bRay(?: Train)? {re.escape(ray_mm)}(?!\d)|"
                      rf"\btorch {re.escape(torch_mm)}(?!\d)")


# ----------------------------------------------------------------------------- the checks
def duplicate_keys(register: Iterable[Workaround]) -> list[str]:
    counts = Counter(w.key for w in register)
    out = [f"key {k!r} is used by {n} entries" for k, n in counts.items() if n > 1]
    out += [f"key {w.key!r} is not a slug (lowercase words joined by '-')"
            for w in register if not SLUG.fullmatch(w.key)]
    return out


def empty_fields(register: Iterable[Workaround]) -> list[str]:
    return [f"{w.key}: {name} is empty" for w in register
            for name in ("upstream", "what", "where", "remove_when") if not getattr(w, name)]


def missing_where(register: Iterable[Workaround], pkg: Path) -> list[str]:
    """Entries whose ``where`` module is missing or does not name the entry."""
    out = []
    for w in register:
        for where in w.where:
            path = pkg.parent / where
            if not where.startswith(f"{pkg.name}/") or not path.is_file():
                out.append(f"{w.key}: where names {where}, which is not a module of "
                           f"{pkg.name}/")
            elif w.key not in refs(path.read_text()):
                out.append(f"{w.key}: {where} does not say `upstream: {w.key}` beside the "
                           f"workaround")
    return out


def dangling_refs(register: Iterable[Workaround], pkg: Path) -> list[str]:
    """``upstream: <key>`` references to no entry, or from a module its entry does not list."""
    where: dict[str, set[str]] = {}
    for w in register:
        where.setdefault(w.key, set()).update(w.where)
    out = []
    for path in modules(pkg):
        if path == pkg / "upstream.py":  # the register: its fields say ``upstream: str``
            continue
        for key in sorted(refs(path.read_text())):
            if key not in where:
                out.append(f"{rel(path, pkg)} says `upstream: {key}`, which is no entry of "
                           f"ray_mesh/upstream.py")
            elif rel(path, pkg) not in where[key]:
                out.append(f"{rel(path, pkg)} says `upstream: {key}`, but the entry's where "
                           f"does not list it")
    return out


def version_mismatches(register: Iterable[Workaround], ray: str, torch: str) -> list[str]:
    """Entries not checked on ``private_apis.CHECKED_RAY`` / ``CHECKED_TORCH``."""
    checked = {"Ray": ray, "torch": torch}
    out = []
    for w in register:
        named = VERSION.findall(w.upstream)
        if not named:
            out.append(f"{w.key}: upstream {w.upstream!r} names no 'Ray X.Y.Z' or "
                       f"'torch X.Y.Z'")
        out += [f"{w.key}: upstream names {what} {version}; private_apis checks {what} "
                f"{checked[what]}: check the behaviour on {checked[what]} and update the "
                f"entry (or remove the workaround)"
                for what, version in named if version != checked[what]]
    return out


def unregistered_notes(pkg: Path, ray: str, torch: str) -> list[str]:
    """Lines naming the checked Ray/torch version with no ``upstream:`` within WINDOW lines."""
    note = version_note(ray, torch)
    out = []
    for path in modules(pkg):
        if path.parent == pkg and path.name in REGISTERS:
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if note.search(line) and not any(
                    REF.search(x) for x in lines[max(0, i - WINDOW):i + WINDOW + 1]):
                out.append(f"{rel(path, pkg)}:{i + 1}: {line.strip()}")
    return out


# ----------------------------------------------------------------------------- the tests
def test_the_register_is_frozen_data():
    assert WORKAROUNDS and all(isinstance(w, Workaround) for w in WORKAROUNDS)
    assert all(isinstance(w.where, tuple) for w in WORKAROUNDS)
    with pytest.raises(FrozenInstanceError):
        WORKAROUNDS[0].key = "other"  # type: ignore[misc]
    assert not empty_fields(WORKAROUNDS)


def test_keys_are_unique_slugs():
    assert not duplicate_keys(WORKAROUNDS)


def test_every_entry_is_named_where_it_lives():
    bad = missing_where(WORKAROUNDS, PKG)
    assert not bad, "\n".join(bad)


def test_every_reference_names_an_entry_that_lists_its_module():
    bad = dangling_refs(WORKAROUNDS, PKG)
    assert not bad, "\n".join(bad)


def test_the_register_is_checked_on_the_versions_private_apis_names():
    bad = version_mismatches(WORKAROUNDS, private_apis.CHECKED_RAY, private_apis.CHECKED_TORCH)
    assert not bad, "\n".join(bad)


def test_no_version_note_without_an_entry():
    bad = unregistered_notes(PKG, private_apis.CHECKED_RAY, private_apis.CHECKED_TORCH)
    assert not bad, (f"notes on upstream versions with no `upstream: <key>` within {WINDOW} "
                     f"lines:\n  " + "\n  ".join(bad) + f"\nFor each, {ADD_ENTRY}; or, "
                     "where it states no workaround, say it without the version.")


def test_the_checks_catch_a_broken_copy(tmp_path):
    pkg = tmp_path / "ray_mesh"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "private_apis.py").write_text('"""Checked on Ray 2.60.0 and torch 2.13.0."""\n')
    (pkg / "good.py").write_text("# torch 2.13 does X, so we do Y (upstream: torch-x).\n")
    (pkg / "bare.py").write_text("x = 1\n# Ray 2.60 logs too much, so we filter it.\n")
    (pkg / "sub" / "far.py").write_text(
        "# Ray Train 2.60 starts an actor we do not want.\n" + "x = 1\n" * 7
        + "# (upstream: ray-y)\n")
    (pkg / "sub" / "stray.py").write_text("# see upstream: ray-gone\n# upstream: torch-x\n")
    (pkg / "upstream.py").write_text("class Workaround:\n    upstream: str\n")
    entry = dict(what="w", remove_when="r")
    register = (
        Workaround(key="torch-x", upstream="torch 2.13.0", where=("ray_mesh/good.py",),
                   **entry),
        Workaround(key="ray-y", upstream="Ray 2.59.0 (Train V2)",
                   where=("ray_mesh/sub/far.py", "ray_mesh/bare.py", "ray_mesh/gone.py"),
                   **entry),
        Workaround(key="ray-y", upstream="Ray", where=(), what="", remove_when="r"),
        Workaround(key="Not_A_Slug", upstream="torch 2.13.0", where=("ray_mesh/good.py",),
                   **entry),
    )
    assert duplicate_keys(register) == ["key 'ray-y' is used by 2 entries",
                                        "key 'Not_A_Slug' is not a slug (lowercase words "
                                        "joined by '-')"]
    assert empty_fields(register) == ["ray-y: what is empty", "ray-y: where is empty"]
    missing = missing_where(register, pkg)
    assert any("ray_mesh/bare.py does not say `upstream: ray-y`" in m for m in missing)
    assert any("ray_mesh/gone.py, which is not a module" in m for m in missing)
    assert any(m.startswith("Not_A_Slug: ray_mesh/good.py does not say") for m in missing)
    assert len(missing) == 3, missing
    dangling = dangling_refs(register, pkg)
    assert dangling == [
        "ray_mesh/sub/stray.py says `upstream: ray-gone`, which is no entry of "
        "ray_mesh/upstream.py",
        "ray_mesh/sub/stray.py says `upstream: torch-x`, but the entry's where does not "
        "list it"], dangling
    versions = version_mismatches(register, "2.60.0", "2.13.0")
    assert any(v.startswith("ray-y: upstream names Ray 2.59.0") for v in versions)
    assert any("ray-y: upstream 'Ray' names no" in v for v in versions)
    assert len(versions) == 2, versions
    notes = unregistered_notes(pkg, "2.60.0", "2.13.0")
    assert notes == ["ray_mesh/bare.py:2: # Ray 2.60 logs too much, so we filter it.",
                     "ray_mesh/sub/far.py:1: # Ray Train 2.60 starts an actor we do not "
                     "want."], notes
    # An upgrade: the notes that name the old versions no longer match, the register does not.
    assert unregistered_notes(pkg, "2.61.0", "2.14.0") == []
    assert any("private_apis checks torch 2.14.0" in v
               for v in version_mismatches(register, "2.60.0", "2.14.0"))
