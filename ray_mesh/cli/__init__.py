"""The ``ray-mesh`` command (driver side): argument parsing and YAML job files."""

from ray_mesh.cli.main import main

__all__ = ["main"]
