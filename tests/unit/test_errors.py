"""One error hierarchy: every exception class of the package is in ``ray_mesh/errors.py``,
under :class:`ray_mesh.RayMeshError` and exactly one of its four branches, and the CLI
decides one line versus traceback by class alone."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import ray_mesh.errors as errors

PACKAGE = Path(__file__).resolve().parents[2] / "ray_mesh"
BRANCHES = (errors.UserInputError, errors.ConfigurationError, errors.ClusterError,
            errors.CheckpointError)


def test_no_exception_class_outside_errors_py():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (getattr(b, "id", None) or getattr(b, "attr", "")).endswith(
                        ("Error", "Exception")) for b in node.bases):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not found, ("exception classes outside ray_mesh/errors.py (define them there, "
                       f"under a RayMeshError branch, and import them): {found}")


@pytest.mark.parametrize("name", [n for n, v in vars(errors).items() if isinstance(v, type)
                                  and issubclass(v, BaseException)
                                  and v.__module__ == errors.__name__])
def test_every_error_is_under_one_branch(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.RayMeshError), name
    if cls in BRANCHES or cls is errors.RayMeshError:
        return
    assert sum(issubclass(cls, b) for b in BRANCHES) == 1, name


@pytest.mark.parametrize("module, name", [
    ("ray_mesh.core.spec", "MeshSpecError"), ("ray_mesh.core.topology", "TopologyError"),
    ("ray_mesh.cli.job", "JobError"), ("ray_mesh.planning.cost", "PlanError"),
    ("ray_mesh.checkpointing", "CheckpointError"), ("ray_mesh.network.interfaces",
                                                     "NetworkError"),
    ("ray_mesh", "RayMeshError")])
def test_errors_are_importable_where_they_are_raised(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_the_cli_decides_by_class(capsys, monkeypatch):
    """Any RayMeshError is one line and exit 2 (a new subclass needs no CLI change);
    anything else is a bug and keeps its traceback."""
    cli = importlib.import_module("ray_mesh.cli.main")

    class Fresh(errors.ClusterError):
        pass

    def boom(args):
        raise Fresh("the node 100.64.0.2 did not answer: check `tailscale status`")

    args = cli.build_parser().parse_args(["status"])
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv: args)
    args.func = boom
    assert cli.main(["status"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ray-mesh: error: the node 100.64.0.2 did not answer: check `tailscale status`")
    args.func = lambda a: 1 / 0
    with pytest.raises(ZeroDivisionError):
        cli.main(["status"])
