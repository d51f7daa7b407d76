"""The network layer (Ray-free): interface choice (``interfaces``), the pre-flight's
worker-side probe (``probe``) and its report (``report``).

Runs on workers and node agents; the Ray side that fans these out lives in
``ray_mesh.raytrain.preflight``.
"""

from ray_mesh.network.interfaces import NetworkError as NetworkError
from ray_mesh.network.report import PreflightError as PreflightError
