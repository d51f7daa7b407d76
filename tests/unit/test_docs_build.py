"""The manual builds with ``mkdocs build --strict``, and README.md's links point at real files.

The suite is what CI runs (the README's test command), so building the docs here makes a
broken link, a missing anchor or an API name that no longer exists in ``docs/api/`` fail CI,
with mkdocs' own output in the failure. Two more builds, of a copy of the docs with one
defect planted, show that the strict build does fail on each kind of defect (a build that
cannot fail would prove nothing).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BUILD_TIMEOUT_S = 180

# [text](target) and ![alt](target); the target ends at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _need_mkdocs() -> None:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx"):
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None):
            pytest.skip(f"{module} is not installed: python -m pip install -e '.[test]' "
                        f"(the test extra has mkdocs, mkdocstrings[python] and pymdown-extensions)")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site``, bounded in time."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
             "--site-dir", str(site)],
            cwd=config.parent, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
            # MkDocs 1.6 prints a notice about MkDocs 2.0 on every run; it is not a warning
            # about these docs.
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mkdocs build did not finish within {BUILD_TIMEOUT_S} s: {e.output}")


def _copy_docs(tmp_path: Path) -> Path:
    """A copy of what the build reads (mkdocs.yml, docs/, the files docs/ includes, the
    package for the API pages), so a defect can be planted without touching the repo."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copytree(REPO / "ray_mesh", root / "ray_mesh",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "RESULTS.md", root / "benchmarks" / "RESULTS.md")
    return root


def test_the_manual_builds_strict(tmp_path):
    _need_mkdocs()
    proc = _build(REPO / "mkdocs.yml", tmp_path / "site")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, f"mkdocs build --strict warned:\n{output}"
    # The API pages were rendered from the docstrings, not left as `::: name` text.
    api = (tmp_path / "site" / "api" / "ray_mesh" / "index.html").read_text()
    assert "MeshConfig" in api and "MeshSpec" in api and ":::" not in api


@pytest.mark.parametrize("defect, expected", [
    ("[a page](no_such_page.md)", "no_such_page.md"),
    ("::: ray_mesh.parallel.no_such_helper", "no_such_helper"),
    ("[an anchor](mesh.md#no-such-section)", "no-such-section"),
])
def test_a_broken_link_or_a_stale_api_name_fails_the_build(tmp_path, defect, expected):
    _need_mkdocs()
    root = _copy_docs(tmp_path)
    page = root / "docs" / "index.md"
    page.write_text(page.read_text() + f"\n{defect}\n")
    proc = _build(root / "mkdocs.yml", tmp_path / "site")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the build passed with {defect!r} planted:\n{output}"
    assert expected in output, output


def _links(markdown: str) -> list[str]:
    """Link targets of a markdown text, outside code blocks and code spans."""
    text = FENCE.sub("", markdown)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def test_every_relative_link_in_the_readme_resolves():
    targets = _links(README.read_text())
    relative = [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)
                and not t.startswith("#")]
    assert relative, "README.md has no relative links: the manual's links are gone"
    missing = [t for t in relative if not (README.parent / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # The manual's pages and the results are reachable from the front page.
    for needed in ("docs/index.md", "docs/security.md", "docs/api/index.md",
                   "benchmarks/RESULTS.md", "docs/mesh_status.png"):
        assert needed in relative, f"README.md does not link {needed}"


def test_the_link_check_sees_a_broken_link():
    text = "See [the page](docs/gone.md) and ![pic](docs/x.png), `[not](a_link.md)`.\n" \
           "```\n[not either](b.md)\n```\n[web](https://example.org/x.md) [here](#set-up)\n"
    assert _links(text) == ["docs/gone.md", "docs/x.png", "https://example.org/x.md",
                            "#set-up"]


def test_the_readme_test_command_is_ci_s_last_line():
    """README.md keeps exactly two set-up commands; the test one is .ci/run's last line."""
    readme = README.read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2, commands
    ci_last = (REPO / ".ci" / "run").read_text().rstrip().splitlines()[-1]
    assert commands[1] == ci_last, (commands[1], ci_last)
    assert commands[0].endswith("ray-mesh run examples/hsdp.yaml"), commands[0]
    assert len(readme.splitlines()) <= 250, "README.md is a front page: at most 250 lines"


def _all_names(init: Path) -> list[str]:
    """``__all__`` of a package, read from its source (importing would load torch or Ray)."""
    import ast

    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{init} has no __all__")


def test_every_public_name_has_an_api_entry():
    """A name added to a public module's ``__all__`` gets a ``::: ...`` entry in docs/api/ (the
    strict build catches the other direction: an entry whose name is gone). The public modules
    are tests/unit/test_public_api.py's."""
    entries = set()
    members = re.compile(r"^::: ([\w.]+)\n    options:\n      members: \[([\w, ]+)\]", re.M)
    for page in (REPO / "docs" / "api").glob("*.md"):
        text = page.read_text()
        entries |= set(re.findall(r"^::: ([\w.]+)", text, re.M))
        entries |= {f"{m}.{n.strip()}" for m, names in members.findall(text)
                    for n in names.split(",")}
    short = {e.rsplit(".", 1)[-1] for e in entries}
    missing = []
    for module in ("ray_mesh", "ray_mesh.parallel", "ray_mesh.checkpointing",
                   "ray_mesh.checkpointing.remote", "ray_mesh.replicas"):
        path = REPO.joinpath(*module.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        missing += [f"{module}.{n}" for n in _all_names(source)
                    if n not in short and f"{module}.{n}" not in entries]
    assert not missing, f"public names with no entry in docs/api/*.md: {missing}"
