"""``python -m ray_mesh.cli``: the ``ray-mesh`` command."""

import sys

from ray_mesh.cli.main import main

sys.exit(main())
