"""The ``ray-mesh`` command (driver side): argument parsing, YAML job files and the runner
that runs a job on Ray (``runner``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ray-mesh`` process (``ray_mesh.cli.main.script``); imported
    lazily so ``python -m ray_mesh.cli.main`` does not load the module twice (runpy warns
    when a package pre-imports it)."""
    from ray_mesh.cli.main import script

    return script(argv)
