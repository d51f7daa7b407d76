"""The name tests and benchmarks have imported the virtual cluster by; it now lives in the
:mod:`harness.netns` package (namespaces, wireguard, ray_nodes, agent, cluster)."""

from harness.netns import *  # noqa: F403 - the same names, one place to define them
from harness.netns import __all__  # noqa: F401
