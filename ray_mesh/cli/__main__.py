"""``python -m ray_mesh.cli``: the same as the ``ray-mesh`` command."""

import sys

from ray_mesh.cli.main import script

sys.exit(script())
