"""The ``ray-mesh`` command (driver side): argument parsing and YAML job files."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ray-mesh`` (imported lazily: ``python -m ray_mesh.cli.main`` works)."""
    from ray_mesh.cli.main import main as _main

    return _main(argv)


__all__ = ["main"]
